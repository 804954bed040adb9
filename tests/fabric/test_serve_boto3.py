"""``fabric serve`` as a plain boto3 Lambda client sees it (not the fabric client): the
fields Lambda tooling reads off ``lambda.invoke``'s response (``LogResult`` with
``LogType='Tail'``, ``ExecutedVersion``), a name qualifier at odds with ``Qualifier=``, the
shape of a service fault, and how a call cut by the server's drain is counted. A real boto3
client against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import boto3
import httpx
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError
from sample_fns import REG
from serve_helpers import PATH, TOKEN_A, auth, config

from fabric.backends.base import InprocConfig, LocalConfig
from fabric.protocol import ErrorInfo, Invocation, Result
from fabric.serve import Gateway, TenantConfig
from fabric.serve._lambda_api import log_tail
from fabric.testing import FakeBackend


def _lambda(g: Gateway) -> Any:
    """A boto3 Lambda client for ``g``: unsigned, with the tenant's bearer token, no retries."""
    client = boto3.session.Session().client(
        "lambda",
        region_name="us-east-1",
        endpoint_url=g.url,
        config=Config(signature_version=UNSIGNED, retries={"total_max_attempts": 1}, read_timeout=30),
    )

    def add_token(request: Any, **_: Any) -> None:
        request.headers["Authorization"] = f"Bearer {TOKEN_A}"

    client.meta.events.register("before-send.lambda.Invoke", add_token)
    return client


async def _invoke(client: Any, **kw: Any) -> dict[str, Any]:
    return await asyncio.to_thread(client.invoke, **kw)


@pytest.fixture
async def gw():
    async with Gateway(config(backend=InprocConfig()), REG) as g:
        yield g


async def test_log_type_tail_answers_a_base64_log_result(gw):
    """Lambda tooling reads ``resp["LogResult"]`` after ``LogType='Tail'``: it was never
    there (a KeyError). It is the invocation's START/END/REPORT lines, base64."""
    client = _lambda(gw)
    resp = await _invoke(client, FunctionName="add", Payload=b'{"a": 2, "b": 3}', LogType="Tail")
    assert json.loads(resp["Payload"].read()) == 5
    log = base64.b64decode(resp["LogResult"]).decode()
    request_id = resp["ResponseMetadata"]["RequestId"]
    lines = log.splitlines()
    assert lines[0] == f"START RequestId: {request_id} Version: $LATEST"
    assert lines[1] == f"END RequestId: {request_id}"
    assert lines[2].startswith(f"REPORT RequestId: {request_id}\tDuration: ")
    # without Tail, none (as Lambda: the log costs a header only when asked for)
    assert "LogResult" not in await _invoke(client, FunctionName="add", Payload=b'{"a": 1}')


async def test_a_failed_call_s_log_result_carries_its_error(gw):
    client = _lambda(gw)
    resp = await _invoke(client, FunctionName="boom", Payload=b'{"x": 7}', LogType="Tail")
    assert resp["FunctionError"] == "Unhandled"
    error = json.loads(resp["Payload"].read())
    log = base64.b64decode(resp["LogResult"]).decode()
    # the runtime's line, with the type and message the body's error object gives
    assert f"[ERROR] {error['errorType']}: {error['errorMessage']}" in log
    assert "bad x=7" in error["errorMessage"] and "Traceback" in log
    assert log.splitlines()[-1].startswith("REPORT RequestId: ")


async def test_a_log_result_is_its_last_4_kb(gw):
    """Lambda's ``LogResult`` is the last 4 KB of the log: a long traceback is cut from the
    front, the REPORT line kept."""
    client = _lambda(gw)
    resp = await _invoke(client, FunctionName="boom", Payload=json.dumps({"x": "y" * 10_000}), LogType="Tail")
    log = base64.b64decode(resp["LogResult"])
    assert len(log) <= 4096
    assert log.decode(errors="replace").splitlines()[-1].startswith("REPORT RequestId: ")


async def test_executed_version_is_the_version_that_ran(gw):
    """Lambda answers the version an alias points to, or the one named; ``$LATEST`` unqualified.
    The server said ``$LATEST`` whatever was asked."""
    client = _lambda(gw)
    version = REG.get("add").version
    resp = await _invoke(client, FunctionName="add", Payload=b'{"a": 1}')
    assert resp["ExecutedVersion"] == "$LATEST"
    resp = await _invoke(client, FunctionName="add", Qualifier="live", Payload=b'{"a": 1}')
    assert resp["ExecutedVersion"] == version
    resp = await _invoke(client, FunctionName=f"add:{version}", Payload=b'{"a": 1}', LogType="Tail")
    assert resp["ExecutedVersion"] == version
    assert f"Version: {version}" in base64.b64decode(resp["LogResult"]).decode()


