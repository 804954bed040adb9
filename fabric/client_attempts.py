"""The client's attempts at one call (``Attempts``, between ``Copies`` and ``KeyedCalls``):
the circuit breaker's admission, one attempt hedged after the function's observed p95
latency (its copies in ``fabric.client_copies``), the version check of its answer, the
retries of retryable failures (tenacity: exponential backoff with full jitter, bounded by
attempts and by the deadline), and the accounting of an outcome in the function's metrics.
Keyed executions (``fabric.client_keyed``) and plain calls (``fabric.client``) both go
through here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tenacity import (
    AsyncRetrying,
    retry_if_result,
    stop_after_attempt,
    wait_random_exponential,
)

from fabric.client_copies import Copies
from fabric.client_state import (
    FnState,
    Sent,
    StopAtDeadline,
    StopPastRetryAfter,
    StopWhen,
    StopWhenOpen,
    StopWhenSet,
    WaitRetryAfter,
)
from fabric.errors import FINAL_ERRORS, SAFE_TO_RETRY, ErrorCode
from fabric.metrics import FunctionMetrics
from fabric.protocol import ErrorInfo, Invocation, Result
from fabric.spec import FunctionSpec

log = logging.getLogger("fabric.client")

#: Failures that are the function's code answering: the infrastructure works (the circuit
#: closes). A VersionMismatch (version_check="refuse") is other code's answer, but an answer:
#: neither counted nor a reset, a circuit whose probe it answered stayed half-open for good
_ANSWERED: frozenset[str] = FINAL_ERRORS | {ErrorCode.VERSION_MISMATCH}


def _ran_past_its_limit(result: Result) -> bool:
    """Whether ``result`` is a ``FunctionTimeout``: the function ran past its ``timeout_s``
    and the backend stopped it. The breaker is for a backend or transport that fails every
    call; a function slow on some inputs (a verifier on a program that loops, which a
    reward job scores as the output's fault) fails only those, and an open circuit would
    fail every other input's calls for the cooldown. Not a reset either: a dependency that
    hangs the function on every input is not a backend that works. The retries stay (it is
    retryable, a slow start may pass). One that never began is the backend's back-pressure,
    counted as a ``Throttled`` is."""
    return result.error is not None and result.error.type == ErrorCode.TIMEOUT and result.started is not False


class Attempts(Copies):
    """The attempts part of a ``Client``; its state is the client's (set in its ``__init__``)."""

    @staticmethod
    def _should_retry(side_effects: bool, r: Result) -> bool:
        """Whether failure ``r`` is retried; ``side_effects``: whether what the call sent may
        have had side effects (``_may_have_effects``)."""
        if not r.retryable:
            return False
        # a function with side effects is retried only when the call provably did not run
        return not side_effects or (r.error is not None and r.error.type in SAFE_TO_RETRY)

    def _may_have_effects(self, fn: FnState, sent: Sent) -> bool:
        """Whether what the call sent may have had side effects: an attempt went under a spec
        with them (``sent.side_effects``), or the code an attempt ran is registered now with
        ``side_effects=True`` (the same code, same version, registered again with other
        options: what its spec says now holds for the runs of that code already sent). Asked
        after a failure only."""
        if sent.side_effects:
            return True
        now = self.registry.find(fn.spec.name)
        return now is not None and now.side_effects and now.version in sent.versions

    def _spec_now(self, fn: FnState) -> FunctionSpec:
        """The function's spec as registered now, taken into ``fn`` (``FnState.respec``) when
        it was registered again since the call began: the backend runs an attempt with the
        code registered when it is sent, so that is the spec it is sent under."""
        spec = self.registry.find(fn.spec.name)
        if spec is not None and spec is not fn.spec:
            fn.respec(spec)
        return fn.spec

    def _breaker_admits(self, fn: FnState) -> tuple[str | None, bool]:
        """``(None, is_probe)`` when the call may go, else ``(why not, False)``. After the
        cooldown one probe goes through; its outcome closes the circuit or opens it again,
        or (a deadline, a cancellation: nothing said of the infrastructure) leaves it half-open.
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
    async def _acquire_slot(fn: FnState, deadline: float | None) -> bool:
        """Take one of the function's concurrency slots (release it with ``fn.sem.release()``),
        waiting no later than ``deadline``: False, holding none, when it passed first."""
        if deadline is None:
            await fn.sem.acquire()
            return True
        try:
            async with asyncio.timeout(max(deadline - time.time(), 0.0)):
                await fn.sem.acquire()  # a slot granted as the timeout fires is given back
        except TimeoutError:
            return False
        return True

    @staticmethod
    def _refuse(m: FunctionMetrics, code: ErrorCode, message: str, name: str, request_id: str) -> Result:
        """A call refused before anything was sent: it never began."""
        m.errors[str(code)] += 1
        return Result.failure(code, message, function=name, request_id=request_id, started=False)

    async def _attempt(
        self,
        fn: FnState,
        inv: Invocation,
        hedge: bool | None,
        deadline: Callable[[], float | None] | None,
        sent: Sent,
    ) -> Result:
        """One attempt, under the spec registered now (``_spec_now``), hedged after the
        observed p95 when allowed: never once an attempt of the call was sent under a spec
        with side effects (``sent.side_effects``). With ``deadline`` (a keyed execution's,
        which grows as callers join), each copy sent carries its value at the time it is
        sent. The primary copy goes into ``sent.copies``: the caller's slot is given back once
        those have ended (``_release_when_settled``); a hedge gives back its own.

        A call with a deadline is answered ``DeadlineExceeded`` at the deadline if the backend
        has not answered by then, and its copies are cancelled: a remote backend (Lambda,
        Modal) does not stop at a caller's deadline, and would hold the caller until its read
        timeout. Not a keyed execution's call (``wait_for_run``): its answer is awaited."""
        if deadline is not None and (d := deadline()) != inv.deadline:
            inv = inv.model_copy(update={"deadline": d})
        spec = self._spec_now(fn)
        version = spec.version  # the code it is sent to
        # the registrations from this one on: the code registered since is the caller's too
        since = max(len(self.registry.versions(spec.name)) - 1, 0)
        sent.side_effects = sent.side_effects or spec.side_effects
        sent.versions.append(version)
        backend = self.backend
        t0 = time.perf_counter()
        try:
            primary = backend.submit(inv)
        except Exception as e:
            # a backend whose dispatch broke (a closed executor, a bug): raised from here it went
            # up through Client.call, which answers every failed call with a Result; sent, it
            # was not (retryable; a call with side effects is not retried on it anyway)
            log.exception("the %s backend could not send a call of %s", backend.kind, fn.spec.name)
            primary = asyncio.get_running_loop().create_future()
            primary.set_result(
                Result.failure(
                    ErrorCode.TRANSPORT,
                    f"{fn.spec.name}: the {backend.kind} backend could not send the call: "
                    f"{type(e).__name__}: {e}",
                    function=inv.function,
                    request_id=inv.request_id,
                )
            )
        sent.copies.append(primary)
        # how long to wait for an answer (None: until it comes)
        wait_s = None if inv.deadline is None or inv.wait_for_run else max(inv.deadline - time.time(), 0.0)
        hcfg = self.config.hedge
        delay_ms = None
        if (hedge if hedge is not None else hcfg.enabled) and spec.hedgeable and not sent.side_effects:
            delay_ms = fn.metrics.window.quantile(hcfg.min_samples)
        result: Result | None
        if delay_ms is None:
            try:
                if wait_s is None:
                    result = await primary
                else:
                    # asyncio.wait, not a timeout around the await: an answer that comes as the
                    # deadline passes (the backend's own DeadlineExceeded) is the one returned
                    await asyncio.wait((primary,), timeout=wait_s)
                    result = self._outcome(primary, inv) if primary.done() else None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not primary.cancelled() or (task is not None and task.cancelling()):
                    primary.cancel()
                    raise  # this caller was cancelled
                result = self._outcome(primary, inv)  # the backend cancelled its own call
            except Exception:
                result = self._outcome(primary, inv)  # the backend's future raised
        else:
            delay_s = max(delay_ms, hcfg.min_delay_ms) / 1e3
            result = await self._hedged(fn, inv, primary, delay_s, deadline, wait_s, spec)
        if result is None:
            result = self._abandoned(fn, inv, [primary])
            primary.cancel()  # a queued call never runs; a remote one may run on, its answer unread
        if result.ok and not result.cold_start:
            # the hedge delay follows the latency of warm answers: not of fast failures, nor
            # of a cold start's (an import and setup hook, waited for by the calls queued at a
            # job's start), which set the p95 at the cold-start time for thousands of calls
            fn.metrics.window.add((time.perf_counter() - t0) * 1e3)
        ran = result.version
        # other code: none registered from the send on. The code registered since, should it
        # be what answered, is the caller's too: a local pool replaced under a queued call
        # hands it to the pool of the function as registered then, which may have been
        # replaced in turn (compared with the code registered now alone, that answer was
        # refused). Code registered only before the send is a deployment's old code. A call
        # it did not start, found late by a local pool's worker, is none of its code's doing
        if (
            ran is not None
            and ran != version
            and ran != fn.spec.version
            and self.config.version_check != "off"
            and result.started is not False
            and not self._registered_since(spec.name, since, ran)
        ):
            result = self._other_code(fn, result, version, ran)
        if fn.spec.version != version:
            # registered again while it ran: the circuit is the new code's (FnState.respec),
            # and how the old code's attempt ended says nothing of it
            return result
        if result.ok or (result.error is not None and result.error.type in _ANSWERED):
            fn.consecutive_failures = 0  # the function answered: the infrastructure works
        elif result.retryable and not result.cut_at_deadline and not _ran_past_its_limit(result):
            fn.consecutive_failures += 1
            if fn.consecutive_failures >= self.config.breaker.failure_threshold:
                fn.breaker_open_until = time.monotonic() + self.config.breaker.cooldown_s
        # else the outcome says nothing of the infrastructure (the caller's deadline passed,
        # a keyed run was cut at it, the function ran past its timeout_s, it was cancelled,
        # the backend closed): neither counted nor a reset. A probe that ends so leaves the
        # circuit half-open (the next call is the next probe); reset, a probe cut off by its
        # own short deadline closed the circuit on a backend still down
        return result

    def _registered_since(self, name: str, since: int, ran: str) -> bool:
        """Whether ``ran`` is code registered under ``name`` from registration ``since`` on
        (``Registry.versions``), run by a backend that runs this client's registry's code as
        registered when a call runs (``Backend.runs_registered_code``). A deployment runs the
        code it was made from: the old code registered here again for a while after the
        send (an edit undone and done again) made its answers the caller's code's."""
        backend = self.backend
        return (
            backend.runs_registered_code
            and backend.registry is self.registry
            and ran in self.registry.versions(name)[since:]
        )

    def _other_code(self, fn: FnState, result: Result, version: str, ran: str) -> Result:
        """``result``, an answer of version ``ran`` of the code, not the caller's (``version``,
        the spec the attempt was sent under), counted; said once per function and pair of versions
        (``version_check="warn"``), or failed as ``VersionMismatch`` (``"refuse"``): final,
        and begun, since it ran. Only on a mismatch: the hot path compares two strings."""
        name = fn.spec.name
        fn.metrics.version_mismatches += 1
        kind = self.backend.kind
        if kind == "modal":
            fix = f"redeploy it: `fabric deploy --backend modal -f {name}`"
        else:
            fix = (
                f"redeploy it (`fabric deploy -f {name}`), or restart the `fabric serve` that serves it "
                "from the edited code"
            )
        what = (
            f"the {kind} backend ran version {ran} of {name}, not version {version}, registered here: "
            "what is deployed there is other code (deployed before the function was edited?)"
        )
        if self.config.version_check == "refuse":
            answered = (
                "" if result.error is None else f" (it answered {result.error.type}: {result.error.message})"
            )
            message = (
                f"{name}: {what}; its answer is refused (ClientConfig.version_check='refuse'){answered}. "
                f"It ran, effects and all, and is not retried: the same code would run again. To run "
                f"this code, {fix}"
            )
            return result.model_copy(
                update={
                    "ok": False,
                    "value": None,
                    "error": ErrorInfo.of(ErrorCode.VERSION_MISMATCH, message),
                    "started": True,
                }
            )
        if (version, ran) not in fn.versions_said:
            fn.versions_said.add((version, ran))
            log.warning(
                "%r: %s, and its answers are that code's. To run this code, %s. Said once per pair of "
                "versions; counted in the client's metrics (version_mismatches); "
                "ClientConfig(version_check='refuse') fails such calls, 'off' checks nothing",
                name,
                what,
                fix,
            )
        return result

    async def _retry(
        self,
        fn: FnState,
        inv: Invocation,
        first: Result,
        hedge: bool | None,
        deadline: Callable[[], float | None],
        sent: Sent,
    ) -> Result:
        """Retry a retryable failure: exponential backoff with full jitter, or a throttle's
        ``Retry-After`` when longer (``WaitRetryAfter``; one past ``max_retry_after_s`` ends the
        retries, ``StopPastRetryAfter``), bounded by the function's attempts and by
        ``deadline()`` (read at each step: a keyed execution's grows as callers join).
        Runs only after a failure. Whether a failure is retried
        follows every spec an attempt was sent under, and what the spec registered now says
        of the code they ran (``_may_have_effects``).

        Never sleeps past the deadline: when the next backoff would end after it, the retries
        stop and the answer is the last real failure (its type and message, with a note that
        the deadline left no time for another attempt), not a made-up deadline error."""
        policy = sent.retry  # the call's own: not changed by a registration since it began
        pending_first = [first]  # tenacity's first attempt is the one the fast path made
        tries = 1
        last = prev = first
        hedged = first.hedged  # any attempt's: a hedge was sent for this call
        at_deadline = StopAtDeadline(deadline)
        too_long = StopPastRetryAfter(self.config.max_retry_after_s)
        when_open = StopWhenOpen(lambda: fn.consecutive_failures, self.config.breaker.failure_threshold)
        moved = StopWhenSet()  # a keyed execution's code registered again (Sent.key_version)
        # a plain call's retries went on after the close, on a backend passed in (still open)
        closed = StopWhen(lambda: self._closed)

        async def attempt() -> Result:
            nonlocal tries, last, prev, hedged
            if pending_first:
                return pending_first.pop()
            d = deadline()
            if d is not None and time.time() >= d:
                at_deadline.hit = True  # the backoff overran the deadline a little: send nothing
                return last
            if when_open() or closed():  # the circuit opened, or the client closed, during the backoff
                return last
            if sent.key_version is not None and self._spec_now(fn).version != sent.key_version:
                moved.hit = True
                return last
            tries += 1
            fn.metrics.retries += 1
            again = inv.model_copy(update={"attempt": tries})
            prev, last = last, await self._attempt(fn, again, hedge, deadline, sent)
            hedged = hedged or last.hedged
            return last

        retrying = AsyncRetrying(
            # too_long before at_deadline: tenacity asks the stops in order until one holds, and a
            # Retry-After past the bound is the cause to report even where the deadline is nearer
            stop=stop_after_attempt(policy.max_attempts)
            | when_open
            | too_long
            | at_deadline
            | moved
            | closed,
            wait=WaitRetryAfter(
                wait_random_exponential(multiplier=policy.initial_backoff_s, max=policy.max_backoff_s)
            ),
            retry=retry_if_result(
                lambda r: not r.ok and self._should_retry(self._may_have_effects(fn, sent), r)
            ),
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else last,
            sleep=asyncio.sleep,
        )
        result: Result = await retrying(attempt)
        result.attempts = tries
        result.hedged = hedged
        err = result.error
        note = None
        if err is not None and moved.hit:
            note = (
                f" (not retried: {fn.spec.name} was registered again with new code, which this call's "
                "idempotency key does not name; a call with the key now runs the new code, under a "
                "key of its own)"
            )
        elif err is not None and closed.hit and tries < policy.max_attempts:
            note = " (not retried: the client closed)"
        elif err is not None and when_open.hit and tries < policy.max_attempts:
            note = (
                f" (not retried: the circuit opened after {fn.consecutive_failures} infrastructure "
                "failures in a row)"
            )
        elif err is not None and too_long.said is not None:
            note = (
                f" (not retried: the service asked for {too_long.said:g} s before attempt {tries + 1} "
                f"(Retry-After), longer than ClientConfig.max_retry_after_s ({too_long.bound:g} s); call "
                "again later, or raise max_retry_after_s to wait that long)"
            )
        elif err is not None and at_deadline.hit and tries < policy.max_attempts:
            note = (
                f" (not retried: the deadline left no time for attempt {tries + 1} of {policy.max_attempts})"
            )
        elif (
            err is not None
            and err.type == ErrorCode.DEADLINE_EXCEEDED
            and prev.error is not None
            and tries > 1
        ):
            # the deadline passed during the last attempt: keep the cause of the retries
            note = f"; attempt {tries - 1} had failed with {prev.error.type}: {prev.error.message}"
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
            # (the circuit is not touched here: _attempt counted the outcome, or left it
            # uncounted when other code than the function's now gave it)
            m.ok += 1
        else:
            assert result.error is not None
            m.errors[result.error.type] += 1
