"""The Lambda entry point's idempotency records during a rolling deploy: a record written by
a newer handler (its ``Result`` carries a field this code does not know) is still read back
as the answer under its key, and one this code cannot read at all is treated as absent,
with a warning, instead of failing every call with the key (but for a function with side
effects, which is not run again on it)."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from handler_fixtures import aws_fixture, lambda_env_fixture, table_fixture  # noqa: E402, F401 - by name=
from handler_fns import CALLS  # noqa: E402
from handler_helpers import TABLE, invoke  # noqa: E402


def _rewrite_records(table: Any, change: Any) -> int:
    """Apply ``change`` to the stored ``Result`` dict of every completed record, as another
    version of the handler would have written it; returns how many were rewritten."""
    n = 0
    for item in table.scan(TableName=TABLE)["Items"]:
        if "data" not in item:
            continue
        stored = json.loads(item["data"]["S"])
        item["data"] = {"S": json.dumps(change(stored), sort_keys=True)}
        table.put_item(TableName=TABLE, Item=item)
        n += 1
    return n


def test_a_record_with_a_field_this_handler_does_not_know_is_still_the_answer(table: Any) -> None:
    """A newer handler added a field to ``Result`` and stored an answer with it: this one
    refused the record (``extra="forbid"``), and the call with the key failed instead of
    being answered from the store. Unknown fields are dropped on read; the answer stands."""
    first = invoke("counted", {"key": "rd"}, idempotency_key="k-rd", request_id="r1")
    assert first.ok and CALLS["counted:rd"] == 1

    def newer(stored: dict[str, Any]) -> dict[str, Any]:
        # a field added at the top, and one inside a nested model
        return {
            **stored,
            "added_by_a_newer_handler": {"x": 1},
            "timings": {**stored["timings"], "gpu_ms": 2.0},
        }

    assert _rewrite_records(table, newer) == 1
    second = invoke("counted", {"key": "rd"}, idempotency_key="k-rd", request_id="r2")
    assert second.ok, second.error
    assert second.cached and second.value == first.value
    assert CALLS["counted:rd"] == 1  # answered from the store: not run again


def test_a_record_this_handler_cannot_read_counts_as_absent(
    table: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A record whose known fields this code cannot read (a type changed under it) is no
    answer it can give: the call runs as if the key had none, with a warning, instead of
    failing every call with the key until the record expires."""
    first = invoke("counted", {"key": "bad"}, idempotency_key="k-bad", request_id="r1")
    assert first.ok
    assert _rewrite_records(table, lambda stored: {**stored, "ok": {"not": "a bool"}}) == 1
    second = invoke("counted", {"key": "bad"}, idempotency_key="k-bad", request_id="r2")
    assert second.ok and not second.cached, second.error
    assert CALLS["counted:bad"] == 2  # ran again: the unreadable record was no answer
    assert any("cannot read" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]
    third = invoke("counted", {"key": "bad"}, idempotency_key="k-bad", request_id="r3")
    assert third.ok and third.cached and CALLS["counted:bad"] == 2  # its own answer replaced it


def test_a_record_unreadable_again_after_it_was_dropped_is_not_started(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another version wrote the key's record again between this one dropping it and looking
    again (here: the drop finds it replaced, and leaves it): the call does not run beside that
    record, and is answered ``NotStarted`` (retryable, nothing ran) instead of failing."""
    from fabric.errors import ErrorCode
    from functions._handler_idempotency import _Idempotency

    first = invoke("counted", {"key": "again"}, idempotency_key="k-again", request_id="r1")
    assert first.ok
    assert _rewrite_records(table, lambda stored: {**stored, "ok": {"not": "a bool"}}) == 1
    monkeypatch.setattr(_Idempotency, "_drop_unreadable", lambda self, record: None)
    second = invoke("counted", {"key": "again"}, idempotency_key="k-again", request_id="r2")
    assert second.error is not None and second.error.type == ErrorCode.NOT_STARTED, second.error
    assert second.started is False and CALLS["counted:again"] == 1


def test_an_unreadable_record_of_a_side_effect_is_not_run_again(table: Any) -> None:
    """The record says the call ran: dropped and run again, a function with side effects
    applied its effect twice. Its call is answered ``OutcomeUnknown`` (final) instead, and
    the record is left for the version that wrote it."""
    from fabric.errors import ErrorCode

    payload = {"key": "fx", "seconds": 0}
    first = invoke("async_effect", payload, idempotency_key="k-fx", request_id="r1")
    assert first.ok and CALLS["async_effect:fx"] == 1
    assert _rewrite_records(table, lambda stored: {**stored, "ok": {"not": "a bool"}}) == 1
    second = invoke("async_effect", payload, idempotency_key="k-fx", request_id="r2")
    assert second.error is not None and second.error.type == ErrorCode.OUTCOME_UNKNOWN, second.error
    assert "not run again" in second.error.message and CALLS["async_effect:fx"] == 1
    assert sum("data" in item for item in table.scan(TableName=TABLE)["Items"]) == 1  # left as it was


def test_an_unreadable_record_that_cannot_be_dropped_is_not_started(
    table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropping the unreadable record failed for another reason than its replacement (the
    table throttled the delete): the ClientError went out of the handler, Lambda sent its
    error object, and the lambda backend read it as the function's final UserError, kept
    under the key. Nothing ran: ``NotStarted``, retryable, naming the store."""
    from botocore.exceptions import ClientError

    from fabric.errors import ErrorCode
    from functions import handler

    first = invoke("counted", {"key": "thr"}, idempotency_key="k-thr", request_id="r1")
    assert first.ok
    assert _rewrite_records(table, lambda stored: {**stored, "ok": {"not": "a bool"}}) == 1
    store = handler._container()._store
    real = store.client

    class Throttled:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def delete_item(self, **_: Any) -> None:
            error = {"Error": {"Code": "ProvisionedThroughputExceededException", "Message": "slow down"}}
            raise ClientError(error, "DeleteItem")

    monkeypatch.setattr(store, "client", Throttled())
    second = invoke("counted", {"key": "thr"}, idempotency_key="k-thr", request_id="r2")
    assert second.error is not None and second.error.type == ErrorCode.NOT_STARTED, second.error
    assert second.retryable and second.started is False and "slow down" in second.error.message
    assert CALLS["counted:thr"] == 1
