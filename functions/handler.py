"""AWS Lambda entry points: one handler serves every registered function.

* ``handler(event, context)``: a direct (synchronous) invoke. The event is a fabric
  ``Invocation`` as JSON; the reply is the fabric ``Result`` as JSON, the object the local
  backend returns (``cold_start`` and ``timings`` included). A failure is data: a bad event,
  an unknown function or a raising function all come back as ``Result(ok=False)``.
* ``sqs_handler(event, context)``: an SQS event source mapping with
  ``FunctionResponseTypes=["ReportBatchItemFailures"]``. Each record's body is an
  ``Invocation``. A retryable failure leaves its record on the queue (it is listed in
  ``batchItemFailures``) until the function's ``retry.max_attempts`` receives are used up,
  except for a side effect that may have run (a retryable failure not in ``SAFE_TO_RETRY``):
  that one ends at once as ``OutcomeUnknown``, as the client concludes it (a direct invoke
  concludes so too, and both keep it under the idempotency key). Every other
  outcome, errors included, is final: the record is deleted and the ``Result``
  goes to the reply queue (the record's ``reply_to`` message attribute, else
  ``RL_FABRIC_REPLY_QUEUE_URL``), or only to the log when there is none.

The functions served are discovered once per container (the cold start) from
``RL_FABRIC_MODULES``. Built on aws-lambda-powertools: Logger (JSON, correlation id = the
invocation's ``request_id``), Metrics (EMF on stdout: cold start, per-function invocations,
errors, latency), parser (the event is validated into the pydantic ``Invocation``),
idempotency (DynamoDB, keyed by the invocation's ``idempotency_key``), batch (SQS partial
failures). docs/lambda-handler.md lists the environment variables.

powertools and boto3 are the optional ``aws`` extra, and ``fabric`` discovery imports every
module under ``functions``: so they are imported when a container starts, never at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import sys
import time
import uuid
from typing import IO, TYPE_CHECKING, Any, cast

from fabric.errors import FINAL_ERRORS, SAFE_TO_RETRY, ErrorCode, PayloadError, UnknownFunctionError
from fabric.protocol import Invocation, Result, Timings, decode_payload, encode_payload
from fabric.registry import Registry
from fabric.runner import FunctionRunner, outcome_to_result
from fabric.spill import BUCKET_ENV as SPILL_BUCKET_ENV
from fabric.spill import SpillError, fetch, is_pointer

if TYPE_CHECKING:
    from collections.abc import Callable

    from aws_lambda_powertools import Logger, Metrics
    from aws_lambda_powertools.metrics import EphemeralMetrics
    from aws_lambda_powertools.utilities.data_classes.sqs_event import SQSRecord

    from fabric.spec import FunctionSpec

SERVICE = "rl-fabric"
MODULES_ENV = "RL_FABRIC_MODULES"
"""Comma-separated modules/packages (or ``file.py`` paths) whose functions this Lambda serves."""
FUNCTIONS_ENV = "RL_FABRIC_FUNCTIONS"
"""Optional comma-separated allow-list of function names; their setup hooks run at cold start."""
TABLE_ENV = "RL_FABRIC_IDEMPOTENCY_TABLE"
"""DynamoDB table (hash key ``id``, TTL attribute ``expiration``); unset: no idempotency."""
TTL_ENV = "RL_FABRIC_IDEMPOTENCY_TTL_S"
REPLY_QUEUE_ENV = "RL_FABRIC_REPLY_QUEUE_URL"
"""SQS queue that receives the ``Result`` of every SQS-triggered invocation."""
REPLY_TO_ATTRIBUTE = "reply_to"
"""SQS message attribute (String) naming the reply queue of one message; overrides the env."""

#: Results larger than this, as powertools stores them (``_stored_bytes``), are returned but
#: not stored for idempotency: a DynamoDB item holds at most 400 KB, and the rest is headroom
#: for the key, the payload hash, the status and expiry attributes and their names.
MAX_CACHED_RESULT_BYTES = 350_000
#: Lambda's limit on a synchronous invoke's response, in bytes as the runtime encodes the
#: reply: the python3.11 runtime uses ``json.dumps`` with ASCII escapes, so a non-ASCII
#: character can take 6 bytes. Over it, Lambda answers ``Function.ResponseSizeTooLarge``.
MAX_LAMBDA_RESPONSE_BYTES = 6_291_556
#: Kept back from that limit for the ``ResultNotSerializable`` that replaces a reply too large.
RESPONSE_MARGIN_BYTES = 16 * 1024
#: SQS's message size limit (1 MiB since 2025; a queue may be configured lower).
MAX_REPLY_BYTES = 1024 * 1024
#: Time kept back from an async function's timeout so the reply (and the idempotency
#: record) is written before Lambda's own timeout kills the invocation.
LAMBDA_MARGIN_S = 0.5
#: What the idempotency store keeps under a key: the function's own answers, and the
#: ``OutcomeUnknown`` an SQS-triggered side effect that may have run concludes with.
_KEPT_ERRORS = FINAL_ERRORS | {ErrorCode.OUTCOME_UNKNOWN}


class _Stdout:
    """A stream that writes to whatever ``sys.stdout`` is at the time (in Lambda, always the
    same; under pytest's capture, the test's), so the Logger's handler never goes stale."""

    def write(self, s: str) -> int:
        return sys.stdout.write(s)

    def flush(self) -> None:
        sys.stdout.flush()


