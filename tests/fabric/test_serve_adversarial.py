"""``fabric serve`` under an adversarial tenant and a careless operator: the drain's end
(calls cut with no aiohttp traceback; one still waiting for room told it did not run), tokens
(spaces around one, a newline in the client's, non-ASCII ones over boto3), a call's memory
(its body, not its parsed payload; an answer not read holds a quota slot, for a while), the
log (a tenant's text cannot forge lines), and answers that say what to do (a 404, a rate
refusal counted, --max-concurrency with --tenants)."""

from __future__ import annotations

import asyncio
import logging
import socket
import tracemalloc

import httpx
import pytest
from lambda_helpers import TOKEN, lam, transport_fixture  # noqa: F401 - by name=
from sample_fns import REG
from serve_helpers import PATH, TOKEN_A, TOKEN_B, auth, config

from fabric.backends.base import TOKEN_ENV, InprocConfig, LocalConfig
from fabric.client import Client
from fabric.errors import ConfigError
from fabric.serve import Gateway, TenantConfig


async def _until_in_flight(g: Gateway, n: int = 1) -> None:
    for _ in range(3000):  # until the server has the requests
        if g.inflight >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{g.inflight} requests in flight, not {n}")


@pytest.mark.parametrize("drain_s", [0, 0.3])
async def test_calls_cut_at_the_drains_end_log_no_traceback(drain_s, caplog):
    """The drain's own timer and aiohttp's shutdown timeout fired at the same moment: aiohttp
    cancelled the future it waits on for the request as our timer cancelled the request, whose
    end then set that cancelled future: an ``InvalidStateError`` logged by aiohttp as an
    "Unhandled exception" with two tracebacks per call cut, which reads as a crash."""
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    g = Gateway(config(drain_s=drain_s), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        calls = [
            asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 20}, headers=auth()))
            for _ in range(2)
        ]
        await _until_in_flight(g, 2)
        await g.aclose()
        for call in calls:
            with pytest.raises(httpx.TransportError):  # dropped: the client retries
                await call
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, "\n".join(r.getMessage() + "\n" + caplog.text for r in errors[:1])
    assert "InvalidStateError" not in caplog.text


@pytest.mark.parametrize("written", [" token-a-0123456789abcdef ", "token-a-0123456789abcdef\n"])
async def test_a_token_written_with_spaces_around_it_is_the_token(written):
    """A request's token is read stripped (HTTP trims a header's value), but a token given
    with spaces or a newline around it (``--token``, a tenants file's ``token``,
    ``$RL_FABRIC_TOKEN`` filled from a file) was kept as written: no request could ever
    match it, and every call was 403 "invalid token". A ``token_file`` was stripped already."""
    tenants = {"job-a": TenantConfig(token=written)}
    async with Gateway(config(tenants=tenants), REG) as g, httpx.AsyncClient(base_url=g.url) as http:
        r = await http.post(PATH.format("add"), json={"a": 1}, headers=auth("token-a-0123456789abcdef"))
        assert r.status_code == 200, r.text
        assert r.json() == 1


def test_a_token_short_once_stripped_is_refused():
    with pytest.raises(ConfigError, match="at least 16 characters"):
        TenantConfig(token="short" + " " * 20).secret()


@pytest.mark.parametrize("where", ["config", "env"])
async def test_the_lambda_backend_sends_its_token_stripped(transport, where, monkeypatch):
    """A token with a newline after it (``$RL_FABRIC_TOKEN`` filled from a file, a secret
    mounted as one) went into the header as it was: the http transport's aiohttp refused the
    header ("header injection") and the boto3 one's urllib3 too, each a retryable
    TransportError, retried till the deadline for a call that could never be sent."""
    cfg = config(tenants={"job": TenantConfig(token=TOKEN)}, backend=InprocConfig())
    monkeypatch.setenv(TOKEN_ENV, TOKEN + "\n")
    async with Gateway(cfg, REG) as g:
        backend = lam(g, transport, token=TOKEN + "\n" if where == "config" else None)
        async with Client(backend=backend, registry=REG) as c:
            r = await c.call("add", {"a": 2})
    assert r.ok, r.error
    assert r.value == 2 and r.attempts == 1


