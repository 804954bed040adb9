"""The lambda backend's transports (http and boto3) against endpoints that misbehave:
throttling, a request over the size limit, an endpoint that is unreachable, never accepts,
cuts the connection or never answers; boto3's connection pool (abandoned calls, a call that
never got a connection, one cancelled in the loop turn it got one)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from aws_fakes import free_port
from lambda_helpers import TOKEN, lam, transport_fixture  # noqa: F401 - by name=
from sample_fns import REG

from fabric.backends.base import LambdaConfig, LocalConfig
from fabric.backends.lambda_ import LambdaBackend
from fabric.client import Client
from fabric.errors import SAFE_TO_RETRY, ErrorCode
from fabric.protocol import Invocation
from fabric.serve import Gateway, ServeConfig, TenantConfig


async def test_throttling_is_retryable_and_the_client_gets_through(transport):
    cfg = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN, max_concurrency=1)},
        backend=LocalConfig(max_workers=2),
        warm=False,
    )
    async with Gateway(cfg, REG) as g, LambdaBackend(REG, lam(g, transport)) as b:
        slow = asyncio.ensure_future(b.invoke(Invocation(function="sleepy", payload={"seconds": 1.0})))
        for _ in range(1000):  # boto3's first call loads its service model: allow for it
            if g.quotas.held["job"]:
                break
            await asyncio.sleep(0.01)
        assert g.quotas.held["job"] == 1
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
        assert r.error.type == ErrorCode.THROTTLED and r.retryable
        assert (await slow).ok
    # through the client, throttled calls back off and go through
    async with Gateway(cfg, REG) as g, Client(backend=lam(g, transport), registry=REG) as c:
        # its worker started first: a cold start (seconds on a loaded machine) held the one
        # slot past the other calls' 20 backoffs, and they ended throttled
        assert (await c.call("patient_sleep", {"seconds": 0.0})).ok
        results = await c.map("patient_sleep", [{"seconds": 0.05}] * 3)
        assert all(x.ok for x in results), [x.error for x in results]
        assert g.quotas.throttled["job"] >= 1 and max(x.attempts for x in results) >= 2


async def test_a_request_over_the_size_limit_is_payload_too_large(transport):
    """Lambda's 413 is ``RequestTooLargeException`` (AWS and fabric serve): PayloadTooLarge,
    not an InvalidArguments that the client would keep under the key as the function's answer."""
    cfg = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN)},
        backend=LocalConfig(max_workers=1),
        warm=False,
        max_body_bytes=1000,
    )
    async with Gateway(cfg, REG) as g, LambdaBackend(REG, lam(g, transport)) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1, "pad": "x" * 2000}))
    assert r.error.type == ErrorCode.PAYLOAD_TOO_LARGE and not r.retryable, r.error
    assert "RequestTooLargeException" in r.error.message


async def test_boto3_raises_lambdas_own_exception_for_a_request_too_large():
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    cfg = ServeConfig(port=0, tenants={"job": TenantConfig(token=TOKEN)}, warm=False, max_body_bytes=1000)
    async with Gateway(cfg, REG) as g:
        client = boto3.client(
            "lambda",
            region_name="us-east-1",
            endpoint_url=g.url,
            aws_access_key_id="x",
            aws_secret_access_key="x",
            config=Config(signature_version=UNSIGNED, retries={"total_max_attempts": 1}),
        )

        def add_token(request, **_):
            request.headers["Authorization"] = f"Bearer {TOKEN}"

        client.meta.events.register("before-send.lambda.Invoke", add_token)
        big = json.dumps({"a": 1, "pad": "x" * 2000}).encode()
        try:
            with pytest.raises(client.exceptions.RequestTooLargeException):
                await asyncio.to_thread(client.invoke, FunctionName="add", Payload=big)
        finally:
            client.close()


async def test_unreachable_endpoint_is_not_started(transport):
    """The connection was refused: the request never went out, so the call is NotStarted,
    safe to retry even for a side effect (it was a TransportError, which may have run)."""
    port = free_port()  # nothing listens there
    cfg = LambdaConfig(
        endpoint_url=f"http://127.0.0.1:{port}", token=TOKEN, connect_timeout_s=1, transport=transport
    )
    async with LambdaBackend(REG, cfg) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable and f"127.0.0.1:{port}" in r.error.message
    assert r.error.type in SAFE_TO_RETRY and "not sent" in r.error.message


