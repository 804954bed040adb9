"""Fakes and conformance checks, shipped for users' own test suites.

* ``FakeBackend``: runs functions in-process like ``inproc`` but lets a test script
  infrastructure failures and delays, and records every execution, so tests exercise the
  client's retries, hedging and idempotency without patching internals. What a function
  does wrong gets the local backends' codes: a setup hook that raises ``SetupFailed``, a
  call whose deadline passed before it started ``DeadlineExceeded`` (not run), a
  synchronous call past ``timeout_s`` ``FunctionTimeout`` (once it has run to its end: a
  synchronous function runs on the event loop here, so calls run one at a time, in order).
* ``check_function``: the conformance check every registered function should pass
  (like gymnasium's ``check_env``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fabric.backends.base import Backend
from fabric.errors import ErrorCode, FabricError, PayloadError
from fabric.protocol import Invocation, Result, encode_payload
from fabric.registry import SPEC_ATTR, Registry, default_registry, load_entry_point, source_version
from fabric.runner import FunctionRunner, Outcome, _decode, not_set_up, outcome_to_result
from fabric.spec import FunctionSpec

#: An async function's call that holds its event loop this long in one stretch is reported:
#: a blocking call (``time.sleep``, ``requests``) in ``async def`` stalls every call its
#: worker runs, and its ``timeout_s`` cannot cut it (the timer needs the loop).
BLOCKING_LIMIT_S = 1.0
#: How often the watch on an async call's loop ticks.
_BEAT_S = 0.01


@dataclass
class Fault:
    """What the fake does to one invocation instead of (or before) running it."""

    code: ErrorCode | None = None
    """Fail with this error code (without running the function)."""
    delay_s: float = 0.0
    """Wait this long first (a straggler)."""
    message: str = "injected fault"
    started: bool | None = None
    """What the failure says of whether the function began (``Result.started``); left out,
    what its code says (``None`` for a ``DeadlineExceeded``, read then by its message)."""


class FakeBackend(Backend):
    """In-process backend with scripted faults and an execution log."""

    kind = "fake"

    def __init__(self, registry: Registry | None = None):
        super().__init__(registry)
        self._runners: dict[str, FunctionRunner] = {}
        self._faults: dict[str, deque[Fault]] = defaultdict(deque)
        self.invocations: list[Invocation] = []
        """Every invocation received, in order (hedges and retries included)."""
        self.executions: Counter[str] = Counter()
        """Function executions per idempotency key (a fault that fails a call does not execute it)."""

    def inject(self, function: str, *faults: Fault) -> None:
        """Queue faults for the next invocations of ``function``, one per invocation."""
        self._faults[function].extend(faults)

    def fail_next(self, function: str, code: ErrorCode = ErrorCode.WORKER_LOST, times: int = 1) -> None:
        self.inject(function, *(Fault(code=code) for _ in range(times)))

    async def _invoke(self, inv: Invocation) -> Result:
        self.invocations.append(inv)
        fault = self._faults[inv.function].popleft() if self._faults[inv.function] else None
        if fault is not None and fault.delay_s:
            await asyncio.sleep(fault.delay_s)
        if fault is not None and fault.code is not None:
            return Result.failure(
                fault.code,
                fault.message,
                function=inv.function,
                request_id=inv.request_id,
                worker="fake",
                started=fault.started,
            )
        try:
            runner = self._runners.get(inv.function)
            spec = self.registry.get(inv.function)
            # by identity, as inproc tells a registration: a function registered again (a
            # module reloaded) runs its new code, set up anew
            if runner is None or runner.spec is not spec:
                runner = FunctionRunner(self.registry.callable(inv.function), spec)
                runner.setup()
                self._runners[inv.function] = runner
        except Exception as e:  # an unknown name, or the setup hook raised: final
            return not_set_up(inv, e)
        if inv.deadline is not None and inv.deadline <= time.time():
            # after a fault's delay (a straggler's wait can pass it), as the backends check it
            return Result.failure(
                ErrorCode.DEADLINE_EXCEEDED,
                "deadline passed before the call started",
                function=inv.function,
                request_id=inv.request_id,
                started=False,
            )
        self.executions[inv.idempotency_key or inv.request_id] += 1
        t0 = time.perf_counter()
        timeout = runner.spec.timeout_s
        ok, out = await runner.run_async(inv.raw_payload, timeout)
        if not runner.is_async and time.perf_counter() - t0 > timeout:
            # a synchronous call runs to its end here (on the loop, in order); a worker is
            # killed at timeout_s, and so its caller gets what it would have
            ok, out = False, (ErrorCode.TIMEOUT, f"{inv.function} ran past its {timeout:.3g} s limit", None)
        return outcome_to_result(
            inv, ok, out, exec_ms=(time.perf_counter() - t0) * 1e3, worker="fake", version=runner.spec.version
        )


class ConformanceError(FabricError):
    def __init__(self, name: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"{name} fails conformance:\n  - " + "\n  - ".join(problems))


def check_function(spec: FunctionSpec | str, registry: Registry | None = None) -> None:
    """Raise ``ConformanceError`` listing every problem of a registered function.

    Checks: the spec survives a JSON round trip (it is what deploys read); the entry point
    imports in a fresh lookup and carries the same spec; the version matches the source;
    every example payload is valid, fits the payload limit, runs within ``timeout_s`` and
    returns JSON that reads back (a reward: a finite number or a ``RewardResult``); an async
    function's call does not hold its event loop ``BLOCKING_LIMIT_S`` at a stretch (on a
    second call too: a first may warm up); unknown arguments are refused."""
    reg = registry if registry is not None else default_registry
    if isinstance(spec, str):
        spec = reg.get(spec)
    problems: list[str] = []
    if FunctionSpec.model_validate_json(spec.model_dump_json()) != spec:
        problems.append("spec does not survive a JSON round trip")
    try:
        fn = load_entry_point(spec.entry)
    except FabricError as e:
        raise ConformanceError(spec.name, [f"entry point: {e}"]) from None
    loaded = getattr(fn, SPEC_ATTR, None)
    if not isinstance(loaded, FunctionSpec) or loaded.name != spec.name:
        problems.append(f"entry point {spec.entry} does not carry this spec")
    elif source_version(fn, getattr(fn, "__fabric_setup__", None)) != spec.version:
        problems.append("version does not match the function's source (stale spec?)")
    if not spec.examples:
        problems.append(
            "no example payloads: add examples=(...) to the decorator so the function can be checked"
        )
    runner = FunctionRunner(fn, spec)
    try:
        runner.setup()
    except Exception as e:
        raise ConformanceError(spec.name, [*problems, f"setup hook raised {type(e).__name__}: {e}"]) from None
    with _calls(runner) as call:
        for i, example in enumerate(spec.examples):
            problem = spec.check_args(example)
            if problem:
                problems.append(f"example {i}: {problem}")
                continue
            try:  # NaN, a set, over the payload limit: the client would refuse it
                raw = encode_payload(example, what=f"example {i}")
            except PayloadError as e:
                problems.append(str(e))
                continue
            t0 = time.monotonic()
            (ok, out), blocked_s = call(raw)
            elapsed = time.monotonic() - t0
            if blocked_s >= BLOCKING_LIMIT_S:
                # once more: a first call may block once (a lazy import of a heavy module,
                # a worker's cold start); one that blocks every time stalls its worker
                _, blocked_s = call(raw)
            if blocked_s >= BLOCKING_LIMIT_S:
                problems.append(
                    f"example {i}: blocked its event loop for {blocked_s:.2f} s at a stretch, call after "
                    "call (a blocking call in async def: time.sleep, requests, subprocess.run): every other "
                    "call on its worker waits, and its timeout_s cannot cut it; await an async form, run "
                    "it with asyncio.to_thread, or make the function synchronous (def)"
                )
            if not ok:
                problems.append(f"example {i} failed: {out[0]}: {out[1]}")
                continue
            if not runner.is_async and elapsed > spec.timeout_s:
                # the check lets it run to its end; a worker kills it at its limit
                problems.append(
                    f"example {i} ran past its timeout_s={spec.timeout_s:g} ({elapsed:.2f} s): deployed, "
                    "every such call fails FunctionTimeout; raise timeout_s or make it faster"
                )
            try:
                value = _decode(out)
            except ValueError as e:  # a worker answers ResultNotSerializable (outcome_to_result)
                problems.append(f"example {i}: returned a value that cannot be read back as JSON: {e}")
                continue
            if spec.kind == "reward":
                problems.extend(f"example {i}: {p}" for p in _reward_problems(value))
        if not spec.accepts_extra:
            bogus = dict(spec.examples[0]) if spec.examples else {}
            bogus["__not_an_argument__"] = 1
            with contextlib.suppress(PayloadError):  # a bad example 0: reported above
                (ok, out), _ = call(encode_payload(bogus))
                if ok or out[0] != ErrorCode.INVALID_ARGUMENTS:
                    problems.append("an unknown argument was not refused with InvalidArguments")
    if problems:
        raise ConformanceError(spec.name, problems)


@contextlib.contextmanager
def _calls(runner: FunctionRunner) -> Iterator[Callable[[bytes], tuple[Outcome, float]]]:
    """Calls of the function for ``check_function``: each call's outcome, and the longest
    stretch an async one held its loop. An async function runs on one private event loop on
    a thread of its own: the caller may be in a running loop (an async test), where
    ``asyncio.run`` refuses, and one loop serves every call, as in a worker."""
    if not runner.is_async:
        yield lambda raw: (runner.run(raw), 0.0)
        return
    loop = asyncio.new_event_loop()
    with ThreadPoolExecutor(1, thread_name_prefix="fabric-check") as thread:

        def call(raw: bytes) -> tuple[Outcome, float]:
            return thread.submit(loop.run_until_complete, _watched(runner, raw)).result()

        try:
            yield call
        finally:

            def close() -> None:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()

            thread.submit(close).result()


async def _watched(runner: FunctionRunner, raw: bytes) -> tuple[Outcome, float]:
    """An async call's outcome, and the longest its loop went without a turn while it ran."""
    loop = asyncio.get_running_loop()
    due = loop.time() + _BEAT_S
    worst = 0.0

    async def beat() -> None:
        nonlocal due, worst
        while True:
            due = loop.time() + _BEAT_S
            await asyncio.sleep(_BEAT_S)
            worst = max(worst, loop.time() - due)

    ticks = loop.create_task(beat())
    await asyncio.sleep(0)  # the watch starts before the call: a block at once is seen
    try:
        out = await runner.run_async(raw, runner.spec.timeout_s)
    finally:
        worst = max(worst, loop.time() - due)  # a block at the very end: the tick is late now
        ticks.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticks
    return out, worst


def _reward_problems(value: Any) -> list[str]:
    from fabric.protocol import RewardResult

    if isinstance(value, bool) or not isinstance(value, int | float | dict):
        return [f"a reward must return a number or a RewardResult, got {type(value).__name__}"]
    if isinstance(value, dict):
        try:
            value = RewardResult.model_validate(value).score
        except ValueError as e:
            return [f"returned a dict that is not a RewardResult: {e}"]
    if not math.isfinite(value):
        return [f"score {value} is not finite"]
    return []
