"""The client's state per function (``FnState``), per idempotency key (``Execution``), and
its timing helpers: when to hedge (``HedgeClock``), how long to wait before a retry
(``WaitRetryAfter``), and when retries must stop before the deadline (``StopAtDeadline``) or
rather than wait out a throttle's ``Retry-After`` past its bound (``StopPastRetryAfter``)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from tenacity import RetryCallState
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from fabric.metrics import FunctionMetrics
from fabric.protocol import Result
from fabric.spec import FunctionSpec, RetryPolicy


class StopAtDeadline(stop_base):
    """Stop retrying when the next backoff would end at or after the deadline: tenacity has
    drawn that backoff (``upcoming_sleep``) when it asks, so no sleep runs past the deadline
    (``stop_after_delay`` looks only at the time already spent)."""

    def __init__(self, deadline: Callable[[], float | None]):
        self.deadline = deadline
        self.hit = False
        """True once the deadline, not the attempts, ended the retries."""

    def __call__(self, retry_state: RetryCallState) -> bool:
        d = self.deadline()
        if d is not None and time.time() + retry_state.upcoming_sleep >= d:
            self.hit = True
        return self.hit


class WaitRetryAfter(wait_base):
    """The backoff ``base`` draws, or the last attempt's ``Retry-After`` when it is longer
    (``ErrorInfo.retry_after_s``, a throttle's): a retry sooner than the service said is
    refused again, and a tenant far over its rate spent its attempts so. Longer than
    ``max_backoff_s`` too, the service's word being the better one, up to
    ``ClientConfig.max_retry_after_s`` (``StopPastRetryAfter``); ``StopAtDeadline`` sees the
    whole wait and stops rather than sleep past the deadline."""

    def __init__(self, base: wait_base):
        self.base = base

    def __call__(self, retry_state: RetryCallState) -> float:
        wait = self.base(retry_state)
        outcome = retry_state.outcome
        if outcome is not None and not outcome.failed:
            error = outcome.result().error
            if error is not None and error.retry_after_s is not None:
                wait = max(wait, error.retry_after_s)
        return wait


class StopPastRetryAfter(stop_base):
    """Stop retrying when the last attempt's ``Retry-After`` is longer than ``bound``
    (``ClientConfig.max_retry_after_s``; None: no bound): a call without a deadline waited
    whatever the header said (a proxy's ``Retry-After: 3600``, an hour), and a retry sooner
    is refused again. ``said`` keeps the wait asked for, which the call's failure reports."""

    def __init__(self, bound: float | None):
        self.bound = bound
        self.said: float | None = None
        """The ``Retry-After`` past the bound, once it ended the retries."""

    def __call__(self, retry_state: RetryCallState) -> bool:
        outcome = retry_state.outcome
        if self.bound is not None and outcome is not None and not outcome.failed:
            error = outcome.result().error
            if error is not None and error.retry_after_s is not None and error.retry_after_s > self.bound:
                self.said = error.retry_after_s
        return self.said is not None


class StopWhenOpen(stop_base):
    """Stop retrying once the function's circuit is open (or half-open): calls fail fast then,
    and a retry is no exception, nor the one probe. A retry follows a counted failure, which
    opens the circuit when it is the ``threshold``-th in a row."""

    def __init__(self, consecutive_failures: Callable[[], int], threshold: int):
        self.failures = consecutive_failures
        self.threshold = threshold
        self.hit = False
        """True once the open circuit, not the attempts or the deadline, ended the retries."""

    def __call__(self, retry_state: RetryCallState | None = None) -> bool:
        if self.failures() >= self.threshold:
            self.hit = True
        return self.hit


class StopWhenSet(stop_base):
    """Stop retrying once ``hit`` is set (by an attempt that found a reason to send none)."""

    def __init__(self) -> None:
        self.hit = False

    def __call__(self, retry_state: RetryCallState | None = None) -> bool:
        return self.hit


class StopWhen(stop_base):
    """Stop retrying once ``cond()`` holds (the client closed): asked after each attempt,
    before the backoff's sleep; ``hit`` says it ended the retries."""

    def __init__(self, cond: Callable[[], bool]) -> None:
        self.cond = cond
        self.hit = False

    def __call__(self, retry_state: RetryCallState | None = None) -> bool:
        self.hit = self.hit or self.cond()
        return self.hit


class _Due:
    """A hedge waiting in a ``HedgeClock``'s FIFO; ``cancel`` lets its callback go (its entry,
    this empty shell, stays until its time)."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]):
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class HedgeClock:
    """When to hedge, for one function: a FIFO of (time, callback) under one timer.

    Every call of a function gets the same delay (its current p95), so the times mostly
    arrive in order and one timer for the head replaces a heap entry per call (the hot path).
    When the p95 drops, a new call's time comes before the times of calls made earlier with
    the longer delay: it gets a timer of its own (the loop's heap), instead of waiting behind
    them in the FIFO and hedging late. A call that finishes first cancels its hedge (the
    handle ``at`` returns): its callback, which holds the call (its invocation, payload and
    encoded bytes included, and its answer), is let go at once, not when its time comes."""

    __slots__ = ("_loop", "_q", "_timer")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._q: deque[tuple[float, _Due]] = deque()  # in time order
        self._timer: asyncio.TimerHandle | None = None

    def at(self, when: float, callback: Callable[[], None]) -> _Due | asyncio.TimerHandle:
        """Call ``callback`` at ``when`` (the loop's clock), unless the handle returned is
        cancelled first."""
        if self._q and when < self._q[-1][0]:
            # due before the FIFO's last: out of its order (a cancelled handle drops its callback)
            return self._loop.call_at(when, callback)
        due = _Due(callback)
        self._q.append((when, due))
        if self._timer is None:
            self._timer = self._loop.call_at(when, self._fire)
        return due

    def _fire(self) -> None:
        self._timer = None
        q = self._q
        now = self._loop.time()
        while q and q[0][0] <= now:
            callback = q.popleft()[1].callback
            if callback is not None:
                callback()
        if q:
            self._timer = self._loop.call_at(q[0][0], self._fire)


class Slots(asyncio.Semaphore):
    """A function's ``max_concurrency`` slots: a semaphore whose slot can also be taken
    without waiting (asyncio's has no ``acquire_nowait``), as a hedge is, and whose number
    of slots can change (``resize``: the function registered again with another limit)."""

    def __init__(self, value: int):
        super().__init__(value)
        self._owed = 0
        """Slots given back that are kept, not freed: held when the number shrank by more
        than was free then."""

    def resize(self, by: int) -> None:
        """Change the number of slots by ``by``. Fewer: free ones go first; slots held now
        are not taken back from their callers, but as many as are still missing are kept
        when given back (``release``), so no more than the new number are held once those
        callers end. More: what is still owed is forgiven first, and the rest freed (waiting
        callers take them at once). A semaphore's count must not go below 0: asyncio's
        admits a caller whenever it is not 0."""
        if by < 0:
            take = min(self._value, -by)
            self._value -= take
            self._owed += -by - take
            return
        forgiven = min(self._owed, by)
        self._owed -= forgiven
        for _ in range(by - forgiven):
            super().release()

    def release(self) -> None:
        if self._owed:
            self._owed -= 1
            return
        super().release()

    def take_now(self) -> bool:
        """Take a slot if one is free now, ahead of no waiting caller; False, holding none,
        when none is. Release it with ``release()``."""
        if self.locked():  # no slot left, or callers already wait for one
            return False
        self._value -= 1  # what ``acquire`` does, without suspending, when a slot is free
        return True


class FnState:
    """Client-side state of one function."""

    __slots__ = (
        "breaker_open_until",
        "consecutive_failures",
        "hedge_clock",
        "hedges_over_limit",
        "metrics",
        "probing",
        "sem",
        "spec",
        "versions_said",
    )

    def __init__(self, spec: FunctionSpec, quantile: float):
        self.spec = spec
        self.sem = Slots(spec.max_concurrency)
        self.metrics = FunctionMetrics(quantile)
        self.consecutive_failures = 0
        self.breaker_open_until = 0.0
        self.probing = False
        self.hedge_clock = HedgeClock()
        self.hedges_over_limit = 0
        self.versions_said: set[tuple[str, str]] = set()
        """(the caller's version, the version that answered) pairs already warned of: once each."""

    def respec(self, spec: FunctionSpec) -> None:
        """Take the spec of the function registered again under its name (new code: a new
        ``version``, which keys the idempotency cache; maybe new limits, used from the next
        call on). Its metrics stay: they are the function's by name. Its circuit is the
        code's: new code starts closed (the old code's failures say nothing of it: an open
        circuit refused the fix for a whole cooldown), the same code (new limits only) keeps
        it. A probe of the old code still under way stays the probe until it ends."""
        if spec.version != self.spec.version:
            self.consecutive_failures = 0
            self.breaker_open_until = 0.0
        self.sem.resize(spec.max_concurrency - self.spec.max_concurrency)
        self.spec = spec

    def take_hedge_slot(self, over_limit_share: float) -> Callable[[], None] | None:
        """Room for one hedge, and how to give it back when the hedge ends; None when there
        is none (the hedge is not sent: it never waits, or it would be late and hold callers
        up). A free ``max_concurrency`` slot first, else one of the hedges' own allowance past
        the limit (``HedgeConfig.over_limit_share``)."""
        if self.sem.take_now():
            return self.sem.release
        # (the nudge: 0.29 * 100 is 28.999..., whose int() let one hedge fewer over)
        if self.hedges_over_limit >= int(over_limit_share * self.spec.max_concurrency + 1e-9):
            return None
        self.hedges_over_limit += 1

        def give_back() -> None:
            self.hedges_over_limit -= 1

        return give_back


class Sent:
    """What one call (a plain call, or the execution under a key) has sent so far, over its
    attempts."""

    __slots__ = ("began_when_cut", "copies", "key_version", "retry", "side_effects", "versions")

    def __init__(self, retry: RetryPolicy, key_version: str | None = None) -> None:
        self.retry = retry
        """The retry budget (attempts, backoff): the function's when the call began. A
        function registered again with another policy while the call is under way changes
        the calls made from then on, not this one's (read when a retry was due, a call's
        budget grew or shrank as it ran, depending on whether a call made meanwhile had
        already taken the new spec into the client)."""
        self.copies: list[asyncio.Future[Result]] = []
        """Each attempt's primary copy (futures from ``submit``): the call's concurrency slot
        is given back once they have ended (``Attempts._release_when_settled``)."""
        self.side_effects = False
        """True once an attempt was sent under a spec with side effects. Whether the call may
        be sent again (a retry, a hedge; what its key keeps) follows what may have run, not
        the spec registered now: the function registered again between two attempts with
        ``side_effects`` turned off had the old code's effect run again, and turned on, the
        new code's ran twice, once the client read the new spec and once it had not yet.
        (``Attempts._may_have_effects`` adds what the spec now says of code that ran.)"""
        self.versions: list[str] = []
        """The code (``FunctionSpec.version``) each attempt was sent to, in order."""
        self.began_when_cut: bool | None = None
        """For a keyed execution the client's close cuts: whether the attempt it had out had
        begun, as the backend said before the close let it go (``KeyedCalls._before_cut``;
        None: not known, read as begun)."""
        self.key_version = key_version
        """For the execution under an idempotency key: the code its key names
        (``name:version:key``), the only code its attempts go to. A caller after the function
        was registered again with new code has a key, and an execution, of its own: an
        attempt of this one sent to the new code ran beside that one (a side effect twice
        under one idempotency key), and its answer was kept under the old code's key."""


class Execution:
    """The one execution under an idempotency key, shared by every caller with the key.

    It belongs to the key, not to the caller that started it: a caller's deadline or
    cancellation ends only that caller's wait. It ends when the backend answers (a hung call
    is bounded by the function's ``timeout_s``, a run by ``deadline``), and only then is the
    key free again, so a caller that comes later never starts a second execution while the
    first may still run."""

    __slots__ = ("deadline", "digest", "fn", "kept", "sent", "task", "unsent")

    def __init__(self, deadline: float | None, digest: bytes, fn: FnState, sent: Sent):
        self.deadline = deadline
        """The latest deadline of the callers that joined (None once one has none): after it
        no caller could use the answer, so each call sent carries it (an async handler is
        cancelled there, in the worker) and the retries stop there."""
        self.digest = digest
        """Of the payload it runs (``client_keyed._digest``): a caller with another is refused."""
        self.fn = fn
        self.sent = sent
        """What its attempts sent (its retry budget and the code its key names too)."""
        self.task: asyncio.Task[Result] | None = None
        self.kept: Result | None = None
        """What the key keeps once it ended (its answer, or ``OutcomeUnknown`` for a side
        effect that may have run; None: nothing, the key is free again): the answer of every
        caller that joined it, as of any caller that comes later."""
        self.unsent = False
        """True when it ended without sending anything: every caller's deadline had passed
        while it waited for a concurrency slot. Not an outcome to count: each caller, its
        deadline passed, counts as one that gave up."""

    def join(self, deadline: float | None) -> bool:
        """Count in a joining caller's deadline; True when that moved ``deadline`` later."""
        if self.deadline is None:
            return False
        later = None if deadline is None else max(self.deadline, deadline)
        moved = later != self.deadline
        self.deadline = later
        return moved
