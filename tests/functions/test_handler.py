"""The Lambda entry points (functions/handler.py), run for real in-process.

AWS is moto, in-process: DynamoDB holds the idempotency records, SQS carries the batches
and the replies. The SQS event source mapping is emulated the way Lambda does it: receive,
call ``sqs_handler``, delete every record not listed in ``batchItemFailures``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

import handler_fns  # noqa: E402 - after the skips: it is served by the handler under test
from handler_fns import CALLS, LambdaContext  # noqa: E402

from fabric.errors import ErrorCode  # noqa: E402
from fabric.protocol import MAX_PAYLOAD_BYTES, Invocation, Result  # noqa: E402
from functions import _handler_requests as handler_requests  # noqa: E402
from functions import handler  # noqa: E402

TABLE = "rl-fabric-idempotency"
# the two built-ins the tests use, not the whole package: these tests do not depend on every
# other built-in importing (tests/test_conformance.py covers that, and test_default_modules)
MODULES = "functions.rewards.exact_match,functions.tools.calculator,handler_fns"
REGION = "us-east-1"
TRAJ = {
    "messages": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "So the answer is \\boxed{42}.", "policy_version": 3},
    ]
}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(autouse=True)
def lambda_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fresh container per test, fake credentials, and the handler_fns module served."""
    for name, value in {
        "AWS_DEFAULT_REGION": REGION,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SECURITY_TOKEN": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "POWERTOOLS_TRACE_DISABLED": "1",
        "POWERTOOLS_METRICS_NAMESPACE": "rl-fabric-test",
        "POWERTOOLS_LOG_LEVEL": "INFO",
        handler.MODULES_ENV: MODULES,
    }.items():
        monkeypatch.setenv(name, value)
    for name in (
        handler.FUNCTIONS_ENV,
        handler.TABLE_ENV,
        handler.REPLY_QUEUE_ENV,
        "AWS_LAMBDA_FUNCTION_NAME",
        "AWS_LAMBDA_INITIALIZATION_TYPE",
        "AWS_PROFILE",
        "POWERTOOLS_IDEMPOTENCY_DISABLED",
        "POWERTOOLS_METRICS_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    CALLS.clear()
    handler.reset()
    yield
    handler.reset()


@pytest.fixture
def aws() -> Iterator[None]:
    with moto.mock_aws():
        yield


@pytest.fixture
def table(aws: None, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The idempotency table, as powertools' DynamoDBPersistenceLayer expects it."""
    ddb = boto3.client("dynamodb", region_name=REGION)
    ddb.create_table(
        TableName=TABLE,
        KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )
    monkeypatch.setenv(handler.TABLE_ENV, TABLE)
    return ddb


@pytest.fixture
def sqs(aws: None) -> Any:
    return boto3.client("sqs", region_name=REGION)


@pytest.fixture
def replies(sqs: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    url: str = sqs.create_queue(QueueName="rl-fabric-replies")["QueueUrl"]
    monkeypatch.setenv(handler.REPLY_QUEUE_ENV, url)
    return url


# ----------------------------------------------------------------------------- helpers


def invoke(
    function: str, payload: dict[str, Any] | None = None, ctx: LambdaContext | None = None, **fields: Any
) -> Result:
    event = Invocation(function=function, payload=payload or {}, **fields).model_dump(mode="json")
    return call(event, ctx)


def call(event: Any, ctx: LambdaContext | None = None) -> Result:
    out = handler.handler(event, ctx or LambdaContext())
    json.dumps(out)  # what Lambda does with the reply
    return Result.model_validate(out)


def stdout_json(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def emf(lines: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The EMF blobs that carry ``metric``."""
    return [
        line
        for line in lines
        if "_aws" in line
        and any(m["Name"] == metric for m in line["_aws"]["CloudWatchMetrics"][0]["Metrics"])
    ]


def send(sqs: Any, url: str, body: Any, reply_to: str | None = None) -> str:
    attrs = {handler.REPLY_TO_ATTRIBUTE: {"DataType": "String", "StringValue": reply_to}} if reply_to else {}
    text = body if isinstance(body, str) else Invocation.model_validate(body).model_dump_json()
    message_id: str = sqs.send_message(QueueUrl=url, MessageBody=text, MessageAttributes=attrs)["MessageId"]
    return message_id


def deliver(sqs: Any, url: str, ctx: LambdaContext | None = None) -> tuple[dict[str, Any], list[str]]:
    """One poll of the event source mapping: receive a batch, run ``sqs_handler``, delete the
    records it did not report as failed. Returns the response and the batch's message ids."""
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    got = sqs.receive_message(
        QueueUrl=url,
        MaxNumberOfMessages=10,
        VisibilityTimeout=0,  # a failed record is at once visible again (no real waiting)
        AttributeNames=["All"],
        MessageAttributeNames=["All"],
    )
    messages = got.get("Messages", [])
    if not messages:  # Lambda polls but never invokes with an empty batch
        return {"batchItemFailures": []}, []
    event = {
        "Records": [
            {
                "messageId": m["MessageId"],
                "receiptHandle": m["ReceiptHandle"],
                "body": m["Body"],
                "attributes": m["Attributes"],
                "messageAttributes": {
                    k: {
                        "stringValue": v.get("StringValue"),
                        "binaryValue": None,
                        "stringListValues": [],
                        "binaryListValues": [],
                        "dataType": v["DataType"],
                    }
                    for k, v in m.get("MessageAttributes", {}).items()
                },
                "md5OfBody": m["MD5OfBody"],
                "eventSource": "aws:sqs",
                "eventSourceARN": arn,
                "awsRegion": REGION,
            }
            for m in messages
        ]
    }
    response = handler.sqs_handler(event, ctx or LambdaContext())
    failed = {f["itemIdentifier"] for f in response["batchItemFailures"]}
    for m in messages:
        if m["MessageId"] not in failed:
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])
    return response, [m["MessageId"] for m in messages]


def drain(sqs: Any, url: str) -> list[Result]:
    out: list[Result] = []
    while True:
        got = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, MessageAttributeNames=["All"])
        if not got.get("Messages"):
            return out
        for m in got["Messages"]:
            result = Result.model_validate_json(m["Body"])
            assert m["MessageAttributes"]["request_id"]["StringValue"] == result.request_id
            assert m["MessageAttributes"]["ok"]["StringValue"] == str(result.ok).lower()
            out.append(result)
            sqs.delete_message(QueueUrl=url, ReceiptHandle=m["ReceiptHandle"])


# ----------------------------------------------------------------------------- direct invokes


def test_exact_match_ok_and_cold_start_once() -> None:
    first = invoke("exact_match", {"traj": TRAJ, "ground_truth": "42"}, request_id="req-1")
    assert first.ok and first.value == 1.0
    assert first.function == "exact_match" and first.request_id == "req-1"
    assert first.cold_start and not first.cached
    assert first.timings.exec_ms > 0 and first.worker and first.worker.startswith("lambda:")
    second = invoke("exact_match", {"traj": TRAJ, "ground_truth": "41"})
    assert second.ok and second.value == 0.0
    assert not second.cold_start and second.worker == first.worker


def test_calculator_value_and_user_error() -> None:
    assert invoke("calculator", {"expression": "(17 + 25) * 2"}).value == "84"
    bad = invoke("calculator", {"expression": "__import__('os')"})
    assert not bad.ok and bad.error is not None
    assert bad.error.type == ErrorCode.USER_ERROR and not bad.error.retryable
    assert "not allowed" in bad.error.message


def test_invalid_arguments_name_the_problem() -> None:
    r = invoke("exact_match", {"traj": TRAJ})
    assert r.error is not None and r.error.type == ErrorCode.INVALID_ARGUMENTS
    assert "missing 'ground_truth'" in r.error.message


def test_unknown_function_is_a_result() -> None:
    r = invoke("no_such_reward", {"x": 1}, request_id="req-u")
    assert not r.ok and r.error is not None
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and not r.error.retryable
    assert "no_such_reward" in r.error.message and "exact_match" in r.error.message
    assert r.request_id == "req-u" and r.cold_start


@pytest.mark.parametrize(
    ("event", "needle"),
    [
        ({"payload": {"x": 1}}, "function: Field required"),
        ({"function": "calculator", "payload": {}, "colour": "red"}, "colour: Extra inputs"),
        ({"function": 3}, "function: Input should be a valid string"),
        ([1, 2], "event"),
        ("not json at all", "Invalid JSON"),
        (None, "event"),
        ({"function": "calculator", "payload": {"expression": "1"}, "raw": '{"expression": "2"}'}, "'raw'"),
    ],
)
def test_not_an_invocation(event: Any, needle: str) -> None:
    r = call(event)
    assert not r.ok and r.error is not None
    assert r.error.type == ErrorCode.INVALID_ARGUMENTS and not r.error.retryable
    assert r.error.message.startswith("the event is not a fabric Invocation")
    assert needle in r.error.message


def test_a_json_string_event_is_parsed() -> None:
    text = Invocation(function="calculator", payload={"expression": "6*7"}).model_dump_json()
    assert call(text).value == "42"


def test_payload_over_the_lambda_limit() -> None:
    huge = "x" * (MAX_PAYLOAD_BYTES + 1)
    r = invoke("exact_match", {"traj": huge, "ground_truth": "x"}, request_id="req-big")
    assert r.error is not None and r.error.type == ErrorCode.PAYLOAD_TOO_LARGE
    assert "over the 6 MiB" in r.error.message and r.function == "exact_match" and r.request_id == "req-big"


def test_a_reply_over_the_lambda_response_limit_as_the_runtime_encodes_it() -> None:
    """1.2 million CJK characters are 3.6 MB of UTF-8, under the runner's 6 MiB check, but the
    python3.11 runtime writes the reply with json.dumps (\\uXXXX escapes): 7.2 MB, over Lambda's
    6,291,556-byte limit, so Lambda answered Function.ResponseSizeTooLarge instead. The handler
    answers ResultNotSerializable, which says to return a reference."""
    inv = Invocation(function="big", payload={"key": "r", "n": 1_200_000, "char": "中"})
    out = handler.handler(inv.model_dump(mode="json"), LambdaContext())
    assert len(json.dumps(out)) <= 6_291_556
    r = Result.model_validate(out)
    assert r.error is not None and r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE, r.error
    assert "reference" in r.error.message and not r.retryable
    assert r.request_id and r.function == "big" and r.worker
    # one just under the limit goes as it is
    n = (6_291_556 - 64 * 1024) // 6
    assert invoke("big", {"key": "r", "n": n, "char": "中"}).ok


def test_async_functions_run_and_time_out() -> None:
    assert invoke("async_double", {"x": 21}).value == 42
    # the deadline bounds an async function; the timeout is retryable and not the function's answer
    r = invoke("async_sleepy", {"seconds": 5}, deadline=__import__("time").time() + 0.05)
    assert r.error is not None and r.error.type == ErrorCode.TIMEOUT and r.error.retryable
    # so does the time the Lambda invocation has left (minus a margin to write the reply)
    r = invoke("async_sleepy", {"seconds": 5}, ctx=LambdaContext(remaining_ms=600))
    assert r.error is not None and r.error.type == ErrorCode.TIMEOUT


def test_a_synchronous_function_reads_its_time_left() -> None:
    # the time the invocation has left, less the margin to write the reply, bounds it (a sync
    # function read None: only async runs had a timer in their context)
    r = invoke("sync_time_left", ctx=LambdaContext(remaining_ms=3000))
    assert r.ok and r.value is not None and 2.0 < r.value <= 3.0 - handler_requests.LAMBDA_MARGIN_S, r


def test_async_functions_share_the_container_loop() -> None:
    # state a setup hook made (an async HTTP client) stays bound to one loop, as in a worker
    assert invoke("loop_id").value == invoke("loop_id").value


def test_provisioned_concurrency_is_not_a_cold_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_LAMBDA_INITIALIZATION_TYPE", "provisioned-concurrency")
    monkeypatch.setenv(handler.FUNCTIONS_ENV, "calculator")
    handler._container()  # what importing the module does in Lambda's init phase
    r = invoke("calculator", {"expression": "1"})
    assert r.ok and not r.cold_start


def test_deadline_passed_before_start() -> None:
    r = invoke("calculator", {"expression": "1"}, deadline=1.0)
    assert r.error is not None and r.error.type == ErrorCode.DEADLINE_EXCEEDED


def test_allow_list_restricts_what_is_served(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(handler.FUNCTIONS_ENV, "calculator")
    assert invoke("calculator", {"expression": "1+1"}).value == "2"
    r = invoke("exact_match", {"traj": TRAJ, "ground_truth": "42"})
    assert r.error is not None and r.error.type == ErrorCode.UNKNOWN_FUNCTION
    assert "known functions: calculator" in r.error.message


def test_allow_list_naming_a_missing_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(handler.FUNCTIONS_ENV, "calculator,typo_reward")
    r = invoke("calculator", {"expression": "1"})
    assert r.error is not None and r.error.type == ErrorCode.SETUP_FAILED
    assert "typo_reward" in r.error.message


def test_bad_module_fails_calls_until_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(handler.MODULES_ENV, MODULES + ",no_such_module_xyz")
    r = invoke("calculator", {"expression": "1"})
    assert r.error is not None and r.error.type == ErrorCode.SETUP_FAILED
    assert "no_such_module_xyz" in r.error.message
    # a failed start is not kept: the next invocation starts again
    monkeypatch.setenv(handler.MODULES_ENV, MODULES)
    assert invoke("calculator", {"expression": "1"}).value == "1"


def test_default_modules_serve_the_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(handler.MODULES_ENV)
    assert invoke("exact_match", {"traj": "The answer is: Paris.", "ground_truth": "paris"}).value == 1.0


def test_setup_hook_failure_is_a_result() -> None:
    r = invoke("needs_setup", {"x": 1})
    assert r.error is not None and r.error.type == ErrorCode.SETUP_FAILED
    assert "model weights not found" in r.error.message


def test_correlation_id_is_the_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    invoke("calculator", {"expression": "2+2"}, request_id="traj-17:calculator")
    logs = [line for line in stdout_json(capsys) if line.get("message") == "invocation ok"]
    assert len(logs) == 1
    log = logs[0]
    assert log["correlation_id"] == "traj-17:calculator"
    assert log["service"] == "rl-fabric" and log["function"] == "calculator"
    assert log["function_request_id"] == "aws-request-1"  # the Lambda context is injected too
    # a refused event is still correlated when it names its request id
    call({"function": "calculator", "request_id": "req-bad", "payload": 5})
    logs = [line for line in stdout_json(capsys) if line.get("message") == "invocation failed"]
    assert logs[0]["correlation_id"] == "req-bad" and logs[0]["error_type"] == ErrorCode.INVALID_ARGUMENTS


def test_metrics_cold_start_once_and_per_function(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    invoke("calculator", {"expression": "1+1"})
    first = stdout_json(capsys)
    cold = emf(first, "ColdStart")
    assert len(cold) == 1 and cold[0]["ColdStart"] == [1.0]
    assert cold[0]["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "rl-fabric-test"
    (inv,) = emf(first, "Invocations")
    assert inv["function"] == "calculator" and inv["service"] == "rl-fabric"
    assert inv["Invocations"] == [1.0] and inv["Errors"] == [0.0] and inv["Latency"][0] > 0
    assert ["function", "service"] in inv["_aws"]["CloudWatchMetrics"][0]["Dimensions"]

    invoke("calculator", {"expression": "1/0"})
    invoke("made_up_name", {})
    later = stdout_json(capsys)
    assert emf(later, "ColdStart") == []
    errors = emf(later, "Errors")
    assert [e["Errors"] for e in errors] == [[1.0], [1.0]]
    assert errors[0]["error_type"] == ErrorCode.USER_ERROR
    # made-up names do not become metric dimensions
    assert errors[1]["function"] == "unknown" and errors[1]["error_type"] == ErrorCode.UNKNOWN_FUNCTION


def test_module_imports_without_the_aws_extra() -> None:
    """Discovery imports every module under ``functions``: the handler must import (and
    register nothing) where powertools and boto3 are not installed."""
    code = (
        "import sys\n"
        "for m in ('aws_lambda_powertools', 'boto3', 'botocore'): sys.modules[m] = None\n"
        "import functions.handler as h\n"
        "from fabric.registry import Registry\n"
        "r = Registry(); r.discover('functions.handler')\n"
        "assert len(r) == 0, r.names()\n"
        "assert callable(h.handler) and callable(h.sqs_handler)\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


# ----------------------------------------------------------------------------- idempotency


def test_same_key_runs_once(table: Any) -> None:
    first = invoke("counted", {"key": "a"}, idempotency_key="k1", request_id="r1")
    second = invoke("counted", {"key": "a"}, idempotency_key="k1", request_id="r2")
    assert CALLS["counted:a"] == 1
    assert first.value == second.value == {"key": "a", "n": 1}
    assert not first.cached and second.cached
    assert second.request_id == "r2" and second.timings.exec_ms == 0.0
    assert table.scan(TableName=TABLE)["Count"] == 1


def test_no_key_is_not_deduplicated(table: Any) -> None:
    invoke("counted", {"key": "b"})
    invoke("counted", {"key": "b"})
    assert CALLS["counted:b"] == 2
    assert table.scan(TableName=TABLE)["Count"] == 0


def test_key_is_scoped_by_tenant_and_function(table: Any) -> None:
    invoke("counted", {"key": "c"}, idempotency_key="traj-7", tenant="job-a")
    invoke("counted", {"key": "c"}, idempotency_key="traj-7", tenant="job-b")
    assert invoke("flaky", {"key": "c", "fail_times": 0}, idempotency_key="traj-7", tenant="job-a").ok
    assert CALLS["counted:c"] == 2 and CALLS["flaky:c"] == 1


def test_retryable_error_is_not_cached(table: Any) -> None:
    first = invoke("flaky", {"key": "f"}, idempotency_key="kf")
    assert first.error is not None and first.error.type == ErrorCode.UNAVAILABLE and first.error.retryable
    assert table.scan(TableName=TABLE)["Count"] == 0  # the in-progress record was deleted
    second = invoke("flaky", {"key": "f"}, idempotency_key="kf")
    assert second.ok and second.value == "recovered" and not second.cached
    third = invoke("flaky", {"key": "f"}, idempotency_key="kf")
    assert third.ok and third.cached
    assert CALLS["flaky:f"] == 2


def test_timeout_is_not_cached(table: Any) -> None:
    r = invoke("async_sleepy", {"seconds": 5}, idempotency_key="ks", ctx=LambdaContext(remaining_ms=600))
    assert r.error is not None and r.error.type == ErrorCode.TIMEOUT
    assert table.scan(TableName=TABLE)["Count"] == 0


def test_a_keyed_side_effect_sent_by_the_lambda_backend_runs_once(table: Any) -> None:
    """What the client's Lambda backend sends for a keyed side effect whose caller has a short
    deadline: the run is not cut at that deadline (a cut run's in-progress record is dropped,
    and the next call with the key, from any client process, would run the effect again)."""
    import time

    from fabric.backends.lambda_ import envelope

    key, payload = "order-7", {"key": "o7", "seconds": 0.4}
    sent = Invocation(
        function="async_effect",
        payload=payload,
        idempotency_key=key,
        deadline=time.time() + 0.1,
        wait_for_run=True,
    )
    first = call(json.loads(envelope(sent)))
    assert first.ok and first.value == "done", first.error
    again = invoke("async_effect", payload, idempotency_key=key)  # another process, no deadline
    assert again.ok and again.cached
    assert CALLS["async_effect:o7"] == 1


def test_a_direct_side_effect_that_may_have_run_is_final_and_kept_under_its_key(table: Any) -> None:
    """A keyed side effect cut at the Lambda's timeout came back as a retryable Timeout on a
    direct invoke, and its idempotency record was dropped: another client (or a retry from
    outside the fabric client) with the same key ran the effect again. It is OutcomeUnknown,
    kept under the key, as on the SQS path."""
    payload = {"key": "d7", "seconds": 1.0}
    first = invoke("async_effect", payload, idempotency_key="order-d7", ctx=LambdaContext(remaining_ms=700))
    assert first.error is not None and first.error.type == ErrorCode.OUTCOME_UNKNOWN, first.error
    assert not first.retryable and ErrorCode.TIMEOUT in first.error.message
    again = invoke("async_effect", payload, idempotency_key="order-d7")
    assert again.error is not None and again.error.type == ErrorCode.OUTCOME_UNKNOWN and again.cached
    assert CALLS["async_effect:d7"] == 1
    # a function without side effects cut the same way stays a retryable timeout, not kept
    cut = invoke("async_sleepy", {"seconds": 5}, idempotency_key="ks2", ctx=LambdaContext(remaining_ms=600))
    assert cut.error is not None and cut.error.type == ErrorCode.TIMEOUT and cut.retryable


def test_final_error_is_cached(table: Any) -> None:
    first = invoke("broken", {"key": "x"}, idempotency_key="kb")
    second = invoke("broken", {"key": "x"}, idempotency_key="kb")
    assert CALLS["broken:x"] == 1
    assert first.error is not None and second.error is not None
    assert second.cached and second.error.type == first.error.type == ErrorCode.USER_ERROR
    assert second.error.message == first.error.message


def test_same_key_other_payload_is_refused(table: Any) -> None:
    assert invoke("counted", {"key": "d"}, idempotency_key="kd").ok
    r = invoke("counted", {"key": "d", "salt": 1}, idempotency_key="kd")
    assert r.error is not None and r.error.type == ErrorCode.INVALID_ARGUMENTS
    assert "another payload" in r.error.message
    # key order is not a different payload
    assert invoke("counted", {"salt": 0, "key": "d"}, idempotency_key="k-order").ok
    assert invoke("counted", {"key": "d", "salt": 0}, idempotency_key="k-order").cached
    assert CALLS["counted:d"] == 2


def test_in_progress_key_is_refused_retryably(table: Any) -> None:
    outer = invoke("reentrant", {"key": "kr"}, idempotency_key="kr")
    assert outer.ok
    inner = Result.model_validate(outer.value)
    assert inner.error is not None and inner.error.type == ErrorCode.NOT_STARTED and inner.error.retryable
    assert "in progress" in inner.error.message


def test_result_too_large_to_store_is_returned_not_cached(table: Any) -> None:
    for _ in range(2):
        r = invoke("big", {"key": "g", "n": handler.MAX_CACHED_RESULT_BYTES + 10}, idempotency_key="kg")
        assert r.ok and len(r.value) == handler.MAX_CACHED_RESULT_BYTES + 10 and not r.cached
    assert CALLS["big:g"] == 2
    assert table.scan(TableName=TABLE)["Count"] == 0


def test_a_result_measured_as_powertools_stores_it(table: Any) -> None:
    """100,000 CJK characters are 100 KB by character count, which the size check measured, but
    600 KB as powertools stores them (json.dumps escapes each as \\uXXXX): the DynamoDB item was
    refused, the answer discarded for a TransportError and the key left in progress."""
    n = 100_000
    assert n < handler.MAX_CACHED_RESULT_BYTES < len(json.dumps("中" * n))
    for _ in range(2):
        r = invoke("big", {"key": "cjk", "n": n, "char": "中"}, idempotency_key="kc")
        assert r.ok and r.value == "中" * n and not r.cached, r.error
    assert CALLS["big:cjk"] == 2
    assert table.scan(TableName=TABLE)["Count"] == 0
    # one that fits is kept, measured the same way
    small = {"key": "cjk2", "n": 1_000, "char": "中"}
    assert invoke("big", small, idempotency_key="kc2").ok
    assert invoke("big", small, idempotency_key="kc2").cached


def test_without_a_table_keys_are_ignored(aws: None) -> None:
    # inside mock_aws with no table: any DynamoDB call would fail the invocation
    for _ in range(2):
        assert invoke("counted", {"key": "e"}, idempotency_key="ke").ok
    assert CALLS["counted:e"] == 2


@pytest.mark.parametrize("ttl", ["1h", "0"])
def test_a_bad_idempotency_ttl_names_its_variable_and_does_not_matter_without_a_table(
    monkeypatch: pytest.MonkeyPatch, table: Any, ttl: str
) -> None:
    monkeypatch.setenv(handler.TTL_ENV, ttl)
    r = invoke("exact_match", {"traj": "42", "ground_truth": "42"})
    assert not r.ok and r.error is not None and r.error.type == ErrorCode.SETUP_FAILED
    assert f"{handler.TTL_ENV}={ttl!r}" in r.error.message, r.error.message
    # without a table idempotency is off and the TTL is never read
    monkeypatch.delenv(handler.TABLE_ENV)
    handler.reset()
    assert invoke("exact_match", {"traj": "42", "ground_truth": "42"}).ok


def test_store_failure_before_the_call_is_not_started(aws: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(handler.TABLE_ENV, "table-that-does-not-exist")
    r = invoke("counted", {"key": "t"}, idempotency_key="kt")
    assert r.error is not None and r.error.type == ErrorCode.NOT_STARTED and r.error.retryable
    assert "idempotency store" in r.error.message
    assert CALLS["counted:t"] == 0


# ----------------------------------------------------------------------------- SQS batches


def test_batch_reports_exactly_the_retryable_failure(
    sqs: Any, replies: str, capsys: pytest.CaptureFixture[str]
) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    good = send(sqs, inbox, {"function": "calculator", "payload": {"expression": "6*7"}, "request_id": "g"})
    bad = send(sqs, inbox, {"function": "flaky", "payload": {"key": "q"}, "request_id": "f"})
    capsys.readouterr()
    response, batch = deliver(sqs, inbox)
    assert sorted(batch) == sorted([good, bad])
    assert response == {"batchItemFailures": [{"itemIdentifier": bad}]}
    (reply,) = drain(sqs, replies)
    assert reply.ok and reply.value == "42" and reply.request_id == "g"
    assert reply.timings.queue_ms >= 0 and reply.cold_start in (True, False)

    lines = stdout_json(capsys)
    (batch_metrics,) = emf(lines, "SqsRecords")
    assert batch_metrics["SqsRecords"] == [2.0] and batch_metrics["SqsRecordsRetried"] == [1.0]
    per_record = emf(lines, "QueueLatency")
    assert sorted(m["function"] for m in per_record) == ["calculator", "flaky"]
    assert {line["correlation_id"] for line in lines if line.get("message", "").startswith("invocation")} == {
        "g",
        "f",
    }

    # SQS delivers the failed record again; this time the function recovers
    response, batch = deliver(sqs, inbox)
    assert batch == [bad] and response == {"batchItemFailures": []}
    (reply,) = drain(sqs, replies)
    assert reply.ok and reply.value == "recovered" and reply.request_id == "f"
    assert deliver(sqs, inbox)[1] == []  # nothing left on the queue


def test_final_errors_are_replied_not_retried(sqs: Any, replies: str) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    send(sqs, inbox, {"function": "broken", "payload": {"key": "z"}, "request_id": "b"})
    send(sqs, inbox, {"function": "nope", "payload": {}, "request_id": "n"})
    junk = send(sqs, inbox, "this is not an invocation")
    response, _ = deliver(sqs, inbox)
    assert response == {"batchItemFailures": []}
    got = {r.request_id: r.error.type if r.error else None for r in drain(sqs, replies)}
    # a body that is not an Invocation is answered under its SQS message id
    assert got == {
        "b": ErrorCode.USER_ERROR,
        "n": ErrorCode.UNKNOWN_FUNCTION,
        junk: ErrorCode.INVALID_ARGUMENTS,
    }
    assert deliver(sqs, inbox)[1] == []


def test_retryable_failure_gives_up_after_max_attempts(sqs: Any, replies: str) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    msg = send(
        sqs, inbox, {"function": "flaky", "payload": {"key": "h", "fail_times": 99}, "request_id": "h"}
    )
    attempts = handler_fns.REG.get("flaky").retry.max_attempts
    for _ in range(attempts - 1):
        assert deliver(sqs, inbox)[0] == {"batchItemFailures": [{"itemIdentifier": msg}]}
        assert drain(sqs, replies) == []
    # the last receive allowed by the function's retry policy: reported as final, not looped
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    (reply,) = drain(sqs, replies)
    assert reply.error is not None and reply.error.type == ErrorCode.UNAVAILABLE and reply.error.retryable
    assert CALLS["flaky:h"] == attempts
    assert deliver(sqs, inbox)[1] == []


def test_a_side_effect_that_may_have_run_is_final_not_redelivered(sqs: Any, replies: str, table: Any) -> None:
    """A side effect cut at the Lambda's timeout (FunctionTimeout: it may have run) was left on
    the queue and run again on each redelivery, up to retry.max_attempts times, since the cut
    run's idempotency record is deleted. It is answered OutcomeUnknown at once, as the client
    concludes such a call, and that answer is kept under the key."""
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    body = {
        "function": "async_effect",
        "payload": {"key": "charge-7", "seconds": 1.0},
        "request_id": "c7",
        "idempotency_key": "order-7",
    }
    send(sqs, inbox, body)
    # 0.7 s left in the Lambda: the call is cut 0.2 s in, after its effect
    assert deliver(sqs, inbox, LambdaContext(remaining_ms=700))[0] == {"batchItemFailures": []}
    (reply,) = drain(sqs, replies)
    assert reply.error is not None and reply.error.type == ErrorCode.OUTCOME_UNKNOWN, reply.error
    assert not reply.retryable and ErrorCode.TIMEOUT in reply.error.message and not reply.cached
    assert deliver(sqs, inbox)[1] == []  # nothing left to redeliver
    # the same message again (SQS delivers at least once): answered from the key, not run
    send(sqs, inbox, body)
    deliver(sqs, inbox)
    (again,) = drain(sqs, replies)
    assert again.error is not None and again.error.type == ErrorCode.OUTCOME_UNKNOWN and again.cached
    assert CALLS["async_effect:charge-7"] == 1


def test_a_side_effect_whose_store_failed_before_it_ran_is_retried(
    sqs: Any, replies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The idempotency store failing before the call ran (its in-progress record could not be
    written) is NotStarted: safe to run again, even for a side effect."""
    monkeypatch.setenv(handler.TABLE_ENV, "table-that-does-not-exist")
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    body = {"function": "async_effect", "payload": {"key": "e", "seconds": 0}, "idempotency_key": "ke"}
    msg = send(sqs, inbox, body)
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": [{"itemIdentifier": msg}]}
    assert drain(sqs, replies) == [] and CALLS["async_effect:e"] == 0


def test_whole_batch_failing_is_reported_not_raised(sqs: Any, replies: str) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    ids = {send(sqs, inbox, {"function": "flaky", "payload": {"key": f"w{i}"}}) for i in range(3)}
    response, _ = deliver(sqs, inbox)
    assert {f["itemIdentifier"] for f in response["batchItemFailures"]} == ids


def test_reply_to_attribute_overrides_the_default_queue(sqs: Any, replies: str) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    mine = sqs.create_queue(QueueName="job-42-replies")["QueueUrl"]
    send(sqs, inbox, {"function": "calculator", "payload": {"expression": "1+2"}, "request_id": "m"}, mine)
    send(sqs, inbox, {"function": "calculator", "payload": {"expression": "2+2"}, "request_id": "d"})
    deliver(sqs, inbox)
    assert [r.request_id for r in drain(sqs, mine)] == ["m"]
    assert [r.request_id for r in drain(sqs, replies)] == ["d"]


def test_without_a_reply_queue_results_are_only_logged(sqs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    send(sqs, inbox, {"function": "calculator", "payload": {"expression": "3*3"}, "request_id": "l"})
    capsys.readouterr()
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    logs = [line for line in stdout_json(capsys) if line.get("message") == "invocation ok"]
    assert [(line["correlation_id"], line["function"]) for line in logs] == [("l", "calculator")]


def test_redelivered_record_runs_once_and_is_answered_again(sqs: Any, replies: str, table: Any) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    body = {"function": "counted", "payload": {"key": "s"}, "request_id": "s", "idempotency_key": "ks"}
    send(sqs, inbox, body)
    send(sqs, inbox, body)  # SQS delivers at least once: the same message twice
    deliver(sqs, inbox)
    got = drain(sqs, replies)
    assert CALLS["counted:s"] == 1
    assert sorted(r.cached for r in got) == [False, True]
    assert all(r.value == {"key": "s", "n": 1} for r in got)


def test_fifo_reply_queue_drops_duplicate_replies(sqs: Any) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    fifo = sqs.create_queue(QueueName="replies.fifo", Attributes={"FifoQueue": "true"})["QueueUrl"]
    body = {"function": "calculator", "payload": {"expression": "5"}, "request_id": "dup"}
    send(sqs, inbox, body, fifo)
    send(sqs, inbox, body, fifo)
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    assert [r.request_id for r in drain(sqs, fifo)] == ["dup"]


def test_failed_reply_send_retries_the_record(sqs: Any) -> None:
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    gone = "https://sqs.us-east-1.amazonaws.com/123456789012/no-such-queue"
    msg = send(sqs, inbox, {"function": "calculator", "payload": {"expression": "1"}}, gone)
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": [{"itemIdentifier": msg}]}


# ----------------------------------------------------------------------------- S3 spill


def _spill(payload: dict[str, Any], bucket: str = "spill-bucket") -> dict[str, Any]:
    from fabric.protocol import encode_payload
    from fabric.spill import pointer

    raw = encode_payload(payload, limit=64 * 1024 * 1024)
    s3 = boto3.client("s3", region_name=REGION)
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="spill/t/r1.json", Body=raw)
    return pointer(bucket, "spill/t/r1.json", raw)


def test_a_spilled_payload_over_6_mb_is_fetched_and_run(aws: None) -> None:
    # 7 MB of reasoning before a short answer (an answer over MAX_ANSWER_CHARS matches nothing)
    big = "x" * (7 * 1024 * 1024) + "\nso the answer is \\boxed{42}."
    traj = {"messages": [{"role": "assistant", "content": big}]}
    r = invoke("exact_match", _spill({"traj": traj, "ground_truth": "42"}))
    assert r.ok and r.value == 1.0, r.error
    wrong = invoke("exact_match", _spill({"traj": traj, "ground_truth": "43"}))
    assert wrong.ok and wrong.value == 0.0, wrong.error


def test_a_spill_pointer_that_does_not_resolve_is_a_clear_error(aws: None) -> None:
    p = _spill({"traj": TRAJ, "ground_truth": "42"})
    p["__fabric_spill__"]["sha256"] = "0" * 64
    r = invoke("exact_match", p)
    assert r.error.type == ErrorCode.INVALID_ARGUMENTS and "does not match its pointer" in r.error.message
    p["__fabric_spill__"]["key"] = "spill/t/missing.json"
    r = invoke("exact_match", p)
    assert r.error.type == ErrorCode.INVALID_ARGUMENTS and "not found" in r.error.message
    r = invoke("exact_match", {"__fabric_spill__": {"bucket": 3}})
    assert r.error.type == ErrorCode.INVALID_ARGUMENTS and "needs a bucket and a key" in r.error.message


def test_an_expired_spilled_payload_did_not_start_and_says_to_send_it_again(aws: None) -> None:
    # the bucket's lifecycle rule deleted it (a call that waited days, an SQS backlog): the
    # function never ran, so the client's retry, which spills the payload anew, is safe even
    # for a side effect; it was a final InvalidArguments, kept under the idempotency key
    p = _spill({"traj": TRAJ, "ground_truth": "42"})
    p["__fabric_spill__"]["key"] = "spill/t/gone.json"
    p["__fabric_spill__"]["spilled_at"] = time.time() - 8 * 86400
    r = invoke("exact_match", p)
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
    assert "expired" in r.error.message and "send the call again" in r.error.message


def test_an_expired_spilled_payload_on_sqs_is_answered_at_once_not_delivered_again(
    sqs: Any, replies: str
) -> None:
    # retryable for its caller (who spills the payload anew), but the record holds the same
    # expired pointer: SQS delivered it again and again (max_attempts), each failing alike,
    # before the caller heard anything
    p = _spill({"traj": TRAJ, "ground_truth": "42"})
    p["__fabric_spill__"]["key"] = "spill/t/gone.json"
    p["__fabric_spill__"]["spilled_at"] = time.time() - 8 * 86400
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    send(sqs, inbox, {"function": "exact_match", "payload": p, "request_id": "x"})
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    (reply,) = drain(sqs, replies)
    assert reply.error is not None and reply.error.type == ErrorCode.NOT_STARTED and reply.retryable
    assert "expired" in reply.error.message
    assert deliver(sqs, inbox)[1] == []
    assert not handler._container()._resend  # nothing kept per request once answered


def test_a_spill_pointer_outside_the_deployment_bucket_is_refused(
    aws: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = _spill({"traj": TRAJ, "ground_truth": "42"}, bucket="someone-elses")
    monkeypatch.setenv("RL_FABRIC_SPILL_BUCKET", "rl-fabric-spill")
    r = invoke("exact_match", p)
    assert (
        r.error.type == ErrorCode.INVALID_ARGUMENTS
        and "read from s3://rl-fabric-spill only" in r.error.message
    )
    monkeypatch.setenv("RL_FABRIC_SPILL_BUCKET", "someone-elses")
    assert invoke("exact_match", p).value == 1.0