@pytest.mark.parametrize("shape", ["raw", "envelope"])
async def test_a_call_waiting_for_room_holds_its_body_not_its_parsed_payload(shape):
    """A tenant holds at most ``max_concurrency`` bodies in the server's memory, the quota's
    promise (6 MB each). But each call kept its payload parsed beside its body while it
    waited and ran, and parsed JSON is many times its text (``[{}, {}, ...]``: about 24x):
    one tenant within its default quota of 64 held some 9 GB, enough to have the server
    killed with every tenant's calls. The backends send the encoded body; the parsed payload
    is not kept."""
    n = 4
    pad = b"[" + b",".join([b"{}"] * 350_000) + b"]"  # 1 MB of JSON, some 25 MB parsed
    if shape == "raw":
        body = b'{"seconds": 0, "pad": ' + pad + b"}"
    else:
        body = b'{"function": "sleepy", "payload": {"seconds": 0, "pad": ' + pad + b"}}"
    g = Gateway(config(backend=LocalConfig(max_workers=1), drain_s=0), REG)
    await g.start()
    try:
        async with httpx.AsyncClient(base_url=g.url, timeout=60) as c:
            # one call has the pool's one slot; the padded ones wait for room in its gate
            busy = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 30}, headers=auth()))
            await _until_in_flight(g, 1)
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                padded = [
                    asyncio.create_task(c.post(PATH.format("sleepy"), content=body, headers=auth()))
                    for _ in range(n)
                ]
                for _ in range(3000):
                    if g._gates["sleepy"].waiting == n:
                        break
                    await asyncio.sleep(0.01)
                assert g._gates["sleepy"].waiting == n
                held = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            for task in [busy, *padded]:
                task.cancel()
            await asyncio.gather(busy, *padded, return_exceptions=True)
    finally:
        await g.aclose()
    # the body, and its copy for the worker: a few times its size, not twenty
    assert held < n * 4 * len(body), f"{held / n / len(body):.1f}x the body per waiting call"


async def test_a_tenant_cannot_write_lines_of_its_own_into_the_servers_log(caplog):
    """An ``Event`` call's failure is logged with its envelope's ``request_id`` and its error
    message, both the caller's text (the message echoes the payload here, as many do). A
    newline in either forged whole log lines (another tenant's, the server's own), and a
    request id of a megabyte was a megabyte of log per call: each is one bounded line."""
    forged = "\n2026-01-01 00:00:00 CRITICAL fabric.serve: tenant job-b leaked its token"
    body = {"function": "boom", "payload": {"x": "1" + forged}, "request_id": "r1" + forged + "A" * 100_000}
    async with Gateway(config(backend=InprocConfig()), REG) as g, httpx.AsyncClient(base_url=g.url) as c:
        with caplog.at_level(logging.INFO, logger="fabric.serve"):
            headers = {**auth(), "X-Amz-Invocation-Type": "Event"}
            r = await c.post(PATH.format("boom"), json=body, headers=headers)
            assert r.status_code == 202
            for _ in range(3000):
                if g.inflight == 0:
                    break
                await asyncio.sleep(0.01)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "fabric.serve"]
    for line in lines:
        assert "\n" not in line and len(line) < 2000, line[:300]
    assert any("boom (tenant job-a) failed" in line for line in lines), lines  # whose event


@pytest.mark.parametrize(
    ("served", "server_prefix", "client_prefix", "says"),
    [
        (["add"], "", "", "restart it with -f boom"),  # registered, not named with -f
        (None, "rl-fabric-", "", "function_prefix='rl-fabric-'"),  # the server's prefix left out
        (None, "", "rl-fabric-", "function_prefix=''"),  # a prefix the server does not use
    ],
)
async def test_a_function_not_served_says_what_to_do_about_it(served, server_prefix, client_prefix, says):
    """The 404 said only "Function not found: NAME", and the lambda backend added advice for
    AWS (`fabric deploy` names it 'rl-fabric-NAME': set that prefix, or run `fabric deploy`),
    wrong for a fabric serve started without the function, or with another prefix."""
    cfg = config(functions=served, function_prefix=server_prefix, backend=InprocConfig())
    async with Gateway(cfg, REG) as g:
        async with Client(backend=lam(g, token=TOKEN_A, function_prefix=client_prefix), registry=REG) as c:
            r = await c.call("boom", {"x": 1})
    assert r.error is not None and r.error.type == "UnknownFunction"
    assert says in r.error.message, r.error.message
    assert "fabric deploy" not in r.error.message, r.error.message


async def test_a_name_with_the_servers_prefix_that_it_does_not_serve_is_404():
    cfg = config(function_prefix="rl-fabric-", backend=InprocConfig())
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url) as http:
        r = await http.post(PATH.format("rl-fabric-nope"), json={}, headers=auth())
        assert r.status_code == 404, r.text
        assert "Function not found: rl-fabric-nope (this server serves add, " in r.json()["message"]
        assert (await http.post(PATH.format("rl-fabric-add"), json={"a": 1}, headers=auth())).json() == 1


async def test_a_request_refused_for_its_rate_counts_as_throttled():
    """``fabric_serve_tenant_throttled_total`` counts the requests refused with 429, the docs
    say; it counted only the quota's, so a tenant refused for its ``max_rps`` showed none."""
    tenants = {
        "job-a": TenantConfig(token=TOKEN_A, max_rps=0.1),  # one request per 10 s
        # the scrape's own token: job-a's /metrics would wait for its max_rps too
        "prometheus": TenantConfig(token=TOKEN_B, metrics="all", invoke=False),
    }
    async with (
        Gateway(config(tenants=tenants, backend=InprocConfig()), REG) as g,
        httpx.AsyncClient(base_url=g.url) as http,
    ):
        assert (await http.post(PATH.format("add"), json={"a": 1}, headers=auth())).status_code == 200
        r = await http.post(PATH.format("add"), json={"a": 1}, headers=auth())
        assert r.status_code == 429 and "max_rps" in r.json()["message"]
        text = (await http.get("/metrics", headers=auth(TOKEN_B))).text
    assert 'fabric_serve_tenant_throttled_total{tenant="job-a"} 1.0' in text, text