@pytest.mark.parametrize("name,qualifier", [("add:live", "$LATEST"), ("add:v9", "live"), ("add:live", "v9")])
async def test_a_name_qualifier_at_odds_with_qualifier_is_400(gw, name, qualifier):
    """Lambda: 400 InvalidParameterValueException. The server took ``?Qualifier=`` and
    dropped the name's: ``add:v9`` with ``Qualifier=live`` ran, ``add:live`` with ``v9`` was 404."""
    client = _lambda(gw)
    with pytest.raises(ClientError) as e:
        await _invoke(client, FunctionName=name, Qualifier=qualifier, Payload=b'{"a": 1}')
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert e.value.response["Error"]["Code"] == "InvalidParameterValueException"
    assert "does not match" in e.value.response["Error"]["Message"]


async def test_the_same_qualifier_in_both_places_and_an_empty_one_are_served(gw):
    client = _lambda(gw)
    resp = await _invoke(client, FunctionName="add:live", Qualifier="live", Payload=b'{"a": 4}')
    assert json.loads(resp["Payload"].read()) == 4
    async with httpx.AsyncClient(base_url=gw.url) as http:  # boto3 sends no empty Qualifier
        r = await http.post(PATH.format("add") + "?Qualifier=", json={"a": 3}, headers=auth())
    assert r.status_code == 200 and r.json() == 3 and r.headers["X-Amz-Executed-Version"] == "$LATEST"


class _Broken(FakeBackend):
    def _submit(self, inv: Invocation) -> asyncio.Future:
        raise RuntimeError("a bug in a backend")


async def test_a_fault_inside_the_server_is_a_service_error_not_a_user_one():
    """Lambda's ``ServiceException`` says ``"Type": "Service"``; the server's said ``User``."""
    async with Gateway(config(), REG, backend=_Broken(REG)) as g:
        with pytest.raises(ClientError) as e:
            await _invoke(_lambda(g), FunctionName="add", Payload=b'{"a": 1}')
        async with httpx.AsyncClient(base_url=g.url) as http:
            raw = await http.post(PATH.format("add"), json={"a": 1}, headers=auth())
    assert e.value.response["Error"]["Code"] == "ServiceException"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert raw.json()["Type"] == "Service"


async def test_a_call_cut_by_the_drain_is_not_counted_as_the_client_s_hang_up():
    """At the drain's end the server cuts the calls still running: counted as 499 "client
    closed request", though the client had closed nothing. Counted under 503 now."""
    g = Gateway(config(drain_s=0.3, backend=LocalConfig(max_workers=1)), REG)
    await g.start()
    client = _lambda(g)
    running = asyncio.create_task(_invoke(client, FunctionName="sleepy", Payload=b'{"seconds": 20}'))
    for _ in range(3000):  # until the call is on the worker
        if g.backend.stats().get("sleepy", {}).get("inflight"):
            break
        await asyncio.sleep(0.01)
    await g.aclose()
    with pytest.raises(Exception):  # noqa: B017 - botocore's connection error, whichever it is
        await running
    text = g.metrics.render()[0].decode()
    assert 'function="sleepy",status="503",tenant="job-a"} 1.0' in text, text
    assert 'status="499"' not in text


def test_a_log_tail_of_text_no_utf8_holds_decodes_and_is_cut_between_characters():
    """A handler's message with a lone surrogate made the encode raise (a 500 for a call that
    ran); a cut at 4 KB inside a character left a log that did not decode."""
    error = ErrorInfo.of("UserError", "ValueError: \ud800 " + "é" * 5000)
    log = base64.b64decode(log_tail(Result(ok=False, error=error), "rid", "$LATEST"))
    assert len(log) <= 4096
    assert log.decode().endswith("END RequestId: rid\nREPORT RequestId: rid\tDuration: 0.00 ms\n")
    short = ErrorInfo.of("UserError", "ValueError: \ud800")
    log = base64.b64decode(log_tail(Result(ok=False, error=short), "rid", "$LATEST")).decode()
    assert "[ERROR] UserError: ValueError: \\ud800" in log


