"""The local pool where two of its events meet: a worker killed for a timeout while an idle
one's window ends, a call dispatched between a worker's EOF and its loss, a worker's "ready"
after the pool gave up on its start, a launch that fails once its process runs, and a raise in
an async worker outside the function. Real worker processes on real sockets; where the timing
of two events cannot be made to meet from outside, a seam of the pool's (its loop, a kill) is
held to force it, and the code under test runs as it is."""

from __future__ import annotations

import asyncio
import errno
import os
import signal

import pytest
from local_backend_helpers import _until
from pool_race_fns import GATE_ENV, REG

from fabric.backends._worker_handle import LIVE_PIDS, WorkerHandle
from fabric.backends.base import LocalConfig
from fabric.backends.local import LocalBackend
from fabric.errors import ErrorCode, SetupFailedError
from fabric.protocol import Invocation


def _inv(function: str, **payload) -> Invocation:
    return Invocation(function=function, payload=payload)


async def test_a_worker_killed_for_its_timeout_does_not_count_toward_warm(monkeypatch):
    """``warm=1`` and two workers: one runs past the function's timeout and is killed in the
    maintenance pass in which the other's idle window ends. The killed one stays in the pool
    until its socket closes, and it was counted toward ``warm``: the idle one was stopped as
    an extra, then the killed one was lost, the pool had none and started one cold."""
    async with LocalBackend(REG, LocalConfig(max_workers=2, idle_window_s=3600)) as backend:
        await backend.warmup(["nap"])
        pool = backend.pool("nap")
        # two at once: the second waits for a second worker (started for it), or for the first
        rs = await asyncio.gather(*(backend.invoke(_inv("nap", seconds=0.2)) for _ in range(2)))
        assert all(r.ok for r in rs), rs
        await _until(lambda: sum(w.usable for w in pool._workers) == 2, "a second worker to be ready")
        idle_window_ends = []
        real_kill = pool._kill_for_timeout

        def kill_for_timeout(w, call, message):
            (idle,) = [x for x in pool._workers if x is not w]
            idle.last_active = float("-inf")  # its idle window ends in the pass that kills w
            idle_window_ends.append(idle)
            real_kill(w, call, message)

        monkeypatch.setattr(pool, "_kill_for_timeout", kill_for_timeout)
        r = await backend.invoke(_inv("nap", seconds=3600))
        assert r.error is not None and r.error.type == ErrorCode.TIMEOUT, r
        (idle,) = idle_window_ends
        # its loss starts a worker then and there if the pool has fewer than warm
        await _until(lambda: pool.metrics["lost"] == 1, "the killed worker to be lost")
        assert pool._workers == [idle] and idle.usable, "the idle worker was stopped, not kept warm"
        assert pool.metrics["spawned"] == 2  # no cold start followed


async def test_an_async_call_dispatched_between_a_worker_s_eof_and_its_loss_is_not_lost():
    """A worker's EOF closes its transport, and its ``connection_lost`` runs a loop turn
    later: a dispatch in between (one another worker's answer scheduled, read in the turn of
    the EOF) took the worker for usable and gave it a call, whose sending the closing
    transport dropped. For an async function the loss then failed it ``WorkerLost``
    "running the call" though it was never sent. The dispatch is run in that window here."""
    async with LocalBackend(REG, LocalConfig(max_workers=1)) as backend:
        await backend.warmup(["anap"])
        pool = backend.pool("anap")
        (w,) = pool._workers
        late: list[asyncio.Future] = []
        real_lost = w.connection_lost

        def connection_lost(exc):
            assert w.transport is not None and w.transport.is_closing()
            late.append(pool.submit(_inv("anap", seconds=0)))
            pool._dispatch()  # as a dispatch scheduled before this handler would
            real_lost(exc)

        w.connection_lost = connection_lost  # type: ignore[method-assign]
        os.kill(w.proc.pid, signal.SIGKILL)
        await _until(lambda: late, "the worker's loss")
        r = await late[0]
        assert r.ok, r.error  # never sent: it waited for the replacement worker
        assert pool.metrics["lost"] == 1 and pool.metrics["spawned"] == 2


