"""The lambda backend: real boto3 over real HTTP, to ``fabric serve`` and to a moto server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import pytest
from aws_fakes import create_function, free_port
from sample_fns import REG

from fabric.backends.base import LambdaConfig, LocalConfig, make_backend
from fabric.backends.lambda_ import LambdaBackend
from fabric.client import Client
from fabric.errors import SAFE_TO_RETRY, ErrorCode
from fabric.protocol import Invocation
from fabric.serve import Gateway, ServeConfig, TenantConfig

TOKEN = "lambda-test-token-0123456789"


@pytest.fixture
async def gw():
    cfg = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN, max_concurrency=64)},
        backend=LocalConfig(max_workers=2),
        warm=False,
    )
    async with Gateway(cfg, REG) as g:
        yield g


@pytest.fixture(params=["http", "boto3"])
def transport(request) -> str:
    return request.param


def lam(gw: Gateway, transport: str = "auto", **kw) -> LambdaConfig:
    return LambdaConfig(endpoint_url=gw.url, token=kw.pop("token", TOKEN), transport=transport, **kw)


async def test_calls_reach_the_local_pool(gw, transport):
    async with Client(backend=lam(gw, transport), registry=REG) as c:
        r = await c.call("add", {"a": 2, "b": 5})
        assert r.ok and r.value == 7
        assert r.worker and r.worker.startswith("add-")  # the pool's worker, through the envelope
        assert r.timings.total_ms > 0 and r.timings.exec_ms >= 0
        results = await c.map("add", [{"a": i} for i in range(50)])
        assert [x.value for x in results] == list(range(50))
    assert gw.quotas.held["job"] == 0


async def test_user_error_is_final_and_not_retried(gw, transport):
    async with Client(backend=lam(gw, transport), registry=REG) as c:
        r = await c.call("boom", {"x": 3})
    assert not r.ok and r.error.type == ErrorCode.USER_ERROR and "bad x=3" in r.error.message
    assert r.attempts == 1


async def test_unknown_function_says_how_it_is_deployed(gw, transport):
    async with LambdaBackend(REG, lam(gw, transport, function_prefix="rl-")) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and "'rl-add'" in r.error.message
    assert "fabric deploy" in r.error.message and not r.retryable


async def test_unknown_function_without_a_prefix_names_deploys_default_prefix(transport):
    """`fabric deploy` names functions rl-fabric-NAME by default, while LambdaConfig's
    function_prefix defaults to "": the first call after a deploy with the defaults was
    UnknownFunction "(deployed as 'add'; run `fabric deploy`?)", pointing at a deploy that
    had been run. The message names the prefix the deploy used by default."""
    cfg = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN)},
        function_prefix="rl-fabric-",  # as `fabric deploy` names them
        backend=LocalConfig(max_workers=1),
        warm=False,
    )
    async with Gateway(cfg, REG) as g, LambdaBackend(REG, lam(g, transport)) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION, r.error
    assert "function_prefix='rl-fabric-'" in r.error.message, r.error.message


async def test_wrong_or_missing_token_is_unauthorized_and_final(gw, transport, monkeypatch):
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    async with LambdaBackend(REG, lam(gw, transport, token="not-the-token-0123456789")) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNAUTHORIZED and not r.retryable
    assert "RL_FABRIC_TOKEN" in r.error.message


async def test_token_from_the_environment(gw, monkeypatch):
    monkeypatch.setenv("RL_FABRIC_TOKEN", TOKEN)
    async with LambdaBackend(REG, LambdaConfig(endpoint_url=gw.url)) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 4}))
    assert r.ok and r.value == 4


async def test_qualifier_none_calls_latest(gw, transport):
    async with LambdaBackend(REG, lam(gw, transport, qualifier=None)) as b:
        assert (await b.invoke(Invocation(function="add", payload={"a": 1}))).value == 1


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
        results = await c.map("patient_sleep", [{"seconds": 0.05}] * 3)
        assert all(x.ok for x in results)
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
            busy.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await busy


@pytest.mark.parametrize(
    ("body", "function_error", "code"),
    [
        (
            {"errorType": "Sandbox.Timedout", "errorMessage": "Task timed out after 3.00 seconds"},
            "Unhandled",
            "FunctionTimeout",
        ),
        (
            {"errorMessage": "2026-01-01 RequestId: x Error: Task timed out after 3.00 seconds"},
            "Unhandled",
            "FunctionTimeout",
        ),
        ({"errorType": "Runtime.ExitError", "errorMessage": "signal: killed"}, "Unhandled", "WorkerLost"),
        ({"errorType": "Runtime.OutOfMemory", "errorMessage": "out of memory"}, "Unhandled", "WorkerLost"),
        ({"errorType": "KeyError", "errorMessage": "'x'"}, "Unhandled", "UserError"),
        # a reply over Lambda's response limit: the function's answer is too large, final
        (
            {
                "errorType": "Function.ResponseSizeTooLarge",
                "errorMessage": "Response payload size exceeded maximum allowed payload size (6291556 bytes)",
            },
            "Unhandled",
            "ResultNotSerializable",
        ),
    ],
)
def test_lambda_error_objects_are_mapped(body, function_error, code):
    b = LambdaBackend(REG, LambdaConfig())
    inv = Invocation(function="add")
    r = b._reply(inv, json.dumps(body).encode(), function_error)
    assert not r.ok and r.error.type == code
    assert r.retryable == (code in ("FunctionTimeout", "WorkerLost"))


def test_a_request_timeout_is_a_retryable_transport_fault():
    # fabric serve's body_timeout_s, or a proxy's: not a wrong request that the client would
    # keep under the key as the function's InvalidArguments
    b = LambdaBackend(REG, LambdaConfig())
    r = b._refused(Invocation(function="add"), "RequestTimeoutException", 408, "the body did not arrive")
    assert r.error.type == ErrorCode.TRANSPORT and r.retryable
    assert b._refused(Invocation(function="add"), "", 418, "").error.type == ErrorCode.INVALID_ARGUMENTS


def test_replies_that_are_not_results():
    b = LambdaBackend(REG, LambdaConfig())
    inv = Invocation(function="add")
    # the function's runtime wrote it, the same at every call: final (test_lambda_not_json.py)
    assert b._reply(inv, b"not json", None).error.type == ErrorCode.RESULT_NOT_SERIALIZABLE
    assert b._reply(inv, b'{"score": 1', None).error.type == ErrorCode.TRANSPORT  # cut short: may pass
    plain = b._reply(inv, b'{"score": 1.0}', None)  # a plain Lambda function's bare value
    assert plain.ok and plain.value == {"score": 1.0}
    assert b._reply(inv, b"", None).value is None


def test_transport_choice(monkeypatch):
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    assert LambdaBackend(REG, LambdaConfig()).transport == "boto3"  # AWS
    assert LambdaBackend(REG, LambdaConfig(endpoint_url="http://x", token=TOKEN)).transport == "http"
    with pytest.raises(Exception, match="needs transport 'boto3'"):
        LambdaBackend(REG, LambdaConfig(transport="http"))


def test_config_by_name_and_dict():
    b = make_backend({"type": "lambda", "endpoint_url": "http://127.0.0.1:1", "function_prefix": "x-"}, REG)
    assert isinstance(b, LambdaBackend) and b.config.function_prefix == "x-"
    with pytest.raises(Exception, match="known types: inproc, local, lambda"):
        make_backend({"type": "lambada"}, REG)


async def test_signed_requests_to_a_real_aws_protocol_endpoint(moto_url):
    # no token: boto3 signs with SigV4, as against AWS. moto's server speaks the Lambda API;
    # without Docker its invoke echoes the request body, so what comes back is our envelope
    create_function(moto_url, "rl-add")
    async with LambdaBackend(REG, LambdaConfig(endpoint_url=moto_url, function_prefix="rl-")) as b:
        inv = Invocation(function="add", payload={"a": 1}, idempotency_key="key-1")
        r = await b.invoke(inv)
    assert r.ok and r.value["function"] == "add" and r.value["idempotency_key"] == "key-1"
    assert r.value["payload"] == {"a": 1}


async def test_payloads_over_6_mb_spill_to_s3(moto_url):
    # the upload, the pointer in the envelope, and the client's limit; the handler's side
    # (fetch, check, run) is tests/functions/test_handler_spill.py
    import boto3

    from fabric.registry import Registry
    from fabric.spill import SPILL_KEY

    url = moto_url
    create_function(url, "rl-add")
    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    s3.create_bucket(Bucket="spill")
    big = {"a": 1, "b": 2, "blob": "x" * (7 * 1024 * 1024)}
    reg = Registry()

    @reg.function(name="add")
    def add(a: int, b: int = 0, blob: str = "") -> int:
        return a + b

    plain = LambdaConfig(endpoint_url=url, function_prefix="rl-")
    async with Client(backend=plain, registry=reg) as c:
        refused = await c.call("add", big)
    assert refused.error.type == ErrorCode.PAYLOAD_TOO_LARGE  # no bucket: refused before sending
    spilling = plain.model_copy(update={"spill_bucket": "spill", "s3_endpoint_url": url})
    async with Client(backend=spilling, registry=reg) as c:
        r = await c.call("add", big)
        small = await c.call("add", {"a": 1})
    # moto echoes the envelope: the payload is the pointer, and S3 holds the payload
    ptr = r.value["payload"][SPILL_KEY]
    assert ptr["bucket"] == "spill" and ptr["key"].startswith("spill/default/") and ptr["bytes"] > 7e6
    assert json.loads(s3.get_object(Bucket="spill", Key=ptr["key"])["Body"].read()) == big
    assert small.value["payload"] == {"a": 1}  # small payloads go inline


async def test_a_backend_used_directly_spills_what_its_client_would(moto_url):
    """Backend.submit encodes an Invocation's payload itself when no client did (fabric
    serve, a backend used directly), but under Lambda's 6 MB limit, not the backend's own:
    a lambda backend with a spill bucket refused a 7 MB payload PayloadTooLarge that the
    client, encoding under max_payload_bytes, sends through S3."""
    import boto3

    from fabric.spill import SPILL_KEY

    create_function(moto_url, "rl-add")
    boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1").create_bucket(Bucket="spill")
    big = {"a": 1, "blob": "x" * (7 * 1024 * 1024)}
    cfg = LambdaConfig(
        endpoint_url=moto_url,
        function_prefix="rl-",
        spill_bucket="spill",
        s3_endpoint_url=moto_url,
        max_spill_bytes=8 * 1024 * 1024,
    )
    async with LambdaBackend(REG, cfg) as b:
        r = await b.invoke(Invocation(function="add", payload=big))
        assert r.ok, r.error
        assert r.value["payload"][SPILL_KEY]["bytes"] > 7e6
        # past the backend's own limit it is still refused, with the limit it has
        over = Invocation(function="add", payload={"blob": "x" * (cfg.max_spill_bytes + 1)})
        refused = await b.invoke(over)
        assert refused.error is not None and refused.error.type == ErrorCode.PAYLOAD_TOO_LARGE


def test_a_newer_handlers_result_with_an_unknown_field_is_still_its_result():
    """A Result carrying a field this client does not know (a newer handler or fabric serve)
    failed validation and was read as a plain function's value: a failure became ok=True
    with the whole error object as its value."""
    from fabric.backends.lambda_ import _as_result
    from fabric.protocol import Result

    sent = Result.failure(ErrorCode.USER_ERROR, "boom", function="f", request_id="r")
    data = {**sent.model_dump(mode="json"), "added_in_a_later_release": {"x": 1}}
    got = _as_result(data)
    assert got is not None and not got.ok and got.error.type == ErrorCode.USER_ERROR
    assert got.error.message == "boom"
    # a user's value that only looks like a Result (no field of ours beside ok/value) stays a value
    assert _as_result({"ok": "yes", "value": 3, "mine": True}) is None


@pytest.mark.parametrize(
    ("etype", "message"),
    [
        (
            "Runtime.ImportModuleError",
            "Unable to import module 'functions.handler': No module named 'pydantic'",
        ),
        ("Runtime.HandlerNotFound", "Handler 'handler' missing on module 'functions.handler'"),
        ("Runtime.UserCodeSyntaxError", "Syntax error in module 'functions.handler': invalid syntax"),
        ("Runtime.InvalidEntrypoint", "RequestId: x Error: exec: no such file or directory"),
    ],
)
def test_a_broken_deployment_is_setup_failed_not_the_functions_answer(etype, message):
    """A package that cannot be imported (a zip built --no-deps without a layer, a wheel for
    the other architecture, a wrong handler) makes Lambda answer every call with its own error
    object. It was read as the function's UserError: final, kept under the idempotency key as
    the function's answer, and scored by RewardConfig.failure_score as if the trajectory had
    crashed the reward (a deployment fault trained into the policy as a zero). The handler
    reports its own start-up failures as SetupFailed; Lambda's are the same kind."""
    from fabric.errors import FINAL_ERRORS

    b = LambdaBackend(REG, LambdaConfig())
    body = json.dumps({"errorMessage": message, "errorType": etype, "requestId": "", "stackTrace": []})
    r = b._reply(Invocation(function="add"), body.encode(), "Unhandled")
    assert r.error.type == ErrorCode.SETUP_FAILED, r.error
    assert r.error.type not in FINAL_ERRORS and not r.retryable
    assert etype in r.error.message and message in r.error.message
    assert "fabric deploy" in r.error.message  # what to do