class _NotCached(Exception):
    """Raised out of the idempotent region so that powertools deletes the in-progress record
    instead of storing the outcome (powertools stores whatever the function *returns*)."""

    def __init__(self, result: Result):
        super().__init__(result.error.type if result.error else "not cached")
        self.result = result


class _RetryLater(Exception):
    """Raised from an SQS record handler: the record is reported in ``batchItemFailures``."""


def _run_recorded(*, key: dict[str, Any], run: Callable[[], Result]) -> Result:
    """The function powertools makes idempotent (``key`` is what it hashes). Only a final
    answer is returned, and so stored: a success or one of ``FINAL_ERRORS``, the same rule
    as the client's own cache (or an ``OutcomeUnknown`` the SQS path concludes with). A
    retryable failure or a passed deadline must let the next call with the key run again,
    and a result too large for a DynamoDB item cannot be kept."""
    result = run()
    final = result.ok or (result.error is not None and result.error.type in _KEPT_ERRORS)
    if not final or _stored_bytes(result) > MAX_CACHED_RESULT_BYTES:
        raise _NotCached(result)
    return result


def _stored_bytes(result: Result) -> int:
    """The size of the item attribute powertools writes for ``result``: its persistence layer
    stores ``json.dumps(..., sort_keys=True)`` of the serializer's dict, ASCII-escaped, so a
    CJK character takes 6 bytes (``\\uXXXX``), not the 1 character or 3 UTF-8 bytes of
    ``model_dump_json``."""
    return len(json.dumps(result.model_dump(mode="json"), sort_keys=True).encode())


def _mark_cached(response: Any, idempotent_data: Any) -> Any:
    # powertools calls this only for a response read back from the store
    return response.model_copy(update={"cached": True}) if isinstance(response, Result) else response


def _payload_hash(payload: dict[str, Any]) -> str:
    # key order must not matter: a retry may rebuild the same payload in another order
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _lambda_remaining_s(context: Any) -> float | None:
    get = getattr(context, "get_remaining_time_in_millis", None)
    return get() / 1000 if callable(get) else None


def _names(env: str, default: str = "") -> list[str]:
    return [n.strip() for n in os.environ.get(env, default).split(",") if n.strip()]


