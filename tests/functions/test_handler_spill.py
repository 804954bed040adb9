"""The Lambda entry point's S3 spill (moto, in-process): a payload over Lambda's 6 MB
limit spilled to S3 is fetched and run; a pointer that does not resolve, one to an expired
object (direct or on SQS) or outside the deployment's bucket is a clear error."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("aws_lambda_powertools")
boto3 = pytest.importorskip("boto3")
moto = pytest.importorskip("moto")

from handler_fixtures import aws_fixture, lambda_env_fixture, replies_fixture, sqs_fixture  # noqa: E402, F401 - by name=
from handler_helpers import REGION, TRAJ, deliver, drain, invoke, send  # noqa: E402

from fabric.errors import ErrorCode  # noqa: E402
from functions import handler  # noqa: E402

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


def test_a_spilled_payload_s3_does_not_serve_in_time_did_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 takes the request and never answers. The handler's S3 client waited botocore's
    defaults (60 s a read, 5 attempts), past any function's time: Lambda killed the invocation
    and the lambda backend read Sandbox.Timedout as the function's FunctionTimeout, which may
    have run (a side effect's call ended OutcomeUnknown) though it never started. The read is
    bounded by the time the invocation has left, and a payload not read by then is NotStarted."""
    import concurrent.futures
    import socket

    from handler_fns import LambdaContext

    from fabric.protocol import Invocation, Result, encode_payload
    from fabric.spill import pointer

    silent = socket.socket()  # accepts connections (its backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{silent.getsockname()[1]}")
    raw = encode_payload({"traj": TRAJ, "ground_truth": "42"})
    event = Invocation(function="exact_match", payload=pointer("b", "spill/t/r1.json", raw)).model_dump(
        mode="json"
    )
    ctx = LambdaContext()
    ctx.remaining_ms = 1500
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        # a guard against the old wait (minutes), not a measure of speed
        out = pool.submit(handler.handler, event, ctx).result(timeout=30)
    finally:
        silent.close()
        pool.shutdown(wait=False)
    r = Result.model_validate(out)
    assert r.error is not None and r.error.type == ErrorCode.NOT_STARTED and r.retryable, r.error
    assert "s3://b/spill/t/r1.json" in r.error.message and r.started is False, r.error