async def test_a_connect_timeout_is_not_started(transport):
    """A TCP handshake that never completes (a listener whose accept queue is full) ends at
    connect_timeout_s. It was FunctionTimeout (aiohttp's ConnectionTimeoutError is a
    ServerTimeoutError) or TransportError (botocore's ConnectTimeoutError): both mean the call
    may have run, so a side effect was not retried, though the request was never sent."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):  # fill the accept queue: later SYNs are dropped, connect() hangs
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fillers.append(s)
    cfg = LambdaConfig(
        endpoint_url=f"http://127.0.0.1:{port}", token=TOKEN, connect_timeout_s=0.3, transport=transport
    )
    try:
        async with LambdaBackend(REG, cfg) as b:
            t0 = time.monotonic()
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
            took = time.monotonic() - t0
    finally:
        for s in [*fillers, listener]:
            s.close()
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
    assert "not sent" in r.error.message and took < 5


async def test_a_tls_handshake_that_fails_is_not_started(transport):
    """An https endpoint that does not speak TLS (or a certificate that does not verify): the
    handshake fails before a byte of the request is sent. The boto3 transport answered
    TransportError (may have run: a side effect was never retried), the http one NotStarted."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]

    def plain_http() -> None:  # answers every TLS ClientHello with plain HTTP
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=plain_http, daemon=True).start()
    cfg = LambdaConfig(
        endpoint_url=f"https://127.0.0.1:{port}", token=TOKEN, connect_timeout_s=1, transport=transport
    )
    try:
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    finally:
        listener.close()
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
    assert "not sent" in r.error.message and "wrong version number" in r.error.message.lower()


async def test_a_proxy_that_cannot_be_reached_is_not_started(monkeypatch):
    """boto3 goes through $HTTP_PROXY: a proxy that refuses the connection never saw the
    request (botocore's ProxyConnectionError was a TransportError, "may have run")."""
    proxy_port, port = free_port(), free_port()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy_port}")
    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    cfg = LambdaConfig(
        endpoint_url=f"http://127.0.0.1:{port}", token=TOKEN, connect_timeout_s=1, transport="boto3"
    )
    async with LambdaBackend(REG, cfg) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
    assert f"127.0.0.1:{proxy_port}" in r.error.message and "not sent" in r.error.message


@pytest.mark.parametrize("cut", ["before the reply", "in the reply"])
async def test_a_connection_cut_after_the_request_is_a_transport_fault(transport, cut):
    """The call may have run: a retryable TransportError (not retried for a side effect), as
    with the http transport. boto3's ConnectionClosedError and ResponseStreamingError were
    read as refused credentials: Unauthorized, final, with advice about tokens."""
    received = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        received.set()
        if cut == "in the reply":
            writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"ok": ')
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = LambdaConfig(endpoint_url=f"http://127.0.0.1:{port}", token=TOKEN, transport=transport)
    try:
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    finally:
        server.close()
        await server.wait_closed()
    assert received.is_set()
    assert r.error.type == ErrorCode.TRANSPORT and r.retryable, r.error
    assert "token" not in r.error.message


async def test_a_call_to_an_endpoint_that_does_not_answer_ends_at_its_deadline(transport):
    """The endpoint took the call and does not answer (a slow function, a hung connection):
    the backend waits up to read_timeout_s (910 s); the caller gets DeadlineExceeded at its
    deadline."""
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(release.wait(), 10)
        writer.close()  # ends the boto3 transport's thread, which nothing can cancel

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    cfg = LambdaConfig(endpoint_url=f"http://127.0.0.1:{port}", token=TOKEN, transport=transport)
    try:
        async with Client(backend=cfg, registry=REG, config={"hedge": {"enabled": False}}) as c:
            t0 = time.monotonic()
            r = await asyncio.wait_for(c.call("add", {"a": 1}, deadline_s=0.5), 5)
            took = time.monotonic() - t0
    finally:
        release.set()
        server.close()
        await server.wait_closed()
    assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and "backend answered" in r.error.message, r.error
    assert r.started is True  # sent: it may run on the far side, and is read as begun
    assert 0.4 < took < 4  # the 0.5 s deadline, not the endpoint's 10 s hold (slack: a loaded machine)


