"""One function's warm pool of worker processes (parent side of ``fabric.worker``).

Calls wait in one FIFO per function and are handed to the least-loaded ready worker in
batches: everything submitted in the same event-loop tick goes out as one message, which
is what makes small calls cheap. The pool keeps ``warm`` workers ready, grows on demand up
to its cap, stops idle extras, replaces dead ones, and kills a worker whose running call
passes the function's timeout (seen through the worker's shared-memory slot, so a worker
stuck in C code is caught too).

A caller's deadline is the caller's business: past it the call is answered
``DeadlineExceeded`` and its result discarded, but the worker is not killed for it. A call
of a keyed execution (``Invocation.wait_for_run``) is not answered early once on a worker:
its worker answers (it cancels an async handler at the deadline), so the key stays busy as
long as the handler may run; its deadline can move later (``extend_deadline``) as callers
with later deadlines join it.

The pool is built in layers, each in a sibling module on the one before it: how calls go
out to the workers and come back (``_pool_dispatch``), the supervision of the workers
(``_pool_workers``), and this module's ``FunctionPool``: its state, start and close, and
what callers ask of it (submit, move a deadline, wait for a worker to be done with a call).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from fabric.backends._pool_snapshot import snapshot_of
from fabric.backends._pool_workers import _MAX_START_FAILURES, _TICK_S, PoolWorkers
from fabric.backends._worker_handle import LIVE_PIDS, PoolCall
from fabric.backends.base import LocalConfig
from fabric.errors import BackendClosedError, BackendError, ErrorCode, SetupFailedError
from fabric.protocol import Invocation, Result
from fabric.registry import FunctionCode
from fabric.spec import FunctionSpec

STOP_GRACE_S = 1.0
"""How long a closing pool waits for its workers to exit on its stop before it kills them."""


class FunctionPool(PoolWorkers):
    def __init__(
        self, spec: FunctionSpec, config: LocalConfig, *, cpu: int, code: FunctionCode | None = None
    ):
        self.spec = spec
        # the source of the modules as registered, which its workers import (_pool_snapshot);
        # None: not known (a spec not made by the decorator here), the workers import the files
        self._snapshot, unkept = snapshot_of(code)
        self._unkept = unkept if code is not None else None
        self.config = config
        self.max_workers = max(1, min(spec.max_concurrency, config.max_workers or cpu))
        self.warm = min(self.max_workers, spec.warm if config.warm is None else config.warm)
        self._loop = asyncio.get_running_loop()
        self._pending = deque()
        self._scheduled = False
        self._workers = []
        self._starting = 0
        self._cids = itertools.count(1)
        self._wids = itertools.count(1)
        self._by_key = {}
        self._closed = False
        self._closing: asyncio.Task[None] | None = None
        self._successor = None  # set once retired: the function's pool now (see retire)
        # nothing can serve (set only while no worker is usable or starting): calls fail fast
        self._broken = None  # until, message, traceback
        self._last_start_failure = None  # message, traceback
        self._no_spawn_until = 0.0
        self._start_failures = 0
        self._exec_ewma_ms = None
        self._maint = None
        self._reaping = set()  # the workers stopped for idleness, until they are waited for
        self._capacity_watchers = []
        self.metrics = {
            "spawned": 0,
            "lost": 0,
            "timeouts": 0,
            "cold_starts": 0,
            "batches": 0,
            "calls": 0,
            "start_failures": 0,
            "requeued": 0,
        }

    # -- lifecycle
    def start(self) -> None:
        for _ in range(self.warm):
            self._spawn()
        self._maint = self._loop.create_task(self._maintain())

    async def wait_ready(self, within_s: float | None = None) -> None:
        """Wait until ``warm`` workers are ready, and at least one: a ``warm=0`` function gets
        one started now (it goes again after ``idle_window_s`` unused, as any worker beyond
        ``warm``), so that its first call is warm and a setup hook that raises is found here,
        not by the first call (a job's start-up check passed, then every reward failed).

        Raises ``SetupFailedError`` when none can be: the setup hook or the import raised, or
        starts failed or timed out until the pool gave up. A pool that serves with fewer
        workers because one of them failed to start counts as ready: calls are answered.
        """
        need = max(self.warm, 1)
        # each start is bounded by start_timeout_s and the pool gives up after a few failed
        # ones in a row, so this deadline is only a backstop
        limit = within_s or self.config.start_timeout_s * (_MAX_START_FAILURES + 1)
        if self._broken is not None and time.monotonic() >= self._broken[0]:
            self._broken = None  # the cooldown is over: try again (maintenance starts the workers)
        deadline = time.monotonic() + limit
        failures = self.metrics["start_failures"]
        while True:
            if self._closed:  # no worker will start any more: waiting would end in a false timeout
                raise BackendClosedError(f"{self.spec.name}: backend closed")
            ready = sum(w.usable for w in self._workers)
            if ready >= need or (ready and self.metrics["start_failures"] > failures):
                return
            if not self._workers and not self._starting and self._can_spawn():
                self._spawn()  # warm=0 (or all lost): the one that answers for the setup
            if self._broken is not None:
                _, message, tb = self._broken
                raise SetupFailedError(message, tb)
            if time.monotonic() > deadline:
                last = self._last_start_failure
                raise BackendError(
                    f"{self.spec.name}: {ready} of {need} warm workers ready after {limit:.3g} s"
                    + (f"; the last failed start: {last[0]}" if last else "")
                )
            await asyncio.sleep(0.01)

    async def retire(self, successor: Callable[[], FunctionPool | None]) -> None:
        """Close once the calls this pool holds have ended: it was replaced by a pool of the
        function registered again (``LocalBackend.pool``), which takes every call from now
        on. Its runs under way finish on the code they started with, and its queue is served
        by its workers too, as submitted (a call runs the code registered when it was made);
        it keeps no worker ready for later (``warm`` 0) and starts none: the function was
        moved to new code on purpose, a new worker would load the old code's setup again (a
        model) for a few leftovers, and one of a module whose source was not kept
        (``_pool_snapshot``) would import the new code and be refused as stale. The calls it
        can no longer serve (its last worker died or failed its start) go to
        ``successor()``, the function's pool now, not failed for a registration that did
        happen. Every call here is bounded (the function's
        ``timeout_s``, a start that fails), so the wait is."""
        self.warm = 0
        self._successor = successor
        self._hand_over_if_stranded()
        # no event marks "held nothing": the pool's own maintenance period is the poll's
        while not self._closed and (self._pending or any(w.inflight for w in self._workers)):
            await asyncio.sleep(_TICK_S)
            self._hand_over_if_stranded()
        await self.close()

    def _hand_over(self) -> None:
        assert self._successor is not None
        pool = self._successor()
        while self._pending:
            call = self._pending.popleft()
            self._forget(call)
            if call.timer is not None:  # the pool that takes it times it
                call.timer.cancel()
                call.timer = None
            if call.fut.done():  # cancelled by the caller (a hedge loser), expired or failed
                continue
            if pool is None or pool is self:
                self._fail(call, ErrorCode.BACKEND_CLOSED, "backend closed", started=False)
            else:
                pool.adopt(call)

    async def close(self) -> None:
        """Stop the workers; the calls still held are answered ``BackendClosed``. Idempotent:
        a second close (the backend's, of a pool whose retirement is closing it) waits for
        the first."""
        self._closed = True
        if self._closing is None:
            self._closing = self._loop.create_task(self._close_now())
        await asyncio.shield(self._closing)

    async def _close_now(self) -> None:
        if self._maint is not None:
            self._maint.cancel()
        while self._pending:  # never sent: none of them began
            self._fail(self._pending.popleft(), ErrorCode.BACKEND_CLOSED, "backend closed", started=False)
        workers = list(self._workers)
        for w in workers:
            w.send(("stop",))
        deadline = time.monotonic() + STOP_GRACE_S
        for w in workers:
            proc = w.proc
            if proc is not None:
                # a process exit has no awaitable here (no child watcher): poll briefly, then kill
                while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
                w.kill()
                await self._loop.run_in_executor(None, proc.wait)
                LIVE_PIDS.discard(proc.pid)
            if w.transport is not None:
                w.transport.close()
            for call in list(w.inflight.values()):
                # sent: it may have run, unless a synchronous worker's slot says it waited
                # behind the others (read once the worker is dead: it starts nothing more)
                self._settle(call)
                self._fail(call, ErrorCode.BACKEND_CLOSED, "backend closed", started=self._began(call))
            w.inflight.clear()
        # the workers stopped for idleness (_shrink): each is waited for within its grace
        await asyncio.gather(*self._reaping, return_exceptions=True)

    # -- submission
    def submit(self, inv: Invocation) -> asyncio.Future[Result]:
        fut: asyncio.Future[Result] = self._loop.create_future()
        call = PoolCall(inv, fut, 0)
        if inv.deadline is not None:
            call.deadline_ns = time.monotonic_ns() + int((inv.deadline - time.time()) * 1e9)
        self._enqueue(call)
        return fut

    def adopt(self, call: PoolCall) -> None:
        """Take a call that a pool this one replaced held and never started (``retire``):
        queued here as if submitted now, under its deadline as it is (maybe moved), answered
        through its own future."""
        if self._closed:
            self._fail(call, ErrorCode.BACKEND_CLOSED, "backend closed", started=False)  # never sent
            return
        call.worker, call.cid, call.avoid = None, 0, None
        self._enqueue(call)

    def _enqueue(self, call: PoolCall) -> None:
        inv, fut = call.inv, call.fut
        if call.deadline_ns:
            remaining = (call.deadline_ns - time.monotonic_ns()) / 1e9
            call.timer = self._loop.call_later(max(remaining, 0.0), self._expire, call)
        if self._broken is not None:
            until, message, tb = self._broken
            if time.monotonic() < until and not any(w.usable for w in self._workers):
                self._fail(call, ErrorCode.SETUP_FAILED, message, tb)
                return
            self._broken = None
        if self.spec.is_async:  # an async call can really be cancelled inside the worker
            fut.add_done_callback(functools.partial(self._on_done, call))
        key = inv.idempotency_key
        if key is not None:
            if inv.hedge:
                primary = self._by_key.get(key)
                if primary is not None:
                    call.avoid = primary.worker  # a hedge is worth nothing on the same worker
            else:
                self._by_key[key] = call
        self._pending.append(call)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._dispatch)

    def extend_deadline(self, key: str, deadline: float | None) -> None:
        """Move the deadline of the calls under ``key`` (a keyed execution's attempt and its
        hedge), queued or running, to ``deadline``; a running async call's moves in its worker
        too. A scan, not an index: only a join with a later deadline asks, and a client keeps
        at most ``max_concurrency`` calls of a function (and their hedges) here."""
        deadline_ns = 0 if deadline is None else time.monotonic_ns() + int((deadline - time.time()) * 1e9)
        calls = [c for c in self._pending if c.inv.idempotency_key == key]
        for w in self._workers:
            calls.extend(c for c in w.inflight.values() if c.inv.idempotency_key == key)
        for call in calls:
            if call.fut.done():
                continue
            call.deadline_ns = deadline_ns
            if call.timer is not None:
                call.timer.cancel()
                call.timer = None
            if deadline is not None:
                call.timer = self._loop.call_later(max(deadline - time.time(), 0.0), self._expire, call)
            # a synchronous worker runs a batch in one go: a later message cannot reach its calls
            if call.worker is not None and self.spec.is_async:
                call.worker.send(("extend", call.cid, deadline_ns))

    @property
    def capacity(self) -> int:
        """Calls the pool holds without queueing any: its workers (at the cap) x the calls
        each may hold (``per_worker``, which grows once calls turn out short)."""
        return self.max_workers * self.per_worker

    def watch_capacity(self, grew: Callable[[], None]) -> None:
        """Call ``grew()`` whenever ``capacity`` grows (see ``_on_results``)."""
        self._capacity_watchers.append(grew)

    def settled(self, fut: asyncio.Future[Result]) -> asyncio.Future[None] | None:
        """``None`` when the call behind ``fut`` (a ``submit`` future, done: answered,
        expired or cancelled) is on no worker any more; else a future done when its worker is
        done with it (a synchronous handler runs to its end whatever its caller does). A scan:
        asked only for calls that ended before their worker answered."""
        for w in self._workers:
            for call in w.inflight.values():
                if call.fut is fut:
                    if call.settled is None:
                        call.settled = self._loop.create_future()
                    return call.settled
        return None

    def started(self, fut: asyncio.Future[Result]) -> bool | None:
        """Whether the call behind ``fut`` (a ``submit`` future) has begun to run: ``None``
        when this pool holds it no more (answered, or never here). A scan: asked only of a
        call its caller stopped waiting for."""
        for call in self._pending:
            if call.fut is fut:
                return False
        for w in self._workers:
            for call in w.inflight.values():
                if call.fut is fut:
                    return self._began(call)
        return None

    def stats(self) -> dict[str, Any]:
        return {
            "workers": len(self._workers),
            "ready": sum(w.usable for w in self._workers),
            "pending": len(self._pending),
            "inflight": sum(len(w.inflight) for w in self._workers),
            "max_workers": self.max_workers,
            "warm": self.warm,
            "pids": [w.proc.pid for w in self._workers if w.proc is not None],
            **self.metrics,
        }
