"""``fabric serve``'s /metrics: each series carries the Prometheus type of what it measures. A
count that only goes up is a counter named ``*_total`` (``rate()`` and ``increase()`` read
its resets right); a level read now is a gauge."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sample_fns import REG

from fabric.backends.base import LocalConfig
from fabric.backends.inproc import InprocBackend
from fabric.backends.lambda_ import LambdaBackend, LambdaConfig
from fabric.backends.modal_ import ModalBackend
from fabric.serve import Gateway, ServeConfig, TenantConfig

TOKEN = "token-types-0123456789abcdef"
PATH = "/2015-03-31/functions/{}/invocations"

#: The pools' statistics that count events since the server started.
POOL_COUNTERS = {
    "calls",
    "spawned",
    "lost",
    "timeouts",
    "cold_starts",
    "batches",
    "start_failures",
    "requeued",
}
#: The pools' levels, read at scrape time.
POOL_GAUGES = {"workers", "ready", "pending", "inflight", "max_workers", "warm", "retiring_workers"}


async def _families() -> dict[str, tuple[str, set[str]]]:
    """Each family of a scrape after one call: its type and its samples' names."""
    tenants = {"ops": TenantConfig(token=TOKEN, metrics="all", max_rps=1000.0)}
    cfg = ServeConfig(port=0, tenants=tenants, warm=False, backend=LocalConfig(max_workers=1))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        assert (await http.post(PATH.format("add"), json={"a": 1}, headers=headers)).json() == 1
        text = (await http.get("/metrics", headers=headers)).text
    return {f.name: (f.type, {s.name for s in f.samples}) for f in text_string_to_metric_families(text)}


async def test_the_pools_counts_are_counters_named_total_and_their_levels_gauges():
    families = await _families()
    for key in POOL_COUNTERS:
        kind, samples = families[f"fabric_pool_{key}"]
        assert (kind, samples) == ("counter", {f"fabric_pool_{key}_total"}), key
    for key in POOL_GAUGES:
        assert families[f"fabric_pool_{key}"] == ("gauge", {f"fabric_pool_{key}"}), key


async def test_the_tenants_counts_so_far_are_counters_and_their_levels_gauges():
    families = await _families()
    for name in ("fabric_serve_tenant_throttled", "fabric_serve_tenant_delayed", "fabric_serve_requests"):
        assert families[name][0] == "counter" and f"{name}_total" in families[name][1], name
    for name in ("fabric_serve_tenant_inflight", "fabric_serve_tenant_limit", "fabric_serve_waiting"):
        assert families[name][0] == "gauge", name
    assert families["fabric_serve_running_on"][0] == "gauge"
    assert families["fabric_serve_request_seconds"][0] == "histogram"
    # every series says what it is: none is left untyped
    assert {n for n, (kind, _) in families.items() if kind not in {"counter", "gauge", "histogram"}} == set()


def test_every_numeric_statistic_a_backend_reports_has_a_type():
    """A statistic a backend adds later must be given its type here, not exported as a
    gauge by default: ``stats()`` of each backend, with a Lambda error counted."""
    from fabric.serve.metrics import pool_metric_type

    lam = LambdaBackend(REG, LambdaConfig())
    lam._errors["Throttled"] = 1  # errors_<code> keys appear once such an error is seen
    stats = {
        **{f"lambda:{k}": v for k, v in lam.stats()["lambda"].items()},
        **{f"modal:{k}": v for k, v in ModalBackend(REG).stats()["modal"].items()},
        **{f"inproc:{k}": v for k, v in InprocBackend(REG).stats().items()},
    }
    untyped = {
        key
        for key, v in stats.items()
        if isinstance(v, int | float)
        and not isinstance(v, bool)
        and pool_metric_type(key.split(":")[1]) is None
    }
    assert untyped == set()
    assert pool_metric_type("errors_Throttled") == "counter" and pool_metric_type("spilled") == "counter"
    assert pool_metric_type("abandoned_running") == "gauge" and pool_metric_type("functions") == "gauge"
    assert {k for k in POOL_COUNTERS if pool_metric_type(k) != "counter"} == set()
    assert {k for k in POOL_GAUGES if pool_metric_type(k) != "gauge"} == set()
