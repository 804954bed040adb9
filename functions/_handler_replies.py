"""The Lambda handler's entry points and the replies they shape: a direct invoke's reply
kept under Lambda's response limit, an SQS record left on the queue for a retry or answered
on its reply queue, and one log line and the metrics of every invocation."""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import TYPE_CHECKING, Any, cast

from fabric.errors import ErrorCode
from fabric.protocol import Result
from functions._handler_base import REPLY_TO_ATTRIBUTE, SERVICE
from functions._handler_requests import _Requests

if TYPE_CHECKING:
    from aws_lambda_powertools import Metrics
    from aws_lambda_powertools.metrics import EphemeralMetrics
    from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

#: Lambda's limit on a synchronous invoke's response, in bytes as the runtime encodes the
#: reply: the python3.11 runtime uses ``json.dumps`` with ASCII escapes, so a non-ASCII
#: character can take 6 bytes. Over it, Lambda answers ``Function.ResponseSizeTooLarge``.
MAX_LAMBDA_RESPONSE_BYTES = 6_291_556
#: Kept back from that limit for the ``ResultNotSerializable`` that replaces a reply too large.
RESPONSE_MARGIN_BYTES = 16 * 1024
#: SQS's message size limit (1 MiB since 2025; a queue may be configured lower).
MAX_REPLY_BYTES = 1024 * 1024


class _RetryLater(Exception):
    """Raised from an SQS record handler: the record is reported in ``batchItemFailures``."""


