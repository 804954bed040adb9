"""The supervision of a ``FunctionPool``'s workers: started (``warm`` of them, more on
demand up to the cap) and told apart when they fail to start; a pool that cannot start any
fails fast for a while; a dead worker replaced and its calls failed or requeued by whether
they ran; a worker whose running call passes the function's timeout killed (seen through
its shared-memory slot); idle extras stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
import subprocess
import sys
import time

from fabric.backends._pool_dispatch import PoolDispatch
from fabric.backends._wire import SLOT_SIZE, read_slot
from fabric.backends._worker_handle import LIVE_PIDS, PoolCall, WorkerHandle, exit_status, exited
from fabric.errors import ErrorCode

_TICK_S = 0.05  # maintenance period: timeouts, idle shrink, replenish
_ASYNC_GRACE_S = 1.0  # an async call is enforced in the worker; the parent steps in after this
_MAX_START_FAILURES = 3
_MAX_REQUEUES = 3  # a call queued on workers that died before running it: re-dispatched this often
_DEAD_OPEN_S = 0.5  # a dead worker's socket still open this long: closed by the pool (_dead_but_open)


class PoolWorkers(PoolDispatch):
    """The pool's worker processes, from spawn to reap (see the module docstring)."""

    # -- growth
    def _can_spawn(self) -> bool:
        return (
            not self._closed
            # retired (FunctionPool.retire): what it holds goes to the pool that replaced it
            and self._successor is None
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

    # -- worker lifecycle
    def _spawn(self) -> None:
        self._starting += 1
        w = WorkerHandle(self, f"{self.spec.name}-{next(self._wids)}")
        self._workers.append(w)
        self._loop.create_task(self._start_worker(w))

    async def _start_worker(self, w: WorkerHandle) -> None:
        try:
            await self._launch(w)
            # not wait_for: on Python 3.11 a start that settles in the loop turn this task is
            # cancelled drops the cancel, and the worker it launched is not killed below
            async with asyncio.timeout(self.config.start_timeout_s):
                await asyncio.shield(w.ready_fut)
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
            if w.proc is not None and w.transport is None:
                # its process runs and no transport holds its socket: no EOF will come, so
                # no _on_lost reaps it. Killed and reaped here, not left a zombie, its pid
                # kept in LIVE_PIDS (killed as a group at exit, by then maybe another's)
                w.kill()
                self._reap_soon(w.proc)
            raise
        fault = self.config.fault.model_dump() if self.config.fault else None
        init = {"entry": self.spec.entry, "sys_path": list(sys.path), "fault": fault}
        w.send(("init", {**init, "snapshot": self._snapshot}))

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
            pass  # wait for the sibling's start to decide
        elif self._successor is not None:
            self._hand_over_if_stranded()  # retired: the pool that replaced it serves them
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

    def _on_stale(self, w: WorkerHandle, version: str) -> None:
        """A worker imported other code than the code registered. The workers import the
        registered source of the function's module (its setup hook's, the helpers beside
        them) where it was kept (``_pool_snapshot``), so this is a module whose source was
        not (from a zip, through an import hook) changed since, or a helper removed or added
        beside. Serving it would run another function under this name
        (and its version, which keys the calls), beside the older workers' code, silently:
        it is refused as a failed setup is, so its calls fail when no other worker serves
        them, saying what to do."""
        w.fatal = True
        w.settle_start()
        entry = self.spec.entry.rpartition(":")[0]
        # the workers import the registered text of the modules that are plain .py files
        # (_pool_snapshot): what changed is one of the others, imported as it is now
        if self._unkept is None:
            why = "; its registered source was not kept (not registered by a decorator in this process)"
        elif self._unkept:
            why = (
                f"; {', '.join(self._unkept)} is not a plain .py file read by Python's own loader "
                "(a zip, an import hook, another module of its name found first), so its "
                "registered source is not kept for the workers"
            )
        else:
            why = ""
        self._start_failed(
            w,
            f"{entry} (or a module it imports from its own directory) changed since it was "
            "registered: a new worker imported other code "
            f"(version {version}, registered {self.spec.version}) and was stopped{why}; register "
            "it again to run the new code (importlib.reload the module, then registry.discover "
            "it, or restart the process), or undo the change",
        )

    def _on_lost(self, w: WorkerHandle) -> None:
        w.settle_start()
        if w.proc is not None:
            w.kill()
            self._reap_soon(w.proc)
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
        self._hand_over_if_stranded()

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
                # the oldest call it holds (a dict keeps the order they were sent in)
                head = next(iter(w.inflight.values()))
                if now - w.last_progress > limit + _ASYNC_GRACE_S:
                    msg = f"{self.spec.name}: worker stopped responding (event loop blocked past the timeout)"
                    self._kill_for_timeout(w, head, msg + "; killed and replaced")
                elif head.sent_ns and (now_ns - head.sent_ns) / 1e9 > limit + _ASYNC_GRACE_S:
                    # the worker cancels a run at its limit; this one ran on (it swallowed the
                    # cancellation: a bare except in a polling loop). Its other calls answering
                    # kept the check above quiet, and it held its caller and slot for good
                    msg = (
                        f"{self.spec.name} ran past its {limit:.3g} s limit and did not stop when "
                        "cancelled there (does it swallow asyncio.CancelledError?); its worker was "
                        "killed and replaced"
                    )
                    self._kill_for_timeout(w, head, msg)
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

    def _reap_soon(self, proc: subprocess.Popen[bytes]) -> None:
        """Reap a killed worker on the loop's executor, then forget its pid."""
        try:
            waited = self._loop.run_in_executor(None, proc.wait)
        except RuntimeError:
            # the executor is shut down: asyncio.run is ending, and this worker's socket closed
            # after its pool did (one killed when its start failed is not among the workers a
            # close waits for). Killed, it is gone within moments: reap it here
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)
                LIVE_PIDS.discard(proc.pid)
            return
        waited.add_done_callback(lambda _: LIVE_PIDS.discard(proc.pid))

    def _shrink(self) -> None:
        if self._pending:  # calls are waiting: a worker without any is about to get some
            return
        now = time.monotonic()
        # a retired pool's idle workers serve nothing more (new calls go to the pool that
        # replaced it), and each holds what its setup hook loaded (a model, GPU memory)
        window = 0.0 if self._successor is not None else self.config.idle_window_s
        # those on their way out (killed for a timeout, dead, their socket closing) are not
        # counted: an idle one stopped as an extra beside them leaves none once they are
        # lost, and a cold start follows
        extra = sum(w.usable or w.starting for w in self._workers) - self.warm
        for w in list(self._workers):
            if extra <= 0:
                break
            if w.usable and not w.inflight and now - w.last_active >= window:
                extra -= 1
                self._workers.remove(w)
                w.lost = True
                w.send(("stop",))
                # kept (the loop holds tasks weakly) and awaited by close: a backend closed
                # meanwhile waits for this worker too, as for those still in the pool
                reap = self._loop.create_task(self._reap(w))
                self._reaping.add(reap)
                reap.add_done_callback(self._reaping.discard)

    async def _reap(self, w: WorkerHandle) -> None:
        try:
            await asyncio.sleep(0.5)  # its grace to stop by itself
        finally:  # cancelled too (the loop ending): the worker is killed, not left behind
            w.kill()
            if w.proc is not None:
                await self._loop.run_in_executor(None, w.proc.wait)
                LIVE_PIDS.discard(w.proc.pid)
            if w.transport is not None:
                w.transport.close()
