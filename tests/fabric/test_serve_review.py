"""``fabric serve`` as the engineer who runs it for several jobs judges it: deadlines,
slots and gauges on the paths a busy server takes. Real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

import httpx
import pytest
from aws_fakes import free_port
from pydantic import ValidationError
from sample_fns import REG, SERVE_REG
from test_serve import PATH, TOKEN_A, TOKEN_B, auth, config
from test_serve_hardening import _Broken, _post_and_hang_up

from fabric.backends.base import LocalConfig
from fabric.errors import ErrorCode
from fabric.protocol import Invocation
from fabric.serve import Gateway
from fabric.testing import FakeBackend


async def _until(predicate, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_a_deadline_passing_while_the_call_waits_for_the_pool_is_answered_at_once():
    """A call waiting for room in a full pool (the fair gate) waited past its envelope's
    deadline: it was answered DeadlineExceeded only when a worker came free (seconds later),
    holding its tenant's quota slot all that time. Now the wait ends at the deadline."""
    cfg = config(backend=LocalConfig(max_workers=1), drain_s=0)  # one worker: the gate holds 1
    url = PATH.format("sleepy")
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url, timeout=60) as c:
        blocker = asyncio.create_task(c.post(url, json={"seconds": 8}, headers=auth(TOKEN_B)))
        await _until(lambda: g.backend.stats().get("sleepy", {}).get("inflight") == 1, "the worker busy")
        env = Invocation(function="sleepy", payload={"seconds": 0.01}, deadline=time.time() + 0.5)
        t0 = time.monotonic()
        r = await c.post(url, content=env.model_dump_json().encode(), headers=auth())
        took = time.monotonic() - t0
        assert r.status_code == 200 and r.json()["error"]["type"] == "DeadlineExceeded", r.text
        assert r.json()["started"] is False  # it never ran: the caller may tell it from a slow run
        assert took < 4.0, f"answered {took:.1f} s after sending, past its 0.5 s deadline"
        assert not blocker.done()
        await _until(lambda: g.quotas.held["job-a"] == 0, "its slot back")
        blocker.cancel()
        await asyncio.gather(blocker, return_exceptions=True)


async def test_calls_giving_up_on_a_full_pool_leave_no_capacity_watcher_behind():
    """A review feared each call that waited for room and gave up left a capacity watcher
    on the pool (a callback per waiter, never removed). The gate registers one per function,
    when it is made, whatever its waiters do: after many waits given up (deadlines passing,
    clients hanging up) the pool still has that one, and the gate no waiter."""
    cfg = config(backend=LocalConfig(max_workers=1), drain_s=0)
    url = PATH.format("sleepy")
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url, timeout=60) as c:
        blocker = asyncio.create_task(c.post(url, json={"seconds": 8}, headers=auth(TOKEN_B)))
        await _until(lambda: g.backend.stats().get("sleepy", {}).get("inflight") == 1, "the worker busy")
        pool = g.backend._pools["sleepy"]
        assert len(pool._capacity_watchers) == 1  # the gate's
        env = Invocation(function="sleepy", payload={"seconds": 0.01}, deadline=time.time() + 0.3)
        body = env.model_dump_json().encode()
        rs = await asyncio.gather(*(c.post(url, content=body, headers=auth()) for _ in range(20)))
        assert all(r.json()["error"]["type"] == "DeadlineExceeded" for r in rs), rs[0].text
        gate = g._gates["sleepy"]
        for _ in range(5):
            await _post_and_hang_up(g.port, url, b'{"seconds": 0.01}', TOKEN_A, lambda: gate.waiting == 1)
            await _until(lambda: gate.waiting == 0, "the hung-up call out of the line")
        assert not blocker.done()
        assert len(pool._capacity_watchers) == 1 and gate.waiting == 0 and g.quotas.held["job-a"] == 0
        blocker.cancel()
        await asyncio.gather(blocker, return_exceptions=True)