@pytest.mark.parametrize("region", ["us east 1", "eu_west_1", "-us-east-1"])
async def test_a_malformed_region_is_a_config_error_at_the_edge(region):
    """It was taken, and the first call raised botocore's InvalidRegionError out of
    client.call (a backend never raises for a call): said when the config is made, naming
    the key and what a region looks like."""
    from fabric.errors import ConfigError

    with pytest.raises(ConfigError, match=r"region: .*like us-east-1"):
        make_backend({"type": "lambda", "region": region}, REG)


def test_an_endpoint_of_ones_own_takes_a_region_name_aws_has_not():
    # fabric serve, LocalStack or MinIO may call their region "local": the AWS shape check
    # refused it, though nothing on that path needs an AWS region (botocore signs with it)
    from fabric.errors import ConfigError

    b = make_backend({"type": "lambda", "region": "local", "endpoint_url": "http://127.0.0.1:9"}, REG)
    assert b.config.region == "local"
    with pytest.raises(ConfigError, match=r"region: 'loc al' is not a region name"):
        make_backend({"type": "lambda", "region": "loc al", "endpoint_url": "http://127.0.0.1:9"}, REG)
    with pytest.raises(ConfigError, match=r"region: 'local' is not an AWS region"):
        make_backend({"type": "lambda", "region": "local"}, REG)  # AWS itself: its shape


