"""What runs inside a Modal container: a fabric ``Invocation`` in, a ``Result`` out.

One ``FunctionRunner`` per function per container, built on first use (the setup hook runs
once, as in a local warm worker), and one event loop per container for the async ones, as the
Lambda handler keeps: a client a setup hook (or a first call) made, an ``httpx.AsyncClient``,
stays bound to the loop it first ran on, and ``asyncio.run`` per call would close that loop
under it. An async call is cut before Modal's own timeout, which counts a cold start's import
and setup hook (``MODAL_MARGIN_S``, as the Lambda handler keeps back from Lambda's). A failure
is data, as with the Lambda handler: the Modal function itself raises only if this module is
broken.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry
from fabric.runner import FunctionRunner, outcome_to_result

#: Time kept back from Modal's timeout for an async call, so that its own FunctionTimeout
#: reaches the client before Modal kills the container (as the Lambda handler keeps back).
MODAL_MARGIN_S = 0.5

_runners: dict[str, FunctionRunner] = {}
_cold = True
_loop: asyncio.AbstractEventLoop | None = None
"""The container's event loop, made on the first async call. The functions are deployed
without ``@modal.concurrent``: a container runs one input at a time, so one loop is never
entered twice at once."""


def run(name: str, module: str, envelope: dict[str, Any]) -> dict[str, Any]:
    global _cold, _loop
    began = time.monotonic()  # Modal's timeout counts from here: the import and setup hook too
    cold, _cold = _cold, False
    try:
        inv = Invocation.model_validate(envelope)
    except ValueError as e:
        return _dump(
            Result.failure(ErrorCode.INVALID_ARGUMENTS, f"not a fabric Invocation: {e}", function=name)
        )
    if inv.function != name:
        return _dump(
            Result.failure(
                ErrorCode.UNKNOWN_FUNCTION,
                f"this Modal function serves {name!r}, not {inv.function!r}",
                function=inv.function,
                request_id=inv.request_id,
            )
        )
    runner = _runners.get(name)
    if runner is None:
        try:
            registry = Registry()
            registry.discover(module)
            runner = FunctionRunner(registry.callable(name), registry.get(name))
            runner.setup()
        except Exception as e:  # an import or setup failure: every call says why
            return _dump(
                Result.failure(
                    ErrorCode.SETUP_FAILED,
                    f"{type(e).__name__}: {e}",
                    function=name,
                    request_id=inv.request_id,
                )
            )
        _runners[name] = runner
    # the deadline, as the Lambda handler and the local workers honour it: a call that arrives
    # after it (queued behind a cold start) is not run, and an async one is cut at it
    timeout = runner.spec.timeout_s
    remaining = inv.remaining_s()
    if remaining is not None:
        if remaining <= 0:
            late = Result.failure(
                ErrorCode.DEADLINE_EXCEEDED,
                "deadline passed before the call started",
                function=name,
                request_id=inv.request_id,
                worker=f"modal:{name}",
                started=False,
            )
            late.cold_start = cold
            return _dump(late)
        timeout = min(timeout, remaining)
    t0 = time.perf_counter()
    if runner.is_async:
        # what Modal's timeout (deployed as ceil(timeout_s)) leaves after a cold start's import
        # and setup hook: cut there, the call ends as its own FunctionTimeout and the container
        # stays warm; past it Modal kills the container and the set-up runner with it
        modal_left = max(1, math.ceil(runner.spec.timeout_s)) - (time.monotonic() - began) - MODAL_MARGIN_S
        timeout = max(min(timeout, modal_left), 0.001)
        if _loop is None:
            _loop = asyncio.new_event_loop()
        ok, out = _loop.run_until_complete(runner.run_async(inv.raw_payload, timeout))
    else:  # it reads what it has left (time_left_s)
        ok, out = runner.run(inv.raw_payload, time.monotonic() + timeout)
    exec_ms = (time.perf_counter() - t0) * 1e3
    # the version of the code this container was built with: the client checks it against its own
    result = outcome_to_result(
        inv, ok, out, exec_ms=exec_ms, worker=f"modal:{name}", version=runner.spec.version
    )
    result.cold_start = cold
    return _dump(result)


def _dump(result: Result) -> dict[str, Any]:
    return result.model_dump(mode="json")


def reset() -> None:
    """Forget this container (its runners and its loop): the next call starts, cold, again.
    For tests; Modal never needs it."""
    global _cold, _loop
    _runners.clear()
    _cold = True
    if _loop is not None:
        _loop.close()
        _loop = None
