"""Per-tenant quotas and fair admission in front of one function's pool.

A quota alone does not isolate tenants: a flooding tenant within its quota still fills the
pool's FIFO, and everyone else's call waits behind its backlog. So the server admits calls
to a pool only while the pool has room (``capacity``), and when it is full the waiting
calls are admitted tenant by tenant in turn (round robin): another tenant's call waits for
one slot, not for the flood.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class QuotaExceeded(Exception):
    """The tenant already holds its ``max_concurrency`` calls."""


class Quotas:
    """Calls each tenant holds (queued or running), against its limit."""

    def __init__(self, limits: dict[str, int]):
        self.limits = dict(limits)
        self.held: dict[str, int] = dict.fromkeys(limits, 0)
        self.throttled: dict[str, int] = dict.fromkeys(limits, 0)

    def take(self, tenant: str) -> None:
        if self.held[tenant] >= self.limits[tenant]:
            self.throttled[tenant] += 1
            raise QuotaExceeded(tenant)
        self.held[tenant] += 1

    def hold(self, tenant: str) -> None:
        """Take a slot past the limit check: for what a call already admitted goes on holding
        (its answer, being written)."""
        self.held[tenant] += 1

    def give(self, tenant: str) -> None:
        self.held[tenant] -= 1


class RateLimiter:
    """Per-tenant request pacing (GCRA, the token bucket as a schedule): a request past the
    tenant's rate waits for its turn. ``burst`` requests may go at once after a quiet spell."""

    MAX_DELAY_S = 5.0
    """Past this much queueing a request is refused instead (429): the tenant is far over."""

    def __init__(self, rates: dict[str, float | None], burst_s: float = 0.05):
        self._interval = {t: 1.0 / r for t, r in rates.items() if r}
        self._tau = burst_s
        self._tat: dict[str, float] = dict.fromkeys(self._interval, 0.0)
        self.delayed: dict[str, int] = dict.fromkeys(rates, 0)

    def delay(self, tenant: str, now: float) -> float | None:
        """Seconds to wait before serving this request (0: at once), or ``None``: refuse."""
        interval = self._interval.get(tenant)
        if interval is None:
            return 0.0
        tat = max(self._tat[tenant], now)  # the theoretical arrival time of this request
        wait = tat - self._tau - now
        if wait > self.MAX_DELAY_S:
            return None
        self._tat[tenant] = tat + interval
        if wait > 0:
            self.delayed[tenant] += 1
            return wait
        return 0.0


class FairGate:
    """At most ``capacity()`` admitted calls at once; waiters are served round robin by tenant."""

    def __init__(self, capacity: Callable[[], int]):
        self._capacity = capacity
        self._running = 0
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}
        self._turns: deque[str] = deque()  # tenants with waiters, in the order they get a slot

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, tenant: str) -> None:
        if not self._turns and self._running < self._capacity():
            self._running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(tenant, deque())
        if not queue:
            self._turns.append(tenant)
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was granted as the waiter was cancelled: pass it on
            else:
                self._drop(tenant, fut)
            raise

    def _drop(self, tenant: str, fut: asyncio.Future[None]) -> None:
        """Take a waiter that gave up (its client hung up, its deadline) out of the line at
        once: left there until a slot came free, it counted in ``waiting`` and stayed in
        memory, and a tenant re-sending and giving up grew both without bound."""
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        try:
            queue.remove(fut)
        except ValueError:
            return
        if not queue:
            del self._waiting[tenant]
            self._turns.remove(tenant)

    def release(self) -> None:
        self._running -= 1
        self.admit()

    def admit(self) -> None:
        """Admit waiting calls while there is room: at each release, and when ``capacity()``
        grows (the backend says so), or room gained meanwhile stood empty till a call ended."""
        while self._turns and self._running < self._capacity():
            tenant = self._turns.popleft()
            queue = self._waiting[tenant]
            fut = queue.popleft()
            if queue:
                self._turns.append(tenant)  # its next call goes to the back of the line
            else:
                del self._waiting[tenant]
            if fut.done():  # cancelled while waiting (and not yet dropped)
                continue
            self._running += 1
            fut.set_result(None)