class _Replies(_Requests):
    """The entry points of one invocation (direct, SQS) and the replies they send."""

    # ------------------------------------------------------------------ observability
    def observe(
        self, result: Result, sink: Metrics | EphemeralMetrics, queue_ms: float | None = None
    ) -> None:
        """One log line and the per-function metrics of a finished invocation."""
        from aws_lambda_powertools.metrics import MetricUnit

        known = result.function in self.served
        sink.add_dimension(name="function", value=result.function if known else "unknown")
        sink.add_metric(name="Invocations", unit=MetricUnit.Count, value=1)
        sink.add_metric(name="Errors", unit=MetricUnit.Count, value=0 if result.ok else 1)
        if result.cached:
            sink.add_metric(name="CacheHits", unit=MetricUnit.Count, value=1)
        elif result.timings.exec_ms > 0:
            sink.add_metric(name="Latency", unit=MetricUnit.Milliseconds, value=result.timings.exec_ms)
        if queue_ms is not None:
            sink.add_metric(name="QueueLatency", unit=MetricUnit.Milliseconds, value=queue_ms)
        fields: dict[str, Any] = {
            "function": result.function,
            "ok": result.ok,
            "cached": result.cached,
            "cold_start": result.cold_start,
            "exec_ms": round(result.timings.exec_ms, 3),
        }
        if result.error is None:
            self.logger.info("invocation ok", extra=fields)
        else:
            sink.add_metadata(key="error_type", value=result.error.type)
            fields.update(error_type=result.error.type, error=result.error.message[:2000])
            fields["retryable"] = result.error.retryable
            self.logger.warning("invocation failed", extra=fields)

    # ------------------------------------------------------------------ entry points
    def direct(self, event: Any, context: Any) -> dict[str, Any]:
        cold = self.take_cold()
        self._began, self._current = False, None
        try:
            return self._answer(event, context, cold=cold)
        except Exception as e:
            # the handler's own code raised (a bug, an unexpected library error in parsing,
            # the idempotency layer, the reply); the function's own exceptions never get here
            # (its runner answers them as UserError). Raised out of here, it became Lambda's
            # error object, which the lambda backend reads as the function's final UserError:
            # kept under the idempotency key and scored as its answer, though it may not have run
            result = self._broken(event, e, cold=cold)
            try:
                self.observe(result, self.metrics)
            except Exception:  # the answer matters more than its log line and metrics
                self.logger.exception("cannot observe the handler's failure")
            return result.model_dump(mode="json")

    def _broken(self, event: Any, e: Exception, *, cold: bool) -> Result:
        """The answer of an invocation whose handler code raised ``e`` (a direct invoke, an SQS
        record): a retryable failure, ``NotStarted`` before the function began (safe to retry
        for any function), else ``TransportError`` (it may have run: the client does not retry
        a side effect on it, nor does an SQS record). ``event`` (a dict) names it until it is
        parsed. Not kept under the key: raised out of the idempotent region, powertools deleted
        the in-progress record, and the record is written nowhere else. But for a side effect
        that began: concluded ``OutcomeUnknown`` and kept, as any other failure after it began
        is (``conclude``), so another call with the key does not run the effect again."""
        began, inv = self._began, self._current
        self.logger.exception("the handler failed", extra={"function_began": began})
        hint: dict[str, Any] = event if isinstance(event, dict) else {}
        function, request_id = hint.get("function"), hint.get("request_id")
        if inv is not None:  # parsed: a JSON string event's names too
            function, request_id = inv.function, inv.request_id
        when = "after the function began (it may have run)" if began else "before the function ran"
        result = Result.failure(
            ErrorCode.TRANSPORT if began else ErrorCode.NOT_STARTED,
            f"the Lambda handler failed {when}: {type(e).__name__}: {e} (its traceback is in the "
            "function's log); retry later",
            function=function if isinstance(function, str) else "",
            request_id=request_id if isinstance(request_id, str) else "",
            worker=self.worker,
            started=began,
        )
        result.cold_start = cold
        if began and inv is not None:
            try:
                result = self.conclude(inv, result)
            except Exception:  # the handler is broken still: the client concludes it itself
                self.logger.exception("cannot conclude the handler's failure")
        return result

    def _answer(self, event: Any, context: Any, *, cold: bool) -> dict[str, Any]:
        parsed = self.parse(event, context=context)
        self.logger.set_correlation_id(parsed.request_id or None)
        if isinstance(parsed, Result):
            parsed.cold_start, parsed.worker = cold, self.worker
            result = parsed
        else:
            self._current = parsed
            result = self.conclude(parsed, self.invoke(parsed, cold=cold, queue_ms=0.0, context=context))
        self._resend.discard(result.request_id)  # the caller's own retry sends anew
        reply = result.model_dump(mode="json")
        size = len(json.dumps(reply))  # what the runtime sends (ASCII-escaped)
        if size > MAX_LAMBDA_RESPONSE_BYTES - RESPONSE_MARGIN_BYTES:
            # the runner's 6 MiB check counts UTF-8 bytes; escaped, the reply can be larger
            # still, and Lambda would replace it with its own Function.ResponseSizeTooLarge
            too_big = Result.failure(
                ErrorCode.RESULT_NOT_SERIALIZABLE,
                f"{result.function} returned a reply of {size:,} bytes as the Lambda runtime encodes it "
                f"(JSON, non-ASCII characters escaped), over the {MAX_LAMBDA_RESPONSE_BYTES:,}-byte "
                "response limit; return a reference (an S3 key) instead",
                function=result.function,
                request_id=result.request_id,
                worker=self.worker,
            )
            # still the answer of the code deployed here (the client checks its version)
            too_big.cold_start, too_big.timings, too_big.version = (
                result.cold_start,
                result.timings,
                result.version,
            )
            result, reply = too_big, too_big.model_dump(mode="json")
        self.observe(result, self.metrics)
        return reply

    def sqs(self, event: Any, context: Any) -> dict[str, Any]:
        from aws_lambda_powertools.metrics import MetricUnit
        from aws_lambda_powertools.utilities.batch import process_partial_response

        if not (isinstance(event, dict) and isinstance(event.get("Records"), list)):
            # powertools' own error lists every batch type it knows and names neither entry
            # point; only the keys are shown (a payload is never logged)
            shown = f"keys {sorted(map(str, event))}" if isinstance(event, dict) else type(event).__name__
            raise ValueError(
                f"sqs_handler got an event that is not an SQS batch ({shown}; one has a 'Records' "
                "list): point the SQS event source mapping here, and a direct invoke (an "
                "Invocation) at functions.handler.handler"
            )
        cold = [self.take_cold()]  # the first record of the batch paid for it

        def record_handler(record: SQSRecord) -> None:
            self.on_record(record, cold=cold.pop() if cold else False, context=context)

        try:
            response = process_partial_response(
                event=event, record_handler=record_handler, processor=self.processor, context=context
            )
        finally:
            self.logger.set_correlation_id(None)
        failed = len(response.get("batchItemFailures", []))
        self.metrics.add_metric(name="SqsRecords", unit=MetricUnit.Count, value=len(self.processor.records))
        self.metrics.add_metric(name="SqsRecordsRetried", unit=MetricUnit.Count, value=failed)
        return cast(dict[str, Any], response)

    def on_record(self, record: SQSRecord, *, cold: bool, context: Any) -> None:
        from aws_lambda_powertools.metrics import EphemeralMetrics

        attributes = record.get("attributes") or {}
        sent = attributes.get("SentTimestamp")
        queue_ms = max(0.0, time.time() * 1e3 - int(sent)) if sent else 0.0
        self._began, self._current = False, None
        try:
            result = self._record_result(record, cold=cold, queue_ms=queue_ms, context=context)
        except Exception as e:
            # the handler's own code raised, as on a direct invoke (``direct``). Raised out of
            # here, the batch processor reported the record and SQS delivered it again past the
            # function's retry.max_attempts (up to the dead-letter queue), running again a side
            # effect that had begun; answered as there, it is retried or concluded below
            result = self._broken(_body_hint(record), e, cold=cold)
        # the result exists: from here on only a reply that cannot be sent fails the record.
        # Anything else raised out of here was redelivered by SQS and ran the function again,
        # a side effect too when no idempotency key answers the second delivery
        try:
            sink = EphemeralMetrics(namespace=self.namespace, service=SERVICE)
            self.observe(result, sink, queue_ms=queue_ms)
            sink.flush_metrics()
        except Exception:  # the call's outcome is the result, not its log line and metrics
            self.logger.exception("cannot observe the record")
        if self._retry_later(result, attributes):
            raise _RetryLater(f"{result.function}: {result.error.type if result.error else ''}")
        self.reply(record, result)

    def _retry_later(self, result: Result, attributes: dict[str, Any]) -> bool:
        """Whether a record's retryable failure is left on the queue (SQS delivers it again
        after the visibility timeout) rather than replied: until the function's
        ``retry.max_attempts`` receives. Deciding it raising replies the result as final."""
        try:
            # a payload that expired needs a new call (its caller spills it anew): the same
            # record delivered again fails the same way, so it is answered now
            resend = result.request_id in self._resend
            self._resend.discard(result.request_id)
            if not result.retryable or resend:
                return False
            spec = self.registry.get(result.function) if result.function in self.served else None
            receives = int(attributes.get("ApproximateReceiveCount") or 1)
            attempts = spec.retry.max_attempts if spec is not None else 1
            if receives < attempts:
                return True
            self.logger.error(
                "giving up on a retryable failure",
                extra={"function": result.function, "receives": receives, "max_attempts": attempts},
            )
        except Exception:  # replied: its caller decides on a retryable result's retry
            self.logger.exception("cannot decide on the record's retry")
        return False

    def _record_result(self, record: SQSRecord, *, cold: bool, queue_ms: float, context: Any) -> Result:
        """The result of a record's invocation, concluded as on a direct invoke (``_answer``)."""
        parsed = self.parse(record.body, fallback_request_id=record.message_id, context=context)
        self.logger.set_correlation_id(parsed.request_id or record.message_id)
        if isinstance(parsed, Result):
            parsed.cold_start, parsed.worker = cold, self.worker
            return parsed
        self._current = parsed
        return self.conclude(parsed, self.invoke(parsed, cold=cold, queue_ms=queue_ms, context=context))

    def reply(self, record: SQSRecord, result: Result) -> None:
        """Send a final ``Result`` to the record's reply queue, if it has one. A send that
        fails raises, so the record is retried (and answered from the idempotency store,
        when the invocation has a key)."""
        attr = (record.get("messageAttributes") or {}).get(REPLY_TO_ATTRIBUTE) or {}
        url = attr.get("stringValue") or self.reply_queue_url
        if not url:
            return
        body = result.model_dump_json()
        size = len(body.encode())
        if size > MAX_REPLY_BYTES:
            # (its attributes say what the body is: ok false, as a reader of the attributes
            # alone was told true for the failure sent in place of the result)
            result = self._too_big(result, size, f"{MAX_REPLY_BYTES:,}-byte SQS message limit")
            body = result.model_dump_json()
        try:
            self._send_reply(url, body, record, result)
        except Exception as e:
            # a reply queue made with a lower MaximumMessageSize (256 KiB was SQS's limit
            # before 2025, and older queues keep it): refused on every delivery, the record
            # ran again each time until the dead-letter queue and was never answered
            limit = _queue_limit(e)
            if limit is None:
                raise
            where = f"{limit:,}-byte limit of the reply queue {url.rsplit('/', 1)[-1]} (MaximumMessageSize)"
            too_big = self._too_big(result, size, where)
            self._send_reply(url, too_big.model_dump_json(), record, too_big)

    def _too_big(self, result: Result, size: int, limit: str) -> Result:
        """The ``ResultNotSerializable`` answered in place of a reply too large."""
        too_big = Result.failure(
            ErrorCode.RESULT_NOT_SERIALIZABLE,
            f"{result.function} returned a result of {size:,} bytes, over the {limit}; "
            "return a reference (an S3 key) instead",
            function=result.function,
            request_id=result.request_id,
            worker=self.worker,
        )
        too_big.version = result.version
        return too_big

    def _send_reply(self, url: str, body: str, record: SQSRecord, result: Result) -> None:
        params: dict[str, Any] = {
            "QueueUrl": url,
            "MessageBody": body,
            "MessageAttributes": {
                "request_id": {"DataType": "String", "StringValue": result.request_id or record.message_id},
                "function": {"DataType": "String", "StringValue": result.function or "-"},
                "ok": {"DataType": "String", "StringValue": "true" if result.ok else "false"},
            },
        }
        if url.endswith(".fifo"):
            # a FIFO reply queue drops a duplicate reply (a redelivered record) for 5 minutes
            digest = hashlib.sha256((result.request_id or record.message_id).encode()).hexdigest()
            params.update(MessageGroupId=digest, MessageDeduplicationId=digest)
        if self._sqs is None:
            import boto3

            self._sqs = boto3.client("sqs")
        self._sqs.send_message(**params)


def _queue_limit(error: Exception) -> int | None:
    """The size limit named by SQS's refusal of a message too long for its queue, or None
    for any other error (``InvalidParameterValue``: "Message must be shorter than N bytes")."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None
    err = response.get("Error") or {}
    if err.get("Code") != "InvalidParameterValue":
        return None
    found = re.search(r"must be shorter than (\d+) bytes", str(err.get("Message", "")))
    return int(found.group(1)) if found else None


def _body_hint(record: SQSRecord) -> dict[str, Any]:
    """The names of a record's invocation, best effort, for its answer when the handler failed
    before it was parsed: a record named by no function is given up at its first receive."""
    try:
        body = json.loads(record.body)
    except Exception:  # not JSON: answered under its message id, as a refused body is
        body = None
    hint = body if isinstance(body, dict) else {}
    request_id = hint.get("request_id")
    if not (isinstance(request_id, str) and request_id):
        request_id = record.message_id
    return {"function": hint.get("function"), "request_id": request_id}