def test_a_malformed_region_from_the_environment_is_a_config_error(monkeypatch):
    from fabric.errors import ConfigError

    monkeypatch.setenv("AWS_REGION", "us east 1")
    with pytest.raises(ConfigError, match=r"region: 'us east 1' is not an AWS region"):
        make_backend("lambda", REG)


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


class _Unreachable:
    """A boto3 Lambda client whose host does not resolve (the region's endpoint is made up)."""

    def __init__(self, region: str):
        self.region = region

    def invoke(self, **_):
        from botocore.exceptions import EndpointConnectionError

        url = f"https://lambda.{self.region}.amazonaws.com/2015-03-31/functions/x/invocations"
        raise EndpointConnectionError(endpoint_url=url, error=OSError("Name or service not known"))


def test_a_region_without_lambda_fails_fast_with_what_to_set(monkeypatch):
    """A well-formed region that AWS has not (us-east-9, a typo of a real one): its endpoint's
    host does not resolve, which read as a connection that was not made, NotStarted, retried
    to the call's attempts and deadline. The region is the fault, and it says so, final."""
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    b = LambdaBackend(REG, LambdaConfig(region="us-east-9", function_prefix="rl-fabric-"))
    b._client = _Unreachable("us-east-9")
    r = b._invoke_sync(Invocation(function="add"), b"{}")
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and not r.retryable, r.error
    assert "us-east-9" in r.error.message and "region" in r.error.message
    assert "$AWS_REGION" in r.error.message and "fabric deploy" in r.error.message
    # a region AWS has: a connection that was not made is still NotStarted (DNS or network down)
    b = LambdaBackend(REG, LambdaConfig(region="eu-west-1"))
    b._client = _Unreachable("eu-west-1")
    assert b._invoke_sync(Invocation(function="add"), b"{}").error.type == ErrorCode.NOT_STARTED


