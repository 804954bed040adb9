"""Prometheus metrics of a gateway: requests by tenant/function/status, latency, quotas,
and the pools behind it (read at scrape time, so serving a call costs two dict lookups)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

if TYPE_CHECKING:
    from fabric.serve.app import Gateway

_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Live:
    """Gauges read off the gateway when scraped."""

    def __init__(self, gateway: Gateway, metrics: ServeMetrics):
        self.gateway = gateway
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        gw = self.gateway
        held = GaugeMetricFamily("fabric_serve_tenant_inflight", "Calls a tenant holds", labels=["tenant"])
        limit = GaugeMetricFamily(
            "fabric_serve_tenant_limit", "A tenant's max_concurrency", labels=["tenant"]
        )
        throttled = GaugeMetricFamily(
            "fabric_serve_tenant_throttled", "Calls refused with 429 so far", labels=["tenant"]
        )
        for tenant, n in gw.quotas.held.items():
            held.add_metric([tenant], n)
            limit.add_metric([tenant], gw.quotas.limits[tenant])
            throttled.add_metric([tenant], gw.quotas.throttled[tenant])
        delayed = GaugeMetricFamily(
            "fabric_serve_tenant_delayed", "Requests held back by max_rps so far", labels=["tenant"]
        )
        for tenant, n in gw.rates.delayed.items():
            delayed.add_metric([tenant], n)
        yield from (held, limit, throttled, delayed)
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
        families: dict[str, GaugeMetricFamily] = {}
        for function, values in sorted(stats.items()):
            for key, value in sorted(values.items()) if isinstance(values, dict) else ():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                fam = families.get(key)
                if fam is None:
                    fam = families[key] = GaugeMetricFamily(
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
