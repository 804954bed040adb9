"""A direct invoke whose handler code itself raises, outside the user function's run (a bug
or an unexpected library error in parsing the event, the idempotency layer, shaping the
reply). Raised out of ``handler``, it became Lambda's error object, which the lambda
backend reads as the function's final ``UserError``: kept under the idempotency key and
scored as the reward's answer, though the function may never have run. It is answered as a
retryable infrastructure failure instead: ``NotStarted`` before the function began,
``TransportError`` (began: the client does not retry a side effect on it) after; logged
with its traceback, and never stored under the key."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from handler_fixtures import aws_fixture, lambda_env_fixture, table_fixture  # noqa: E402, F401 - by name=
from handler_fns import CALLS  # noqa: E402
from handler_helpers import invoke, stdout_json  # noqa: E402

from fabric.errors import ErrorCode  # noqa: E402


def _raise(*_: Any, **__: Any) -> Any:
    raise RuntimeError("a bug in the handler")


def test_a_bug_before_the_function_runs_is_not_started(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Encoding the parsed payload raised: nothing ran, so any function may be retried."""
    monkeypatch.setattr("functions._handler_requests.encode_payload", _raise)
    r = invoke("counted", {"key": "pre"}, request_id="req-pre")
    assert r.error is not None and r.error.type == ErrorCode.NOT_STARTED, r.error
    assert r.retryable and r.started is False and "a bug in the handler" in r.error.message
    assert r.function == "counted" and r.request_id == "req-pre"
    assert CALLS["counted:pre"] == 0
    logged = [line for line in stdout_json(capsys) if "a bug in the handler" in line.get("exception", "")]
    assert logged and "Traceback" in logged[0]["exception"], logged  # its traceback, for the fix


def test_a_bug_after_the_function_ran_is_retryable_and_not_kept(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizing the result for the store raised after the function ran: it began, so
    ``TransportError`` (a side effect is not retried on it), and the key keeps nothing: the
    next call with it runs and its answer is kept."""
    monkeypatch.setattr("functions._handler_idempotency._stored_bytes", _raise)
    r = invoke("counted", {"key": "post"}, idempotency_key="k-post", request_id="r1")
    assert r.error is not None and r.error.type == ErrorCode.TRANSPORT, r.error
    assert r.retryable and r.started is True and CALLS["counted:post"] == 1
    monkeypatch.undo()  # fixed
    again = invoke("counted", {"key": "post"}, idempotency_key="k-post", request_id="r2")
    assert again.ok and not again.cached and again.value == {"key": "post", "n": 2}, again


def test_the_functions_own_exception_is_still_a_user_error(table: Any) -> None:
    r = invoke("broken", {"key": "own"}, idempotency_key="k-own")
    assert r.error is not None and r.error.type == ErrorCode.USER_ERROR and not r.retryable
    assert "bad input 'own'" in r.error.message
    again = invoke("broken", {"key": "own"}, idempotency_key="k-own")
    assert again.cached and CALLS["broken:own"] == 1  # the function's answer, kept


def test_a_bug_after_a_side_effect_began_concludes_outcome_unknown_under_the_key(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As any other failure after a side effect began (the store failing after the run): the
    in-progress record was deleted with the exception, so another call with the key (another
    client, a retry from outside the fabric client) ran the effect again. The handler
    concludes ``OutcomeUnknown`` and keeps it under the key."""
    from functions import _handler_idempotency

    real, raised = _handler_idempotency._stored_bytes, []

    def once(result: Any) -> int:
        if not raised:
            raised.append(result)
            raise RuntimeError("a bug in the handler")
        return real(result)

    monkeypatch.setattr(_handler_idempotency, "_stored_bytes", once)
    payload = {"key": "fx-bug", "seconds": 0}
    r = invoke("async_effect", payload, idempotency_key="k-fx-bug", request_id="r1")
    assert r.error is not None and r.error.type == ErrorCode.OUTCOME_UNKNOWN, r.error
    assert "TransportError" in r.error.message and "a bug in the handler" in r.error.message
    assert not r.retryable and CALLS["async_effect:fx-bug"] == 1
    again = invoke("async_effect", payload, idempotency_key="k-fx-bug", request_id="r2")
    assert again.error is not None and again.error.type == ErrorCode.OUTCOME_UNKNOWN, again.error
    assert again.cached and CALLS["async_effect:fx-bug"] == 1  # not run again
