"""How a ``FunctionPool`` hands its calls to its workers and answers them: the queue sent
in batches to the least-loaded ready worker (each worker holding what ``per_worker`` allows),
a hedge kept off its primary's worker, the workers' answers turned into ``Result``s, and a
call failed, expired or cancelled.

The pool is built in layers, each on the one before: this one, the supervision of its
workers (``_pool_workers.PoolWorkers``), and the public face (``_pool.FunctionPool``). The
pool's state is declared here, so that each layer type-checks on its own, and set in
``FunctionPool.__init__``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fabric.backends._wire import read_slot
from fabric.backends._worker_handle import PoolCall, WorkerHandle
from fabric.backends.base import LocalConfig
from fabric.errors import ErrorCode
from fabric.protocol import Result
from fabric.runner import outcome_to_result
from fabric.spec import FunctionSpec

_QUEUED_WORK_MS = 2.0  # work a synchronous worker may have queued (see FunctionPool.per_worker)


class PoolDispatch:
    """Calls on their way to the workers and back (see the module docstring)."""

    spec: FunctionSpec
    config: LocalConfig
    max_workers: int
    warm: int
    _loop: asyncio.AbstractEventLoop
    _pending: deque[PoolCall]
    _scheduled: bool
    _workers: list[WorkerHandle]
    _starting: int
    _cids: itertools.count[int]
    _wids: itertools.count[int]
    _by_key: dict[str, PoolCall]
    _closed: bool
    _broken: tuple[float, str, str | None] | None
    _last_start_failure: tuple[str, str | None] | None
    _no_spawn_until: float
    _start_failures: int
    _exec_ewma_ms: float | None
    _maint: asyncio.Task[None] | None
    _reaping: set[asyncio.Task[None]]
    _capacity_watchers: list[Callable[[], None]]
    _successor: Callable[[], Any] | None
    _snapshot: list[tuple[str, str, bytes]]
    _unkept: list[str] | None
    metrics: dict[str, int]

    if TYPE_CHECKING:
        # in the layer above (PoolWorkers): a queue left after a dispatch may start a worker
        def _grow(self) -> None: ...

        # in the top layer (FunctionPool): a retired pool's queue, to the function's pool now
        def _hand_over(self) -> None: ...

    def _hand_over_if_stranded(self) -> None:
        """A retired pool (``FunctionPool.retire``) starts no worker: calls still queued
        when none of its workers can serve them any more go to the pool that replaced it."""
        if self._successor is not None and self._pending and not self._closed:
            if not any(w.usable or w.starting for w in self._workers):
                self._hand_over()

    @staticmethod
    def _settle(call: PoolCall) -> None:
        if call.settled is not None and not call.settled.done():
            call.settled.set_result(None)

    def _expire(self, call: PoolCall) -> None:
        if call.worker is not None and call.inv.wait_for_run:
            return  # its worker answers: it cancels an async handler there, a sync one runs on
        began = self._began(call)
        if began:
            where = "while running; its result will be discarded"
        elif call.worker is not None:
            where = f"while queued on worker {call.worker.id}, behind its other calls (it did not start)"
        else:
            where = "while queued"
        self._fail(call, ErrorCode.DEADLINE_EXCEEDED, f"deadline passed {where}", started=began)

    def _began(self, call: PoolCall) -> bool:
        """Whether ``call``'s execution has begun (it may have ended since). A call in the
        queue has not; one sent to an async worker has (the worker starts each on receipt,
        unless it finds it past its deadline, which it answers as not started). A synchronous
        worker runs its calls one at a time in cid order, and its slot holds the last one it
        started: one sent to it with a cid past that one waits there, behind the others."""
        w = call.worker
        if w is None:
            return False
        if self.spec.is_async or w.slot is None:
            return True
        running, _ = read_slot(w.slot)
        return call.cid <= running

    def _on_done(self, call: PoolCall, fut: asyncio.Future[Result]) -> None:
        w = call.worker
        if fut.cancelled() and w is not None and call.cid in w.inflight:
            w.send(("cancel", call.cid))

    @property
    def per_worker(self) -> int:
        """Calls one worker may hold. Async workers run them concurrently; a synchronous
        worker runs them one after another, so it gets about ``_QUEUED_WORK_MS`` of work:
        cheap calls are batched, slow ones stay in the pool queue for whichever worker
        (maybe a new one) frees up first instead of queueing behind each other."""
        if self.spec.is_async:
            return self.spec.max_concurrency
        if self._exec_ewma_ms is None:
            # one at a time until the first answer says how long a call takes: a slow call's
            # batch-mates would wait behind it in the worker, where a caller that gives up on
            # them (a timeout, a hedge that lost) cannot take them back and they run anyway
            return 1
        return max(1, min(self.spec.max_batch, int(_QUEUED_WORK_MS / max(self._exec_ewma_ms, 1e-3))))

    def _dispatch(self) -> None:
        self._scheduled = False
        pending = self._pending
        if not pending or self._closed:
            return
        cap = self.per_worker
        ready = [w for w in self._workers if w.usable and len(w.inflight) < cap]
        ready.sort(key=lambda w: len(w.inflight))
        now = time.monotonic_ns()
        for w in ready:
            if not pending:
                break
            room = min(cap - len(w.inflight), self.spec.max_batch)
            batch: list[tuple[int, bytes, int, float]] = []
            skipped: list[PoolCall] = []
            while pending and len(batch) < room:
                call = pending.popleft()
                if call.fut.done():  # cancelled by the caller (a hedge loser), expired or failed
                    self._forget(call)
                    continue
                if call.avoid is w and len(ready) > 1:
                    skipped.append(call)
                    continue
                if call.deadline_ns and now > call.deadline_ns:
                    self._fail(
                        call, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued", started=False
                    )
                    continue
                cid = next(self._cids)
                call.cid = cid
                call.worker = w
                call.sent_ns = now
                w.inflight[cid] = call
                timeout = self.spec.timeout_s
                if call.deadline_ns:  # an async handler is cancelled at the deadline, in the worker
                    timeout = min(timeout, max((call.deadline_ns - now) / 1e9, 0.0))
                batch.append((cid, call.inv.raw_payload, call.deadline_ns, timeout))
            pending.extendleft(reversed(skipped))
            if batch:
                if len(w.inflight) == len(batch):
                    w.last_progress = time.monotonic()
                w.send(("calls", batch))
                self.metrics["batches"] += 1
        if pending:
            self._grow()

    # -- results
    def _on_results(self, w: WorkerHandle, results: list[tuple[Any, ...]]) -> None:
        now = time.monotonic()
        w.last_progress = w.last_active = now
        served = 0
        room = self.per_worker
        ewma = self._exec_ewma_ms
        for cid, ok, out, start_ns, exec_ms in results:
            ewma = exec_ms if ewma is None else 0.9 * ewma + 0.1 * exec_ms
            call = w.inflight.pop(cid, None)
            if call is None:
                continue
            self._settle(call)
            if not ok and out[0] == ErrorCode.DEADLINE_EXCEEDED and self._requeue_moved(call):
                continue
            served += 1
            self._forget(call)
            if call.timer is not None:
                call.timer.cancel()
            if call.fut.done():  # expired, or a cancelled hedge loser
                continue
            # cold: this call waited for its worker to start (import and setup hook included)
            cold = call.t_submit_ns < w.ready_ns
            if cold:
                self.metrics["cold_starts"] += 1
            queue_ms = (start_ns - call.t_submit_ns) / 1e6
            # a worker answers DeadlineExceeded only for a call it found late, before starting it;
            # BackendClosed for one its stop cut off, running or not yet begun, as _began tells
            started = None
            if not ok and out[0] == ErrorCode.DEADLINE_EXCEEDED:
                started = False
            elif not ok and out[0] == ErrorCode.BACKEND_CLOSED:
                started = self._began(call)
            at_deadline = not ok and out[0] == ErrorCode.TIMEOUT and self._cut_at_deadline(call, start_ns)
            if at_deadline and not call.inv.wait_for_run:
                # the worker's cut came in before the call's own timer (the loop was busy past
                # the deadline and reads sockets before timers): answered as _expire answers it
                out = (
                    ErrorCode.DEADLINE_EXCEEDED,
                    "deadline passed while running; the call was cancelled",
                    None,
                )
                started = True
            res = outcome_to_result(
                call.inv,
                ok,
                out,
                exec_ms=exec_ms,
                worker=w.id,
                cold=cold,
                queue_ms=queue_ms,
                started=started,
                version=self.spec.version,  # the pool's code: a replaced pool's runs end on theirs
            )
            if at_deadline and call.inv.wait_for_run:
                res.cut_at_deadline = True  # the callers' deadline, not the infrastructure
            call.fut.set_result(res)
        self._exec_ewma_ms = ewma
        w.served += served
        self.metrics["calls"] += served
        if self._pending and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._dispatch)
        if self.per_worker > room:  # calls turned out short: each worker holds more of them
            for grew in self._capacity_watchers:
                grew()

    def _cut_at_deadline(self, call: PoolCall, start_ns: int) -> bool:
        """Whether a ``FunctionTimeout`` from the worker was its cut at the call's deadline
        (as it is now: moved or not), not at the function's ``timeout_s``: an async handler
        is cut at whichever comes first from its start (a synchronous one only at
        ``timeout_s``, by the pool)."""
        limit_ns = start_ns + int(self.spec.timeout_s * 1e9)
        return self.spec.is_async and 0 < call.deadline_ns < limit_ns

    def _requeue_moved(self, call: PoolCall) -> bool:
        """A worker answers DeadlineExceeded only for a call it found past the deadline it was
        sent with, before starting it. For a keyed execution's call whose deadline moved since
        (a caller with a later one joined: ``extend_deadline``), that answer is stale: a
        synchronous worker takes a batch in one go and cannot read the move, and an async one
        checks on receipt. Nothing ran, so the call goes back to the head of the queue under
        its moved deadline (sent with it this time; its timer already follows it), and no
        side-effect question arises. True when requeued."""
        if call.fut.done() or not call.inv.wait_for_run:
            return False
        if call.deadline_ns and time.monotonic_ns() >= call.deadline_ns:
            return False  # not moved (or moved, and passed too): the answer stands
        call.worker, call.cid = None, 0
        self.metrics["requeued"] += 1
        self._pending.appendleft(call)
        return True

    def _forget(self, call: PoolCall) -> None:
        key = call.inv.idempotency_key
        if key is not None and not call.inv.hedge and self._by_key.get(key) is call:
            del self._by_key[key]

    def _fail(
        self,
        call: PoolCall,
        code: ErrorCode,
        message: str,
        tb: str | None = None,
        *,
        started: bool | None = None,
    ) -> None:
        self._forget(call)
        if call.timer is not None:
            call.timer.cancel()
        if not call.fut.done():
            inv = call.inv
            wid = call.worker.id if call.worker else None
            r = Result.failure(
                code,
                message,
                function=inv.function,
                request_id=inv.request_id,
                traceback=tb,
                worker=wid,
                started=started,
            )
            call.fut.set_result(r)

    def _fail_pending(self, code: ErrorCode, message: str, tb: str | None = None) -> None:
        while self._pending:
            self._fail(self._pending.popleft(), code, message, tb)
