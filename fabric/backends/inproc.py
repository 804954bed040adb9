"""Run functions in the calling process: for tests and debugging, no isolation.

Synchronous functions run in a thread so a slow one does not stall the event loop and
``timeout_s`` can be reported; a thread cannot be killed, so a truly hung function keeps
its thread (use the local backend for isolation).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fabric.backends.base import Backend, InprocConfig
from fabric.errors import ErrorCode, UnknownFunctionError
from fabric.protocol import Invocation, Result
from fabric.registry import Registry
from fabric.runner import FunctionRunner, outcome_to_result


class InprocBackend(Backend):
    kind = "inproc"

    def __init__(self, registry: Registry | None = None, config: InprocConfig | None = None):
        super().__init__(registry)
        self.config = config or InprocConfig()
        self._runners: dict[str, FunctionRunner] = {}
        self._calls = 0

    def _runner(self, name: str) -> FunctionRunner:
        runner = self._runners.get(name)
        if runner is None:
            spec = self.registry.get(name)
            runner = FunctionRunner(self.registry.callable(name), spec)
            runner.setup()
            self._runners[name] = runner
        return runner

    async def _invoke(self, inv: Invocation) -> Result:
        try:
            runner = self._runner(inv.function)
        except UnknownFunctionError as e:
            return Result.failure(
                ErrorCode.UNKNOWN_FUNCTION, str(e), function=inv.function, request_id=inv.request_id
            )
        except Exception as e:
            return Result.failure(
                ErrorCode.SETUP_FAILED,
                f"{type(e).__name__}: {e}",
                function=inv.function,
                request_id=inv.request_id,
            )
        timeout = runner.spec.timeout_s
        remaining = inv.remaining_s()
        if remaining is not None:
            if remaining <= 0:
                return Result.failure(
                    ErrorCode.DEADLINE_EXCEEDED,
                    "deadline passed before the call started",
                    function=inv.function,
                    request_id=inv.request_id,
                )
            timeout = min(timeout, remaining)
        t0 = time.perf_counter()
        try:
            if runner.is_async:
                ok, out = await runner.run_async(inv.raw_payload, timeout)
            else:
                ok, out = await asyncio.wait_for(asyncio.to_thread(runner.run, inv.raw_payload), timeout)
        except TimeoutError:
            ok, out = False, (ErrorCode.TIMEOUT, f"{inv.function} ran past its {timeout:.3g} s limit", None)
        exec_ms = (time.perf_counter() - t0) * 1e3
        self._calls += 1
        return outcome_to_result(inv, ok, out, exec_ms=exec_ms, worker="inproc")

    def stats(self) -> dict[str, Any]:
        return {"calls": self._calls}
