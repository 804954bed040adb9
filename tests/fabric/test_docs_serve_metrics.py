"""docs/serve.md names the /metrics series a dashboard or an alert is written against: every
name it gives must be one a scrape carries, as the scrape spells it (a counter's samples end in
``_total``), so a metric renamed in the code and not in the doc fails here."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sample_fns import REG

from fabric.backends.base import LocalConfig
from fabric.serve import Gateway, ServeConfig, TenantConfig
from fabric.serve.metrics import pool_metric_type

DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
TOKEN = "token-docs-0123456789abcdef"


def _documented() -> set[str]:
    """The series names docs/serve.md gives, the list's shorthand (``_spawned_total`` after
    ``fabric_pool_calls_total``) spelled out, leaving out the sentence that names the old ones."""
    text = DOC.read_text()
    text = re.sub(r"Earlier\s+versions\b.*?:\s*rename them", "", text, flags=re.S)
    names: set[str] = set()
    family = ""
    for token in re.findall(r"`([a-z_<>]+)(?:\{[^}`]*\})?`", text):
        if token.startswith(("fabric_serve_", "fabric_pool_")):
            family = "fabric_pool_" if token.startswith("fabric_pool_") else "fabric_serve_"
            names.add(token)
        elif token.startswith("_") and family:
            names.add(family + token[1:])
    return names


async def _scraped() -> set[str]:
    """The names a scrape spells, after one call: a counter ``<family>_total`` (whether or
    not it has counted yet), a gauge or a histogram by its family's name."""
    tenants = {"ops": TenantConfig(token=TOKEN, metrics="all")}
    cfg = ServeConfig(port=0, tenants=tenants, warm=False, backend=LocalConfig(max_workers=1))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        reply = await http.post("/2015-03-31/functions/add/invocations", json={"a": 1}, headers=headers)
        assert reply.json() == 1
        text = (await http.get("/metrics", headers=headers)).text
    families = text_string_to_metric_families(text)
    return {f"{f.name}_total" if f.type == "counter" else f.name for f in families}


def _pool_series_of_other_backends(name: str) -> bool:
    """A pool series only the lambda or modal backend reports, named as serve/metrics.py types it."""
    key = name.removeprefix("fabric_pool_").replace("<code>", "Throttled")
    if key.endswith("_total"):
        return pool_metric_type(key.removesuffix("_total")) == "counter"
    return pool_metric_type(key) == "gauge"


async def test_every_series_docs_serve_md_names_is_scraped_under_that_name():
    documented = _documented()
    assert "fabric_serve_requests_total" in documented and "fabric_pool_spawned_total" in documented
    scraped = await _scraped()
    wrong = {
        name
        for name in documented - scraped
        if not (name.startswith("fabric_pool_") and _pool_series_of_other_backends(name))
    }
    assert not wrong, f"docs/serve.md names series no scrape has: {sorted(wrong)}; scraped: {sorted(scraped)}"