class _Container:
    """Everything one Lambda execution environment keeps between invocations."""

    def __init__(self) -> None:
        t0 = time.perf_counter()
        from aws_lambda_powertools import Logger, Metrics
        from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType

        self.logger: Logger = Logger(service=SERVICE, stream=cast(IO[str], _Stdout()))
        self.namespace = os.environ.get("POWERTOOLS_METRICS_NAMESPACE") or SERVICE
        self.metrics: Metrics = Metrics(namespace=self.namespace, service=SERVICE)
        # an entirely failed batch is reported record by record, not raised as an error
        self.processor = BatchProcessor(event_type=EventType.SQS, raise_on_entire_batch_failure=False)
        self.worker = f"lambda:{os.environ.get('AWS_LAMBDA_FUNCTION_NAME', SERVICE)}/{uuid.uuid4().hex[:8]}"
        self.reply_queue_url = os.environ.get(REPLY_QUEUE_ENV) or None
        self._sqs: Any = None
        self._s3: Any = None
        self._runners: dict[str, FunctionRunner] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._first_call = os.environ.get("AWS_LAMBDA_INITIALIZATION_TYPE") != "provisioned-concurrency"
        self.registry = Registry()
        self.served: frozenset[str] = frozenset()
        self.table: str | None = None
        self._idempotent: Callable[..., Result] | None = None
        self.init_error: str | None = None
        modules = _names(MODULES_ENV, "functions")
        try:
            self.registry.discover(*modules)
            allowed = _names(FUNCTIONS_ENV)
            missing = [n for n in allowed if n not in self.registry]
            if missing:
                raise UnknownFunctionError(", ".join(missing), self.registry.names())
            self.served = frozenset(allowed or self.registry.names())
            self._init_idempotency()
        except Exception as e:  # a misconfigured deployment answers every call with the reason
            self.init_error = f"cannot start ({MODULES_ENV}={','.join(modules)}): {type(e).__name__}: {e}"
            self.logger.exception("container init failed")
        for name in _names(FUNCTIONS_ENV) if self.init_error is None else []:
            self._runner(name)  # setup hooks in the init phase (provisioned concurrency)
        # powertools' own wrappers: Lambda context in every log line and state cleared per
        # invocation; metrics flushed (EMF) after each one, cold start counted once
        self.direct_handler = self._wrap(self.direct)
        self.sqs_handler = self._wrap(self.sqs)
        self.init_ms = (time.perf_counter() - t0) * 1e3
        self.logger.info(
            "container ready",
            extra={
                "functions": sorted(self.served),
                "init_ms": round(self.init_ms, 1),
                "idempotency": self.table,
            },
        )

    def _wrap(self, entry: Callable[[Any, Any], dict[str, Any]]) -> Callable[[Any, Any], dict[str, Any]]:
        with_metrics = self.metrics.log_metrics(entry, capture_cold_start_metric=True)
        return cast(
            "Callable[[Any, Any], dict[str, Any]]",
            self.logger.inject_lambda_context(with_metrics, clear_state=True),
        )

    def _init_idempotency(self) -> None:
        self.table = os.environ.get(TABLE_ENV) or None
        if self.table is None:
            return  # idempotency off: its TTL does not matter, a bad one included
        raw_ttl = os.environ.get(TTL_ENV, "3600")
        try:
            ttl_s = int(raw_ttl)
        except ValueError:
            ttl_s = 0
        if ttl_s <= 0:
            raise ValueError(f"{TTL_ENV}={raw_ttl!r}: give the TTL as a whole number of seconds > 0")
        from aws_lambda_powertools.utilities.idempotency import (
            DynamoDBPersistenceLayer,
            IdempotencyConfig,
            idempotent_function,
        )
        from aws_lambda_powertools.utilities.idempotency.serialization.pydantic import PydanticSerializer

        self.idem_config = IdempotencyConfig(
            # the tenant, function and version scope the caller's key: two training jobs that
            # both say "traj-7" do not share results, nor do two versions of a function
            event_key_jmespath="[tenant, function, version, idempotency_key]",
            # the same key with another payload is refused instead of answered from the store
            payload_validation_jmespath="payload_hash",
            expires_after_seconds=ttl_s,
            response_hook=_mark_cached,
        )
        self._idempotent = idempotent_function(
            _run_recorded,
            data_keyword_argument="key",
            persistence_store=DynamoDBPersistenceLayer(table_name=self.table),
            config=self.idem_config,
            output_serializer=PydanticSerializer(Result),
            # not the Lambda's name: the key already names the function, so every Lambda
            # serving it (aliases, a redeploy under another name) shares the records
            key_prefix=SERVICE,
        )

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
        if self._sqs is not None:
            self._sqs.close()
        if self._s3 is not None:
            self._s3.close()

    # ------------------------------------------------------------------ one invocation
    def take_cold(self) -> bool:
        cold, self._first_call = self._first_call, False
        return cold

    def parse(self, event: Any, *, fallback_request_id: str = "") -> Invocation | Result:
        """The ``Invocation`` in ``event`` (a dict, or a JSON string as in an SQS body), or
        the failed ``Result`` saying why it is not one."""
        from aws_lambda_powertools.utilities.parser import parse
        from pydantic import ValidationError

        # best effort, so even a refused event's Result names what it was for
        hint: dict[str, Any] = event if isinstance(event, dict) else {}
        function = hint.get("function")
        function = function if isinstance(function, str) else ""
        request_id = hint.get("request_id")
        request_id = (request_id if isinstance(request_id, str) else "") or fallback_request_id

        def refuse(code: ErrorCode, message: str) -> Result:
            return Result.failure(code, message, function=function, request_id=request_id)

        try:
            inv = parse(event=event, model=Invocation)
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(x) for x in err['loc']) or 'event'}: {err['msg']}"
                for err in e.errors(include_url=False)[:5]
            )
            return refuse(ErrorCode.INVALID_ARGUMENTS, f"the event is not a fabric Invocation: {problems}")
        if inv.raw is not None:  # a model field, but never a wire field: it would replace payload
            return refuse(
                ErrorCode.INVALID_ARGUMENTS, "the event is not a fabric Invocation: 'raw' is not allowed"
            )
        if is_pointer(inv.payload):  # a payload over 6 MB, spilled to S3 by the caller
            return self._unspill(inv)
        try:
            inv.raw = encode_payload(inv.payload, what=f"payload of {inv.function}")
        except PayloadError as e:
            return Result.failure(e.code, str(e), function=inv.function, request_id=inv.request_id)
        return inv

    def _unspill(self, inv: Invocation) -> Invocation | Result:
        if self._s3 is None:
            import boto3

            self._s3 = boto3.client("s3")
        try:
            raw = fetch(self._s3, inv.payload, only_bucket=os.environ.get(SPILL_BUCKET_ENV) or None)
            payload = decode_payload(raw)
        except SpillError as e:
            code = ErrorCode.TRANSPORT if e.retryable else ErrorCode.INVALID_ARGUMENTS
            return self._failure(inv, code, str(e))
        except ValueError as e:
            return self._failure(inv, ErrorCode.INVALID_ARGUMENTS, f"the spilled payload is not JSON: {e}")
        if not isinstance(payload, dict):
            return self._failure(inv, ErrorCode.INVALID_ARGUMENTS, "the spilled payload is not a JSON object")
        inv.payload = payload
        inv.raw = raw  # the bytes as uploaded: no second encoding, and no 6 MB limit here
        return inv

    def invoke(self, inv: Invocation, *, cold: bool, queue_ms: float, context: Any) -> Result:
        if self.init_error is not None:
            result = self._failure(inv, ErrorCode.SETUP_FAILED, self.init_error)
        elif inv.function not in self.served:
            result = self._failure(
                inv, ErrorCode.UNKNOWN_FUNCTION, str(UnknownFunctionError(inv.function, list(self.served)))
            )
        else:
            runner = self._runner(inv.function)
            if isinstance(runner, Result):
                result = runner
            else:
                run = functools.partial(self._run, inv, runner, queue_ms=queue_ms, context=context)
                result = run() if inv.idempotency_key is None else self._run_once(inv, runner, run, context)
        result.request_id = inv.request_id  # a stored result carries its first caller's id
        result.cold_start = cold
        result.worker = self.worker
        if result.cached:
            result.timings = Timings(queue_ms=queue_ms)  # nothing ran
        return result

    def _failure(self, inv: Invocation, code: ErrorCode, message: str) -> Result:
        return Result.failure(code, message, function=inv.function, request_id=inv.request_id)

    def _runner(self, name: str) -> FunctionRunner | Result:
        runner = self._runners.get(name)
        if runner is None:
            runner = FunctionRunner(self.registry.callable(name), self.registry.get(name))
            try:
                runner.setup()
            except Exception as e:  # not kept: the next call tries the setup again
                message = f"setup hook of {name} raised {type(e).__name__}: {e}"
                self.logger.exception("setup failed", extra={"function": name})
                return Result.failure(ErrorCode.SETUP_FAILED, message, function=name)
            self._runners[name] = runner
        return runner

    def _run(self, inv: Invocation, runner: FunctionRunner, *, queue_ms: float, context: Any) -> Result:
        timeout = runner.spec.timeout_s
        remaining = inv.remaining_s()
        if remaining is not None:
            if remaining <= 0:
                return self._failure(
                    inv, ErrorCode.DEADLINE_EXCEEDED, "deadline passed before the call started"
                )
            timeout = min(timeout, remaining)
        lambda_left = _lambda_remaining_s(context)
        if lambda_left is not None:
            timeout = max(min(timeout, lambda_left - LAMBDA_MARGIN_S), 0.001)
        t0 = time.perf_counter()
        if runner.is_async:  # only async functions can be timed out; Lambda's timeout bounds the rest
            if self._loop is None:
                # one loop for the container's life, as a local worker has: clients a setup
                # hook made (an httpx.AsyncClient) stay bound to the loop they first ran on
                self._loop = asyncio.new_event_loop()
            ok, out = self._loop.run_until_complete(runner.run_async(inv.raw_payload, timeout))
        else:
            ok, out = runner.run(inv.raw_payload)
        exec_ms = (time.perf_counter() - t0) * 1e3
        return outcome_to_result(inv, ok, out, exec_ms=exec_ms, worker=self.worker, queue_ms=queue_ms)

    def _key(self, inv: Invocation, spec: FunctionSpec) -> dict[str, Any]:
        """What powertools hashes (and validates) for an invocation's idempotency key."""
        return {
            "tenant": inv.tenant,
            "function": inv.function,
            "version": spec.version,
            "idempotency_key": inv.idempotency_key,
            "payload_hash": _payload_hash(inv.payload),
        }

    def _run_once(
        self, inv: Invocation, runner: FunctionRunner, run: Callable[[], Result], context: Any
    ) -> Result:
        """``run`` under the invocation's idempotency key (or plainly, with no table)."""
        if self._idempotent is None:
            return run()
        from aws_lambda_powertools.utilities.idempotency.exceptions import (
            BaseError,
            IdempotencyAlreadyInProgressError,
            IdempotencyValidationError,
        )

        if callable(getattr(context, "get_remaining_time_in_millis", None)):
            # an in-progress record left by a timed-out invocation expires with it
            self.idem_config.register_lambda_context(context)
        started = False

        def run_started() -> Result:
            nonlocal started
            started = True
            return run()

        try:
            return self._idempotent(key=self._key(inv, runner.spec), run=run_started)
        except _NotCached as e:
            return e.result
        except IdempotencyAlreadyInProgressError:
            # this call did not run; the one in progress will answer
            message = f"a call with idempotency key {inv.idempotency_key!r} is in progress; retry later"
            return self._failure(inv, ErrorCode.NOT_STARTED, message)
        except IdempotencyValidationError:
            message = f"idempotency key {inv.idempotency_key!r} was already used with another payload"
            return self._failure(inv, ErrorCode.INVALID_ARGUMENTS, message)
        except BaseError as e:
            self.logger.exception("idempotency store failed", extra={"function": inv.function})
            message = f"idempotency store ({self.table}): {e}"
            if not started:  # its in-progress record could not be written: nothing ran
                return self._failure(inv, ErrorCode.NOT_STARTED, message)
            # it ran, and its outcome could not be recorded (or its record dropped)
            return self._failure(inv, ErrorCode.TRANSPORT, message)

    def conclude(self, inv: Invocation, result: Result) -> Result:
        """``result``, or the final ``OutcomeUnknown`` of a side effect that may have run.
        Both entry points conclude so: on SQS a redelivery would apply the effect again, and
        on a direct invoke another client (or a retry from outside the fabric client) with
        the same key would run it again, the cut run's idempotency record being dropped."""
        err = result.error
        if err is None or not err.retryable or err.type in SAFE_TO_RETRY or inv.function not in self.served:
            return result
        spec = self.registry.get(inv.function)
        return self.conclude_unknown(inv, spec, result) if spec.side_effects else result

    def conclude_unknown(self, inv: Invocation, spec: FunctionSpec, result: Result) -> Result:
        """The final ``OutcomeUnknown`` of a side effect that may have run (``result`` is a
        retryable failure not in ``SAFE_TO_RETRY``), kept under the invocation's key as the
        client keeps it: running it again on a redelivery could apply the effect twice, and
        its own idempotency record was dropped (or never completed) with the failure."""
        err = result.error
        assert err is not None
        unknown = self._failure(
            inv,
            ErrorCode.OUTCOME_UNKNOWN,
            f"{spec.name}: the call ended with {err.type} ({err.message}) and may have run; "
            f"{spec.name} has side effects, so it is not run again"
            + (
                f" under idempotency key {inv.idempotency_key!r}. Check whether its effect happened; "
                "to run it again, send it with a new idempotency key"
                if inv.idempotency_key is not None
                else ". Check whether its effect happened"
            ),
        )
        unknown.timings, unknown.cold_start, unknown.worker = result.timings, result.cold_start, result.worker
        if self._idempotent is None or inv.idempotency_key is None:
            return unknown
        from aws_lambda_powertools.utilities.idempotency.exceptions import BaseError

        try:
            self._idempotent(key=self._key(inv, spec), run=lambda: unknown)
        except BaseError:  # still in progress (its success could not be written) or the store is down
            self.logger.exception(
                "could not keep OutcomeUnknown under the key", extra={"function": spec.name}
            )
        return unknown

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
        parsed = self.parse(event)
        self.logger.set_correlation_id(parsed.request_id or None)
        if isinstance(parsed, Result):
            parsed.cold_start, parsed.worker = cold, self.worker
            result = parsed
        else:
            result = self.conclude(parsed, self.invoke(parsed, cold=cold, queue_ms=0.0, context=context))
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
            too_big.cold_start, too_big.timings = result.cold_start, result.timings
            result, reply = too_big, too_big.model_dump(mode="json")
        self.observe(result, self.metrics)
        return reply

    def sqs(self, event: Any, context: Any) -> dict[str, Any]:
        from aws_lambda_powertools.metrics import MetricUnit
        from aws_lambda_powertools.utilities.batch import process_partial_response

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
        parsed = self.parse(record.body, fallback_request_id=record.message_id)
        self.logger.set_correlation_id(parsed.request_id or record.message_id)
        if isinstance(parsed, Result):
            parsed.cold_start, parsed.worker = cold, self.worker
            result = parsed
        else:
            result = self.conclude(parsed, self.invoke(parsed, cold=cold, queue_ms=queue_ms, context=context))
        spec = self.registry.get(result.function) if result.function in self.served else None
        sink = EphemeralMetrics(namespace=self.namespace, service=SERVICE)
        self.observe(result, sink, queue_ms=queue_ms)
        sink.flush_metrics()
        if result.retryable:
            receives = int(attributes.get("ApproximateReceiveCount") or 1)
            attempts = spec.retry.max_attempts if spec is not None else 1
            if receives < attempts:
                # left on the queue: SQS delivers it again after the visibility timeout
                raise _RetryLater(f"{result.function}: {result.error.type if result.error else ''}")
            self.logger.error(
                "giving up on a retryable failure",
                extra={"function": result.function, "receives": receives, "max_attempts": attempts},
            )
        self.reply(record, result)

    def reply(self, record: SQSRecord, result: Result) -> None:
        """Send a final ``Result`` to the record's reply queue, if it has one. A send that
        fails raises, so the record is retried (and answered from the idempotency store,
        when the invocation has a key)."""
        attr = (record.get("messageAttributes") or {}).get(REPLY_TO_ATTRIBUTE) or {}
        url = attr.get("stringValue") or self.reply_queue_url
        if not url:
            return
        body = result.model_dump_json()
        if len(body.encode()) > MAX_REPLY_BYTES:
            too_big = Result.failure(
                ErrorCode.RESULT_NOT_SERIALIZABLE,
                f"{result.function} returned a result of {len(body.encode()):,} bytes, over the "
                f"{MAX_REPLY_BYTES:,}-byte SQS message limit; return a reference (an S3 key) instead",
                function=result.function,
                request_id=result.request_id,
                worker=self.worker,
            )
            body = too_big.model_dump_json()
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