async def test_a_late_ready_from_a_worker_failed_for_its_start_timeout_keeps_the_pool_failing_fast(
    tmp_path, monkeypatch
):
    """Three starts timed out in a row: the pool fails fast for the cooldown. A worker's
    "ready" sent as the pool killed it for its timeout is read after its failure (the kill
    does not take back what is in the socket); read as any worker's, it ended the fail-fast
    period, and the pool started workers again at once. The kills are held until the
    workers' readies are out, as if each had been in the socket when its kill landed."""
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))  # the setup hook waits for it: every start times out
    real_kill, real_data = WorkerHandle.kill, WorkerHandle.data_received
    held: list[WorkerHandle] = []
    heard: list[WorkerHandle] = []
    holding = True

    def kill(self):
        if holding:
            held.append(self)
        else:
            real_kill(self)

    def data_received(self, data):
        real_data(self, data)
        heard.append(self)

    monkeypatch.setattr(WorkerHandle, "kill", kill)
    monkeypatch.setattr(WorkerHandle, "data_received", data_received)
    cfg = LocalConfig(start_timeout_s=0.2, setup_failure_cooldown_s=3600)
    async with LocalBackend(REG, cfg) as backend:
        pool = backend.pool("gated")
        try:
            with pytest.raises(SetupFailedError, match="did not become ready"):
                await pool.wait_ready(30)
            holding = False
            assert len(held) == 3 and pool._broken is not None
            gate.touch()
            await _until(lambda: all(w in heard for w in held), "the failed workers' late readies", 30)
            assert pool._broken is not None, "a late ready ended the fail-fast period"
            r = await backend.invoke(_inv("gated"))
            assert r.error is not None and r.error.type == ErrorCode.SETUP_FAILED, r
        finally:
            holding = False
            for w in held:
                real_kill(w)
            await _until(lambda: not {w.proc.pid for w in held} & LIVE_PIDS, "the held workers' reaping")


async def test_a_launch_that_fails_after_its_process_started_reaps_the_process(monkeypatch):
    """The worker's process started, then connecting its socket failed (no transport: no
    EOF will ever come, so ``_on_lost`` does not reap it): it was killed and never waited
    for, a zombie, its pid kept in ``LIVE_PIDS`` (killed as a process group at exit, by then
    maybe another process's)."""
    procs = []

    async def refuse(protocol_factory, sock, **kw):
        procs.append(protocol_factory().proc)
        raise OSError(errno.EMFILE, "Too many open files")

    cfg = LocalConfig(setup_failure_cooldown_s=3600)
    async with LocalBackend(REG, cfg) as backend:
        monkeypatch.setattr(asyncio.get_running_loop(), "connect_accepted_socket", refuse)
        pool = backend.pool("nap")
        try:
            with pytest.raises(SetupFailedError, match="cannot start a worker: OSError"):
                await pool.wait_ready(30)
            assert len(procs) == 3
            await _until(
                lambda: all(p.returncode is not None and p.pid not in LIVE_PIDS for p in procs),
                "the workers whose launch failed to be reaped",
            )
        finally:
            for p in procs:  # a failed test leaves no zombie behind
                if p.returncode is None:
                    p.kill()
                    p.wait()
                LIVE_PIDS.discard(p.pid)


async def test_an_unexpected_raise_in_an_async_worker_answers_the_call():
    """Outside the function (whose raises are outcomes), a raise in the async worker's run of
    a call (a bug of fabric's) ended its task with no answer: the call was held until the
    pool killed the worker for the function's timeout (its other calls lost with it). It is
    answered at once, as run and lost (it may have run), and the worker serves on."""
    async with LocalBackend(REG, LocalConfig(max_workers=1)) as backend:
        await backend.warmup(["fragile"])
        r = await backend.invoke(_inv("fragile", boom=True))
        assert r.error is not None and r.error.type == ErrorCode.WORKER_LOST, r
        assert "RuntimeError: a bug in the runner" in r.error.message
        assert (await backend.invoke(_inv("fragile"))).ok
        stats = backend.stats()["fragile"]
        assert stats["timeouts"] == 0 and stats["lost"] == 0 and stats["spawned"] == 1
