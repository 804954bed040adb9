"""The Lambda entry point's SQS batches (moto, in-process; the event source mapping
emulated as in handler_helpers.deliver): exactly the retryable failures reported, final
errors replied, not retried; max attempts; side effects that may have run; replies (the
reply-to attribute, none configured, FIFO duplicates, a failed send); redelivery."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

import handler_fns  # noqa: E402 - after the skips: it is served by the handler under test
from handler_fixtures import aws_fixture, lambda_env_fixture, replies_fixture, sqs_fixture, table_fixture  # noqa: E402, F401 - by name=
from handler_fns import CALLS, LambdaContext  # noqa: E402
from handler_helpers import deliver, drain, emf, send, stdout_json  # noqa: E402

from fabric.errors import ErrorCode  # noqa: E402
from functions import handler  # noqa: E402

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


def _bug(*_: Any, **__: Any) -> Any:
    raise RuntimeError("a bug in the handler")


def test_a_handler_bug_before_the_function_ran_is_retried_up_to_max_attempts(
    sqs: Any, replies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's own code raising (encoding the parsed payload) went to the batch
    processor as a failed record, redelivered past the function's ``retry.max_attempts``
    until the dead-letter queue took it, never answered. As on a direct invoke it is
    ``NotStarted``: redelivered (nothing ran), then replied as final."""
    monkeypatch.setattr("functions._handler_requests.encode_payload", _bug)
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    msg = send(sqs, inbox, {"function": "flaky", "payload": {"key": "nb"}, "request_id": "nb"})
    attempts = handler_fns.REG.get("flaky").retry.max_attempts
    for _ in range(attempts - 1):
        assert deliver(sqs, inbox)[0] == {"batchItemFailures": [{"itemIdentifier": msg}]}
        assert drain(sqs, replies) == []
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    (reply,) = drain(sqs, replies)
    assert reply.error is not None and reply.error.type == ErrorCode.NOT_STARTED, reply.error
    assert "a bug in the handler" in reply.error.message and reply.request_id == "nb"
    assert reply.function == "flaky" and CALLS["flaky:nb"] == 0
    assert deliver(sqs, inbox)[1] == []


def test_a_handler_bug_after_a_side_effect_began_is_outcome_unknown_not_redelivered(
    sqs: Any, replies: str, table: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sizing the result for the store raised after the effect ran: the record was redelivered
    and, its in-progress record deleted with the exception, the effect ran again. It is
    concluded ``OutcomeUnknown`` under the key and replied, as on a direct invoke."""
    from functions import _handler_idempotency

    real, raised = _handler_idempotency._stored_bytes, []

    def once(result: Any) -> int:
        if not raised:
            raised.append(result)
            raise RuntimeError("a bug in the handler")
        return real(result)

    monkeypatch.setattr(_handler_idempotency, "_stored_bytes", once)
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    body = {
        "function": "async_effect",
        "payload": {"key": "sq-bug", "seconds": 0},
        "request_id": "sb",
        "idempotency_key": "k-sq-bug",
    }
    send(sqs, inbox, body)
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    (reply,) = drain(sqs, replies)
    assert reply.error is not None and reply.error.type == ErrorCode.OUTCOME_UNKNOWN, reply.error
    assert "TransportError" in reply.error.message and "a bug in the handler" in reply.error.message
    assert not reply.retryable and reply.request_id == "sb"
    assert deliver(sqs, inbox)[1] == []  # nothing left to redeliver
    send(sqs, inbox, body)  # the same message again: answered from the key, not run
    deliver(sqs, inbox)
    (again,) = drain(sqs, replies)
    assert again.error is not None and again.error.type == ErrorCode.OUTCOME_UNKNOWN and again.cached
    assert CALLS["async_effect:sq-bug"] == 1


@pytest.mark.parametrize("broken", ["observe", "log line"])
def test_a_failure_after_the_result_exists_replies_it_not_a_second_run(
    sqs: Any, replies: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], broken: str
) -> None:
    """The record's log line and metrics raising after its side effect ran (no idempotency
    key) failed the record: SQS delivered it again and the effect ran a second time. The
    result that exists is replied; the failure is logged with its traceback."""
    from functions._handler_replies import _Replies

    if broken == "observe":
        monkeypatch.setattr(_Replies, "observe", _bug)
    else:  # its "invocation ok"
        monkeypatch.setattr(handler._container().logger, "info", _bug)
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    body = {"function": "async_effect", "payload": {"key": "sq-obs", "seconds": 0}, "request_id": "so"}
    send(sqs, inbox, body)
    capsys.readouterr()
    first, _ = deliver(sqs, inbox)
    _, again = deliver(sqs, inbox)  # what SQS would deliver again
    assert CALLS["async_effect:sq-obs"] == 1
    assert first == {"batchItemFailures": []} and again == []
    (reply,) = drain(sqs, replies)
    assert reply.ok and reply.request_id == "so" and not reply.cached
    (logged,) = [line for line in stdout_json(capsys) if line.get("message") == "cannot observe the record"]
    assert "a bug in the handler" in logged["exception"] and logged["correlation_id"] == "so"


def test_a_failure_giving_up_a_retryable_result_replies_it_not_another_run(
    sqs: Any, replies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the last receive allowed by ``retry.max_attempts``, logging the give-up raised: the
    record failed, SQS delivered it past max_attempts and the function ran once more each
    time, never answered. The retryable result is replied as final."""
    monkeypatch.setattr(handler._container().logger, "error", _bug)
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    send(sqs, inbox, {"function": "flaky", "payload": {"key": "gu", "fail_times": 99}, "request_id": "gu"})
    attempts = handler_fns.REG.get("flaky").retry.max_attempts
    for _ in range(attempts + 1):  # one more than it may take: what SQS would deliver again
        deliver(sqs, inbox)
    assert CALLS["flaky:gu"] == attempts
    (reply,) = drain(sqs, replies)
    assert reply.error is not None and reply.error.type == ErrorCode.UNAVAILABLE and reply.error.retryable
    assert deliver(sqs, inbox)[1] == []


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


