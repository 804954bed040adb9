"""Parent-side handles of the local pool: one worker process (``WorkerHandle``, the asyncio
protocol on its socket) and one call on its way through the pool (``PoolCall``), with the exit
backstop that kills whatever worker a crashed caller failed to close."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import mmap
import os
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

from fabric.backends._wire import FrameReader, pack
from fabric.protocol import Invocation, Result

if TYPE_CHECKING:
    from fabric.backends._pool_workers import PoolWorkers

_REAP_WAIT_S = 0.2  # a worker whose socket closed is exiting: how long to wait for its exit status

# exit backstop: whatever a crashed caller failed to close is killed at interpreter exit
LIVE_PIDS: set[int] = set()


@atexit.register
def _kill_leftovers() -> None:
    for pid in list(LIVE_PIDS):  # each leads its own process group: see WorkerHandle.kill
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether a worker's process ended, without reaping it: until it is reaped its pid, its
    process group's id, stays ours (``WorkerHandle.kill`` may still kill the group)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped meanwhile, by a wait on another thread
        return True


def exit_status(proc: subprocess.Popen[bytes]) -> str:
    """How a worker ended, for error messages: its exit code or the signal that killed it."""
    try:
        # its socket closes as the process exits, so the status follows within moments
        code = proc.wait(timeout=_REAP_WAIT_S)
    except subprocess.TimeoutExpired:
        return "exit status unknown"
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


class PoolCall:
    __slots__ = (
        "avoid",
        "cid",
        "deadline_ns",
        "fut",
        "inv",
        "requeues",
        "sent_ns",
        "settled",
        "t_submit_ns",
        "timer",
        "worker",
    )

    def __init__(self, inv: Invocation, fut: asyncio.Future[Result], deadline_ns: int):
        self.inv = inv
        self.fut = fut
        self.t_submit_ns = time.monotonic_ns()
        self.deadline_ns = deadline_ns
        self.cid = 0
        self.worker: WorkerHandle | None = None
        self.avoid: WorkerHandle | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.requeues = 0
        self.sent_ns = 0
        """When it was last sent to a worker (``time.monotonic_ns``); 0 while queued."""
        self.settled: asyncio.Future[None] | None = None
        """Made by ``FunctionPool.settled`` for a call answered or abandoned while its worker
        still runs it; done when the worker is done with it."""


class WorkerHandle(asyncio.Protocol):
    """Parent-side handle of one worker process."""

    def __init__(self, pool: PoolWorkers, wid: str):
        self.pool = pool
        self.id = wid
        self.proc: subprocess.Popen[bytes] | None = None
        self.slot: mmap.mmap | None = None
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader()
        self.inflight: dict[int, PoolCall] = {}
        self.ready = False
        self.ready_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ready_ns = 0
        self.served = 0
        self.last_active = time.monotonic()
        self.last_progress = self.last_active
        self.lost = False
        self.fatal = False
        self.kill_reason: tuple[int, str] | None = None
        self.dead_since: float | None = None  # its process ended while its socket stayed open

    @property
    def usable(self) -> bool:
        """Whether calls may be sent to it. Not once its socket is closing: its EOF (or a
        failed write) closes the transport a loop turn before ``connection_lost`` tells the
        pool, and a call given it meanwhile is never sent, though its loss would fail it as
        one the worker ran (an async worker's calls all run at once). Nor once its process
        ended (``dead_since``): it reads nothing more."""
        if not self.ready or self.lost or self.kill_reason is not None or self.dead_since is not None:
            return False
        return self.transport is None or not self.transport.is_closing()

    @property
    def starting(self) -> bool:
        return not self.ready and not self.lost

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        for msg in self.reader.feed(data):
            kind = msg[0]
            if kind == "results":
                self.pool._on_results(self, msg[1])
            elif self.lost:
                # its start was failed (timed out) and it was killed: a "ready" or "fatal" it
                # sent meanwhile is read after that. The pool is done with it: read as a live
                # one's, a ready ended the pool's fail-fast period, a fatal counted it twice
                continue
            elif kind == "ready":
                version = msg[1].get("version")
                if version is not None and version != self.pool.spec.version:
                    self.pool._on_stale(self, version)
                    continue
                self.ready = True
                self.ready_ns = time.monotonic_ns()
                # idle counts from readiness, not from the spawn: a slow cold start is not idleness
                self.last_active = time.monotonic()
                self.settle_start()
                self.pool._on_ready(self)
            elif kind == "fatal":
                self.pool._on_fatal(self, msg[2], msg[3])

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._on_lost(self)

    def settle_start(self) -> None:
        """Whatever happened (ready, fatal, death), the spawner stops waiting."""
        if not self.ready_fut.done():
            self.ready_fut.set_result(None)

    def send(self, msg: Any) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(pack(msg))

    def kill(self) -> None:
        """SIGKILL the worker and whatever it started. It leads a session of its own
        (``FunctionPool._launch``), so its process group holds the processes the function
        started (a forked helper) unless they left it: they would outlive it as orphans and,
        holding a copy of its socket, keep the pool from seeing it die. Only until the worker
        is reaped: after that its pid, the group's id, may be another process's."""
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
