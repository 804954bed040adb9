"""Prometheus metrics of a gateway: requests by tenant/function/status, latency, quotas,
and the pools behind it (read at scrape time, so serving a call costs two dict lookups)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, UnknownMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from fabric.serve.app import Gateway

_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: The backends' statistics that count events since the server started (a re-registered
#: function's carry on from its old pool's, see ``LocalBackend.stats``): Prometheus counters,
#: ``fabric_pool_<key>_total``. Typed as gauges (as they were), a scraper's metadata said they
#: were levels, and Prometheus flags ``rate()`` over a name not ending in ``_total``.
_POOL_COUNTERS = frozenset(
    {
        # the local pools'
        "calls",
        "spawned",
        "lost",
        "timeouts",
        "cold_starts",
        "batches",
        "start_failures",
        "requeued",
        # the lambda backend's (its ``errors_<code>`` too)
        "spilled",
        "spill_failed",
    }
)
_POOL_COUNTER_PREFIXES = ("errors_",)
#: Levels read at scrape time (they go down as well as up): gauges, ``fabric_pool_<key>``.
_POOL_GAUGES = frozenset(
    {
        "workers",
        "ready",
        "pending",
        "inflight",
        "max_workers",
        "warm",
        "retiring_workers",
        "abandoned_running",
        "functions",
    }
)


def pool_metric_type(key: str) -> Literal["counter", "gauge"] | None:
    """``"counter"`` or ``"gauge"``: the Prometheus type of a backend statistic; ``None`` for
    one not classified here (exported untyped, so no count passes for a level or the other
    way round; tests/fabric/test_serve_metric_types.py asks every backend's to be classified)."""
    if key in _POOL_COUNTERS or key.startswith(_POOL_COUNTER_PREFIXES):
        return "counter"
    return "gauge" if key in _POOL_GAUGES else None


class _Live:
    """Series read off the gateway when scraped: gauges of levels, counters of counts."""

    def __init__(self, gateway: Gateway, metrics: ServeMetrics):
        self.gateway = gateway
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        gw = self.gateway
        held = GaugeMetricFamily("fabric_serve_tenant_inflight", "Calls a tenant holds", labels=["tenant"])
        limit = GaugeMetricFamily(
            "fabric_serve_tenant_limit", "A tenant's max_concurrency", labels=["tenant"]
        )
        throttled = CounterMetricFamily(
            "fabric_serve_tenant_throttled",
            "Requests refused with 429 (invocations and metrics scrapes)",
            labels=["tenant"],
        )
        for tenant, n in gw.quotas.held.items():
            held.add_metric([tenant], n)
            limit.add_metric([tenant], gw.quotas.limits[tenant])
        for tenant, n in gw.quotas.throttled.items():  # a metrics-only tenant's too: no quota
            throttled.add_metric([tenant], n)
        delayed = CounterMetricFamily(
            "fabric_serve_tenant_delayed", "Requests held back by max_rps", labels=["tenant"]
        )
        for tenant, n in gw.rates.delayed.items():
            delayed.add_metric([tenant], n)
        conns = GaugeMetricFamily(
            "fabric_serve_tenant_connections",
            "Connections open whose latest request was the tenant's",
            labels=["tenant"],
        )
        closed = CounterMetricFamily(
            "fabric_serve_tenant_connections_closed",
            "A tenant's idle connections closed to make room for its new ones (max_connections)",
            labels=["tenant"],
        )
        for tenant, n in gw.connections.closed_idle.items():
            conns.add_metric([tenant], gw.connections.open(tenant))
            closed.add_metric([tenant], n)
        yield from (held, limit, throttled, delayed, conns, closed)
        waiting = GaugeMetricFamily(
            "fabric_serve_waiting", "Calls waiting for room in a function's pool", labels=["function"]
        )
        for name, gate in gw._gates.items():
            waiting.add_metric([name], gate.waiting)
        yield waiting
        yield GaugeMetricFamily(
            "fabric_serve_running_on",
            "Calls given up on (a hang-up, a deadline) that still run on a worker, holding their slots",
            value=self.metrics.running_on,
        )
        stats: dict[str, Any] = gw.backend.stats()
        families: dict[str, CounterMetricFamily | GaugeMetricFamily | UnknownMetricFamily] = {}
        for function, values in sorted(stats.items()):
            for key, value in sorted(values.items()) if isinstance(values, dict) else ():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                fam = families.get(key)
                if fam is None:
                    kind = pool_metric_type(key)
                    family = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}.get(
                        kind or "", UnknownMetricFamily
                    )
                    # a counter's samples are named fabric_pool_<key>_total
                    fam = families[key] = family(
                        f"fabric_pool_{key}", f"pool statistic {key!r}", labels=["function"]
                    )
                fam.add_metric([function], value)
        yield from families.values()


class ServeMetrics:
    def __init__(self, gateway: Gateway):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "fabric_serve_requests",
            "Invoke requests by tenant, function and HTTP status",
            ["tenant", "function", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "fabric_serve_request_seconds",
            "Invoke request latency inside the server",
            ["tenant", "function"],  # per tenant: its count is that tenant's traffic
            buckets=_BUCKETS_S,
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "fabric_serve_events_dropped",
            "Event calls accepted (202) and cut when the server stopped before they ended",
            ["tenant", "function"],
            registry=self.registry,
        )
        self.running_on = 0
        """Calls given up on that still run on a worker (their quota and gate slots held)."""
        self.registry.register(_Live(gateway, self))  # type: ignore[arg-type]
        self._children: dict[tuple[str, str, int], Any] = {}
        self._hist: dict[tuple[str, str], Any] = {}

    def observe(self, tenant: str, function: str, status: int, seconds: float) -> None:
        key = (tenant, function, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.requests.labels(tenant, function, str(status))
        child.inc()
        hist = self._hist.get((tenant, function))
        if hist is None:
            hist = self._hist[tenant, function] = self.latency.labels(tenant, function)
        hist.observe(seconds)

    def event_dropped(self, tenant: str, function: str) -> None:
        self.events_dropped.labels(tenant, function).inc()

    def render(self, tenant: str | None = None) -> tuple[bytes, str]:
        """Prometheus text; with ``tenant``, the series of other tenants are left out."""
        if tenant is None:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        return generate_latest(_OneTenant(self.registry, tenant)), CONTENT_TYPE_LATEST  # type: ignore[arg-type]


class _OneTenant:
    """A view of a registry with only one tenant's tenant-labelled samples. The series
    without a tenant label stay: the pools' (``fabric_pool_*``, ``fabric_serve_waiting``)
    are shared by every tenant, and their counts are totals over all of them."""

    def __init__(self, registry: CollectorRegistry, tenant: str):
        self.registry = registry
        self.tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            # collect() builds fresh families on each scrape: filtering in place is safe
            family.samples = [s for s in family.samples if s.labels.get("tenant", self.tenant) == self.tenant]
            yield family
