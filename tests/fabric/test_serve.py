"""``fabric serve``: the Lambda Invoke API over real local pools, spoken to over real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import time
from pathlib import Path

import httpx
import pytest
from sample_fns import REG, SERVE_REG

from fabric.backends.base import LocalConfig
from fabric.errors import BackendError, ConfigError, SetupFailedError
from fabric.protocol import Invocation
from fabric.registry import Registry
from fabric.serve import Gateway, ServeConfig, TenantConfig, load_tenants
from fabric.serve.gate import FairGate
from fabric.testing import FakeBackend

TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"
PATH = "/2015-03-31/functions/{}/invocations"


def config(**kw) -> ServeConfig:
    tenants = kw.pop(
        "tenants",
        {
            "job-a": TenantConfig(token=TOKEN_A, max_concurrency=kw.pop("quota_a", 64)),
            "job-b": TenantConfig(token=TOKEN_B, max_concurrency=64),
        },
    )
    kw.setdefault("warm", False)
    kw.setdefault("backend", LocalConfig(max_workers=2))
    return ServeConfig(port=0, tenants=tenants, **kw)


def auth(token: str = TOKEN_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def gw():
    async with Gateway(config(), REG) as g:
        yield g


@pytest.fixture
async def http(gw):
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        yield c


async def test_raw_payload_returns_the_bare_value(http):
    r = await http.post(PATH.format("add"), json={"a": 2, "b": 3}, headers=auth())
    assert r.status_code == 200 and r.json() == 5
    assert r.headers["x-amzn-RequestId"]


async def test_envelope_returns_a_result_and_the_tenant_comes_from_the_token(http):
    inv = Invocation(function="add", payload={"a": 1}, tenant="someone-else", idempotency_key="k1")
    r = await http.post(PATH.format("add"), content=inv.model_dump_json(), headers=auth(TOKEN_B))
    body = r.json()
    assert r.status_code == 200 and body["ok"] is True and body["value"] == 1
    assert body["request_id"] == inv.request_id and body["worker"]


@pytest.mark.parametrize(
    "name",
    [
        "add:live",
        "add:$LATEST",
        "arn:aws:lambda:us-east-1:123456789012:function:add",
        "arn:aws:lambda:us-east-1:123456789012:function:add:live",
        "123456789012:function:add",  # a partial ARN, as Lambda's Invoke takes
        "123456789012:function:add:live",
    ],
)
async def test_qualified_names_and_arns_are_served(http, name):
    r = await http.post(PATH.format(name), json={"a": 4}, headers=auth())
    assert r.status_code == 200 and r.json() == 4
    r = await http.post(
        PATH.format("add"), params={"Qualifier": REG.get("add").version}, json={"a": 4}, headers=auth()
    )
    assert r.json() == 4


async def test_function_error_sets_the_lambda_header(http):
    r = await http.post(PATH.format("boom"), json={"x": 7}, headers=auth())
    assert r.status_code == 200 and r.headers["X-Amz-Function-Error"] == "Unhandled"
    err = r.json()
    assert err["errorType"] == "UserError" and "bad x=7" in err["errorMessage"]
    assert any("ValueError" in line for line in err["stackTrace"])


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({}, 401, "MissingAuthenticationTokenException"),
        ({"Authorization": "Basic dXNlcjpwYXNz"}, 401, "MissingAuthenticationTokenException"),
        ({"Authorization": "Bearer"}, 401, "MissingAuthenticationTokenException"),
        ({"Authorization": "Bearer wrong-token-0123456789"}, 403, "UnrecognizedClientException"),
        ({"Authorization": f"Bearer {TOKEN_A}x"}, 403, "UnrecognizedClientException"),
    ],
)
async def test_missing_or_wrong_token_runs_nothing(http, tmp_path, headers, status, code):
    out = tmp_path / "ran.txt"
    r = await http.post(PATH.format("append_line"), json={"path": str(out), "line": "x"}, headers=headers)
    assert r.status_code == status and r.headers["x-amzn-ErrorType"] == code
    await asyncio.sleep(0.2)
    assert not out.exists()


async def test_unknown_function_and_qualifier_are_404(http):
    r = await http.post(PATH.format("nope"), json={}, headers=auth())
    assert r.status_code == 404 and r.json()["__type"] == "ResourceNotFoundException"
    r = await http.post(PATH.format("add:v9"), json={}, headers=auth())
    assert r.status_code == 404 and "served qualifiers" in r.json()["message"]


async def test_functions_outside_the_allow_list_are_404():
    async with Gateway(config(functions=["add"]), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        assert (await c.post(PATH.format("add"), json={"a": 1}, headers=auth())).json() == 1
        assert (await c.post(PATH.format("boom"), json={"x": 1}, headers=auth())).status_code == 404


async def test_unknown_served_function_is_a_config_error():
    with pytest.raises(ConfigError, match="not registered: nope"):
        Gateway(config(functions=["add", "nope"]), REG)


async def test_a_function_that_cannot_start_is_reported_and_the_rest_are_served():
    cfg = config(warm=True)
    async with Gateway(cfg, SERVE_REG) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        assert list(g.not_ready) == ["serve_broken"]
        assert "model weights not found" in g.not_ready["serve_broken"]
        assert (await http.post(PATH.format("serve_add"), json={"a": 1}, headers=auth())).json() == 2
        r = await http.post(PATH.format("serve_broken"), json={"x": 1}, headers=auth())
        assert "model weights not found" in r.text


async def test_a_function_that_cannot_be_imported_is_reported_and_the_rest_are_served():
    """Without ``-f`` only a failed setup hook was listed in ``not_ready``: an entry point the
    workers cannot import (EntryPointError) stopped the whole server at its warm-up, every
    good function with it. It is listed with its reason now, and its calls answer
    SetupFailed."""
    import sample_fns

    reg = Registry()
    reg.add(sample_fns.serve_add)

    @reg.function(name="nested", warm=1)
    def nested(x: int) -> int:
        return x

    async with Gateway(config(warm=True), reg) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        assert list(g.not_ready) == ["nested"] and "nested function" in g.not_ready["nested"]
        assert not g.slow_to_start  # it cannot start: its calls answer SetupFailed
        assert (await http.post(PATH.format("serve_add"), json={"a": 1}, headers=auth())).json() == 2
        r = await http.post(PATH.format("nested"), json={"x": 1}, headers=auth())
        assert r.headers.get("x-amz-function-error") and "nested function" in r.text, r.text


class _SlowToWarm(FakeBackend):
    """The warm workers of ``serve_broken`` are not ready in time (the local pool's wait gives
    up: BackendError); every other function warms."""

    async def _warmup(self, names: list[str] | None) -> None:
        if names and "serve_broken" in names:
            raise BackendError("serve_broken: 0 of 1 warm workers ready after 240 s")


async def test_a_warm_up_that_times_out_is_reported_and_the_rest_are_served():
    """A function whose warm workers were not ready in time stopped the whole server (the
    warm-up's BackendError), without ``-f``; it is listed in ``not_ready`` now. With ``-f``
    naming it, the server still does not start."""
    async with (
        Gateway(config(warm=True), SERVE_REG, backend=_SlowToWarm(SERVE_REG)) as g,
        httpx.AsyncClient(base_url=g.url, timeout=30) as http,
    ):
        assert list(g.not_ready) == ["serve_broken"]
        assert "warm workers ready after 240 s" in g.not_ready["serve_broken"]
        assert g.slow_to_start == {"serve_broken"}  # only late: its calls wait for a worker
        assert (await http.post(PATH.format("serve_add"), json={"a": 1}, headers=auth())).json() == 2
    strict = Gateway(config(warm=True, functions=["serve_broken"]), SERVE_REG, backend=_SlowToWarm(SERVE_REG))
    with pytest.raises(BackendError, match="240 s"):
        await strict.start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_named_function_that_cannot_start_stops_the_server_and_its_pools():
    gw = Gateway(config(warm=True, functions=["serve_add", "serve_broken"]), SERVE_REG)
    with pytest.raises(SetupFailedError, match="model weights not found"):
        await gw.start()
    pids = [pid for p in gw.backend.stats().values() for pid in p["pids"]]
    assert pids  # serve_add's worker had started...
    assert [pid for pid in pids if _alive(pid)] == []  # ...and stopped with the rest


async def test_a_named_warm_0_function_that_cannot_start_stops_the_server_too():
    # -f checked only the functions with warm > 0: a warm=0 one's broken setup was found by
    # the first call of some job, after the server said it was up
    gw = Gateway(config(warm=True, functions=["add", "bad_setup"]), REG)  # bad_setup: warm=0
    with pytest.raises(SetupFailedError, match="model weights not found"):
        await gw.start()


async def test_oversize_payload_is_413_and_runs_nothing(http, tmp_path):
    out = tmp_path / "ran.txt"
    big = {"path": str(out), "line": "x" * (6 * 1024 * 1024)}
    r = await http.post(PATH.format("append_line"), json=big, headers=auth())
    assert r.status_code == 413 and r.headers["x-amzn-ErrorType"] == "RequestTooLargeException"
    # an Event's limit is 1 MB
    r = await http.post(
        PATH.format("append_line"),
        json={"path": str(out), "line": "x" * (1024 * 1024)},
        headers={**auth(), "X-Amz-Invocation-Type": "Event"},
    )
    assert r.status_code == 413
    await asyncio.sleep(0.2)
    assert not out.exists()


async def test_chunked_oversize_body_is_413():
    async with Gateway(config(max_body_bytes=1000), REG) as g, httpx.AsyncClient(base_url=g.url) as c:

        async def chunks():
            for _ in range(10):
                yield b"x" * 500

        r = await c.post(PATH.format("add"), content=chunks(), headers=auth())
        assert r.status_code == 413
        assert (await c.post(PATH.format("add"), json={"a": 2}, headers=auth())).json() == 2


@pytest.mark.parametrize(
    ("body", "headers", "code"),
    [
        (b"{not json", {}, "InvalidRequestContentException"),
        (b"[1, 2]", {}, "InvalidRequestContentException"),
        (b'"text"', {}, "InvalidRequestContentException"),
        (b'{"function": "add", "payload": 3}', {}, "InvalidRequestContentException"),
        (b'{"a": 1}', {"X-Amz-Invocation-Type": "Sometimes"}, "InvalidParameterValueException"),
        (b"\xff\xfe", {}, "InvalidRequestContentException"),
    ],
)
async def test_malformed_requests_are_400(http, body, headers, code):
    r = await http.post(PATH.format("add"), content=body, headers={**auth(), **headers})
    assert r.status_code == 400 and r.json()["__type"] == code


async def test_bad_arn_is_400(http):
    r = await http.post(PATH.format("arn:aws:lambda:function"), json={}, headers=auth())
    assert r.status_code == 400


async def test_empty_body_is_an_empty_payload(http):
    r = await http.post(PATH.format("add"), content=b"", headers=auth())
    assert r.headers["X-Amz-Function-Error"] == "Unhandled" and "missing 'a'" in r.json()["errorMessage"]


async def test_event_runs_in_the_background_and_dry_run_runs_nothing(http, tmp_path):
    out = tmp_path / "ran.txt"
    payload = {"path": str(out), "line": "event"}
    r = await http.post(
        PATH.format("append_line"), json=payload, headers={**auth(), "X-Amz-Invocation-Type": "DryRun"}
    )
    assert r.status_code == 204
    r = await http.post(
        PATH.format("append_line"), json=payload, headers={**auth(), "X-Amz-Invocation-Type": "Event"}
    )
    assert r.status_code == 202 and r.content == b""
    # until the line is in it: the file exists from the handler's open(), before its write
    # (polling for the file alone read it empty once, under load)
    for _ in range(200):
        if out.exists() and out.read_text() == "event\n":
            break
        await asyncio.sleep(0.02)
    assert out.read_text() == "event\n"
    r = await http.post(PATH.format("nope"), json={}, headers={**auth(), "X-Amz-Invocation-Type": "DryRun"})
    assert r.status_code == 404


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


async def test_healthz_is_open_and_metrics_need_a_token(http):
    r = await http.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert (await http.get("/metrics")).status_code == 401
    await http.post(PATH.format("add"), json={"a": 1}, headers=auth())
    await http.post(PATH.format("made-up-name"), json={}, headers=auth())
    text = (await http.get("/metrics", headers=auth())).text
    assert 'fabric_serve_requests_total{function="add",status="200",tenant="job-a"} 1.0' in text
    assert 'function="-",status="404"' in text  # made-up names share one label
    assert 'fabric_serve_tenant_limit{tenant="job-a"} 64.0' in text
    assert 'fabric_pool_calls_total{function="add"}' in text


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


async def test_a_thousand_malformed_requests_leave_the_server_serving(gw, http):
    rng = random.Random(7)
    host, port = "127.0.0.1", gw.port
    garbage_lines = [
        b"GARBAGE\r\n\r\n",
        b"POST /2015-03-31/functions/add/invocations HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /2015-03-31/functions/add/invocations HTTP/9.9\r\n\r\n",
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x00\x01\x02\x03" * 64,
        b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
    ]
    statuses: dict[int, int] = {}
    for i in range(1000):
        kind = i % 4
        if kind == 0:  # raw bytes on a socket, then hang up
            _, writer = await asyncio.open_connection(host, port)
            writer.write(
                rng.choice(garbage_lines) + bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
            )
            await writer.drain()
            writer.close()
            continue
        if kind == 1:  # a random body
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
            r = await http.post(PATH.format("add"), content=body, headers=auth())
        elif kind == 2:  # random headers
            headers = {**auth(), "X-Amz-Invocation-Type": rng.choice(["", "event", "x" * 300, "DryRun"])}
            if rng.random() < 0.5:
                headers["Authorization"] = "Bearer " + "".join(
                    rng.choice("ab$%") for _ in range(rng.randrange(1, 40))
                )
            r = await http.post(PATH.format("add"), json={"a": rng.randrange(9)}, headers=headers)
        else:  # random paths and methods
            name = "".join(rng.choice("ab:/%$._-") for _ in range(rng.randrange(1, 30)))
            r = await http.request(
                rng.choice(["POST", "GET", "PUT", "DELETE"]),
                f"/2015-03-31/functions/{name}/invocations",
                headers=auth(),
            )
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (r.status_code, r.text)
    assert set(statuses) - {200, 204, 400, 401, 403, 404, 405} == set()
    for a in range(5):
        r = await http.post(PATH.format("add"), json={"a": a, "b": 1}, headers=auth())
        assert r.json() == a + 1


async def test_a_malformed_request_is_one_debug_line_not_an_error_traceback(gw, http, caplog):
    caplog.set_level(logging.DEBUG)
    _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(_.read(), 10)  # the 400, then the server hangs up
    writer.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    lines = [r.getMessage() for r in caplog.records if r.name == "fabric.serve"]
    assert any("malformed HTTP request" in m and "Content-Length" in m for m in lines), lines
    r = await http.post(PATH.format("add"), json={"a": 1, "b": 1}, headers=auth())
    assert r.json() == 2


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
    f.write_text("tenants: {job-a: {token: x, quota: 3}}\n")
    with pytest.raises(ConfigError, match="tenant 'job-a': quota: Extra inputs"):
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


async def test_port_in_use_is_an_os_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        g = Gateway(config().model_copy(update={"port": s.getsockname()[1]}), REG)
        with pytest.raises(OSError):
            await g.start()
        await g.aclose()
    finally:
        s.close()


def test_envelope_json_round_trips():
    from fabric.backends.lambda_ import envelope

    inv = Invocation(function="add", payload={"a": 1, "s": "é\n"}, idempotency_key="k", deadline=5.0)
    data = json.loads(envelope(inv))
    assert Invocation.model_validate(data).model_dump() == inv.model_dump()


def test_a_keyed_execution_s_envelope_is_what_an_older_handler_takes():
    """A keyed execution's call (``wait_for_run``) goes to a remote endpoint as before the
    mark existed: no mark (a handler or ``fabric serve`` deployed from older code refuses a
    field it does not know, InvalidArguments that the client would keep under the key) and no
    deadline (a Lambda handler cut there drops the key's record, and a side effect could run
    again from another client process)."""
    from fabric.backends.lambda_ import envelope

    old_fields = {
        "function",
        "payload",
        "request_id",
        "idempotency_key",
        "deadline",
        "tenant",
        "attempt",
        "hedge",
    }
    inv = Invocation(function="add", payload={"a": 1}, idempotency_key="k", deadline=5.0, wait_for_run=True)
    data = json.loads(envelope(inv))
    assert set(data) <= old_fields and data["deadline"] is None
    plain = json.loads(envelope(inv.model_copy(update={"wait_for_run": False})))
    assert set(plain) <= old_fields and plain["deadline"] == 5.0  # an unkeyed call keeps its deadline


async def test_a_keyed_execution_s_call_is_answered_by_its_run_not_at_its_deadline(http):
    """A call marked ``wait_for_run`` (fabric serve reads the mark, though a fabric client
    sends it only to its local pools): a synchronous handler runs on past the deadline, and the answer is the
    run's own, not an early DeadlineExceeded that would free the client's key while it runs."""
    from fabric.backends.lambda_ import envelope

    await http.post(PATH.format("sleepy"), json={"seconds": 0}, headers=auth())  # a warm worker
    for wait in (True, False):  # first the one that leaves its worker free
        inv = Invocation(
            function="sleepy",
            payload={"seconds": 0.5},
            idempotency_key=f"k-{wait}",
            deadline=time.time() + 0.2,
            wait_for_run=wait,
        )
        # no fabric client sends the mark (see the test above); fabric serve still reads it
        event = {**json.loads(envelope(inv)), "deadline": inv.deadline, "wait_for_run": wait}
        body = (await http.post(PATH.format("sleepy"), json=event, headers=auth())).json()
        if wait:
            assert body["ok"] and isinstance(body["value"], int), body["error"]
        else:
            assert body["error"]["type"] == "DeadlineExceeded", body


async def test_prefixed_names_as_deployed():
    async with Gateway(config(function_prefix="rl-"), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        assert (await c.post(PATH.format("rl-add"), json={"a": 3}, headers=auth())).json() == 3
        assert (await c.post(PATH.format("rl-add:live"), json={"a": 3}, headers=auth())).json() == 3
        assert (await c.post(PATH.format("add"), json={"a": 3}, headers=auth())).status_code == 404


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


async def until_in_flight(g: Gateway) -> None:
    for _ in range(3000):  # until the server has the request
        if g.inflight:
            break
        await asyncio.sleep(0.01)
    assert g.inflight == 1


async def test_close_lets_the_calls_in_flight_finish():
    g = Gateway(config(drain_s=30), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        call = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 1.0}, headers=auth()))
        await until_in_flight(g)
        await g.aclose()  # stops accepting, waits for the call
        r = await call
    assert r.status_code == 200 and isinstance(r.json(), int)
    assert g.inflight == 0


@pytest.mark.parametrize("how", ["drain_s", "no_drain", "stop_now"])
async def test_a_call_that_outlives_the_drain_is_cancelled(how):
    # no_drain: drain_s=0, which aiohttp's shutdown_timeout would read as "wait forever"
    g = Gateway(config(drain_s={"drain_s": 0.3, "no_drain": 0, "stop_now": 60}[how]), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        call = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 20}, headers=auth()))
        await until_in_flight(g)
        t0 = time.monotonic()
        closing = asyncio.create_task(g.aclose())
        if how == "stop_now":  # a second Ctrl-C
            await asyncio.sleep(0.3)
            assert not closing.done()  # still draining: the call has 60 s
            g.stop_now()
        await closing
        took = time.monotonic() - t0
        with pytest.raises(httpx.TransportError):  # the connection dropped: the client retries
            await call
    assert took < 10, took  # not the call's 20 s, nor the 60 s drain
    assert g.inflight == 0


@pytest.mark.parametrize("drain_s", [0, 3])
async def test_the_drain_lasts_drain_s_and_zero_means_none(drain_s):
    """aiohttp's shutdown_timeout was the drain: it waits that long for a handler, then as
    long again after cancelling only its body read (a 30 s drain was 60 s), and 0 is no limit
    at all (drain_s 0 waited for the call to end)."""
    g = Gateway(config(drain_s=drain_s), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        call = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 9}, headers=auth()))
        for _ in range(3000):  # until the server has the request
            if g.inflight:
                break
            await asyncio.sleep(0.01)
        assert g.inflight == 1
        t0 = time.monotonic()
        closing = asyncio.create_task(g.aclose())
        with pytest.raises(httpx.TransportError):  # the connection dropped at the drain's end
            await call
        dropped = time.monotonic() - t0
        await closing
    # the slow paths: the call's 9 s (drain_s 0), twice the drain (6 s)
    assert dropped < drain_s + 2, dropped
    assert g.inflight == 0


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