@pytest.mark.parametrize("kind", ["RequestResponse", "Event", "DryRun"])
@pytest.mark.parametrize("log_type", ["Bogus", "tail", ""])
async def test_a_log_type_lambda_does_not_know_is_400(gw, kind, log_type):
    """Lambda's ``LogType`` is ``None`` or ``Tail`` (botocore's model; botocore does not check
    an enum, so boto3 sends any): another is Lambda's 400 ``InvalidParameterValueException``,
    whatever the invocation type. It was ignored: the call ran, with no log."""
    client = _lambda(gw)
    with pytest.raises(ClientError) as e:
        await _invoke(client, FunctionName="add", InvocationType=kind, LogType=log_type, Payload=b'{"a": 1}')
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert e.value.response["Error"]["Code"] == "InvalidParameterValueException"
    assert "LogType" in e.value.response["Error"]["Message"]
    assert gw.quotas.held["job-a"] == 0


async def test_log_type_none_answers_no_log_result(gw):
    resp = await _invoke(_lambda(gw), FunctionName="add", LogType="None", Payload=b'{"a": 1}')
    assert json.loads(resp["Payload"].read()) == 1 and "LogResult" not in resp


@pytest.mark.parametrize(
    "op,kw",
    [
        ("get_function", {"FunctionName": "add"}),
        ("list_functions", {}),
        ("get_alias", {"FunctionName": "add", "Name": "live"}),
    ],
)
async def test_an_operation_other_than_invoke_is_told_what_the_server_answers(gw, op, kw):
    """aiohttp's own answer was text (``404: Not Found``): boto3 raised a ``ClientError``
    whose code was ``404``, and ``aws lambda list-functions --endpoint-url`` said no more.
    It is Lambda's JSON error now, saying what the server serves."""
    client = _lambda(gw)
    with pytest.raises(ClientError) as e:
        await asyncio.to_thread(getattr(client, op), **kw)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert e.value.response["Error"]["Code"] == "UnknownOperationException"
    assert "Invoke" in e.value.response["Error"]["Message"]


async def test_another_method_on_the_invoke_path_is_a_json_error(gw):
    async with httpx.AsyncClient(base_url=gw.url) as http:
        r = await http.get(PATH.format("add"), headers=auth())
    assert r.status_code == 405 and r.headers["x-amzn-ErrorType"] == "UnknownOperationException"
    assert "POST" in r.json()["message"] and r.headers["Allow"] == "POST"


def _throttled(e: ClientError) -> tuple[str, str | None, str | None]:
    """What boto3 made of a 429: its code, Lambda's ``Reason``, and the ``Retry-After`` header."""
    headers = e.response["ResponseMetadata"]["HTTPHeaders"]
    return e.response["Error"]["Code"], e.response.get("Reason"), headers.get("retry-after")


async def test_a_rate_429_says_why_and_when_to_retry_as_lambdas_does():
    """Lambda's TooManyRequestsException carries a ``Reason`` and a ``Retry-After`` header
    (botocore's model: ``retryAfterSeconds``); the server's carried neither, so a client could
    not tell its rate from its concurrency, nor how long to wait. The rate's comes from the
    tenant's bucket: the seconds until a request would be paced rather than refused."""
    tenants = {"job-a": TenantConfig(token=TOKEN_A, max_rps=0.1)}  # one request per 10 s
    async with Gateway(config(tenants=tenants, backend=InprocConfig()), REG) as g:
        client = _lambda(g)
        assert (
            json.loads((await _invoke(client, FunctionName="add", Payload=b'{"a": 1}'))["Payload"].read())
            == 1
        )
        with pytest.raises(ClientError) as caught:
            await _invoke(client, FunctionName="add", Payload=b'{"a": 1}')
    code, reason, retry_after = _throttled(caught.value)
    assert (code, reason) == ("TooManyRequestsException", "CallerRateLimitExceeded")
    # 10 s to the next turn, less the 5 s a request may be held back (MAX_DELAY_S)
    assert retry_after is not None and 1 <= int(retry_after) <= 5, retry_after
    assert caught.value.response["Type"] == "User"


async def test_a_concurrency_429_says_why_as_lambdas_does():
    async with Gateway(config(quota_a=1), REG) as g:
        client = _lambda(g)
        slow = asyncio.create_task(_invoke(client, FunctionName="sleepy", Payload=b'{"seconds": 1.0}'))
        for _ in range(500):
            if g.quotas.held["job-a"] == 1:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(ClientError) as caught:
            await _invoke(_lambda(g), FunctionName="add", Payload=b'{"a": 1}')
        await slow
    code, reason, retry_after = _throttled(caught.value)
    assert (code, reason) == ("TooManyRequestsException", "ConcurrentInvocationLimitExceeded")
    # when a call ends is not known: no Retry-After (a constant 1 s made the fabric client,
    # which honours it, wait a second per retry where a slot frees within milliseconds)
    assert retry_after is None, retry_after
