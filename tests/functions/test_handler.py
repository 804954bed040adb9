"""The Lambda entry points (functions/handler.py), run for real in-process: direct
invokes (results and errors, limits, async functions and time left, cold starts, the allow
list and modules served, the setup hook, logs' correlation ids and metrics). Idempotency,
SQS batches and S3 spill have their own test_handler_*.py modules; the fixtures and helpers
are in handler_fixtures.py and handler_helpers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from handler_fixtures import lambda_env_fixture  # noqa: E402, F401 - by name=
from handler_fns import LambdaContext  # noqa: E402
from handler_helpers import MODULES, TRAJ, call, emf, invoke, stdout_json  # noqa: E402

from fabric.errors import ErrorCode  # noqa: E402
from fabric.protocol import MAX_PAYLOAD_BYTES, Invocation, Result  # noqa: E402
from functions import _handler_requests as handler_requests  # noqa: E402
from functions import handler  # noqa: E402

powertools = sys.modules["aws_lambda_powertools"]

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
    assert r.started is False


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


def test_a_container_that_cannot_start_answers_setup_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The container's own start (powertools' Logger and Metrics, before the modules are
    discovered) raised out of the handler: Lambda sent its error object ({"errorType":
    "ModuleNotFoundError"} for a package built without the aws extra), which the lambda
    backend reads as the function's final UserError, kept under the idempotency key and
    scored as the reward's answer. It is the deployment's fault, as a module that does not
    import is: SetupFailed, saying what to install, and the next call starts again."""
    monkeypatch.setitem(sys.modules, "aws_lambda_powertools", None)
    r = invoke("calculator", {"expression": "1"}, request_id="req-broken")
    assert r.error is not None and r.error.type == ErrorCode.SETUP_FAILED, r.error
    assert not r.error.retryable and "rl-fabric[aws]" in r.error.message, r.error.message
    assert r.function == "calculator" and r.request_id == "req-broken" and r.cold_start
    assert r.started is False
    monkeypatch.setitem(sys.modules, "aws_lambda_powertools", powertools)  # fixed
    assert invoke("calculator", {"expression": "1"}).value == "1"


def test_a_powertools_setting_it_refuses_is_setup_failed() -> None:
    """powertools' Logger refuses a log level it does not know (ValueError) when the
    container starts: as above, that was Lambda's error object, read as a UserError. In a
    fresh process: the Logger configures its logging.Logger once per process."""
    code = (
        "import json\n"
        "from functions import handler\n"
        "print(json.dumps(handler.handler({'function': 'calculator', 'request_id': 'r-1'}, None)))\n"
    )
    env = {**os.environ, "POWERTOOLS_LOG_LEVEL": "LOUD", handler.MODULES_ENV: MODULES}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    r = Result.model_validate_json(out.stdout.strip().splitlines()[-1])
    assert r.error is not None and r.error.type == ErrorCode.SETUP_FAILED, r.error
    assert "LOUD" in r.error.message and "POWERTOOLS_" in r.error.message, r.error.message
    assert r.request_id == "r-1"