# ----------------------------------------------------------------------------- entry points

_state: _Container | None = None


def _container() -> _Container:
    global _state
    if _state is None:
        state = _Container()
        if state.init_error is not None:
            return state  # not kept: the next invocation tries to start again
        _state = state
    return _state


def handler(event: Any, context: Any) -> dict[str, Any]:
    """Lambda entry point for direct invokes: an ``Invocation`` in, a ``Result`` out."""
    return _container().direct_handler(event, context)


def sqs_handler(event: Any, context: Any) -> dict[str, Any]:
    """Lambda entry point for an SQS event source: ``{"batchItemFailures": [...]}``."""
    return _container().sqs_handler(event, context)


def reset() -> None:
    """Forget this container: the next invocation starts (and counts as a cold start) again.
    For tests; Lambda never needs it."""
    global _state
    if _state is not None:
        _state.close()
    _state = None
    for name in ("aws_lambda_powertools.metrics.provider.cold_start", "aws_lambda_powertools.logging.logger"):
        module = sys.modules.get(name)
        if module is not None:
            module.is_cold_start = True  # type: ignore[attr-defined]


if os.environ.get("AWS_LAMBDA_INITIALIZATION_TYPE"):
    # in Lambda: start in the init phase, which provisioned concurrency runs ahead of traffic
    with contextlib.suppress(Exception):
        _container()
