"""A Lambda reply whose body is not JSON (and not a lone surrogate's case). It was always a
retryable TransportError, so a deterministic bad reply (a custom runtime or container
writing raw bytes, a handler bug, a proxy's 200 page) was fetched again up to max_attempts,
and for a side effect the key kept OutcomeUnknown. The Invoke API says where a body comes
from: HTTP 200 without ``X-Amz-Function-Error`` is the function's response as its runtime
wrote it; with the header, the function's error. A transport cut is told apart before the
body is read (a Content-Length or chunk not filled: aiohttp's ClientPayloadError, botocore's
IncompleteReadError, both TransportError). What is left is a complete body: one that is
JSON cut short (an end of valid JSON missing: a reply delimited by the connection's close,
cut there) may pass and is retried; anything else is the same whenever it is asked, and
final."""

from __future__ import annotations

import pytest
from aws_fakes import create_function
from aws_fakes import fixed_reply_endpoint as endpoint
from sample_fns import REG

from fabric.backends.base import LambdaConfig
from fabric.backends.lambda_ import LambdaBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation

TOKEN = "lambda-not-json-token-0123456789"


@pytest.fixture(params=["http", "boto3"])
def transport(request) -> str:
    return request.param


def _cfg(url: str, transport: str) -> LambdaConfig:
    return LambdaConfig(endpoint_url=url, token=TOKEN, transport=transport)


_FAST_RETRY = {"max_attempts": 3, "initial_backoff_s": 0.001}


async def _call(url: str, transport: str) -> tuple[object, object]:
    """The reply through the backend, and through a client (3 attempts)."""
    async with LambdaBackend(REG, _cfg(url, transport)) as b:
        raw = await b.invoke(Invocation(function="add", payload={"a": 1}))
    spec = REG.get("add")
    reg = type(REG)()
    reg.function(REG.callable("add"), name="add", retry=_FAST_RETRY, warm=spec.warm)
    async with Client(backend=_cfg(url, transport), registry=reg, config={"hedge": {"enabled": False}}) as c:
        via_client = await c.call("add", {"a": 1})
    return raw, via_client


@pytest.mark.parametrize(
    "body",
    [
        b"<html><body><h1>Welcome</h1></body></html>",  # a proxy's page, at 200
        b"Traceback (most recent call last): ...",  # a custom runtime writing its own text
        b'{"score": 1.0}trailing',  # JSON, then bytes that are not
    ],
)
async def test_a_complete_reply_that_is_not_json_is_final_and_not_retried(transport, body):
    hits: list[int] = []
    async with endpoint(body, None, hits) as url:
        raw, r = await _call(url, transport)
    assert raw.error is not None and raw.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE, raw.error
    assert not raw.retryable
    assert "the reply of add is not JSON" in raw.error.message, raw.error.message
    assert r.error is not None and r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE and r.attempts == 1
    assert len(hits) == 2  # one for the backend's call, one for the client's: never again


async def test_a_function_error_whose_body_is_not_json_is_the_functions_error(transport):
    """X-Amz-Function-Error: the function failed, whatever its runtime wrote: its error,
    final (a UserError, the body its message), not a transport fault fetched again."""
    hits: list[int] = []
    async with endpoint(b"handler crashed: bad state", "Unhandled", hits) as url:
        raw, r = await _call(url, transport)
    assert raw.error is not None and raw.error.type == ErrorCode.USER_ERROR, raw.error
    assert "handler crashed: bad state" in raw.error.message
    assert r.error is not None and r.error.type == ErrorCode.USER_ERROR and r.attempts == 1
    assert len(hits) == 2


@pytest.mark.parametrize("body", [b'{"ok": tru', b'{"score": [1.0, 2', b'"cut str'])
async def test_json_cut_short_is_a_transport_fault_and_retried(transport, body):
    hits: list[int] = []
    async with endpoint(body, None, hits) as url:
        raw, r = await _call(url, transport)
    assert raw.error is not None and raw.error.type == ErrorCode.TRANSPORT and raw.retryable, raw.error
    assert "cut short" in raw.error.message, raw.error.message
    assert r.error is not None and r.error.type == ErrorCode.TRANSPORT and r.attempts == 3
    assert len(hits) == 1 + 3


async def test_through_moto_signed_a_reply_that_is_not_json_is_final(moto_url):
    """boto3 signing with SigV4 to moto's Lambda, whose invoke (without Docker) sends the
    request back: an envelope whose payload is not JSON comes back as such."""
    create_function(moto_url, "rl-add")
    async with LambdaBackend(REG, LambdaConfig(endpoint_url=moto_url, function_prefix="rl-")) as b:
        inv = Invocation(function="add", payload={})
        inv.raw = b"<not json>"
        r = await b.invoke(inv)
    assert r.error is not None and r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE, r.error
    assert not r.retryable and "the reply of add is not JSON" in r.error.message


def test_json_too_deep_for_the_strict_parser_is_read_as_any_reply():
    """The strict parser stops at about 200 levels: a valid reply nested deeper was "not
    JSON", a TransportError fetched again; Python's parser reads it."""
    b = LambdaBackend(REG, LambdaConfig())
    deep = "[" * 300 + "]" * 300
    r = b._reply(Invocation(function="add"), f'{{"nested": {deep}}}'.encode(), None)
    assert r.ok and r.value is not None and "nested" in r.value, r.error
    failed = b._reply(
        Invocation(function="add"), f'{{"errorType": "KeyError", "stackTrace": {deep}}}'.encode(), "Unhandled"
    )
    assert failed.error is not None and failed.error.type == ErrorCode.USER_ERROR, failed.error