async def test_calls_given_up_while_waiting_for_room_leave_the_waiting_gauge():
    """A call whose client hung up while it waited for room in a full pool stayed in the
    gate's queue until a slot came free: fabric_serve_waiting counted it (and the queue held
    it) although its quota slot was back, so a tenant with max_concurrency=1 that kept
    re-sending and giving up grew both without bound while the pool was busy."""
    cfg = config(backend=LocalConfig(max_workers=1), drain_s=0, quota_a=1)
    url = PATH.format("sleepy")
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url, timeout=60) as c:
        blocker = asyncio.create_task(c.post(url, json={"seconds": 8}, headers=auth(TOKEN_B)))
        await _until(lambda: g.backend.stats().get("sleepy", {}).get("inflight") == 1, "the worker busy")
        gate = g._gates["sleepy"]
        live = lambda: sum(not f.done() for q in gate._waiting.values() for f in q)  # noqa: E731
        for _ in range(5):
            await _post_and_hang_up(g.port, url, b'{"seconds": 0.01}', TOKEN_A, lambda: live() == 1)
            await _until(lambda: g.quotas.held["job-a"] == 0, "the hung-up call's slot back")
        assert not blocker.done()
        metrics = (await c.get("/metrics", headers=auth())).text
        assert 'fabric_serve_waiting{function="sleepy"} 0.0' in metrics, [
            line for line in metrics.splitlines() if line.startswith("fabric_serve_waiting")
        ]
        blocker.cancel()
        await asyncio.gather(blocker, return_exceptions=True)


@pytest.mark.parametrize("host", ["", "  "])
def test_an_empty_host_is_refused_not_every_interface(host):
    """``--host ""`` (a script's unset variable: ``--host "$HOST"``) bound 0.0.0.0 and ::,
    every interface of the machine, for a server documented as loopback unless an address is
    chosen, and printed its URL as ``http://:PORT``."""
    with pytest.raises(ValidationError, match=r"0\.0\.0\.0"):
        config(host=host)


