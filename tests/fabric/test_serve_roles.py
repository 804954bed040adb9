"""``fabric serve``'s tenant roles: a metrics-only tenant (``invoke: false``, a monitoring
scraper's token) reads ``/metrics`` and invokes nothing, and the tenant names the server
keeps for itself (``-``, the label of requests with no valid token) are refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from sample_fns import REG
from serve_helpers import PATH, TOKEN_A, TOKEN_B, auth, config

from fabric import Client
from fabric.backends.base import LambdaConfig
from fabric.errors import ConfigError, ErrorCode
from fabric.serve import Gateway, ServeConfig, TenantConfig, load_tenants

TOKEN_PROM = "token-prom-0123456789abcdef"


def _tenants() -> dict[str, TenantConfig]:
    return {
        "job-a": TenantConfig(token=TOKEN_A),
        "prom": TenantConfig(token=TOKEN_PROM, metrics="all", invoke=False),
    }


@pytest.mark.parametrize("kind", ["RequestResponse", "Event", "DryRun"])
async def test_a_metrics_only_tenant_may_invoke_nothing(kind: str):
    async with Gateway(config(tenants=_tenants()), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        headers = {**auth(TOKEN_PROM), "X-Amz-Invocation-Type": kind}
        r = await c.post(PATH.format("add"), json={"a": 1}, headers=headers)
        # refused as the other authorization refusals are: a 403 with Lambda's code, which
        # the lambda backend reads as Unauthorized (final, not retried)
        assert r.status_code == 403, r.text
        assert r.headers["x-amzn-ErrorType"] == "AccessDeniedException"
        message = r.json()["message"]
        assert "'prom'" in message and "invoke: false" in message
        # what the token is for, and how the tenant would be let to invoke
        assert "may only scrape metrics (GET /metrics)" in message, message
        assert "invoke: true" in message and "--tenants" in message, message
        stats = g.backend.stats()
        assert stats.get("add", {}).get("calls", 0) == 0  # nothing ran
        # the tenant that may invoke still does
        assert (await c.post(PATH.format("add"), json={"a": 1}, headers=auth())).json() == 1


@pytest.mark.parametrize("transport", ["http", "boto3"])
async def test_the_fabric_client_reads_the_refusal_as_unauthorized(transport: str):
    async with Gateway(config(tenants=_tenants()), REG) as g:
        backend = LambdaConfig(endpoint_url=g.url, token=TOKEN_PROM, transport=transport)
        async with Client(backend=backend, registry=REG) as c:
            r = await c.call("add", {"a": 1})
    assert r.error is not None and r.error.type == ErrorCode.UNAUTHORIZED and not r.error.retryable
    assert "invoke: false" in r.error.message


async def test_a_metrics_only_tenant_reads_the_metrics_and_holds_no_quota():
    async with Gateway(config(tenants=_tenants()), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        assert (await c.post(PATH.format("add"), json={"a": 1}, headers=auth())).status_code == 200
        await c.post(PATH.format("add"), json={"a": 1}, headers=auth(TOKEN_PROM))
        r = await c.get("/metrics", headers=auth(TOKEN_PROM))
        assert r.status_code == 200
        text = r.text
    assert 'fabric_serve_requests_total{function="add",status="200",tenant="job-a"} 1.0' in text
    # its refused call is counted under its name (refused before the function's name is read)
    assert 'fabric_serve_requests_total{function="-",status="403",tenant="prom"} 1.0' in text
    # no quota of calls it may not make: a limit of 64 on the dashboard would say it may
    assert 'fabric_serve_tenant_limit{tenant="prom"}' not in text
    assert 'fabric_serve_tenant_limit{tenant="job-a"}' in text


def test_a_metrics_only_tenant_is_checked_at_config_load(tmp_path: Path):
    f = tmp_path / "tenants.yaml"
    f.write_text(
        f"tenants:\n  job-a: {{token: {TOKEN_A}}}\n"
        f"  prom: {{token: {TOKEN_PROM}, metrics: all, invoke: false}}\n"
    )
    tenants = load_tenants(f)
    assert tenants["prom"].invoke is False and tenants["job-a"].invoke is True
    # a quota for calls it may not make is a mistake in the file, said where it is
    f.write_text(f"tenants:\n  prom: {{token: {TOKEN_PROM}, invoke: false, max_concurrency: 8}}\n")
    with pytest.raises(ConfigError, match=r"tenant 'prom': .*invoke: false.*max_concurrency"):
        load_tenants(f)
    with pytest.raises(ValidationError, match="max_rps"):
        TenantConfig(token=TOKEN_PROM, invoke=False, max_rps=10)
    # a server no tenant may call serves nothing: a typo, most likely
    with pytest.raises(ValidationError, match=r"no tenant may invoke.*invoke: false"):
        ServeConfig(tenants={"prom": TenantConfig(token=TOKEN_PROM, invoke=False)})


def test_the_unauthenticated_label_is_no_tenant_name(tmp_path: Path):
    # requests with no valid token are counted as tenant "-": a tenant of that name would
    # see them as its own, and its own calls would be mixed into them
    with pytest.raises(ValidationError, match=r"tenant '-': the name '-' is reserved"):
        ServeConfig(tenants={"-": TenantConfig(token=TOKEN_A)})
    f = tmp_path / "tenants.yaml"
    f.write_text(f"tenants:\n  '-': {{token: {TOKEN_A}}}\n  job-b: {{token: {TOKEN_B}}}\n")
    with pytest.raises(ConfigError, match=r"tenant '-': the name '-' is reserved"):
        load_tenants(f)


def test_a_blank_tenant_name_is_refused(tmp_path: Path):
    # Prometheus reads an empty label value as no label at all
    with pytest.raises(ValidationError, match="tenant '': the name is empty"):
        ServeConfig(tenants={"": TenantConfig(token=TOKEN_A)})
    f = tmp_path / "tenants.yaml"
    f.write_text(f"tenants:\n  ' ': {{token: {TOKEN_A}}}\n")
    with pytest.raises(ConfigError, match="tenant ' ': the name is empty"):
        load_tenants(f)


async def test_a_metrics_only_tenants_429_counts_as_throttled():
    """``fabric_serve_tenant_throttled_total{tenant}`` counts the requests refused with 429,
    the docs say. A metrics-only tenant over its ``max_connections`` got its 429 uncounted
    (the counter kept only the tenants holding a quota), so a scraper refused showed none."""
    tenants = {
        "job-a": TenantConfig(token=TOKEN_A, metrics="all"),  # reads prom's series below
        "prom": TenantConfig(token=TOKEN_PROM, metrics="all", invoke=False, max_connections=1),
    }
    async with Gateway(config(tenants=tenants), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        # a scrape whose body has not all come: answered, its connection busy reading the rest
        reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
        try:
            writer.write(
                b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                + TOKEN_PROM.encode()
                + b"\r\nContent-Length: 10\r\n\r\n{}"
            )
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            assert head.startswith(b"HTTP/1.1 200"), head
            r = await c.get("/metrics", headers=auth(TOKEN_PROM))
            assert r.status_code == 429 and "max_connections" in r.json()["message"], r.text
        finally:
            writer.close()
        text = (await c.get("/metrics", headers=auth())).text
    assert 'fabric_serve_tenant_throttled_total{tenant="prom"} 1.0' in text, text
