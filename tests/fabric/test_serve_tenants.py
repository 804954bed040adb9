"""``fabric serve``'s tenants: a quota's 429 that leaves the others alone, the metrics a
tenant may see, the fair gate's turns, max_rps's pacing, and tenants' config and file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from sample_fns import REG
from serve_helpers import PATH, TOKEN_A, TOKEN_B, auth, config

from fabric.errors import ConfigError
from fabric.serve import Gateway, ServeConfig, TenantConfig, load_tenants
from fabric.serve.gate import FairGate


async def test_a_tenant_over_its_quota_gets_429_and_others_do_not():
    async with Gateway(config(quota_a=1), REG) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        slow = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 1.0}, headers=auth()))
        for _ in range(100):
            if g.quotas.held["job-a"] == 1:
                break
            await asyncio.sleep(0.01)
        r = await c.post(PATH.format("add"), json={"a": 1}, headers=auth())
        assert r.status_code == 429 and r.headers["x-amzn-ErrorType"] == "TooManyRequestsException"
        assert (await c.post(PATH.format("add"), json={"a": 1}, headers=auth(TOKEN_B))).json() == 1
        assert (await slow).status_code == 200
        assert (await c.post(PATH.format("add"), json={"a": 1}, headers=auth())).json() == 1
        assert g.quotas.held == {"job-a": 0, "job-b": 0}
        assert g.quotas.throttled["job-a"] == 1


async def test_a_tenant_sees_only_its_own_series_unless_it_may_see_all():
    ops = "token-ops-0123456789abcdef"
    tenants = {
        "job-a": TenantConfig(token=TOKEN_A),
        "job-b": TenantConfig(token=TOKEN_B),
        "ops": TenantConfig(token=ops, metrics="all"),
    }
    async with Gateway(config(tenants=tenants), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        for token in (TOKEN_A, TOKEN_B):
            assert (await c.post(PATH.format("add"), json={"a": 1}, headers=auth(token))).status_code == 200
        seen = {t: (await c.get("/metrics", headers=auth(t))).text for t in (TOKEN_A, TOKEN_B, ops)}
    mine = 'fabric_serve_requests_total{function="add",status="200",tenant="job-b"} 1.0'
    theirs = 'tenant="job-a"'
    assert mine in seen[TOKEN_B] and theirs not in seen[TOKEN_B]  # not even its gauges
    assert 'fabric_serve_tenant_limit{tenant="job-b"}' in seen[TOKEN_B]
    assert 'tenant="job-b"' not in seen[TOKEN_A] and 'tenant="ops"' not in seen[TOKEN_A]
    # a tenant's latency histogram is its own (its count was the other's traffic too)
    assert 'fabric_serve_request_seconds_count{function="add",tenant="job-b"} 1.0' in seen[TOKEN_B]
    assert 'fabric_serve_request_seconds_count{function="add",tenant="job-a"} 1.0' in seen[ops]
    # the pools' series are shared: totals over every tenant
    for text in seen.values():
        assert 'fabric_pool_calls_total{function="add"}' in text
    assert mine in seen[ops] and theirs in seen[ops]
    assert 'fabric_serve_tenant_limit{tenant="ops"}' in seen[ops]


async def test_fair_gate_takes_tenants_in_turn():
    gate = FairGate(lambda: 1)
    await gate.acquire("flood")
    order: list[str] = []

    async def one(tenant: str, i: int) -> None:
        await gate.acquire(tenant)
        order.append(f"{tenant}{i}")
        gate.release()

    tasks = [asyncio.create_task(one("flood", i)) for i in range(5)]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("quiet", 0)))
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(*tasks)
    assert order[:2] == ["flood0", "quiet0"]  # one flood call ahead of it, not five
    assert gate.running == 0 and gate.waiting == 0


async def test_fair_gate_cancelled_waiter_passes_its_slot_on():
    gate = FairGate(lambda: 1)
    await gate.acquire("a")
    waiter = asyncio.create_task(gate.acquire("b"))
    other = asyncio.create_task(gate.acquire("c"))
    await asyncio.sleep(0)
    waiter.cancel()
    gate.release()
    await asyncio.wait_for(other, 1)
    assert gate.running == 1
    gate.release()
    assert gate.running == 0


def test_tenant_config_errors(tmp_path):
    with pytest.raises(ValueError, match="exactly one of token, token_file"):
        TenantConfig()
    with pytest.raises(ConfigError, match="at least 16 characters"):
        Gateway(config(tenants={"x": TenantConfig(token="short")}), REG)
    with pytest.raises(ConfigError, match="cannot read token_file"):
        Gateway(config(tenants={"x": TenantConfig(token_file=tmp_path / "missing")}), REG)
    with pytest.raises(ConfigError, match="same token"):
        Gateway(config(tenants={"x": TenantConfig(token=TOKEN_A), "y": TenantConfig(token=TOKEN_A)}), REG)
    with pytest.raises(ValueError, match="tenants"):
        ServeConfig(tenants={})


def test_tenants_file(tmp_path: Path):
    secret = tmp_path / "b.token"
    secret.write_text(TOKEN_B + "\n")
    f = tmp_path / "tenants.yaml"
    f.write_text(
        f"tenants:\n  job-a: {{token: {TOKEN_A}, max_concurrency: 3}}\n  job-b: {{token_file: {secret}}}\n"
    )
    tenants = load_tenants(f)
    assert tenants["job-a"].max_concurrency == 3 and tenants["job-b"].secret() == TOKEN_B
    f.write_text("tenants: {job-a: {token: x, max_concurency: 3}}\n")
    with pytest.raises(
        ConfigError,
        match=r"tenant 'job-a': max_concurency: unknown key \(did you mean 'max_concurrency'\?\); allowed: ",
    ):
        load_tenants(f)
    f.write_text("tenants: {job-a: {max_concurrency: 3}}\n")
    with pytest.raises(ConfigError, match="tenant 'job-a': give exactly one of token, token_file"):
        load_tenants(f)
    f.write_text(f"tenants: {{ops: {{token: {TOKEN_A}, metrics: everything}}}}\n")
    with pytest.raises(ConfigError, match="tenant 'ops': metrics: Input should be 'own' or 'all'"):
        load_tenants(f)
    f.write_text("- just a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_tenants(f)
    f.write_text("tenants: {a: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_tenants(f)
    with pytest.raises(ConfigError, match="cannot read the tenants file"):
        load_tenants(tmp_path / "missing.yaml")


def test_a_tenants_or_token_file_that_cannot_be_parsed_is_a_config_error(tmp_path: Path):
    """A file that is not UTF-8 (UTF-16 from an editor, a binary) or YAML nested past Python's
    recursion limit: UnicodeDecodeError or RecursionError was `fabric serve`'s traceback."""
    f = tmp_path / "tenants.yaml"
    f.write_bytes("tenants: {}\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=r"cannot read the tenants file .*: not UTF-8 text"):
        load_tenants(f)
    f.write_text("tenants: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="not valid YAML/JSON: nested too deeply"):
        load_tenants(f)
    secret = tmp_path / "b.token"
    secret.write_bytes(TOKEN_B.encode("utf-16"))
    with pytest.raises(ConfigError, match=r"cannot read token_file .*: not UTF-8 text"):
        Gateway(config(tenants={"x": TenantConfig(token_file=secret)}), REG)


def test_rate_limiter_paces_a_tenant_and_leaves_others_alone():
    from fabric.serve.gate import RateLimiter

    rl = RateLimiter({"slow": 100.0, "free": None}, burst_s=0.05)
    waits = [rl.delay("slow", 10.0) for _ in range(20)]
    assert waits[:5] == [0.0] * 5  # the burst: 50 ms worth at 100/s
    assert waits[6] == pytest.approx(0.01) and waits[19] == pytest.approx(0.14)  # then one every 10 ms
    assert rl.delay("slow", 10.5) == 0.0  # a quiet spell refills
    assert rl.delay("free", 10.0) == 0.0 and rl.delayed == {"slow": 14, "free": 0}
    for _ in range(600):
        rl.delay("slow", 20.0)
    assert rl.delay("slow", 20.0) is None  # over 5 s of backlog: refused


def test_rate_limiter_says_when_a_refused_tenant_would_be_served():
    """A 429's ``Retry-After`` for ``max_rps``: the time until the backlog is back within
    ``MAX_DELAY_S``, so a request then is held back, not refused again."""
    from fabric.serve.gate import RateLimiter

    rl = RateLimiter({"slow": 1.0}, burst_s=0.05)
    assert [rl.delay("slow", 0.0) for _ in range(6)] == pytest.approx([0.0, 0.95, 1.95, 2.95, 3.95, 4.95])
    assert rl.delay("slow", 0.0) is None
    assert rl.refused_for("slow", 0.0) == pytest.approx(0.95)  # the 7th's turn is at 5.95 s
    assert rl.delay("slow", 0.9) is None
    assert rl.delay("slow", 0.95) == pytest.approx(5.0)  # as said: held back, served


async def test_max_rps_delays_instead_of_refusing():
    tenants = {
        "job-a": TenantConfig(token=TOKEN_A, max_rps=50.0),
        "job-b": TenantConfig(token=TOKEN_B),
    }
    async with Gateway(config(tenants=tenants), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        t0 = asyncio.get_running_loop().time()
        rs = await asyncio.gather(
            *(c.post(PATH.format("add"), json={"a": i}, headers=auth()) for i in range(10))
        )
        took = asyncio.get_running_loop().time() - t0
        assert [r.json() for r in rs] == list(range(10))  # all served, none refused
        assert took >= 0.1  # 10 requests at 50/s after a 50 ms burst
        assert g.rates.delayed["job-a"] >= 5
        text = (await c.get("/metrics", headers=auth())).text
        assert 'fabric_serve_tenant_delayed_total{tenant="job-a"}' in text


def test_a_relative_token_file_is_read_beside_the_tenants_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # (it was read from the server's working directory: a tenants file that names its
    # secrets beside it worked only when the server started there)
    conf = tmp_path / "conf"
    (conf / "secrets").mkdir(parents=True)
    (conf / "secrets" / "b.token").write_text(TOKEN_B + "\n")
    f = conf / "tenants.yaml"
    f.write_text("tenants:\n  job-b: {token_file: secrets/b.token}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    tenants = load_tenants(f)
    assert tenants["job-b"].secret() == TOKEN_B
    assert tenants["job-b"].token_file == conf / "secrets" / "b.token"
    # an absolute one is read as written; a missing relative one is named as it resolved
    f.write_text("tenants:\n  job-b: {token_file: nope.token}\n")
    with pytest.raises(ConfigError, match=r"tenant 'job-b': cannot read token_file '.*conf/nope\.token'"):
        load_tenants(f)