def test_serve_says_max_concurrency_is_the_tenants_files_with_tenants(tmp_path):
    """``--max-concurrency`` is the ``default`` tenant's quota. With ``--tenants`` there is no
    such tenant, and the option was dropped without a word: an operator who capped every
    job at 8 ran them at the file's quotas (64 each unless it said otherwise)."""
    from cli_helpers import runner

    from fabric.cli import app

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text('tenants:\n  job-a: {token: "a-long-random-token-for-job-a"}\n')
    args = ["serve", "-f", "exact_match", "--port", "-1", "--tenants", str(tenants)]
    r = runner.invoke(app, [*args, "--max-concurrency", "8"])
    assert r.exit_code == 2, r.output
    assert "max_concurrency" in r.output and "tenants file" in " ".join(r.output.split()), r.output
    # without it, the command gets past the check (and fails on its bad port, before it serves)
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "max_concurrency" not in r.output and "port" in r.output, r.output


async def test_a_token_with_non_ascii_characters_works_over_either_transport(transport):
    """Tokens with UTF-8 characters are served (test_serve_hardening.py), and the http
    transport sends them as UTF-8. boto3 (and the AWS CLI, and Python's http.client) sends a
    header as Latin-1: the same token arrived as other bytes, and every call was 403."""
    token = "jöb-ä-tökén-0123456789"
    cfg = config(tenants={"job-ä": TenantConfig(token=token)}, backend=InprocConfig())
    async with Gateway(cfg, REG) as g, Client(backend=lam(g, transport, token=token), registry=REG) as c:
        r = await c.call("add", {"a": 5})
    assert r.ok, r.error
    assert r.value == 5


async def test_a_call_still_waiting_for_room_when_the_drain_ends_is_told_it_did_not_run():
    """At the drain's end every call left was cut, its connection dropped: a TransportError
    to the lambda backend, after which a call may have run. So a side effect's call that had
    only waited for room in the pool was not retried, and a keyed one was left
    OutcomeUnknown, though it never ran. One still waiting is answered 429: nothing ran."""
    g = Gateway(config(drain_s=0.3, backend=LocalConfig(max_workers=1)), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        running = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 20}, headers=auth()))
        await _until_in_flight(g, 1)
        for _ in range(3000):  # until the call is on the worker, not only in flight here
            if g.backend.stats()["sleepy"]["inflight"]:
                break
            await asyncio.sleep(0.01)
        # the pool's one worker is busy: this one waits for room in the function's gate
        waiting = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 0}, headers=auth()))
        for _ in range(3000):
            if g._gates["sleepy"].waiting:
                break
            await asyncio.sleep(0.01)
        assert g._gates["sleepy"].waiting == 1
        await g.aclose()
        with pytest.raises(httpx.TransportError):  # the running one: cut, it may have run
            await running
        r = await waiting
    assert r.status_code == 429, r.text
    assert r.headers["x-amzn-ErrorType"] == "TooManyRequestsException"
    assert "did not run" in r.json()["message"], r.text
    assert g.quotas.held["job-a"] == 0


async def test_an_answer_the_client_does_not_take_holds_its_slot_and_then_goes(caplog):
    """A call gave its quota slot back when it ended, before its answer was written: a client
    that never reads its answers (a large result each) held every one in the server's memory,
    on as many connections as it liked, none counted in its quota and none ever let go (a
    write has no timeout). An answer being written now keeps its slot, and one not taken
    within body_timeout_s goes with its connection."""
    cfg = config(backend=InprocConfig(), quota_a=2, body_timeout_s=1.0)
    body = b'{"n": 5000000}'
    request = (
        f"POST {PATH.format('big_result')} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN_A}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url) as http:
        readers = []
        try:
            for _ in range(2):  # answers of 5 MB each, never read
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", g.port))
                s.sendall(request)
                readers.append(s)
            for want in (2, 0):  # until both calls have run, then ended: their answers are ready
                for _ in range(3000):
                    gate = g._gates.get("big_result")
                    if gate is not None and gate.running == want:
                        break
                    await asyncio.sleep(0.01)
            assert g.quotas.held["job-a"] == 2, "an answer not taken holds no slot"
            r = await http.post(PATH.format("add"), json={"a": 1}, headers=auth())
            assert r.status_code == 429, r.text
            for _ in range(500):  # body_timeout_s: the answers go, and their slots come back
                if g.quotas.held["job-a"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert g.quotas.held["job-a"] == 0
            assert (await http.post(PATH.format("add"), json={"a": 1}, headers=auth())).json() == 1
        finally:
            for s in readers:
                s.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
