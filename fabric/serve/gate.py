"""Per-tenant quotas and fair admission in front of one function's pool.

A quota alone does not isolate tenants: a flooding tenant within its quota still fills the
pool's FIFO, and everyone else's call waits behind its backlog. So the server admits calls
to a pool only while the pool has room (``capacity``), and when it is full the waiting
calls are admitted tenant by tenant in turn (round robin): another tenant's call waits for
one slot, not for the flood.

``TenantConnections`` bounds the connections a tenant holds open, idle keep-alive ones
included: aiohttp bounds their number nowhere, and their idle time at an hour by default.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

C = TypeVar("C")


class QuotaExceeded(Exception):
    """The tenant already holds its ``max_concurrency`` calls."""


class Quotas:
    """Calls each tenant holds (queued or running), against its limit."""

    def __init__(self, limits: dict[str, int], others: Iterable[str] = ()):
        self.limits = dict(limits)
        self.held: dict[str, int] = dict.fromkeys(limits, 0)
        self.throttled: dict[str, int] = dict.fromkeys([*limits, *others], 0)
        """Requests refused with 429, of every tenant: ``others`` hold no quota (metrics-only
        ones) but are refused past their ``max_connections``."""

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


class TenantConnections(Generic[C]):
    """The connections each tenant's requests came on, against its bound. A connection
    counts for the tenant of its latest request (a proxy in front sends every tenant's over
    its own connections). Closed ones are forgotten lazily, when the tenant is over its
    bound, so each tenant's entries stay within its bound plus one.

    ``idle``, ``closed`` and ``close`` read and end a connection (aiohttp's, in the server)."""

    def __init__(
        self,
        limits: dict[str, int],
        *,
        idle: Callable[[C], bool],
        closed: Callable[[C], bool],
        close: Callable[[C], None],
    ):
        self.limits = dict(limits)
        self._of: dict[str, dict[C, None]] = {t: {} for t in limits}  # in order of last use
        self._owner: dict[C, str] = {}
        self._idle, self._closed, self._close = idle, closed, close
        self.closed_idle: dict[str, int] = dict.fromkeys(limits, 0)
        """Idle connections closed to make room for a tenant's new ones."""

    def open(self, tenant: str) -> int:
        """The tenant's connections still open."""
        return sum(not self._closed(c) for c in self._of[tenant])

    def arrive(self, tenant: str, conn: C) -> bool:
        """A request of ``tenant`` came on ``conn``. ``False``: the tenant is at its bound
        with every other connection busy: refuse the request and close ``conn``."""
        mine = self._of[tenant]
        owner = self._owner.get(conn)
        if owner == tenant:
            del mine[conn]
            mine[conn] = None  # the most recently used now
            return True
        if owner is not None:
            del self._of[owner][conn]
        mine[conn] = None
        self._owner[conn] = tenant
        limit = self.limits[tenant]
        if len(mine) <= limit:
            return True
        for c in [c for c in mine if self._closed(c)]:
            self._forget(c)
        for c in list(mine):  # the least recently used first
            if len(mine) <= limit:
                break
            if c is not conn and self._idle(c):
                self._close(c)
                self._forget(c)
                self.closed_idle[tenant] += 1
        if len(mine) <= limit:
            return True
        self._forget(conn)
        return False

    def _forget(self, conn: C) -> None:
        del self._of[self._owner.pop(conn)][conn]


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

    def refused_for(self, tenant: str, now: float) -> float:
        """Seconds from ``now`` until a request of ``tenant`` (one ``delay`` refused) would be
        held back ``MAX_DELAY_S`` at most, so served rather than refused: its ``Retry-After``."""
        return max(self._tat[tenant], now) - self._tau - now - self.MAX_DELAY_S


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
