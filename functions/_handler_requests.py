"""How the Lambda handler takes one request: the event parsed and validated into an
``Invocation`` (its payload fetched from S3 when the caller spilled it there), then the
function run, under the invocation's idempotency key when it has one."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any

from fabric.errors import ErrorCode, PayloadError, UnknownFunctionError
from fabric.protocol import Invocation, Result, Timings, decode_payload, encode_payload
from fabric.runner import FunctionRunner, outcome_to_result
from fabric.spill import BUCKET_ENV as SPILL_BUCKET_ENV
from fabric.spill import SPILL_KEY, SpillError, fetch, is_pointer
from functions._handler_idempotency import _Idempotency

#: Time kept back from an async function's timeout so the reply (and the idempotency
#: record) is written before Lambda's own timeout kills the invocation.
LAMBDA_MARGIN_S = 0.5
#: The S3 client's for spilled payloads: a read's timeout is per socket read (a large object
#: streams in reads well under it), not the transfer's. botocore's defaults (60 s, 3 attempts)
#: outlasted the invocation; each read is bounded by its time left too (``_fetch``).
_S3_OPTIONS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 20,
    "retries": {"mode": "standard", "total_max_attempts": 3},
}


def _lambda_remaining_s(context: Any) -> float | None:
    get = getattr(context, "get_remaining_time_in_millis", None)
    return get() / 1000 if callable(get) else None


class _Requests(_Idempotency):
    """Parsing an event and running the function it names."""

    def parse(self, event: Any, *, fallback_request_id: str = "", context: Any = None) -> Invocation | Result:
        """The ``Invocation`` in ``event`` (a dict, or a JSON string as in an SQS body), or
        the failed ``Result`` saying why it is not one. ``context`` (Lambda's) bounds the
        read of a spilled payload by the time the invocation has left."""
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
            return self._unspill(inv, context)
        try:
            inv.raw = encode_payload(inv.payload, what=f"payload of {inv.function}")
        except PayloadError as e:
            return Result.failure(e.code, str(e), function=inv.function, request_id=inv.request_id)
        return inv

    def _unspill(self, inv: Invocation, context: Any = None) -> Invocation | Result:
        if self._s3 is None:
            import boto3
            from botocore.config import Config

            self._s3 = boto3.client("s3", config=Config(**_S3_OPTIONS))
        try:
            raw = self._fetch(inv, _lambda_remaining_s(context))
            payload = decode_payload(raw)
        except SpillError as e:
            # before the function: a retry (which spills the payload anew) is safe for any
            code = ErrorCode.NOT_STARTED if e.retryable else ErrorCode.INVALID_ARGUMENTS
            if e.resend:  # an SQS record delivered again reads the same expired pointer
                self._resend.add(inv.request_id)
            return self._failure(inv, code, str(e))
        except ValueError as e:
            return self._failure(inv, ErrorCode.INVALID_ARGUMENTS, f"the spilled payload is not JSON: {e}")
        if not isinstance(payload, dict):
            return self._failure(inv, ErrorCode.INVALID_ARGUMENTS, "the spilled payload is not a JSON object")
        inv.payload = payload
        inv.raw = raw  # the bytes as uploaded: no second encoding, and no 6 MB limit here
        return inv

    def _fetch(self, inv: Invocation, left_s: float | None) -> bytes:
        """The spilled payload's bytes, read by the time the invocation has left (``left_s``,
        less the margin for the reply; ``None``: outside Lambda, unbounded): past it Lambda
        kills the invocation, and its Sandbox.Timedout reads as the function's timeout, one
        that may have run. Read on a thread, which a read that does not end in time is left
        to (the client's own timeouts end it)."""
        only = os.environ.get(SPILL_BUCKET_ENV) or None
        if left_s is None:
            return fetch(self._s3, inv.payload, only_bucket=only)
        if self._fetcher is None:
            self._fetcher = ThreadPoolExecutor(4, thread_name_prefix="fabric-spill")
        budget = max(left_s - LAMBDA_MARGIN_S, 0.0)
        read = self._fetcher.submit(fetch, self._s3, inv.payload, only_bucket=only)
        try:
            return read.result(timeout=budget)
        except FutureTimeoutError:
            p = inv.payload[SPILL_KEY]
            raise SpillError(
                f"cannot read the spilled payload s3://{p.get('bucket')}/{p.get('key')} in the "
                f"{budget:.1f} s the invocation had left (S3 slow or unreachable); the function did not run",
                retryable=True,
            ) from None

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
                    inv, ErrorCode.DEADLINE_EXCEEDED, "deadline passed before the call started", started=False
                )
            timeout = min(timeout, remaining)
        lambda_left = _lambda_remaining_s(context)
        if lambda_left is not None:
            timeout = max(min(timeout, lambda_left - LAMBDA_MARGIN_S), 0.001)
        self._began = True  # from here on the function may have run (``_Replies.direct``)
        t0 = time.perf_counter()
        if runner.is_async:  # only async functions can be timed out; Lambda's timeout bounds the rest
            if self._loop is None:
                # one loop for the container's life, as a local worker has: clients a setup
                # hook made (an httpx.AsyncClient) stay bound to the loop they first ran on
                self._loop = asyncio.new_event_loop()
            ok, out = self._loop.run_until_complete(runner.run_async(inv.raw_payload, timeout))
        else:  # it reads what it has left (time_left_s), and should stop in time on its own
            ok, out = runner.run(inv.raw_payload, time.monotonic() + timeout)
        exec_ms = (time.perf_counter() - t0) * 1e3
        # the version of the code deployed here: the client checks it against its own
        return outcome_to_result(
            inv, ok, out, exec_ms=exec_ms, worker=self.worker, queue_ms=queue_ms, version=runner.spec.version
        )