def test_a_function_not_found_on_aws_names_the_region_it_was_looked_for_in():
    # deployed to eu-west-1, called in us-east-1 (the default when $AWS_REGION is unset)
    b = LambdaBackend(REG, LambdaConfig(region="us-east-1", function_prefix="rl-fabric-"))
    message = "Function not found: arn:aws:lambda:us-east-1:123456789012:function:rl-fabric-add:live"
    r = b._refused(Invocation(function="add"), "ResourceNotFoundException", 404, message)
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and not r.retryable
    assert "in us-east-1" in r.error.message and "$AWS_REGION" in r.error.message
    # an opt-in region not enabled for the account: Lambda refuses the credentials there
    b = LambdaBackend(REG, LambdaConfig(region="me-south-1"))
    r = b._refused(
        Invocation(function="add"), "UnrecognizedClientException", 403, "The security token is invalid"
    )
    assert r.error.type == ErrorCode.UNAUTHORIZED and "me-south-1" in r.error.message


class _RefusingS3:
    def __init__(self, error: Exception):
        self.error = error

    def put_object(self, **_):
        raise self.error


@pytest.mark.parametrize(
    ("code", "status", "expected", "says"),
    [
        ("NoSuchBucket", 404, ErrorCode.SETUP_FAILED, "spill_bucket"),
        ("AccessDenied", 403, ErrorCode.UNAUTHORIZED, "s3:PutObject"),
        ("SlowDown", 503, ErrorCode.NOT_STARTED, "not sent"),
    ],
)
def test_a_payload_that_cannot_be_spilled_was_not_sent(code, status, expected, says):
    """The upload failed, so Lambda was never called. It was a TransportError, after which a
    call may have run: a side effect's key was kept as OutcomeUnknown (never run again under
    it) though nothing ran, and a bucket that does not exist was retried as if it might."""
    from botocore.exceptions import ClientError

    from fabric.errors import SAFE_TO_RETRY

    b = LambdaBackend(REG, LambdaConfig(spill_bucket="spill", function_prefix="rl-"))
    error = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    b._s3 = _RefusingS3(ClientError(error, "PutObject"))
    r = b._spill(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == expected and says in r.error.message, r.error
    assert r.retryable == (expected == ErrorCode.NOT_STARTED)
    assert r.error.type in SAFE_TO_RETRY or not r.retryable  # never "may have run"


def test_a_spill_without_credentials_is_final_as_the_call_itself_would_be():
    """NoCredentialsError is no ClientError: it fell through to NotStarted and was retried
    until the attempts ran out, where the same error on the Lambda call is Unauthorized."""
    from botocore.exceptions import NoCredentialsError

    b = LambdaBackend(REG, LambdaConfig(spill_bucket="spill", function_prefix="rl-"))
    b._s3 = _RefusingS3(NoCredentialsError())
    r = b._spill(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNAUTHORIZED and not r.retryable, r.error
    assert "aws configure" in r.error.message


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (401, ErrorCode.UNAUTHORIZED),
        (403, ErrorCode.UNAUTHORIZED),
        (404, ErrorCode.UNKNOWN_FUNCTION),
        (413, ErrorCode.PAYLOAD_TOO_LARGE),
    ],
)
def test_a_refusal_without_a_lambda_error_code_is_read_by_its_status(status, expected):
    """A proxy in front of fabric serve (nginx's client_max_body_size, an auth gateway) or an
    endpoint_url with a wrong path answers with a bare status, no x-amzn-ErrorType. Any 4xx
    was InvalidArguments: final and kept under the idempotency key as the function's own
    answer (a reward's failure_score scored it), for a refusal that is no fault of the payload."""
    from fabric.errors import FINAL_ERRORS

    b = LambdaBackend(REG, LambdaConfig(endpoint_url="http://127.0.0.1:9", token=TOKEN))
    # the http transport finds no code; botocore puts the status in its place
    for code_name in ("", str(status)):
        r = b._refused(Invocation(function="add"), code_name, status, "<html><body>refused</body></html>")
        assert r.error.type == expected and r.error.type not in FINAL_ERRORS, r.error
        assert str(status) in r.error.message
        if status == 404:
            assert "endpoint_url" in r.error.message