@pytest.mark.parametrize("taken", ["port", "address"])
async def test_a_port_in_use_or_a_bad_address_fails_before_the_warm_up(taken):
    """The warm-up ran before the listener was bound: a server whose port was taken (an old
    one still running) or whose address was not the machine's started every warm worker
    first (a judge model loads for minutes), then failed to listen."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        if taken == "port":
            cfg = config(warm=True, functions=["serve_add"]).model_copy(update={"port": s.getsockname()[1]})
        else:  # TEST-NET-1: never an address of this machine
            cfg = config(warm=True, functions=["serve_add"], host="192.0.2.1")
        g = Gateway(cfg, SERVE_REG)
        with pytest.raises(OSError):
            await g.start()
        assert g.backend.stats() == {}, "the warm-up ran before the bind failed"
        await g.aclose()
    finally:
        s.close()


async def test_an_address_family_the_machine_lacks_is_skipped_as_the_listener_skips_it(monkeypatch):
    """The probe bind before the warm-up raised where the listener binds: a host that also
    resolves to an IPv6 address on a machine without IPv6 (``::1 localhost`` in /etc/hosts, a
    kernel booted with ipv6.disable=1: no AF_INET6 socket can be made) failed to start with
    EAFNOSUPPORT, while asyncio's listener skips a family it cannot make a socket of and
    serves on 127.0.0.1. Simulated: AF_INET6 sockets refused, localhost resolving to both."""
    real_getaddrinfo = socket.getaddrinfo

    class NoIPv6(socket.socket):
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if family == socket.AF_INET6:
                raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
            super().__init__(family, type, proto, fileno)

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        infos = real_getaddrinfo(host, port, family, type, proto, flags)
        if host == "localhost" and family in (0, socket.AF_UNSPEC):
            v6 = (socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("::1", int(port or 0), 0, 0))
            infos = [v6, *(i for i in infos if i[0] != socket.AF_INET6)]
        return infos

    monkeypatch.setattr(socket, "socket", NoIPv6)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    async with Gateway(config(host="localhost"), SERVE_REG) as g:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{g.port}", timeout=30) as c:
            assert (await c.get("/healthz")).status_code == 200


def test_the_cli_says_what_to_do_about_a_port_in_use():
    from typer.testing import CliRunner

    from fabric.cli import app

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        port = str(s.getsockname()[1])
        args = ["serve", "-f", "exact_match", "--workers", "1", "--port", port, "--token", TOKEN_A]
        r = CliRunner().invoke(app, args)
    finally:
        s.close()
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "Address already in use" in text and "pick another --port" in text, text


async def test_an_envelope_whose_payload_json_cannot_carry_is_400_and_wedges_nothing():
    """An envelope's payload holding NaN or Infinity (``1e999``, which the JSON parser takes)
    passed validation, and the pool could not encode it for its worker: the call was never
    answered, and its quota slot and its place in the pool were held for good. Two such
    requests from one tenant filled the pool's gate (capacity 2): every tenant's calls of that
    function then waited forever."""
    cfg = config(backend=LocalConfig(max_workers=1), drain_s=0)
    url = PATH.format("add")
    async with Gateway(cfg, REG) as g, httpx.AsyncClient(base_url=g.url, timeout=10) as c:
        for number in (b"1e999", b"-1e999", b"NaN", b"Infinity"):
            body = b'{"function": "add", "payload": {"a": ' + number + b"}}"
            r = await c.post(url, content=body, headers=auth())
            assert r.status_code == 400, r.text
            assert r.headers["x-amzn-ErrorType"] == "InvalidRequestContentException"
            assert "NaN or Infinity" in r.json()["message"]
        assert g.quotas.held["job-a"] == 0
        r = await c.post(url, json={"a": 1}, headers=auth(TOKEN_B))
        assert r.status_code == 200 and r.json() == 1
        env = Invocation(function="add", payload={"a": 2, "b": 3})  # a good envelope still runs
        r = await c.post(url, content=env.model_dump_json().encode(), headers=auth())
        assert r.json()["value"] == 5


async def test_the_local_pool_answers_a_call_whose_payload_it_cannot_encode():
    """Found through fabric serve (fixed there by encoding an envelope's payload itself): a
    call the pool could not encode for its worker (it raised in the dispatch, a loop
    callback) was never answered; its future waited forever. Backend.submit encodes first."""
    from fabric.backends.local import LocalBackend

    async with LocalBackend(REG, LocalConfig(max_workers=1)) as backend:
        fut = backend.submit(Invocation(function="add", payload={"a": float("inf")}))
        done, _ = await asyncio.wait({fut}, timeout=10)
        assert done, "the call was never answered"
        r = fut.result()
        assert not r.ok and r.error.type == ErrorCode.PAYLOAD_NOT_SERIALIZABLE
        assert "not JSON-serialisable" in r.error.message
        ok = await backend.invoke(Invocation(function="add", payload={"a": 1, "b": 2}))
        assert ok.ok  # the pool goes on


def test_the_url_of_an_ipv6_host_has_it_in_brackets():
    # http://::1:PORT is no URL: an IPv6 address goes in brackets
    from fabric.serve import Gateway

    g = Gateway(config(host="::1"), REG)
    g.port = 9000
    assert g.url == "http://[::1]:9000"
    g = Gateway(config(host="127.0.0.1"), REG)
    g.port = 9000
    assert g.url == "http://127.0.0.1:9000"


class _PortTakenInTheWarmUp(FakeBackend):
    """A warm-up during which another process takes the server's port: the probe before the
    warm-up found it free (a judge model loads for minutes; a second server started meanwhile)."""

    def __init__(self, registry, port: int):
        super().__init__(registry)
        self.port = port
        self.taker: socket.socket | None = None

    async def _warmup(self, names):
        self.taker = socket.socket()
        self.taker.bind(("127.0.0.1", self.port))
        self.taker.listen()


async def test_a_listener_that_cannot_bind_after_the_warm_up_leaves_no_pool_running():
    """Only a failed warm-up closed the pools: a listener that then failed to bind (or a
    cancelled start) left them running, and ``async with Gateway(...)`` never reaches
    ``__aexit__`` when ``__aenter__`` raises, so the warm workers outlived the server till
    the interpreter exited."""
    port = free_port()
    backend = _PortTakenInTheWarmUp(SERVE_REG, port)
    cfg = config(warm=True, functions=["serve_add"]).model_copy(update={"port": port})
    try:
        with pytest.raises(OSError):
            async with Gateway(cfg, SERVE_REG, backend=backend):
                pytest.fail("the server started on a port another process listens on")
        assert backend.taker is not None, "the warm-up did not run"
        assert backend.closed, "the backend's pools outlived a server that did not start"
    finally:
        if backend.taker is not None:
            backend.taker.close()


async def test_an_event_that_fails_inside_the_server_is_logged_with_its_request_id(caplog):
    """A bug under an Event call (here a backend that raises) ended its task with an exception
    nobody read: the caller had its 202, and all that showed was asyncio's "Task exception was
    never retrieved" when the task was collected, with no request id. It is logged at once,
    as a RequestResponse call's 500 is."""
    async with (
        Gateway(config(), REG, backend=_Broken(REG)) as g,
        httpx.AsyncClient(base_url=g.url, timeout=30) as c,
    ):
        with caplog.at_level(logging.ERROR, logger="fabric.serve"):
            headers = {**auth(), "X-Amz-Invocation-Type": "Event"}
            r = await c.post(PATH.format("add"), json={"a": 1}, headers=headers)
            assert r.status_code == 202
            await _until(lambda: g.inflight == 0, "the event to end")
        request_id = r.headers["x-amzn-RequestId"]
        errors = [
            rec.getMessage()
            for rec in caplog.records
            if rec.name == "fabric.serve" and rec.levelno >= logging.ERROR
        ]
        assert any(request_id in message for message in errors), caplog.text
        assert "a bug in a backend" in caplog.text
        assert g.quotas.held["job-a"] == 0
