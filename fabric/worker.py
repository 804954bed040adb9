"""The worker process of the local backend: ``python -m fabric.worker``.

One worker serves one function. It imports the function once, runs its setup hook once,
then serves batches of calls from its parent over a socketpair until the parent says stop
or goes away. Every call runs in this warm process; a user exception is returned as data.

Orphans are impossible by construction: the kernel kills us when the parent dies
(PR_SET_PDEATHSIG), and we exit on EOF of the parent's socket.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import functools
import mmap
import os
import random
import signal
import socket
import sys
import time
import traceback
from collections import deque
from typing import Any

from fabric.backends._wire import SLOT, SLOT_SIZE, FrameReader, pack
from fabric.errors import ErrorCode

IMPORTING_ENV = "_FABRIC_WORKER_IMPORTING"


def _late() -> tuple[str, str, None]:
    return (ErrorCode.DEADLINE_EXCEEDED, "deadline passed before the call started", None)


def _die_with_parent(parent_pid: int) -> None:
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class _Frames:
    """The parent's frames read blocking, before the worker serves: its ("init"). A read
    returns whatever the socket holds, so the init comes with what the pool sent right after
    it (a ("stop"): the pool closed while this worker started), and a large one (a kept
    module's text) ends in a read that may hold the start of the next frame. Nothing is
    dropped: the messages read and not yet taken, and the reader with its partial frame,
    go on to the serving protocol (``_Serve``), which reads on from there."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader()
        self.queued: deque[Any] = deque()

    def recv(self) -> Any:
        while not self.queued:
            data = self.sock.recv(1 << 16)
            if not data:  # the parent went away
                os._exit(0)
            self.queued.extend(self.reader.feed(data))
        return self.queued.popleft()

    def stopped(self) -> bool:
        """Whether a ("stop") was read already."""
        return any(msg[0] == "stop" for msg in self.queued)


class _Serve(asyncio.Protocol):
    def __init__(
        self,
        runner: Any,
        slot: mmap.mmap,
        fault: dict[str, Any] | None,
        done: asyncio.Future[None],
        frames: _Frames | None = None,
    ):
        self.runner = runner
        self.slot = slot
        # read on where the init's reads stopped: their messages first, then their partial frame
        self.reader = frames.reader if frames is not None else FrameReader()
        self.backlog = list(frames.queued) if frames is not None else []
        self.done = done
        self.transport: asyncio.Transport | None = None
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.timers: dict[int, tuple[int, asyncio.Timeout]] = {}  # async calls: start_ns, timer
        # a deadline moved before its call's task made its timer (the extend came in the chunk
        # that brought the call): applied when the timer is made
        self.pending: dict[int, int] = {}
        # synchronous calls not started yet, run one at a time by one task (_run_sync)
        self.queue: deque[tuple[int, bytes, int, float]] = deque()
        self.sync_task: asyncio.Task[None] | None = None
        self.flushed = asyncio.Event()  # set while no reply waits in the transport's buffer
        self.flushed.set()
        self.fault_rate = float(fault["straggler_rate"]) if fault else 0.0
        self.fault_s = float(fault["straggler_ms"]) / 1000 if fault else 0.0
        self.rng = random.Random(fault.get("seed", 0) * 1_000_003 + os.getpid() if fault else 0)
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        self.transport = transport  # type: ignore[assignment]
        if not self.runner.is_async:
            # pause_writing as soon as a reply does not go into the socket whole (see _run_sync)
            transport.set_write_buffer_limits(high=0)
        if self.backlog:
            backlog, self.backlog = self.backlog, []
            self._handle(backlog)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def pause_writing(self) -> None:
        self.flushed.clear()

    def resume_writing(self) -> None:
        self.flushed.set()

    def data_received(self, data: bytes) -> None:
        self._handle(self.reader.feed(data))

    def _handle(self, msgs: list[Any]) -> None:
        for msg in msgs:
            kind = msg[0]
            if kind == "calls":
                self._calls(msg[1])
            elif kind == "cancel":
                task = self.tasks.get(msg[1])
                if task is not None:
                    task.cancel()
            elif kind == "extend":
                self._extend(msg[1], msg[2])
            elif kind == "stop":
                if not self.done.done():
                    self.done.set_result(None)

    # -- results
    def _reply(self, item: tuple[Any, ...]) -> None:
        """Send one result now. Results are never held back for a batch: a finished call
        must not be lost (and so re-run) if the next call in the batch hangs and is killed."""
        # fault injection: a straggling reply is held back without blocking the worker
        if self.fault_rate and self.rng.random() < self.fault_rate:
            self.loop.call_later(self.fault_s, self._send, item)
        else:
            self._send(item)

    def _send(self, item: tuple[Any, ...]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(pack(("results", [item])))

    def _calls(self, calls: list[tuple[int, bytes, int, float]]) -> None:
        if not self.runner.is_async:
            self.queue.extend(calls)
            if self.sync_task is None:
                self.sync_task = self.loop.create_task(self._run_sync())
            return
        for cid, raw, deadline_ns, timeout_s in calls:
            start = time.monotonic_ns()
            if deadline_ns and start > deadline_ns:
                self._reply((cid, False, _late(), start, 0.0))
                continue
            task = self.loop.create_task(self._run_async(cid, raw, timeout_s, start))
            task.add_done_callback(functools.partial(self._cancelled_unstarted, cid, start))
            self.tasks[cid] = task

    def _cancelled_unstarted(self, cid: int, start: int, task: asyncio.Task[None]) -> None:
        """Answer a call whose task was cancelled before it first ran: its ("cancel") came in
        the chunk that brought it (a hedge that lost as it was dispatched). Such a task never
        enters ``_run_async``, so neither its clean-up nor its reply would happen: the parent
        would hold the call for good, taking one of the worker's places. A task that ran
        replies itself (it catches the cancellation), so it never ends cancelled."""
        if not task.cancelled():
            return
        self.tasks.pop(cid, None)
        self.pending.pop(cid, None)
        self._reply((cid, False, self._cancelled(began=False), start, 0.0))

    def _cancelled(self, *, began: bool) -> tuple[str, str, None]:
        """The answer to a call whose task was cancelled: by its caller (a ("cancel")), or by
        this worker's end (told to stop, or its parent's socket closed: ``asyncio.run`` then
        cancels what still runs). The latter is the backend closing under the call, not a
        caller that gave up on it: it must not read as ``Cancelled``."""
        if self.done.done():
            what = "while the call ran; it was cancelled" if began else "before the call started"
            return (ErrorCode.BACKEND_CLOSED, f"backend closed {what}", None)
        return (
            ErrorCode.CANCELLED,
            "cancelled by the caller" if began else "cancelled by the caller before it started",
            None,
        )

    async def _run_sync(self) -> None:
        """Run the synchronous calls one after another, in the order they came (their cids'),
        each in the slot while it runs. A call's reply is wholly in the socket (the parent
        reads it even if this process dies next) before the next call starts: were it still
        in the transport's buffer, a death in the next call would lose it, and the parent
        would take the finished call for one that never started and run it again (twice, for
        a side effect). Once it has run, the slot keeps its cid, with no start: a reply held
        back (an injected straggler) is in no buffer, and a worker that dies idle before
        sending it must still show the call ran. So the parent reads a death as: the call in
        the slot with a start was running, the ones up to the slot's cid ran, the ones after
        never started (``FunctionPool._on_lost``). A reply that goes out whole at once (the
        usual case) costs no wait: the batch runs in one go."""
        runner, slot, queue = self.runner, self.slot, self.queue
        try:
            while queue:
                cid, raw, deadline_ns, _ = queue.popleft()
                start = time.monotonic_ns()
                if deadline_ns and start > deadline_ns:
                    self._reply((cid, False, _late(), start, 0.0))  # it never ran: the slot stays
                    await self.flushed.wait()
                    continue
                SLOT.pack_into(slot, 0, cid, start)
                # the pool kills the run at timeout_s from its start; its caller stops waiting
                # at the deadline (a move later cannot reach this busy loop)
                end_ns = start + int(runner.spec.timeout_s * 1e9)
                ok, res = runner.run(raw, min(end_ns, deadline_ns or end_ns) / 1e9)
                self._reply((cid, ok, res, start, (time.monotonic_ns() - start) / 1e6))
                await self.flushed.wait()
                SLOT.pack_into(slot, 0, cid, 0)  # ran, not running: no timeout applies
        except Exception:  # a bug of ours, not the function's (its raises are outcomes)
            # end the worker, as an exception out of data_received did: the parent sees it
            # die (WorkerLost for the call in the slot) instead of waiting for its timeout
            traceback.print_exc()
            if self.transport is not None:
                self.transport.abort()
        finally:
            self.sync_task = None

    async def _run_async(self, cid: int, raw: bytes, timeout_s: float, start: int) -> None:
        def keep(timer: asyncio.Timeout) -> None:
            self.timers[cid] = (start, timer)
            deadline_ns = self.pending.pop(cid, None)
            if deadline_ns is not None:
                self._extend(cid, deadline_ns)

        try:
            ok, res = await self.runner.run_async(raw, timeout_s, keep)
        except asyncio.CancelledError:
            ok, res = False, self._cancelled(began=True)
        except Exception as e:  # a bug of ours, not the function's (its raises are outcomes)
            # answered, or the parent would hold the call until it killed this worker for the
            # function's timeout, losing its other calls. The worker's other calls run on, so
            # it is not ended as a synchronous one is (_run_sync); as there, the call counts
            # as lost running: it may have run (the raise may come after the handler returned)
            traceback.print_exc()
            try:
                what = f"{type(e).__name__}: {e}"
            except Exception:  # its str() raised: the answer must still go out
                what = type(e).__name__
            msg = f"worker error running the call (not the function's): {what}"
            ok, res = False, (ErrorCode.WORKER_LOST, msg, traceback.format_exc()[-4000:])
        finally:
            self.tasks.pop(cid, None)
            self.timers.pop(cid, None)
            self.pending.pop(cid, None)  # its arguments were refused: no timer was made
        self._reply((cid, ok, res, start, (time.monotonic_ns() - start) / 1e6))

    def _extend(self, cid: int, deadline_ns: int) -> None:
        """The call's deadline moved (a caller with a later one joined its keyed execution):
        its handler now stops there, or at the function's own limit from its start."""
        entry = self.timers.get(cid)
        if entry is None:
            if cid in self.tasks:  # its task has not run yet: it makes its timer when it does
                self.pending[cid] = deadline_ns
            return  # else it ended meanwhile
        start, timer = entry
        if timer.expired():  # too late: it is being cancelled
            return
        end_ns = start + int(self.runner.spec.timeout_s * 1e9)
        if deadline_ns:
            end_ns = min(end_ns, deadline_ns)
        # the loop's clock is time.monotonic, the clock of the _ns stamps
        timer.reschedule(self.loop.time() + (end_ns - time.monotonic_ns()) / 1e9)


def main() -> None:
    fd = int(os.environ["FABRIC_WORKER_FD"])
    shm_fd = int(os.environ["FABRIC_WORKER_SHM"])
    _die_with_parent(int(os.environ["FABRIC_PARENT_PID"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent shuts us down; Ctrl-C is its business
    os.dup2(2, 1)  # user prints go to stderr so the parent's stdout (e.g. --json) stays clean
    sock = socket.socket(fileno=fd)
    slot = mmap.mmap(shm_fd, SLOT_SIZE)
    frames = _Frames(sock)
    msg = frames.recv()
    if msg[0] != "init" or frames.stopped():
        # closed before it started (the stop came with the init): no import, no setup hook
        os._exit(0)
    init = msg[1]
    sys.path[:] = init["sys_path"]
    t0 = time.perf_counter()
    try:
        from fabric.backends._pool_snapshot import install
        from fabric.runner import FunctionRunner

        # a script that starts a Client at import (no main guard) would otherwise make every
        # worker start its own pool; the Client refuses while this is set
        os.environ[IMPORTING_ENV] = init["entry"]
        try:
            # the function's module as it was registered, not as the file is now (edited since?)
            install(init.get("snapshot", ()), init["entry"])
            runner = FunctionRunner.from_entry(init["entry"])
        finally:
            os.environ.pop(IMPORTING_ENV, None)
        t1 = time.perf_counter()
        runner.setup()
    except BaseException as e:
        msg = f"{type(e).__name__}: {e}"
        sock.sendall(pack(("fatal", ErrorCode.SETUP_FAILED, msg, traceback.format_exc()[-4000:])))
        os._exit(3)
    t2 = time.perf_counter()
    sock.sendall(
        pack(
            (
                "ready",
                {
                    "pid": os.getpid(),
                    "import_ms": (t1 - t0) * 1e3,
                    "setup_ms": (t2 - t1) * 1e3,
                    # of the code imported now: the pool checks it is the code registered
                    "version": runner.spec.version,
                },
            )
        )
    )

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        sock.setblocking(False)
        await loop.connect_accepted_socket(
            lambda: _Serve(runner, slot, init.get("fault"), done, frames), sock
        )
        await done

    asyncio.run(serve())
    # told to stop, or the parent's socket closed: the function's exit handlers run (the code
    # verifier's closes its sandbox, whose zygote ends its runs and removes its cgroups), the
    # rest of interpreter teardown is skipped: nothing to flush, and it is the slow part. The
    # pool kills a worker that takes too long at it
    atexit._run_exitfuncs()
    os._exit(0)


if __name__ == "__main__":
    main()
