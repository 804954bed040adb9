"""A call's copies (``Copies``, the base of ``Attempts``): its primary and the hedge sent
after the function's observed p95 latency (``_hedged``), what a done copy answered, whether
any began, the answer of a call abandoned at its deadline, and the concurrency slot given
back once the copies' runs have ended. ``fabric.client_attempts`` sends them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from fabric.backends.base import Backend
from fabric.client_config import ClientConfig
from fabric.client_state import FnState
from fabric.errors import SAFE_TO_RETRY, ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry
from fabric.spec import FunctionSpec

log = logging.getLogger("fabric.client")

_BURST = 5  # hedges allowed beyond the share, so a short run can still hedge


def _answered(f: asyncio.Future[Result]) -> bool:
    """A done future that holds a ``Result`` (not cancelled, no exception)."""
    return f.done() and not f.cancelled() and f.exception() is None


class Copies:
    """The copies part of a ``Client``; its state is the client's (set in its ``__init__``)."""

    backend: Backend
    config: ClientConfig
    registry: Registry
    _closed: bool
    """Set at the start of ``Client.aclose``: no copy or attempt is sent after it."""

    def _release_when_settled(
        self, fn: FnState, copies: list[asyncio.Future[Result]], release: Callable[[], None]
    ) -> None:
        """Call ``release`` (a concurrency slot's) once every one of ``copies`` (futures from
        ``submit``) is done and its run has ended: a copy let go while it runs (cancelled, a
        hedge that lost or a call abandoned at its deadline, or answered DeadlineExceeded as it
        ran) may run on in its worker (a synchronous handler runs to its end), and
        ``max_concurrency`` bounds the calls running, not the callers waiting. At once when
        every copy answered, as is usual."""
        left = len(copies) + 1

        def one_ended(_: object = None) -> None:
            nonlocal left
            left -= 1
            if left == 0:
                release()

        def one_done(f: asyncio.Future[Result]) -> None:
            # only a copy let go may still run: the backend is asked of those alone (a scan)
            let_go = (
                not f.done()  # a task told to cancel (FakeBackend, inproc): it ends at its next step
                or f.cancelled()
                or (
                    f.exception() is None
                    and (err := f.result().error) is not None
                    and err.type == ErrorCode.DEADLINE_EXCEEDED
                )
            )
            runs = self.backend.settled(fn.spec.name, f) if let_go else None
            if runs is None:
                one_ended()
            else:
                runs.add_done_callback(one_ended)

        for f in copies:
            if f.done() or (isinstance(f, asyncio.Task) and f.cancelling()):
                one_done(f)
            else:
                f.add_done_callback(one_done)
        one_ended()

    def _outcome(self, f: asyncio.Future[Result], inv: Invocation) -> Result:
        """What done copy ``f`` answered. A backend's future holds a ``Result``; one that ended
        without (raised: a backend's bug, a library error it did not translate; or cancelled by
        the backend itself: an executor shut down under its calls as it closed) is read as a
        failed one: let out of ``Client.call``, the exception broke its promise of a
        ``Result``, and a CancelledError in a task no one cancelled was read as that task's own
        cancellation (a ``gather`` over a batch gave up on all of it)."""
        if not f.cancelled() and (e := f.exception()) is None:
            return f.result()
        name = inv.function
        if f.cancelled():
            code, why = (
                (ErrorCode.BACKEND_CLOSED, "closed while the call was in flight")
                if self.backend.closed
                else (ErrorCode.CANCELLED, "cancelled the call")
            )
            return Result.failure(
                code,
                f"{name}: the {self.backend.kind} backend {why}",
                function=name,
                request_id=inv.request_id,
            )
        log.error("the %s backend failed a call of %s", self.backend.kind, name, exc_info=e)
        return Result.failure(
            ErrorCode.TRANSPORT,
            f"{name}: the {self.backend.kind} backend failed the call: {type(e).__name__}: {e}",
            function=name,
            request_id=inv.request_id,
        )

    def _began(self, fn: FnState, copies: list[asyncio.Future[Result]]) -> bool | None:
        """Whether any of a call's ``copies`` (its primary and hedge) began to run, asked
        before they are let go: an answered copy's ``Result.started``, else the backend's
        word (``Backend.started``); a copy that ended without an answer is not known. ``None``
        when none is known to have begun and one is not known either way."""
        known: list[bool | None] = []
        for f in copies:
            if _answered(f):
                known.append(f.result().started)
            elif not f.done():
                known.append(self.backend.started(fn.spec.name, f))
            else:
                # ended without an answer (its backend's future raised, or the backend cancelled
                # it): it was sent, and nothing says whether it ran
                known.append(None)
        if any(known):
            return True
        return None if None in known else False

    @staticmethod
    def _may_have_run(copies: list[asyncio.Future[Result]], began_when_cut: bool | None) -> bool:
        """Whether any of a call's ``copies`` (its attempts' primaries, the last one cut by its
        caller's cancellation) may have run: an answer that does not say it did not (``started``
        False, or a failure safe to retry), or a copy that ended without one, unless it is the
        cut one and the backend said it had not begun (``began_when_cut``)."""
        for f in copies:
            if _answered(f):
                r = f.result()
                if r.started is False or (r.error is not None and r.error.type in SAFE_TO_RETRY):
                    continue
                return True
            if f is copies[-1] and began_when_cut is False:
                continue
            return True
        return False

    def _abandoned(self, fn: FnState, inv: Invocation, copies: list[asyncio.Future[Result]]) -> Result:
        """The answer of a call whose deadline passed before the backend answered any of its
        ``copies`` (asked before they are cancelled)."""
        began = self._began(fn, copies)
        if began is None:
            # a request sent to a remote function (Lambda, Modal, a fabric serve) whose answer
            # did not come: it may be running, and may have had its effects; read as begun, as
            # the retry rules read such a call (only NotStarted and Throttled are safe to retry)
            began = True
        why = (
            "the call was abandoned (a remote function may still run to its end)"
            if began
            else "the call was abandoned before it started"
        )
        return Result.failure(
            ErrorCode.DEADLINE_EXCEEDED,
            f"{fn.spec.name}: deadline passed before the backend answered; {why}",
            function=inv.function,
            request_id=inv.request_id,
            started=began,
        )

    async def _hedged(
        self,
        fn: FnState,
        inv: Invocation,
        primary: asyncio.Future[Result],
        delay_s: float,
        deadline: Callable[[], float | None] | None,
        wait_s: float | None,
        spec: FunctionSpec,
    ) -> Result:
        """The first answer of the primary and its hedge; ``DeadlineExceeded`` when none came
        within ``wait_s`` (both copies are cancelled). No hedge goes once the function was registered
        again after the primary was sent (under ``spec``): it would run other code than the
        primary, maybe with side effects its spec did not say, or the same code that its spec
        now says has them (its version unchanged)."""
        loop = asyncio.get_running_loop()
        winner: asyncio.Future[Result] = loop.create_future()
        futs = [primary]
        m = fn.metrics

        def waits(r: Result) -> bool:
            # a retryable failure of one copy waits for the other copy, if there is one; so
            # does a keyed execution's copy answered DeadlineExceeded: it did not start (its
            # backend does not answer such a call early once it runs), and the other may run
            return not r.ok and (
                r.retryable
                or (inv.wait_for_run and r.error is not None and r.error.type == ErrorCode.DEADLINE_EXCEEDED)
            )

        def done(f: asyncio.Future[Result]) -> None:
            if winner.done():  # answered, or the call is over (the finally below)
                return
            r = self._outcome(f, inv)
            if waits(r) and any(
                not g.done() or (_answered(g) and not waits(g.result())) for g in futs if g is not f
            ):
                # another copy is still out, or has answered already (in this same loop turn,
                # its callback not run yet): that one decides, not this failure
                return
            if f is not primary and not waits(r):
                m.hedge_wins += 1  # the hedge's answer is the call's (not: every copy failed)
            winner.set_result(r)

        def fire() -> None:
            if winner.done() or primary.done():
                return
            if self._closed:
                return  # a call in flight at the close sent its hedge after it (a backend passed in)
            if m.hedges >= self.config.hedge.max_share * m.calls + _BURST:
                return
            if fn.consecutive_failures >= self.config.breaker.failure_threshold:
                return  # the circuit is open (or half-open: a probe is one call, not two)
            if self.registry.find(spec.name) is not spec:
                return
            # a hedge is one more call in flight: it takes one of the function's max_concurrency
            # slots (a limit a paid or rate-limited dependency relies on), or, all being held,
            # one of the hedges' small allowance past it; else it is not sent
            give_back = fn.take_hedge_slot(self.config.hedge.over_limit_share)
            if give_back is None:
                return
            update: dict[str, Any] = {"hedge": True, "request_id": inv.request_id + "-h"}
            if deadline is not None:
                update["deadline"] = deadline()
            try:
                h = self.backend.submit(inv.model_copy(update=update))
            except Exception:
                # not sent: its room goes back (kept, every such failure took a slot or the
                # allowance for good, and hedging, then calls, stopped), and the primary,
                # still out, answers the call. Raised out of this timer callback it also
                # cut short the other hedges due in the same tick (HedgeClock._fire)
                give_back()
                log.warning("could not send a hedge of %s", fn.spec.name, exc_info=True)
                return
            m.hedges += 1
            self._release_when_settled(fn, [h], give_back)  # answered, or the loser's run ended
            futs.append(h)
            h.add_done_callback(done)

        primary.add_done_callback(done)
        due = fn.hedge_clock.at(loop.time() + delay_s, fire)
        try:
            if wait_s is None:
                result = await winner
            else:
                await asyncio.wait((winner,), timeout=wait_s)
                # (not returned from here: it is hedged too, below)
                result = winner.result() if winner.done() else self._abandoned(fn, inv, futs)
            if (
                not result.ok
                and result.started is not True
                and len(futs) > 1
                and (err := result.error) is not None
                and err.type == ErrorCode.DEADLINE_EXCEEDED
            ):
                # one copy's deadline passed before it began while the other ran: the call began
                began = self._began(fn, futs)
                if began is not None and began != result.started:
                    result = result.model_copy(update={"started": began})
        finally:
            # over: the hedge not sent yet never will be, and its timer, due at the p95 delay
            # (minutes for a slow function), must not hold the call until then
            due.cancel()
            if not winner.done():
                winner.cancel()  # over: the copies cancelled next answer nothing (done() above)
            for f in futs:
                if not f.done():
                    f.cancel()  # the loser: a queued copy never runs, a running one is ignored
        if len(futs) > 1:
            result.hedged = True
        return result
