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

The container is built in layers, each in a sibling module on the one before it: the state
it keeps (``_handler_base``), idempotency (``_handler_idempotency``), parsing and running a
request (``_handler_requests``), the entry points and their replies (``_handler_replies``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
import uuid
from typing import IO, TYPE_CHECKING, Any, cast

from fabric.errors import ErrorCode, UnknownFunctionError
from fabric.protocol import Result
from fabric.registry import Registry

# the names the layers define that callers (and tests) read from here
from functions._handler_base import (
    FUNCTIONS_ENV,
    MODULES_ENV,
    REPLY_QUEUE_ENV,
    REPLY_TO_ATTRIBUTE,
    SERVICE,
    TABLE_ENV,
    TTL_ENV,
)
from functions._handler_idempotency import MAX_CACHED_RESULT_BYTES
from functions._handler_replies import (
    MAX_LAMBDA_RESPONSE_BYTES,
    MAX_REPLY_BYTES,
    RESPONSE_MARGIN_BYTES,
    _Replies,
)
from functions._handler_requests import LAMBDA_MARGIN_S

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "FUNCTIONS_ENV",
    "LAMBDA_MARGIN_S",
    "MAX_CACHED_RESULT_BYTES",
    "MAX_LAMBDA_RESPONSE_BYTES",
    "MAX_REPLY_BYTES",
    "MODULES_ENV",
    "REPLY_QUEUE_ENV",
    "REPLY_TO_ATTRIBUTE",
    "RESPONSE_MARGIN_BYTES",
    "SERVICE",
    "TABLE_ENV",
    "TTL_ENV",
    "handler",
    "reset",
    "sqs_handler",
]


class _Stdout:
    """A stream that writes to whatever ``sys.stdout`` is at the time (in Lambda, always the
    same; under pytest's capture, the test's), so the Logger's handler never goes stale."""

    def write(self, s: str) -> int:
        return sys.stdout.write(s)

    def flush(self) -> None:
        sys.stdout.flush()


def _names(env: str, default: str = "") -> list[str]:
    return [n.strip() for n in os.environ.get(env, default).split(",") if n.strip()]


class _Container(_Replies):
    """Everything one Lambda execution environment keeps between invocations (the state is
    declared, with its types, in ``_handler_base._ContainerBase``)."""

    def __init__(self) -> None:
        t0 = time.perf_counter()
        from aws_lambda_powertools import Logger, Metrics
        from aws_lambda_powertools.utilities.batch import BatchProcessor, EventType

        self.logger = Logger(service=SERVICE, stream=cast(IO[str], _Stdout()))
        self.namespace = os.environ.get("POWERTOOLS_METRICS_NAMESPACE") or SERVICE
        self.metrics = Metrics(namespace=self.namespace, service=SERVICE)
        # an entirely failed batch is reported record by record, not raised as an error
        self.processor = BatchProcessor(event_type=EventType.SQS, raise_on_entire_batch_failure=False)
        self.worker = f"lambda:{os.environ.get('AWS_LAMBDA_FUNCTION_NAME', SERVICE)}/{uuid.uuid4().hex[:8]}"
        self.reply_queue_url = os.environ.get(REPLY_QUEUE_ENV) or None
        self._sqs = None
        self._s3 = None
        self._fetcher = None
        self._resend = set()
        self._runners = {}
        self._loop = None
        self._first_call = os.environ.get("AWS_LAMBDA_INITIALIZATION_TYPE") != "provisioned-concurrency"
        self.registry = Registry()
        self.served = frozenset()
        self.table = None
        self._idempotent = None
        self.init_error = None
        self._began = False
        self._current = None
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

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
        if self._sqs is not None:
            self._sqs.close()
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=False, cancel_futures=True)
        if self._s3 is not None:
            self._s3.close()


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
    try:
        container = _container()
    except Exception as e:
        return _cannot_start(event, e)
    return container.direct_handler(event, context)


def _cannot_start(event: Any, e: Exception) -> dict[str, Any]:
    """The reply of a direct invoke whose container could not build its own parts (the aws
    extra missing from the package, a powertools setting it refuses), before the modules it
    serves are discovered (a failure there is ``SetupFailed`` too). Raised, it became Lambda's
    error object, which the lambda backend reads as the function's final ``UserError``: kept
    under the idempotency key, scored as a reward's answer. Not kept: the next call starts
    again."""
    traceback.print_exc()  # the function's log (stderr): there is no Logger to write it
    hint: dict[str, Any] = event if isinstance(event, dict) else {}
    function, request_id = hint.get("function"), hint.get("request_id")
    if isinstance(e, ImportError):
        advice = (
            "the deployment package needs the aws extra: pip install 'rl-fabric[aws]' (or a layer with it)"
        )
    else:
        advice = "check the function's POWERTOOLS_* environment variables"
    result = Result.failure(
        ErrorCode.SETUP_FAILED,
        f"the Lambda handler cannot start: {type(e).__name__}: {e}; {advice}, then run `fabric deploy` again",
        function=function if isinstance(function, str) else "",
        request_id=request_id if isinstance(request_id, str) else "",
        worker=f"lambda:{os.environ.get('AWS_LAMBDA_FUNCTION_NAME', SERVICE)}",
        started=False,  # no function ran
    )
    result.cold_start = True  # each call starts a container anew
    return result.model_dump(mode="json")


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