class _CountedS3(_RefusingS3):
    """Refuses every upload; says whether it was closed."""

    closed = False

    def close(self) -> None:
        self.closed = True


async def test_a_failed_spill_counts_in_stats_and_the_s3_client_closes():
    """A payload that could not be spilled was answered before the backend counted its calls
    and errors: stats() showed nothing of the spill failures. And the S3 client was never
    closed (its connection pool stayed open after aclose)."""
    from botocore.exceptions import ClientError

    cfg = LambdaConfig(endpoint_url="http://127.0.0.1:1", token="t", spill_bucket="spill", region="us-east-1")
    b = LambdaBackend(REG, cfg)
    await b.start()
    b._s3.close()  # the real one, replaced by one that says whether it was closed
    error = {"Error": {"Code": "SlowDown"}, "ResponseMetadata": {"HTTPStatusCode": 503}}
    b._s3 = s3 = _CountedS3(ClientError(error, "PutObject"))
    try:
        r = await b.submit(Invocation(function="add", payload={"blob": "x" * (7 * 1024 * 1024)}))
        assert not r.ok and r.error.type == ErrorCode.NOT_STARTED, r.error
        stats = b.stats()["lambda"]
        assert stats["spill_failed"] == 1 and stats["spilled"] == 0, stats
        assert stats["calls"] == 1 and stats[f"errors_{ErrorCode.NOT_STARTED}"] == 1, stats
    finally:
        await b.aclose()
    assert s3.closed
