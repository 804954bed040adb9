"""``Client``: the one resilient async entry point to every backend.

    async with fabric.Client(backend="local") as c:
        r = await c.call("exact_match", {"traj": t, "ground_truth": "42"})

What it adds on top of a backend, per function:

* refuses bad calls before sending (unknown name, bad arguments, not JSON, over 6 MB);
* a concurrency limit (the function's ``max_concurrency``) and a deadline that travels
  with the call to the worker;
* retries of retryable failures only, with exponential backoff and full jitter (tenacity),
  bounded by attempts and by the deadline;
* hedged requests: a duplicate after the function's observed p95 latency, capped to a
  share of calls; the first answer wins and the loser is cancelled;
* idempotency: one execution per key, shared by every caller with the key (each waits
  within its own deadline; the execution's is the latest of theirs), then its cached result;
* a circuit breaker that opens after consecutive infrastructure failures;
* metrics (``client.metrics()``).

A failed call is a ``Result(ok=False)``, never an exception; ``Result.unwrap()`` raises.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from typing import Any

from pydantic import BaseModel
from tenacity import (
    AsyncRetrying,
    retry_if_result,
    stop_after_attempt,
    wait_random_exponential,
)

from fabric.backends.base import Backend, make_backend
from fabric.client_config import BreakerConfig, ClientConfig, HedgeConfig
from fabric.client_state import Execution, FnState, StopAtDeadline
from fabric.errors import (
    FINAL_ERRORS,
    RETRYABLE,
    SAFE_TO_RETRY,
    ErrorCode,
    FabricError,
    PayloadError,
)
from fabric.metrics import FunctionMetrics
from fabric.protocol import Invocation, Result, encode_payload
from fabric.registry import Registry, default_registry
from fabric.spec import FunctionSpec

# the settings live in their own module; they stay importable from here
__all__ = ["BreakerConfig", "Client", "ClientConfig", "HedgeConfig"]

#: Failures after which a call may have run, in part or whole (the worker died in it, it ran
#: past its timeout, the transport lost the answer, the function reported a dependency down):
#: for a function with side effects, the effect may have happened.
_MAY_HAVE_RUN: frozenset[str] = RETRYABLE - SAFE_TO_RETRY


_BURST = 5  # hedges allowed beyond the share, so a short run can still hedge


class Client:
    def __init__(
        self,
        backend: str | dict[str, Any] | BaseModel | Backend = "local",
        *,
        registry: Registry | None = None,
        config: ClientConfig | dict[str, Any] | None = None,
    ):
        importing = os.environ.get("_FABRIC_WORKER_IMPORTING")
        if importing:
            raise FabricError(
                f"a fabric worker imported {importing.rpartition(':')[0]} to find its function, and the "
                "import started a fabric.Client. Put the script's entry point under "
                '`if __name__ == "__main__":` so importing the file only defines functions.'
            )
        self.registry = registry if registry is not None else default_registry
        self._owns_backend = not isinstance(backend, Backend)
        self.backend = make_backend(backend, self.registry)
        self.config = (
            config if isinstance(config, ClientConfig) else ClientConfig.model_validate(config or {})
        )
        self._fns: dict[str, FnState] = {}
        self._cache: dict[str, Result] = {}
        self._inflight: dict[str, Execution] = {}
        self._executions: set[asyncio.Task[Result]] = set()
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4).hex()

    async def __aenter__(self) -> Client:
        await self.backend.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        # keyed executions outlive their callers (see Execution); they end with the client
        tasks = list(self._executions)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # a task cancelled before it ever ran skipped its own clean-up (its finally)
        self._inflight.clear()
        for fn in self._fns.values():
            fn.probing = False
        if self._owns_backend:
            await self.backend.aclose()

    # ------------------------------------------------------------------ public calls
    async def call(
        self,
        name: str,
        payload: dict[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        deadline_s: float | None = None,
        hedge: bool | None = None,
        tenant: str | None = None,
    ) -> Result:
        """Run ``name`` with ``payload`` (its keyword arguments); never raises for a failed call."""
        t0 = time.perf_counter()
        request_id = f"{self._prefix}-{next(self._ids)}"
        payload = {} if payload is None else payload
        fn = self._fns.get(name)
        if fn is None:
            if name not in self.registry:
                from fabric.errors import UnknownFunctionError

                return Result.failure(
                    ErrorCode.UNKNOWN_FUNCTION,
                    str(UnknownFunctionError(name, self.registry.names())),
                    function=name,
                    request_id=request_id,
                )
            fn = self._fns[name] = FnState(self.registry.get(name), self.config.hedge.quantile)
        spec = fn.spec
        m = fn.metrics
        m.calls += 1
        # refuse bad input before anything is sent
        if not isinstance(payload, dict):
            return self._refuse(
                m,
                ErrorCode.INVALID_ARGUMENTS,
                f"{name}: payload must be a dict of keyword arguments, got {type(payload).__name__}",
                name,
                request_id,
            )
        problem = spec.check_args(payload)
        if problem is not None:
            return self._refuse(m, ErrorCode.INVALID_ARGUMENTS, problem, name, request_id)
        try:
            raw = encode_payload(payload, limit=self.backend.max_payload_bytes, what=f"payload of {name}")
        except PayloadError as e:
            return self._refuse(m, e.code, str(e), name, request_id)
        deadline_s = deadline_s if deadline_s is not None else self.config.default_deadline_s
        deadline = time.time() + deadline_s if deadline_s is not None else None
        if idempotency_key is not None:
            return await self._call_keyed(
                fn, idempotency_key, payload, raw, request_id, deadline, hedge, tenant, t0
            )
        refusal, probe = self._breaker_admits(fn)
        if refusal is not None:
            return self._refuse(m, ErrorCode.CIRCUIT_OPEN, refusal, name, request_id)
        inv = Invocation.fast(
            function=name,
            payload=payload,
            request_id=request_id,
            idempotency_key=f"{name}:{spec.version}:{request_id}",
            deadline=deadline,
            tenant=tenant or self.config.tenant,
            attempt=1,
            hedge=False,
            wait_for_run=False,
            raw=raw,
        )
        try:
            async with fn.sem:
                result = await self._attempt(fn, inv, hedge)
                if not result.ok and self._should_retry(spec, result):
                    result = await self._retry(fn, inv, result, hedge, lambda: deadline)
        finally:
            if probe:
                fn.probing = False
        self._settle(fn, result, t0)
        return result

    async def warmup(self, names: list[str] | None = None) -> None:
        """Start the warm instances of ``names`` (default: every registered function) and wait
        until they are ready, so the first calls do not pay a cold start."""
        await self.backend.warmup(names)

    async def map(self, name: str, payloads: Iterable[dict[str, Any]], **kw: Any) -> list[Result]:
        """Run ``name`` over ``payloads``; results in input order."""
        results = await asyncio.gather(*(self.call(name, p, **kw) for p in payloads))
        for i, r in enumerate(results):
            r.index = i
        return list(results)

    async def stream(
        self,
        name: str,
        payloads: Iterable[dict[str, Any]] | AsyncIterable[dict[str, Any]],
        *,
        max_inflight: int | None = None,
        **kw: Any,
    ) -> AsyncIterator[Result]:
        """Yield results as they complete (``Result.index`` is the payload's position).
        ``payloads`` may be an async iterable that is still being produced."""
        limit = max_inflight or max(1, 2 * self._spec_or_default(name).max_concurrency)
        # a slot is held from launch until the consumer takes the result: at most ``limit``
        # calls are running or waiting to be consumed, and a lazy input is read only as fast
        slots = asyncio.Semaphore(limit)
        done: asyncio.Queue[Result | BaseException | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int, p: dict[str, Any]) -> None:
            r = await self.call(name, p, **kw)
            r.index = i
            done.put_nowait(r)

        def launch(i: int, p: dict[str, Any]) -> None:
            t = asyncio.create_task(one(i, p))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        async def produce() -> None:
            try:
                i = 0
                if isinstance(payloads, AsyncIterable):
                    async for p in payloads:
                        await slots.acquire()
                        launch(i, p)
                        i += 1
                else:
                    for p in payloads:
                        await slots.acquire()
                        launch(i, p)
                        i += 1
                while tasks:
                    await asyncio.gather(*list(tasks))
            except BaseException as e:  # a failing input iterator reaches the consumer
                done.put_nowait(e)
                raise
            finally:
                done.put_nowait(None)

        producer = asyncio.create_task(produce())
        try:
            while (item := await done.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
                slots.release()
        finally:
            producer.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(producer, *tasks, return_exceptions=True)

    def metrics(self) -> dict[str, Any]:
        return {name: fn.metrics.snapshot() for name, fn in self._fns.items()}

    # ------------------------------------------------------------------ internals
    async def _call_keyed(
        self,
        fn: FnState,
        user_key: str,
        payload: dict[str, Any],
        raw: bytes,
        request_id: str,
        deadline: float | None,
        hedge: bool | None,
        tenant: str | None,
        t0: float,
    ) -> Result:
        """A call under an idempotency key: the key's cached answer, else its execution
        (joined when one is in flight, else started), waited for until this caller's own
        deadline."""
        spec = fn.spec
        m = fn.metrics
        key = f"{spec.name}:{spec.version}:{user_key}"
        hit = self._cache.get(key)
        if hit is not None:
            m.cache_hits += 1
            return hit.model_copy(update={"cached": True, "request_id": request_id})
        ex = self._inflight.get(key)
        joined = ex is not None
        if ex is None:
            refusal, probe = self._breaker_admits(fn)
            if refusal is not None:
                return self._refuse(m, ErrorCode.CIRCUIT_OPEN, refusal, spec.name, request_id)
            inv = Invocation.fast(
                function=spec.name,
                payload=payload,
                request_id=request_id,
                idempotency_key=key,
                # each call sent carries the execution's deadline as it is then, the latest of
                # its callers' (Execution.deadline): an async handler is cancelled there, in the
                # worker, when no caller can use its answer any more. wait_for_run: the backend
                # answers with the run's own outcome, never early while it runs (a synchronous
                # handler runs on past a deadline), so the key stays busy while it may run, and
                # a cut run is a FunctionTimeout: for a side effect, OutcomeUnknown. The
                # remote backends send neither (Invocation.wait_for_run)
                deadline=deadline,
                tenant=tenant or self.config.tenant,
                attempt=1,
                hedge=False,
                wait_for_run=True,
                raw=raw,
            )
            ex = self._inflight[key] = Execution(deadline)
            ex.task = asyncio.create_task(self._execute(fn, inv, user_key, ex, hedge, probe, t0))
            self._executions.add(ex.task)
            ex.task.add_done_callback(self._executions.discard)
        elif ex.join(deadline):
            # a later deadline than the execution had: what was sent moves with it where the
            # backend sent one (the local pool, inproc); the execution's retries go on until this one
            self.backend.extend_deadline(spec.name, key, ex.deadline)
        task = ex.task
        assert task is not None
        # asyncio.wait never cancels the task: a caller that gives up leaves it to the others
        await asyncio.wait((task,), timeout=None if deadline is None else max(deadline - time.time(), 0.0))
        if not task.done():
            # not the execution's outcome (that one is counted when it ends): a give-up
            m.gave_up += 1
            return Result.failure(
                ErrorCode.DEADLINE_EXCEEDED,
                f"{spec.name}: deadline passed while the call under idempotency key {user_key!r} was in "
                "progress; it goes on for the callers still waiting (a synchronous handler to its end), "
                "and a later call with this key gets the answer it leaves",
                function=spec.name,
                request_id=request_id,
            )
        if task.cancelled():  # closed before it had an outcome to count: each caller's own
            result = Result.failure(
                ErrorCode.CANCELLED,
                f"{spec.name}: the client closed before the call under idempotency key {user_key!r} ended",
                function=spec.name,
                request_id=request_id,
            )
        else:
            result = task.result()
            if ex.unsent:  # nothing was sent, every caller's deadline had passed: this one's too
                m.gave_up += 1
                return result if not joined else result.model_copy(update={"request_id": request_id})
            if not joined:
                return result  # the execution counted its outcome as it ended (_execute)
            # no new execution for this caller: its own copy of what the key keeps (the answer,
            # or OutcomeUnknown for a side effect that may have run: what any later caller with
            # the key gets, not the raw failure), "cached"; a failure the key does not keep
            # (the key is free again) is this caller's failure, counted as such
            kept = ex.kept
            timings = result.timings.model_copy(update={"total_ms": (time.perf_counter() - t0) * 1e3})
            result = (kept or result).model_copy(
                update={
                    "cached": kept is not None,
                    "cold_start": False,
                    "request_id": request_id,
                    "timings": timings,
                }
            )
            if kept is not None:
                m.cache_hits += 1
                return result
        self._settle(fn, result, t0)
        return result

    async def _execute(
        self,
        fn: FnState,
        inv: Invocation,
        user_key: str,
        ex: Execution,
        hedge: bool | None,
        probe: bool,
        t0: float,
    ) -> Result:
        """The execution under a key: attempts and retries, then what a later caller with
        the key gets (``_conclude``), and the key is free again. Its outcome goes into the
        metrics here, once, timed from its starter's call (``t0``): the starter may have
        given up long before."""
        key = inv.idempotency_key
        assert key is not None
        try:
            async with fn.sem:
                if ex.deadline is not None and ex.deadline <= time.time():
                    # every caller gave up while it waited for a slot: nothing was sent, and
                    # there is no outcome to count (each caller counts in gave_up, the ones
                    # whose wait ended before this too)
                    ex.unsent = True
                    result = Result.failure(
                        ErrorCode.DEADLINE_EXCEEDED,
                        "deadline passed before the call was sent",
                        function=inv.function,
                        request_id=inv.request_id,
                    )
                else:
                    result = await self._attempt(fn, inv, hedge, lambda: ex.deadline)
                    if not result.ok and self._should_retry(fn.spec, result):
                        result = await self._retry(fn, inv, result, hedge, lambda: ex.deadline)
            ex.kept = self._conclude(fn, key, user_key, result)
            if not ex.unsent:
                self._settle(fn, result, t0)
            return result
        finally:
            if probe:
                fn.probing = False
            if self._inflight.get(key) is ex:
                del self._inflight[key]

    def _conclude(self, fn: FnState, key: str, user_key: str, result: Result) -> Result | None:
        """Remember what a later caller with the key gets instead of a new execution: the
        function's own answer; or, for a function with side effects whose call may have run
        (WorkerLost, FunctionTimeout, ...), a final ``OutcomeUnknown``, since running it
        again could apply the effect twice. After other failures (the call did not run, or
        a pure function) the next caller with the key runs it again. Returns what the key
        keeps (None: nothing, the key is free), which the callers that joined get too."""
        err = result.error
        if err is None or err.type in FINAL_ERRORS:
            return self._remember(key, result)
        if fn.spec.side_effects and err.type in _MAY_HAVE_RUN:
            name = fn.spec.name
            return self._remember(
                key,
                Result.failure(
                    ErrorCode.OUTCOME_UNKNOWN,
                    f"{name}: the call under idempotency key {user_key!r} ended with {err.type} "
                    f"({err.message}) and may have run; {name} has side effects, so it is not run "
                    "again under this key. Check whether its effect happened; to run it again, call "
                    "with a new idempotency key",
                    function=name,
                    request_id=result.request_id,
                ),
            )
        return None

    def _spec_or_default(self, name: str) -> FunctionSpec:
        if name in self.registry:
            return self.registry.get(name)
        return FunctionSpec(name="unknown", entry="unknown:unknown", version="0")

    @staticmethod
    def _should_retry(spec: FunctionSpec, r: Result) -> bool:
        if not r.retryable:
            return False
        # a function with side effects is retried only when the call provably did not run
        return not spec.side_effects or (r.error is not None and r.error.type in SAFE_TO_RETRY)

    def _breaker_admits(self, fn: FnState) -> tuple[str | None, bool]:
        """``(None, is_probe)`` when the call may go, else ``(why not, False)``. After the
        cooldown one probe goes through; its outcome closes the circuit or opens it again.
        The probe's caller ends the probe (``fn.probing = False``) however its call ends,
        even cancelled while it waits for a concurrency slot: else the circuit would stay
        half-open, refusing every call, for good."""
        if fn.consecutive_failures < self.config.breaker.failure_threshold:
            return None, False
        now = time.monotonic()
        if now >= fn.breaker_open_until and not fn.probing:
            fn.probing = True
            return None, True
        wait = max(fn.breaker_open_until - now, 0.0)
        return (
            f"{fn.spec.name}: circuit open after {fn.consecutive_failures} infrastructure failures in a row; "
            f"retry in {wait:.1f} s"
            if wait
            else f"{fn.spec.name}: circuit half-open, a probe call is in flight"
        ), False

    @staticmethod
    def _refuse(m: FunctionMetrics, code: ErrorCode, message: str, name: str, request_id: str) -> Result:
        m.errors[str(code)] += 1
        return Result.failure(code, message, function=name, request_id=request_id)

    def _remember(self, key: str, result: Result) -> Result | None:
        """Keep ``result`` under ``key``; returns it, or None when no cache is kept."""
        cache = self._cache
        if self.config.idempotency_cache_size == 0:
            return None
        if len(cache) >= self.config.idempotency_cache_size:
            del cache[next(iter(cache))]  # dicts keep insertion order: drop the oldest
        cache[key] = result
        return result

    async def _attempt(
        self,
        fn: FnState,
        inv: Invocation,
        hedge: bool | None,
        deadline: Callable[[], float | None] | None = None,
    ) -> Result:
        """One attempt, hedged after the observed p95 when allowed. With ``deadline`` (a
        keyed execution's, which grows as callers join), each copy sent carries its value
        at the time it is sent."""
        if deadline is not None and (d := deadline()) != inv.deadline:
            inv = inv.model_copy(update={"deadline": d})
        backend = self.backend
        t0 = time.perf_counter()
        primary = backend.submit(inv)
        hcfg = self.config.hedge
        delay_ms = None
        if (hedge if hedge is not None else hcfg.enabled) and fn.spec.hedgeable:
            delay_ms = fn.metrics.window.quantile(hcfg.min_samples)
        if delay_ms is None:
            try:
                result = await primary
            except asyncio.CancelledError:
                primary.cancel()
                raise
        else:
            result = await self._hedged(fn, inv, primary, max(delay_ms, hcfg.min_delay_ms) / 1e3, deadline)
        if result.ok:  # the hedge delay follows the latency of answers, not of fast failures
            fn.metrics.window.add((time.perf_counter() - t0) * 1e3)
        if result.ok or not result.retryable:
            fn.consecutive_failures = 0  # the function answered: the infrastructure works
        else:
            fn.consecutive_failures += 1
            if fn.consecutive_failures >= self.config.breaker.failure_threshold:
                fn.breaker_open_until = time.monotonic() + self.config.breaker.cooldown_s
        return result

    async def _hedged(
        self,
        fn: FnState,
        inv: Invocation,
        primary: asyncio.Future[Result],
        delay_s: float,
        deadline: Callable[[], float | None] | None,
    ) -> Result:
        loop = asyncio.get_running_loop()
        winner: asyncio.Future[Result] = loop.create_future()
        futs = [primary]
        m = fn.metrics

        def done(f: asyncio.Future[Result]) -> None:
            if winner.done() or f.cancelled():
                return
            r = f.result()
            # a retryable failure of one copy waits for the other copy, if there is one; so
            # does a keyed execution's copy answered DeadlineExceeded: it did not start (its
            # backend does not answer such a call early once it runs), and the other may run
            waits = r.retryable or (
                inv.wait_for_run and r.error is not None and r.error.type == ErrorCode.DEADLINE_EXCEEDED
            )
            if not r.ok and waits and any(not g.done() for g in futs):
                return
            if f is not primary:
                m.hedge_wins += 1
            winner.set_result(r)

        def fire() -> None:
            if winner.done() or primary.done():
                return
            if m.hedges >= self.config.hedge.max_share * m.calls + _BURST:
                return
            m.hedges += 1
            update: dict[str, Any] = {"hedge": True, "request_id": inv.request_id + "-h"}
            if deadline is not None:
                update["deadline"] = deadline()
            h = self.backend.submit(inv.model_copy(update=update))
            futs.append(h)
            h.add_done_callback(done)

        primary.add_done_callback(done)
        fn.hedge_clock.at(loop.time() + delay_s, fire)
        try:
            result = await winner
        finally:
            for f in futs:
                if not f.done():
                    f.cancel()  # the loser: a queued copy never runs, a running one is ignored
        if len(futs) > 1:
            result.hedged = True
        return result

    async def _retry(
        self,
        fn: FnState,
        inv: Invocation,
        first: Result,
        hedge: bool | None,
        deadline: Callable[[], float | None],
    ) -> Result:
        """Retry a retryable failure: exponential backoff with full jitter, bounded by the
        function's attempts and by ``deadline()`` (read at each step: a keyed execution's
        grows as callers join). Runs only after a failure.

        Never sleeps past the deadline: when the next backoff would end after it, the retries
        stop and the answer is the last real failure (its type and message, with a note that
        the deadline left no time for another attempt), not a made-up deadline error."""
        policy = fn.spec.retry
        pending_first = [first]  # tenacity's first attempt is the one the fast path made
        sent = 1
        last = prev = first
        at_deadline = StopAtDeadline(deadline)

        async def attempt() -> Result:
            nonlocal sent, last, prev
            if pending_first:
                return pending_first.pop()
            d = deadline()
            if d is not None and time.time() >= d:
                at_deadline.hit = True  # the backoff overran the deadline a little: send nothing
                return last
            sent += 1
            fn.metrics.retries += 1
            again = inv.model_copy(update={"attempt": sent})
            prev, last = last, await self._attempt(fn, again, hedge, deadline)
            return last

        retrying = AsyncRetrying(
            stop=stop_after_attempt(policy.max_attempts) | at_deadline,
            wait=wait_random_exponential(multiplier=policy.initial_backoff_s, max=policy.max_backoff_s),
            retry=retry_if_result(lambda r: not r.ok and self._should_retry(fn.spec, r)),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else last,
            sleep=asyncio.sleep,
        )
        result: Result = await retrying(attempt)
        result.attempts = sent
        err = result.error
        note = None
        if err is not None and at_deadline.hit and sent < policy.max_attempts:
            note = (
                f" (not retried: the deadline left no time for attempt {sent + 1} of {policy.max_attempts})"
            )
        elif (
            err is not None
            and err.type == ErrorCode.DEADLINE_EXCEEDED
            and prev.error is not None
            and sent > 1
        ):
            # the deadline passed during the last attempt: keep the cause of the retries
            note = f"; attempt {sent - 1} had failed with {prev.error.type}: {prev.error.message}"
        if note is not None:
            assert err is not None
            result = result.model_copy(
                update={"error": err.model_copy(update={"message": err.message + note})}
            )
        return result

    def _settle(self, fn: FnState, result: Result, t0: float) -> None:
        m = fn.metrics
        ms = (time.perf_counter() - t0) * 1e3
        result.timings.total_ms = ms
        m.observe(ms)
        if result.cold_start:
            m.cold_starts += 1
        if result.ok:
            m.ok += 1
            fn.consecutive_failures = 0
        else:
            assert result.error is not None
            m.errors[result.error.type] += 1
