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
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import mmap
import os
import socket
import subprocess
import sys
import time
from collections import deque
from typing import Any

from fabric.backends._wire import SLOT_SIZE, read_slot
from fabric.backends._worker_handle import LIVE_PIDS, PoolCall, WorkerHandle, exit_status, exited
from fabric.backends.base import LocalConfig
from fabric.errors import BackendClosedError, BackendError, ErrorCode, SetupFailedError
from fabric.protocol import Invocation, Result
from fabric.runner import outcome_to_result
from fabric.spec import FunctionSpec

_TICK_S = 0.05  # maintenance period: timeouts, idle shrink, replenish
_ASYNC_GRACE_S = 1.0  # an async call is enforced in the worker; the parent steps in after this
_MAX_START_FAILURES = 3
_QUEUED_WORK_MS = 2.0  # work a synchronous worker may have queued (see FunctionPool.per_worker)
_MAX_REQUEUES = 3  # a call queued on workers that died before running it: re-dispatched this often
_DEAD_OPEN_S = 0.5  # a dead worker's socket still open this long: closed by the pool (_dead_but_open)


class FunctionPool:
    def __init__(self, spec: FunctionSpec, config: LocalConfig, *, cpu: int):
        self.spec = spec
        self.config = config
        self.max_workers = max(1, min(spec.max_concurrency, config.max_workers or cpu))
        self.warm = min(self.max_workers, spec.warm if config.warm is None else config.warm)
        self._loop = asyncio.get_running_loop()
        self._pending: deque[PoolCall] = deque()
        self._scheduled = False
        self._workers: list[WorkerHandle] = []
        self._starting = 0
        self._cids = itertools.count(1)
        self._wids = itertools.count(1)
        self._by_key: dict[str, PoolCall] = {}
        self._closed = False
        # nothing can serve (set only while no worker is usable or starting): calls fail fast
        self._broken: tuple[float, str, str | None] | None = None  # until, message, traceback
        self._last_start_failure: tuple[str, str | None] | None = None  # message, traceback
        self._no_spawn_until = 0.0
        self._start_failures = 0
        self._exec_ewma_ms: float | None = None
        self._maint: asyncio.Task[None] | None = None
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
        """Wait until ``warm`` workers are ready.

        Raises ``SetupFailedError`` when none can be: the setup hook or the import raised, or
        starts failed or timed out until the pool gave up. A pool that serves with fewer
        workers because one of them failed to start counts as ready: calls are answered.
        """
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
            if ready >= self.warm or (ready and self.metrics["start_failures"] > failures):
                return
            if self._broken is not None:
                _, message, tb = self._broken
                raise SetupFailedError(message, tb)
            if time.monotonic() > deadline:
                last = self._last_start_failure
                raise BackendError(
                    f"{self.spec.name}: {ready} of {self.warm} warm workers ready after {limit:.3g} s"
                    + (f"; the last failed start: {last[0]}" if last else "")
                )
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._closed = True
        if self._maint is not None:
            self._maint.cancel()
        while self._pending:
            self._fail(self._pending.popleft(), ErrorCode.BACKEND_CLOSED, "backend closed")
        workers = list(self._workers)
        for w in workers:
            w.send(("stop",))
        deadline = time.monotonic() + 1.0
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
                self._settle(call)
                self._fail(call, ErrorCode.BACKEND_CLOSED, "backend closed")
            w.inflight.clear()

    # -- submission
    def submit(self, inv: Invocation) -> asyncio.Future[Result]:
        fut: asyncio.Future[Result] = self._loop.create_future()
        call = PoolCall(inv, fut, 0)
        if inv.deadline is not None:
            remaining = inv.deadline - time.time()
            call.deadline_ns = time.monotonic_ns() + int(remaining * 1e9)
            call.timer = self._loop.call_later(max(remaining, 0.0), self._expire, call)
        if self._broken is not None:
            until, message, tb = self._broken
            if time.monotonic() < until and not any(w.usable for w in self._workers):
                self._fail(call, ErrorCode.SETUP_FAILED, message, tb)
                return fut
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
        return fut

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

    @staticmethod
    def _settle(call: PoolCall) -> None:
        if call.settled is not None and not call.settled.done():
            call.settled.set_result(None)

    def _expire(self, call: PoolCall) -> None:
        if call.worker is not None and call.inv.wait_for_run:
            return  # its worker answers: it cancels an async handler there, a sync one runs on
        where = "while running; its result will be discarded" if call.worker else "while queued"
        self._fail(call, ErrorCode.DEADLINE_EXCEEDED, f"deadline passed {where}")

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
                    self._fail(call, ErrorCode.DEADLINE_EXCEEDED, "deadline passed while queued")
                    continue
                cid = next(self._cids)
                call.cid = cid
                call.worker = w
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

    def _can_spawn(self) -> bool:
        return (
            not self._closed
            and self._broken is None
            and len(self._workers) < self.max_workers
            and time.monotonic() >= self._no_spawn_until
        )

    def _grow(self) -> None:
        # one more worker at a time while calls queue and the cap allows
        if self._starting == 0 and self._can_spawn():
            cap = self.per_worker
            if all(len(w.inflight) >= cap for w in self._workers if w.usable):
                self._spawn()

    # -- results
    def _on_results(self, w: WorkerHandle, results: list[tuple[Any, ...]]) -> None:
        now = time.monotonic()
        w.last_progress = w.last_active = now
        served = 0
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
            at_deadline = not ok and out[0] == ErrorCode.TIMEOUT and self._cut_at_deadline(call, start_ns)
            if at_deadline and not call.inv.wait_for_run:
                # the worker's cut came in before the call's own timer (the loop was busy past
                # the deadline and reads sockets before timers): answered as _expire answers it
                out = (
                    ErrorCode.DEADLINE_EXCEEDED,
                    "deadline passed while running; the call was cancelled",
                    None,
                )
            res = outcome_to_result(
                call.inv, ok, out, exec_ms=exec_ms, worker=w.id, cold=cold, queue_ms=queue_ms
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

    def _fail(self, call: PoolCall, code: ErrorCode, message: str, tb: str | None = None) -> None:
        self._forget(call)
        if call.timer is not None:
            call.timer.cancel()
        if not call.fut.done():
            inv = call.inv
            wid = call.worker.id if call.worker else None
            r = Result.failure(
                code, message, function=inv.function, request_id=inv.request_id, traceback=tb, worker=wid
            )
            call.fut.set_result(r)

    def _fail_pending(self, code: ErrorCode, message: str, tb: str | None = None) -> None:
        while self._pending:
            self._fail(self._pending.popleft(), code, message, tb)

    # -- worker lifecycle
    def _spawn(self) -> None:
        self._starting += 1
        w = WorkerHandle(self, f"{self.spec.name}-{next(self._wids)}")
        self._workers.append(w)
        self._loop.create_task(self._start_worker(w))

    async def _start_worker(self, w: WorkerHandle) -> None:
        try:
            await self._launch(w)
            await asyncio.wait_for(asyncio.shield(w.ready_fut), self.config.start_timeout_s)
        except TimeoutError:
            # counted now, before a replacement can start: a worker that is still starting
            # keeps the pool from failing fast (see _start_failed)
            limit = self.config.start_timeout_s
            self._start_failed(
                w,
                f"a worker did not become ready within start_timeout_s={limit:g} s (import and "
                "setup hook) and was killed; if they are this slow, raise LocalConfig(start_timeout_s=...)",
            )
        except asyncio.CancelledError:
            w.kill()
            raise
        except Exception as e:  # the spawn itself failed (no process, no fds): never wedge the pool
            self._start_failed(w, f"cannot start a worker: {type(e).__name__}: {e}")
        finally:
            self._starting -= 1
        if w.usable:
            self._start_failures = 0
        if not self._closed and self._pending:
            self._dispatch()

    async def _launch(self, w: WorkerHandle) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            shm_fd = os.memfd_create("fabric-slot", 0)
            try:
                os.ftruncate(shm_fd, SLOT_SIZE)
                w.slot = mmap.mmap(shm_fd, SLOT_SIZE)
                env = dict(os.environ)
                env.update(
                    FABRIC_WORKER_FD=str(child.fileno()),
                    FABRIC_WORKER_SHM=str(shm_fd),
                    FABRIC_PARENT_PID=str(os.getpid()),
                    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                )
                # a new session: the terminal's Ctrl-C goes to the parent, which shuts us down in order,
                # and the worker's process group holds what it starts (WorkerHandle.kill kills it all).
                # fork+exec takes a few ms; doing it on the loop keeps spawns ordered and simple
                w.proc = subprocess.Popen(  # noqa: ASYNC220
                    [sys.executable, "-m", "fabric.worker"],
                    pass_fds=(child.fileno(), shm_fd),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            finally:
                child.close()
                os.close(shm_fd)
            LIVE_PIDS.add(w.proc.pid)
            self.metrics["spawned"] += 1
            await self._loop.connect_accepted_socket(lambda: w, parent)
        except BaseException:
            parent.close()
            raise
        fault = self.config.fault.model_dump() if self.config.fault else None
        w.send(("init", {"entry": self.spec.entry, "sys_path": list(sys.path), "fault": fault}))

    def _start_failed(self, w: WorkerHandle, message: str, tb: str | None = None) -> None:
        """A worker that never became ready: after a few in a row, stop trying for a while."""
        w.lost = True
        w.kill()
        if w in self._workers:
            self._workers.remove(w)
        self.metrics["start_failures"] += 1
        self._start_failures += 1
        if self._closed:
            return
        msg = f"{self.spec.name}: {message}"
        self._last_start_failure = (msg, tb)
        cooldown = time.monotonic() + self.config.setup_failure_cooldown_s
        if any(x.usable for x in self._workers):
            self._no_spawn_until = cooldown  # the healthy workers keep serving the queue
        elif any(x.starting for x in self._workers):
            # a sibling is still starting: a transient failure (a flaky download, an OOM) says
            # nothing about it, so the queue waits for it; if it fails too, its failure decides
            pass
        elif w.fatal or self._start_failures >= _MAX_START_FAILURES:
            self._broken = (cooldown, msg, tb)  # nothing can serve: fail fast until the cooldown ends
            self._fail_pending(ErrorCode.SETUP_FAILED, msg, tb)

    def _on_ready(self, w: WorkerHandle) -> None:
        # a worker that can serve ends any fail-fast period (see _broken)
        self._broken = None

    def _on_fatal(self, w: WorkerHandle, message: str, tb: str | None) -> None:
        # the import or the setup hook raised: this is the function's fault, not the machine's
        w.fatal = True
        w.settle_start()
        self._start_failed(w, f"worker setup failed: {message}", tb)

    def _on_lost(self, w: WorkerHandle) -> None:
        w.settle_start()
        if w.proc is not None:
            w.kill()
            proc = w.proc
            self._loop.run_in_executor(None, proc.wait).add_done_callback(
                lambda _: LIVE_PIDS.discard(proc.pid)
            )
        if w.lost:  # stopped on purpose, or already handled
            return
        if self._closed:
            w.lost = True
            return
        if not w.ready:
            status = exit_status(w.proc) if w.proc is not None else "never started"
            self._start_failed(w, f"a worker died before it was ready ({status}); see its stderr")
            return
        w.lost = True
        if w in self._workers:
            self._workers.remove(w)
        self.metrics["lost"] += 1
        if w.kill_reason:  # killed by us: the reason is known, no need to wait for the status
            code = "killed: a call ran past the function's timeout"
        else:
            code = exit_status(w.proc) if w.proc is not None else "never started"
        timed_out = w.kill_reason[0] if w.kill_reason else 0
        # a synchronous worker runs its calls one at a time in cid order; its slot holds the
        # last one it started, with a start while it runs. That one, if still running, died
        # with it. Those up to it ran: their answers are lost with the worker (a worker sends
        # each before its next call starts, but a straggling one may be held back, even while
        # the worker is idle), and running them again could apply a side effect twice. Those
        # after it never started, so they are safe to retry even for functions with side effects
        running, started = (-1, 0)
        if w.slot is not None and not self.spec.is_async:
            running, started = read_slot(w.slot)
        requeue: list[PoolCall] = []
        for cid, call in list(w.inflight.items()):
            self._settle(call)
            if cid == timed_out and w.kill_reason:
                self._fail(call, ErrorCode.TIMEOUT, w.kill_reason[1])
            elif running == -1 or (cid == running and started):
                self._fail(call, ErrorCode.WORKER_LOST, f"worker {w.id} died ({code}) running the call")
            elif cid <= running:
                msg = f"worker {w.id} died ({code}) after running the call, before its answer arrived"
                self._fail(call, ErrorCode.WORKER_LOST, msg)
            elif call.requeues < _MAX_REQUEUES and not call.fut.done():
                # it never ran: back to the head of the queue, for another worker, without
                # spending one of the caller's attempts (a neighbour's timeout is not its fault)
                call.requeues += 1
                call.worker, call.cid = None, 0
                requeue.append(call)
            else:
                msg = f"worker {w.id} died ({code}) before the call started"
                self._fail(call, ErrorCode.NOT_STARTED, msg)
        w.inflight.clear()
        if requeue:
            self.metrics["requeued"] += len(requeue)
            self._pending.extendleft(reversed(requeue))
            if not self._scheduled:
                self._scheduled = True
                self._loop.call_soon(self._dispatch)
        if self._can_spawn() and (len(self._workers) < self.warm or self._pending):
            self._spawn()

    async def _maintain(self) -> None:
        while not self._closed:
            await asyncio.sleep(_TICK_S)
            try:
                self._check_timeouts()
                self._shrink()
                if not self._starting and len(self._workers) < self.warm and self._can_spawn():
                    self._spawn()
                if self._pending and not self._scheduled:
                    self._dispatch()  # e.g. after a spawn cooldown ended
            except Exception as e:  # never let the pool's housekeeping die silently
                print(f"fabric: pool maintenance error in {self.spec.name}: {e!r}", file=sys.stderr)

    def _check_timeouts(self) -> None:
        now_ns = time.monotonic_ns()
        now = time.monotonic()
        limit = self.spec.timeout_s
        for w in list(self._workers):
            if w.proc is not None and w.transport is not None and exited(w.proc):
                self._dead_but_open(w, now)
                continue
            if not w.inflight or w.slot is None or w.kill_reason:
                continue
            if self.spec.is_async:
                if now - w.last_progress > limit + _ASYNC_GRACE_S:
                    head = next(iter(w.inflight.values()))
                    msg = f"{self.spec.name}: worker stopped responding (event loop blocked past the timeout)"
                    self._kill_for_timeout(w, head, msg + "; killed and replaced")
                continue
            cid, start = read_slot(w.slot)
            call = w.inflight.get(cid) if cid else None
            if call is not None and start and (now_ns - start) / 1e9 > limit:
                msg = f"{self.spec.name} ran past its {limit:.3g} s limit; its worker was killed and replaced"
                self._kill_for_timeout(w, call, msg)

    def _dead_but_open(self, w: WorkerHandle, now: float) -> None:
        """A worker's process ended and its socket has not closed: its EOF is on its way, or a
        process it started (a forked helper) holds a copy of the socket, and no EOF comes while
        that one lives. The worker's calls would wait for good, and it would never be replaced
        (a worker killed for a timeout included). Its process group is killed at once (the
        helper with it: no orphan); if the socket is still open a while later (a helper that
        left the group), the pool closes its end, by then having read all the worker sent
        before it died, and the worker counts as lost (``_on_lost``)."""
        if w.dead_since is None:
            w.dead_since = now
            w.kill()
        elif now - w.dead_since >= _DEAD_OPEN_S and w.transport is not None:
            w.transport.abort()

    def _kill_for_timeout(self, w: WorkerHandle, call: PoolCall, message: str) -> None:
        self.metrics["timeouts"] += 1
        w.kill_reason = (call.cid, message)
        w.kill()

    def _shrink(self) -> None:
        if self._pending:  # calls are waiting: a worker without any is about to get some
            return
        now = time.monotonic()
        extra = len(self._workers) - self.warm
        for w in list(self._workers):
            if extra <= 0:
                break
            if w.usable and not w.inflight and now - w.last_active > self.config.idle_window_s:
                extra -= 1
                self._workers.remove(w)
                w.lost = True
                w.send(("stop",))
                self._loop.create_task(self._reap(w))

    async def _reap(self, w: WorkerHandle) -> None:
        await asyncio.sleep(0.5)
        w.kill()
        if w.proc is not None:
            await self._loop.run_in_executor(None, w.proc.wait)
            LIVE_PIDS.discard(w.proc.pid)
        if w.transport is not None:
            w.transport.close()

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
