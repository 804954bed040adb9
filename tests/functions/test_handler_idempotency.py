"""The Lambda entry point's idempotency: DynamoDB (moto, in-process) holds the records;
a key runs once per tenant and function, what is cached (final errors, a side effect that
may have run) and what is not (retryable errors, timeouts, results too large to store);
a key in progress, another payload under a key, no table, a bad TTL, a store that fails."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from handler_fixtures import aws_fixture, lambda_env_fixture, table_fixture  # noqa: E402, F401 - by name=
from handler_fns import CALLS, LambdaContext  # noqa: E402
from handler_helpers import TABLE, call, invoke  # noqa: E402

from fabric.errors import ErrorCode  # noqa: E402
from fabric.protocol import Invocation, Result  # noqa: E402
from functions import handler  # noqa: E402

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
