"""A lone surrogate (half of a UTF-16 pair, ``"\\ud800"``) in what a Lambda function sent
back. Lambda's Python runtime writes a returned string with one as JSON's escape (as
``json.dumps`` does), which the backend's strict parser refused: the reply read as "not
JSON", a retryable TransportError. As on the local backend, a value with one is the
function's answer that JSON cannot carry (``ResultNotSerializable``, final, saying where it
is); an error object whose message holds one is still that error."""

from __future__ import annotations

import pytest
from aws_fakes import create_function
from aws_fakes import fixed_reply_endpoint as endpoint
from sample_fns import REG

from fabric.backends.base import LambdaConfig
from fabric.backends.lambda_ import LambdaBackend
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result

TOKEN = "lambda-surrogate-token-0123456789"


@pytest.fixture(params=["http", "boto3"])
def transport(request) -> str:
    return request.param


@pytest.mark.parametrize(
    ("body", "where"),
    [
        (b'"ok \\ud800"', "$"),  # a plain function's bare value, as Lambda's runtime writes it
        (b'{"texts": ["fine", "cut \\udbff"]}', "$.texts[1]"),
        (b'"ok \xed\xa0\x80"', "$"),  # the half pair as (invalid) UTF-8 bytes
    ],
)
async def test_a_returned_lone_surrogate_is_a_result_not_serializable_saying_where(transport, body, where):
    async with endpoint(body, None) as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport=transport)
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error is not None and r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE, r.error
    assert not r.retryable
    assert f"the reply of add has a lone surrogate at {where}" in r.error.message, r.error.message
    assert "not JSON" not in r.error.message and "hex escape" not in r.error.message
    r.error.message.encode()  # the message itself is valid text


async def test_an_error_object_whose_message_holds_a_lone_surrogate_is_still_that_error(transport):
    """A handler that raised with such a message: Lambda's error object is read as it would
    be otherwise (a UserError here), the half pair shown as its escape."""
    body = b'{"errorType": "ValueError", "errorMessage": "bad text \\ud800", "stackTrace": []}'
    async with endpoint(body, "Unhandled") as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport=transport)
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error is not None and r.error.type == ErrorCode.USER_ERROR, r.error
    assert r.error.message == "ValueError: bad text \\ud800", r.error.message


async def test_a_timeout_error_object_with_one_is_still_a_timeout(transport):
    body = b'{"errorType": "Sandbox.Timedout", "errorMessage": "Task timed out \\udfff"}'
    async with endpoint(body, "Unhandled") as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport=transport)
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error is not None and r.error.type == ErrorCode.TIMEOUT and r.retryable, r.error


def test_a_failed_result_whose_message_holds_one_is_still_that_failure():
    """A fabric handler's failed Result quoting such text (its runner escapes it; another
    handler may not): still its UserError, not the reply's ResultNotSerializable."""
    failed = Result.failure(ErrorCode.USER_ERROR, "ValueError: PLACE", function="add", request_id="r1")
    body = failed.model_dump_json().replace("PLACE", "\\udc80").encode()
    b = LambdaBackend(REG, LambdaConfig())
    r = b._reply(Invocation(function="add"), body, None)
    assert r.error is not None and r.error.type == ErrorCode.USER_ERROR, r.error
    assert r.error.message == "ValueError: \\udc80" and r.request_id == "r1"


async def test_a_reply_cut_short_is_still_a_transport_fault():
    # (a reply that is not JSON at all: tests/fabric/test_lambda_not_json.py)
    async with endpoint(b'{"ok": tru', None) as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport="http")
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error is not None and r.error.type == ErrorCode.TRANSPORT and r.retryable, r.error
    assert "is JSON cut short" in r.error.message and "surrogate" not in r.error.message


async def test_through_moto_signed_a_reply_with_one_names_where(moto_url):
    """boto3 signing with SigV4 to moto's Lambda, whose invoke (without Docker) sends the
    request back: an envelope whose payload, encoded elsewhere, holds an escaped half pair."""
    create_function(moto_url, "rl-add")
    async with LambdaBackend(REG, LambdaConfig(endpoint_url=moto_url, function_prefix="rl-")) as b:
        inv = Invocation(function="add", payload={})
        inv.raw = b'{"tag": "\\ud800"}'
        r = await b.invoke(inv)
    assert r.error is not None and r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE, r.error
    assert "the reply of add has a lone surrogate at $.payload.tag" in r.error.message, r.error.message


async def test_a_deeply_nested_error_object_with_one_is_still_that_error_not_an_exception(transport):
    """The half pairs were written as escapes by a walk one Python frame (two, with the
    comprehension's) per level: an error object nested a few hundred deep (its stackTrace
    here) raised RecursionError out of the backend, where a failed call is a Result."""
    deep = "[" * 600 + '"frame"' + "]" * 600
    body = f'{{"errorType": "ValueError", "errorMessage": "bad \\ud800", "stackTrace": {deep}}}'.encode()
    async with endpoint(body, "Unhandled") as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport=transport)
        async with LambdaBackend(REG, cfg) as b:
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error is not None and r.error.type == ErrorCode.USER_ERROR, r.error
    assert r.error.message == "ValueError: bad \\ud800", r.error.message


def test_a_deeply_nested_failed_result_with_one_is_still_that_failure():
    failed = Result.failure(ErrorCode.USER_ERROR, "ValueError: PLACE", function="add", request_id="r1")
    deep = "[" * 600 + "]" * 600  # as its value: deeper than pydantic writes, so spliced in
    body = failed.model_dump_json().replace("PLACE", "\\udc80").replace('"value":null', f'"value":{deep}')
    assert deep in body
    r = LambdaBackend(REG, LambdaConfig())._reply(Invocation(function="add"), body.encode(), None)
    assert r.error is not None and r.error.type == ErrorCode.USER_ERROR, r.error
    assert r.error.message == "ValueError: \\udc80"
