"""The lambda backend against moto's server (signed requests, as to AWS) and its S3 spill
of payloads over Lambda's 6 MB: the upload and the pointer, a backend used directly, and a
spill that fails (no bucket, refused, throttled, no credentials: never sent; counted)."""

from __future__ import annotations

import json

import pytest
from aws_fakes import create_function
from sample_fns import REG

from fabric.backends.base import LambdaConfig
from fabric.backends.lambda_ import LambdaBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation


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
        # session credentials past their expiry (S3 says 400, not 403): final, as Lambda's
        # ExpiredTokenException is for the call itself; it was NotStarted, retried to the
        # last attempt, and its message said nothing of the credentials
        ("ExpiredToken", 400, ErrorCode.UNAUTHORIZED, "refresh the credentials"),
        ("InvalidToken", 400, ErrorCode.UNAUTHORIZED, "refresh the credentials"),
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


def test_a_spill_whose_upload_times_out_was_not_sent_and_may_be_retried():
    """botocore's transport errors (a read timeout, a connection closed) carry
    ``response=None``: reading the error code from it raised AttributeError out of the
    backend's thread, not the NotStarted the call is (Lambda was never called)."""
    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError

    b = LambdaBackend(REG, LambdaConfig(spill_bucket="spill", function_prefix="rl-"))
    for error in (
        ReadTimeoutError(endpoint_url="https://s3.example"),
        ConnectionClosedError(endpoint_url="https://s3.example"),
    ):
        b._s3 = _RefusingS3(error)
        r = b._spill(Invocation(function="add", payload={"a": 1}))
        assert r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
        assert "not sent" in r.error.message


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


async def test_the_spill_threshold_counts_the_whole_envelope(moto_url):
    """Lambda's 6 MiB counts the request: the payload and the envelope around it. The
    backend spilled only a payload within 4 KiB of the limit, a guess at the envelope's other
    fields; a long idempotency key (a caller's own, escaped as JSON writes non-ASCII text, 6
    bytes a character) makes them larger, and such a payload went inline, to be refused
    PayloadTooLarge though a spill bucket was set."""
    import boto3

    from fabric.protocol import MAX_PAYLOAD_BYTES
    from fabric.spill import SPILL_KEY

    create_function(moto_url, "rl-add")
    boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1").create_bucket(Bucket="spill")
    cfg = LambdaConfig(
        endpoint_url=moto_url, function_prefix="rl-", spill_bucket="spill", s3_endpoint_url=moto_url
    )
    key = "轨迹" * 500  # 1,000 characters, 6,000 bytes in the envelope
    blob = "x" * (MAX_PAYLOAD_BYTES - 5000)  # with its field, under the limit by more than 4 KiB
    async with LambdaBackend(REG, cfg) as b:
        r = await b.invoke(Invocation(function="add", payload={"blob": blob}, idempotency_key=key))
    assert r.ok, r.error
    assert r.value["payload"][SPILL_KEY]["bytes"] > MAX_PAYLOAD_BYTES - 5000
    assert r.value["idempotency_key"] == key


async def test_a_spill_is_one_upload_an_attempt_the_clients_retries_are_the_rest(aws_env):
    """The S3 client kept botocore's retries (3 attempts, with backoff sleeps) under the
    fabric client's own: each attempt of a call S3 throttled uploaded the payload (over 6 MB)
    up to 3 times, sleeping on a thread past the call's deadline, and the client's retries
    multiplied that. One upload an attempt, as for the Lambda call itself; and its connect
    timeout is the configured one, not botocore's 60 s."""
    import http.server
    import threading

    puts: list[str] = []

    class SlowDown(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            puts.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), SlowDown)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    cfg = LambdaConfig(
        endpoint_url=url,
        function_prefix="rl-",
        spill_bucket="spill",
        s3_endpoint_url=url,
        connect_timeout_s=2,
    )
    try:
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"blob": "x" * (7 * 1024 * 1024)}))
            connect_timeout = b._s3.meta.config.connect_timeout
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert r.error is not None and r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
    assert len(puts) == 1, puts
    assert connect_timeout == 2