@pytest.mark.parametrize(
    "event",
    [
        {"function": "calculator", "payload": {"expression": "6*7"}},  # a direct invoke's Invocation
        {"Records": "not a list"},
        "a string",
    ],
)
@pytest.mark.filterwarnings("ignore:No application metrics:UserWarning")  # it raised before any
def test_an_event_that_is_not_an_sqs_batch_says_where_it_belongs(event: Any) -> None:
    # it raised powertools' "Unexpected batch event type. Possible values are: SQS,
    # KinesisDataStreams, DynamoDBStreams, Kafka", which names neither handler
    with pytest.raises(ValueError, match=r"not an SQS batch .*functions\.handler\.handler"):
        handler.sqs_handler(event, LambdaContext())


def test_a_reply_over_a_smaller_reply_queues_limit_is_replaced_not_redelivered(sqs: Any) -> None:
    # a reply queue made with a limit below SQS's 1 MiB (256 KiB was the limit before 2025,
    # and older queues keep it): the reply's send was refused every delivery, the record
    # redelivered and run again until it reached the dead-letter queue, never answered
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    small = sqs.create_queue(QueueName="small-replies", Attributes={"MaximumMessageSize": "4096"})["QueueUrl"]
    body = {"function": "big", "payload": {"key": "sq", "n": 8000}, "request_id": "sq"}
    send(sqs, inbox, body, small)
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    (reply,) = drain(sqs, small)
    assert not reply.ok and reply.error is not None and reply.request_id == "sq"
    assert reply.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE
    assert "4,096-byte" in reply.error.message and "small-replies" in reply.error.message
    assert CALLS["big:sq"] == 1
    assert deliver(sqs, inbox)[1] == []  # nothing left to run again


def test_a_reply_over_sqs_limit_is_replaced_and_its_attributes_say_it_failed(sqs: Any, replies: str) -> None:
    # the failure sent in place of a reply over 1 MiB carried the attribute ok=true (the
    # result's), so a consumer that routes on the attributes alone took it for a success
    inbox = sqs.create_queue(QueueName="rl-fabric-calls")["QueueUrl"]
    send(sqs, inbox, {"function": "big", "payload": {"key": "mb", "n": 1_100_000}, "request_id": "mb"})
    assert deliver(sqs, inbox)[0] == {"batchItemFailures": []}
    (reply,) = drain(sqs, replies)  # drain checks the attributes against the body
    assert reply.error is not None and reply.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE
    assert "1,048,576-byte SQS message limit" in reply.error.message
