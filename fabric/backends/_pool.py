"""One function's warm pool of worker processes (parent side of ``fabric.worker``).

Calls wait in one FIFO per function and are handed to the least-loaded ready worker in
batches: everything submitted in the same event-loop tick goes out as one message, which
is what makes small calls cheap. The pool keeps ``warm`` workers ready, grows on demand up
to its cap, stops idle extras, replaces dead ones, and kills a worker whose running call
passes its timeout (seen through the worker's shared-memory slot, so a worker stuck in C
code is caught too).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import mmap
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from typing import Any

import pydantic_core

from fabric.backends._wire import SLOT_SIZE, FrameReader, pack, read_slot
from fabric.backends.base import LocalConfig
from fabric.errors import ErrorCode
from fabric.protocol import ErrorInfo, Invocation, Result, Timings
from fabric.spec import FunctionSpec

_TICK_S = 0.05  # maintenance period: timeouts, idle shrink, replenish
_ASYNC_GRACE_S = 1.0  # an async call is enforced in the worker; the parent steps in after this
_MAX_START_FAILURES = 3
_QUEUED_WORK_MS = 2.0  # work a synchronous worker may have queued (see FunctionPool.per_worker)

# exit backstop: whatever a crashed caller failed to close is killed at interpreter exit
_LIVE_PIDS: set[int] = set()


@atexit.register
def _kill_leftovers() -> None:
    for pid in list(_LIVE_PIDS):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class _Call:
    __slots__ = ("avoid", "cid", "deadline_ns", "fut", "inv", "t_submit_ns", "timeout_s", "worker")

    def __init__(self, inv: Invocation, fut: asyncio.Future[Result], timeout_s: float, deadline_ns: int):
        self.inv = inv
        self.fut = fut
        self.t_submit_ns = time.monotonic_ns()
        self.timeout_s = timeout_s
        self.deadline_ns = deadline_ns
        self.cid = 0
        self.worker: _Worker | None = None
        self.avoid: _Worker | None = None


class _Worker(asyncio.Protocol):
    """Parent-side handle of one worker process."""

    def __init__(self, pool: FunctionPool, wid: str, on_demand: bool):
        self.pool = pool
        self.id = wid
        self.on_demand = on_demand
        self.proc: subprocess.Popen[bytes] | None = None
        self.slot: mmap.mmap | None = None
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader()
        self.inflight: dict[int, _Call] = {}
        self.ready = False
        self.ready_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.served = 0
        self.ready_ns = 0
        self.last_active = time.monotonic()
        self.last_progress = self.last_active
        self.lost = False
        self.kill_reason: tuple[int, str] | None = None

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for msg in self.reader.feed(data):
            kind = msg[0]
            if kind == "results":
                self.pool._on_results(self, msg[1])
            elif kind == "ready":
                self.ready = True
                self.ready_ns = time.monotonic_ns()
                if not self.ready_fut.done():
                    self.ready_fut.set_result(None)
            elif kind == "fatal":
                self.pool._on_fatal(self, msg[2], msg[3])

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._on_lost(self)

    def send(self, msg: Any) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(pack(msg))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


class FunctionPool:
    def __init__(self, spec: FunctionSpec, config: LocalConfig, *, cpu: int):
        self.spec = spec
        self.config = config
        self.max_workers = max(1, min(spec.max_concurrency, config.max_workers or cpu))
        self.warm = min(self.max_workers, spec.warm if config.warm is None else config.warm)
        self._exec_ewma_ms: float | None = None
        self._loop = asyncio.get_running_loop()
        self._pending: deque[_Call] = deque()
        self._scheduled = False
        self._workers: list[_Worker] = []
        self._starting = 0
        self._cids = itertools.count(1)
        self._wids = itertools.count(1)
        self._by_key: dict[str, _Call] = {}
        self._closed = False
        self._broken: tuple[float, str, str | None] | None = None  # until, message, traceback
        self._start_failures = 0
        self._maint: asyncio.Task[None] | None = None
        self.metrics = {"spawned": 0, "lost": 0, "timeouts": 0, "cold_starts": 0, "batches": 0, "calls": 0}

    # -- lifecycle
    def start(self) -> None:
        for _ in range(self.warm):
            self._spawn(on_demand=False)
        self._maint = self._loop.create_task(self._maintain())

    async def wait_ready(self, within_s: float | None = None) -> None:
        """Wait until ``warm`` workers are ready (or the pool is broken)."""
        deadline = time.monotonic() + (within_s or self.config.start_timeout_s)
        while sum(w.ready for w in self._workers) < self.warm and self._broken is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.spec.name}: warm workers not ready in time")
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
            if proc is None:
                continue
            # a process exit has no awaitable here (no child watcher): poll briefly, then kill
            while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            w.kill()
            await self._loop.run_in_executor(None, proc.wait)
            _LIVE_PIDS.discard(proc.pid)
            if w.transport is not None:
                w.transport.close()
            for call in list(w.inflight.values()):
                self._fail(call, ErrorCode.BACKEND_CLOSED, "backend closed")
            w.inflight.clear()

    # -- submission
    def submit(self, inv: Invocation) -> asyncio.Future[Result]:
        fut: asyncio.Future[Result] = self._loop.create_future()
        timeout = self.spec.timeout_s
        deadline_ns = 0
        if inv.deadline is not None:
            remaining = inv.deadline - time.time()
            timeout = min(timeout, max(remaining, 0.0))
            deadline_ns = time.monotonic_ns() + int(remaining * 1e9)
        call = _Call(inv, fut, timeout, deadline_ns)
        if self._broken is not None:
            until, message, tb = self._broken
            if time.monotonic() < until:
                self._fail(call, ErrorCode.SETUP_FAILED, message, tb)
                return fut
            self._broken = None
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

    @property
    def per_worker(self) -> int:
        """Calls one worker may hold. Async workers run them concurrently; a synchronous
        worker runs them one after another, so it gets about ``_QUEUED_WORK_MS`` of work:
        cheap calls are batched, slow ones stay in the pool queue for whichever worker
        (maybe a new one) frees up first instead of queueing behind each other."""
        if self.spec.is_async:
            return self.spec.max_concurrency
        if self._exec_ewma_ms is None:
            return min(4, self.spec.max_batch)
        return max(1, min(self.spec.max_batch, int(_QUEUED_WORK_MS / max(self._exec_ewma_ms, 1e-3))))

    def _dispatch(self) -> None:
        self._scheduled = False
        pending = self._pending
        if not pending or self._closed:
            return
        cap = self.per_worker
        ready = [w for w in self._workers if w.ready and not w.lost and len(w.inflight) < cap]
        ready.sort(key=lambda w: len(w.inflight))
        now = time.monotonic_ns()
        for w in ready:
            if not pending:
                break
            room = min(cap - len(w.inflight), self.spec.max_batch)
            batch: list[tuple[int, bytes, int, float]] = []
            skipped: list[_Call] = []
            while pending and len(batch) < room:
                call = pending.popleft()
                if call.fut.done():  # cancelled by the caller (a hedge loser) or failed
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
                batch.append((cid, call.inv.raw_payload, call.deadline_ns, call.timeout_s))
            pending.extendleft(reversed(skipped))
            if batch:
                if len(w.inflight) == len(batch):
                    w.last_progress = time.monotonic()
                w.send(("calls", batch))
                self.metrics["batches"] += 1
        if pending:
            self._grow()

    def _grow(self) -> None:
        # one more worker per tick while calls queue and the cap allows
        alive = len(self._workers)
        if self._broken is None and alive < self.max_workers and self._starting == 0:
            cap = self.per_worker
            busy = all(len(w.inflight) >= cap for w in self._workers if w.ready)
            if busy:
                self._spawn(on_demand=True)

    # -- results
    def _on_results(self, w: _Worker, results: list[tuple[Any, ...]]) -> None:
        now = time.monotonic()
        w.last_progress = w.last_active = now
        served = 0
        ewma = self._exec_ewma_ms
        for cid, ok, out, start_ns, exec_ms in results:
            ewma = exec_ms if ewma is None else 0.9 * ewma + 0.1 * exec_ms
            call = w.inflight.pop(cid, None)
            if call is None:
                continue
            served += 1
            self._forget(call)
            if call.fut.done():
                continue
            # cold: this call waited for its worker to start (import and setup hook included)
            cold = call.t_submit_ns < w.ready_ns
            if cold:
                self.metrics["cold_starts"] += 1
            timings = Timings.model_construct(
                queue_ms=(start_ns - call.t_submit_ns) / 1e6, exec_ms=exec_ms, total_ms=0.0
            )
            inv = call.inv
            if ok:
                res = Result.model_construct(
                    ok=True,
                    function=inv.function,
                    request_id=inv.request_id,
                    value=pydantic_core.from_json(out),
                    error=None,
                    timings=timings,
                    cold_start=cold,
                    worker=w.id,
                    attempts=1,
                    hedged=False,
                    cached=False,
                    index=None,
                )
            else:
                code, message, tb = out
                res = Result.model_construct(
                    ok=False,
                    function=inv.function,
                    request_id=inv.request_id,
                    value=None,
                    error=ErrorInfo.of(code, message, tb),
                    timings=timings,
                    cold_start=cold,
                    worker=w.id,
                    attempts=1,
                    hedged=False,
                    cached=False,
                    index=None,
                )
            call.fut.set_result(res)
        self._exec_ewma_ms = ewma
        w.served += served
        self.metrics["calls"] += served
        if self._pending and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._dispatch)

    def _forget(self, call: _Call) -> None:
        key = call.inv.idempotency_key
        if key is not None and not call.inv.hedge and self._by_key.get(key) is call:
            del self._by_key[key]

    def _fail(self, call: _Call, code: ErrorCode, message: str, tb: str | None = None) -> None:
        self._forget(call)
        if not call.fut.done():
            inv = call.inv
            r = Result.failure(
                code,
                message,
                function=inv.function,
                request_id=inv.request_id,
                traceback=tb,
                worker=call.worker.id if call.worker else None,
            )
            call.fut.set_result(r)

    # -- worker lifecycle
    def _spawn(self, *, on_demand: bool) -> None:
        self._starting += 1
        w = _Worker(self, f"{self.spec.name}-{next(self._wids)}", on_demand)
        self._workers.append(w)
        self._loop.create_task(self._start_worker(w))

    async def _start_worker(self, w: _Worker) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
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
            # a new session: the terminal's Ctrl-C goes to the parent, which shuts us down in order
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
        _LIVE_PIDS.add(w.proc.pid)
        self.metrics["spawned"] += 1
        await self._loop.connect_accepted_socket(lambda: w, parent)
        w.send(
            (
                "init",
                {
                    "entry": self.spec.entry,
                    "sys_path": list(sys.path),
                    "fault": self.config.fault.model_dump() if self.config.fault else None,
                },
            )
        )
        try:
            await asyncio.wait_for(asyncio.shield(w.ready_fut), self.config.start_timeout_s)
        except TimeoutError:
            w.kill()
        except asyncio.CancelledError:
            w.kill()
            raise
        finally:
            self._starting -= 1
        if w.ready:
            self._start_failures = 0
            self._dispatch()

    def _on_fatal(self, w: _Worker, message: str, tb: str | None) -> None:
        # the setup hook or the import failed: no worker of this function can serve now
        msg = f"{self.spec.name}: worker setup failed: {message}"
        self._broken = (time.monotonic() + self.config.setup_failure_cooldown_s, msg, tb)
        while self._pending:
            self._fail(self._pending.popleft(), ErrorCode.SETUP_FAILED, msg, tb)

    def _on_lost(self, w: _Worker) -> None:
        if w.lost:
            return
        w.lost = True
        if w in self._workers:
            self._workers.remove(w)
        if w.proc is not None:
            w.kill()
            proc = w.proc
            self._loop.run_in_executor(None, proc.wait).add_done_callback(
                lambda _: _LIVE_PIDS.discard(proc.pid)
            )
        if self._closed:
            return
        self.metrics["lost"] += 1
        code = w.proc.poll() if w.proc is not None else None
        timed_out = w.kill_reason[0] if w.kill_reason else 0
        for cid, call in list(w.inflight.items()):
            if cid == timed_out:
                self._fail(call, ErrorCode.TIMEOUT, w.kill_reason[1] if w.kill_reason else "timeout")
            else:
                self._fail(
                    call,
                    ErrorCode.WORKER_LOST,
                    f"worker {w.id} died (exit code {code}) with the call in flight",
                )
        w.inflight.clear()
        if not w.ready and self._broken is None:
            self._start_failures += 1
            if self._start_failures >= _MAX_START_FAILURES:
                msg = (
                    f"{self.spec.name}: {self._start_failures} workers in a row died before they were ready "
                    f"(last exit code {code}); see the worker's stderr"
                )
                self._broken = (time.monotonic() + self.config.setup_failure_cooldown_s, msg, None)
                while self._pending:
                    self._fail(self._pending.popleft(), ErrorCode.SETUP_FAILED, msg)
                return
        if self._broken is None and (len(self._workers) < self.warm or self._pending):
            self._spawn(on_demand=len(self._workers) >= self.warm)

    async def _maintain(self) -> None:
        while not self._closed:
            await asyncio.sleep(_TICK_S)
            try:
                self._check_timeouts()
                self._shrink()
                if self._broken is None and not self._starting and len(self._workers) < self.warm:
                    self._spawn(on_demand=False)
            except Exception as e:  # never let the pool's housekeeping die silently
                print(f"fabric: pool maintenance error in {self.spec.name}: {e!r}", file=sys.stderr)

    def _check_timeouts(self) -> None:
        now_ns = time.monotonic_ns()
        now = time.monotonic()
        for w in list(self._workers):
            if not w.inflight or w.slot is None or w.kill_reason:
                continue
            cid, start = read_slot(w.slot)
            call = w.inflight.get(cid) if cid else None
            if call is not None and start and (now_ns - start) / 1e9 > call.timeout_s:
                self._kill_for_timeout(
                    w,
                    call,
                    f"{self.spec.name} ran past its {call.timeout_s:.3g} s limit; "
                    f"its worker was killed and replaced",
                )
            elif self.spec.is_async and now - w.last_progress > call_timeout(w) + _ASYNC_GRACE_S:
                head = next(iter(w.inflight.values()))
                self._kill_for_timeout(
                    w,
                    head,
                    f"{self.spec.name}: worker stopped responding (event loop blocked "
                    "for longer than the timeout); killed and replaced",
                )

    def _kill_for_timeout(self, w: _Worker, call: _Call, message: str) -> None:
        self.metrics["timeouts"] += 1
        w.kill_reason = (call.cid, message)
        w.kill()

    def _shrink(self) -> None:
        now = time.monotonic()
        extra = len(self._workers) - self.warm
        for w in list(self._workers):
            if extra <= 0:
                break
            if w.ready and not w.inflight and now - w.last_active > self.config.idle_window_s:
                extra -= 1
                self._workers.remove(w)
                w.send(("stop",))
                self._loop.create_task(self._reap(w))

    async def _reap(self, w: _Worker) -> None:
        w.lost = True
        await asyncio.sleep(0.5)
        w.kill()
        if w.proc is not None:
            await self._loop.run_in_executor(None, w.proc.wait)
            _LIVE_PIDS.discard(w.proc.pid)
        if w.transport is not None:
            w.transport.close()

    def stats(self) -> dict[str, Any]:
        return {
            "workers": len(self._workers),
            "ready": sum(w.ready for w in self._workers),
            "pending": len(self._pending),
            "inflight": sum(len(w.inflight) for w in self._workers),
            "max_workers": self.max_workers,
            "warm": self.warm,
            "pids": [w.proc.pid for w in self._workers if w.proc is not None],
            **self.metrics,
        }


def call_timeout(w: _Worker) -> float:
    return max(c.timeout_s for c in w.inflight.values())