@contextlib.asynccontextmanager
async def holding_endpoint():
    """A Lambda Invoke endpoint on 127.0.0.1 that answers ``add`` at once and holds every
    ``sleepy`` call until it closes (a judge that takes minutes). Yields its URL."""
    from fabric.protocol import Result

    closing = asyncio.Event()
    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        try:
            while True:  # keep-alive: one request after another
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                length = int(
                    next(h for h in head.split("\r\n") if h.lower().startswith("content-length:"))[15:]
                )
                inv = json.loads(await reader.readexactly(length))
                if "/sleepy/" in head.split("\r\n")[0]:
                    await closing.wait()
                    return
                body = Result.built(
                    True, function=inv["function"], request_id=inv["request_id"], value=1, worker="fake"
                ).model_dump_json()
                head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                writer.write(f"{head}\r\n\r\n{body}".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client hung up: this connection is done, nothing to answer
        finally:
            writers.discard(writer)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        closing.set()  # the held calls' threads end now, not at read_timeout_s
        for w in list(writers):
            w.close()
        server.close()
        await server.wait_closed()


async def test_abandoned_boto3_calls_do_not_starve_live_ones():
    """boto3 calls run on a thread pool as wide as the connection pool. Calls abandoned at
    their callers' deadline kept their threads until Lambda answered (up to 900 s), so every
    other function's calls queued behind them and ended DeadlineExceeded, never sent. An
    abandoned call's thread no longer counts against the live calls."""
    config = {"hedge": {"enabled": False}}
    async with holding_endpoint() as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport="boto3", max_connections=2)
        async with Client(backend=cfg, registry=REG, config=config) as c:
            assert (await c.call("add", {"a": 1})).ok  # boto3 loads its service model once
            gave_up = await asyncio.gather(
                *(c.call("sleepy", {"seconds": 600}, deadline_s=0.3) for _ in range(2))
            )
            assert [r.error.type for r in gave_up] == [ErrorCode.DEADLINE_EXCEEDED] * 2
            t0 = time.monotonic()
            r = await c.call("add", {"a": 1}, deadline_s=1.5)
            assert r.ok, r.error
            assert time.monotonic() - t0 < 1.0


async def test_a_boto3_call_that_never_got_a_connection_says_it_was_not_sent():
    """All connections busy with calls whose callers still wait: a call whose deadline passes
    while it waits for one was never sent, and says so (it said the call was abandoned and
    that the remote function may still run)."""
    config = {"hedge": {"enabled": False}}
    async with holding_endpoint() as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport="boto3", max_connections=1)
        async with Client(backend=cfg, registry=REG, config=config) as c:
            assert (await c.call("add", {"a": 1})).ok
            busy = asyncio.ensure_future(c.call("sleepy", {"seconds": 600}, deadline_s=30))
            await asyncio.sleep(0.2)
            r = await c.call("add", {"a": 1}, deadline_s=0.4)
            assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and "not sent" in r.error.message, r.error
            assert r.started is False
            busy.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await busy


async def test_a_call_cancelled_in_the_loop_turn_it_gets_a_connection_is_not_sent():
    """asyncio.wait_for (Python 3.11) returns the inner result that lands in the loop turn
    its caller is cancelled, and drops the cancellation: a boto3 call waiting for a free
    connection that got one just as its caller gave up (a losing hedge, a deadline) was sent
    to Lambda all the same, its caller gone."""
    sent: list[str] = []

    class Recording(LambdaBackend):
        def _invoke_sync(self, inv, body):
            sent.append(inv.request_id)
            return self._fail(inv, ErrorCode.TRANSPORT, "not sent here")

    cfg = LambdaConfig(endpoint_url="http://127.0.0.1:9", token=TOKEN, transport="boto3", max_connections=1)
    async with Recording(REG, cfg) as b:
        await b._slots.acquire()  # the one connection is busy with a call whose caller waits
        inv = Invocation(function="add", payload={"a": 1}, deadline=time.time() + 30)
        call = asyncio.ensure_future(b.invoke(inv))
        while not b._slots._waiters:  # noqa: ASYNC110 - until it waits for the connection
            await asyncio.sleep(0)
        b._slots.release()
        call.cancel()  # in the same loop turn as the connection frees up
        with pytest.raises(asyncio.CancelledError):
            await call
        assert sent == []
        assert not b._slots.locked()  # nor did it keep the connection
