"""The local backend's calls in flight, with real worker processes (and a worker's protocol
in this process): when a later call in the batch hangs or kills the worker, when an answer
is held back, when a helper keeps the worker's socket, when a deadline passes (queued, in the
worker's queue, running), and when a call is cancelled. Nothing that ran is run again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time

import pytest
from local_backend_helpers import _until, alive, local

from fabric.client import Client
from fabric.errors import ErrorCode


async def test_a_finished_call_survives_a_hang_after_it_and_queued_calls_did_not_run(tmp_path):
    path = tmp_path / "effects"
    async with local(max_workers=1) as c:
        await c.backend.warmup(["maybe_hang"])  # warm=0: starts nothing, but the pool exists
        # the three go to the worker in one batch, so the third waits behind the hang in the
        # worker: a pool that judged calls slow (a loaded machine) sent one at a time, the
        # third stayed in the pool's queue and was never re-queued (requeued 0, 1 run in ~10)
        c.backend.pool("maybe_hang")._exec_ewma_ms = 0.01
        rs = await c.map("maybe_hang", [{"path": str(path), "hang": h} for h in (False, True, False)])
        assert rs[0].ok and rs[0].value == "done"  # answered before the next call hung
        assert rs[1].error.type == ErrorCode.TIMEOUT and rs[1].attempts == 1  # side effects: not retried
        # the third call was queued behind the hang: it never ran, so the pool re-queued it for
        # the replacement worker (not a retry: no attempt spent) and it ran once
        assert rs[2].ok and rs[2].attempts == 1
        assert c.backend.stats()["maybe_hang"]["requeued"] == 1
        assert path.read_text() == "xxx"


async def _batch_of_two(c: Client, tmp_path, then: str, size: int) -> tuple:
    """A finished side effect (with a ``size``-byte answer), then a call that kills the worker
    (``then``), both under a key and sent to the one worker in one batch."""
    for i in range(3):  # cheap calls: the pool learns calls are fast and batches them
        assert (await c.call("effect_then", {"path": str(tmp_path / "warm"), "tag": i})).ok
    # ...unless a loaded machine (CI beside other jobs) made one of them take over 1 ms: then
    # the pool sends one call at a time (per_worker 1) and there is no batch to test
    c.backend.pool("effect_then")._exec_ewma_ms = 0.01
    batches = c.backend.stats()["effect_then"]["batches"]
    path = tmp_path / "effects"
    a, b = await asyncio.gather(
        c.call("effect_then", {"path": str(path), "tag": 1, "size": size}, idempotency_key="pay-1"),
        c.call("effect_then", {"path": str(path), "tag": 2, "then": then}, idempotency_key="pay-2"),
    )
    assert c.backend.stats()["effect_then"]["batches"] == batches + 1  # one batch, nothing re-sent
    assert path.read_text().split() == ["1"]  # the first ran once; the second never got to its effect
    return a, b


@pytest.mark.parametrize("then", ["crash", "hang"])
async def test_a_finished_call_keeps_its_answer_when_a_later_call_in_its_batch_kills_the_worker(
    tmp_path, then
):
    # the 2 MB answer does not go into the socket at once: the worker sends it whole before it
    # starts the next call, so the death of the next call cannot lose it (and the pool took
    # the call for one that never started and ran its side effect again)
    async with local(max_workers=1) as c:
        a, b = await _batch_of_two(c, tmp_path, then, size=2_000_000)
        assert a.ok and len(a.value) == 2_000_000, a.error
        assert b.error.type == (ErrorCode.WORKER_LOST if then == "crash" else ErrorCode.TIMEOUT)


async def test_a_call_that_ran_before_the_one_that_killed_its_worker_is_not_run_again(tmp_path):
    # its answer is held back in the worker (a straggling reply, injected) when the next call
    # kills the worker: the worker runs calls in order, so it ran; its answer is lost
    async with local(max_workers=1, fault={"straggler_rate": 1.0, "straggler_ms": 200}) as c:
        a, b = await _batch_of_two(c, tmp_path, "crash", size=0)
        assert a.error.type == ErrorCode.WORKER_LOST and "after running the call" in a.error.message
        assert b.error.type == ErrorCode.WORKER_LOST and "running the call" in b.error.message


async def test_a_call_whose_answer_is_held_back_is_not_run_again_when_its_idle_worker_dies(tmp_path):
    """The worker ran the call and went idle with its answer held back (an injected
    straggler), then died: it had cleared its slot once the call ended, so the pool took the
    call for one that never started and ran it again on a new worker (the effect twice)."""
    from fabric.backends._wire import read_slot

    path = tmp_path / "effects"
    async with local(max_workers=1, warm=1, fault={"straggler_rate": 1.0, "straggler_ms": 3000}) as c:
        await c.warmup(["effect_then"])
        (w,) = c.backend.pool("effect_then")._workers
        call = asyncio.create_task(
            c.call("effect_then", {"path": str(path), "tag": 1}, idempotency_key="pay-1")
        )
        # it ran, and its worker is idle (no call in the slot has a start): the answer is held back
        await _until(lambda: path.exists() and read_slot(w.slot)[1] == 0, "the call to run")
        os.kill(w.proc.pid, signal.SIGKILL)
        r = await asyncio.wait_for(call, 10)
        assert not r.ok and r.error.type == ErrorCode.WORKER_LOST, r  # not run again: it ran
        assert "after running the call" in r.error.message
        assert path.read_text().split() == ["1"]
        assert c.backend.stats()["effect_then"]["requeued"] == 0


@pytest.mark.parametrize(
    ("then", "escape"), [("hang", False), ("crash", False), ("crash", True)], ids=["hang", "crash", "setsid"]
)
async def test_a_worker_whose_child_holds_its_socket_is_still_replaced(tmp_path, then, escape):
    # the helper's copy of the worker's socket kept the pool from seeing the worker die (no
    # EOF): its call hung and, on a one-worker pool, so did every later one
    pid_path = tmp_path / "helper"
    async with local(max_workers=1) as c:
        try:
            t0 = time.monotonic()
            call = c.call("leaves_a_child", {"pid_path": str(pid_path), "then": then})
            r = await asyncio.wait_for(call, 10)
            assert r.error.type == (ErrorCode.TIMEOUT if then == "hang" else ErrorCode.WORKER_LOST), r.error
            # timeout_s=1; a hang is the 10 s wait_for (a cold worker on a loaded host took
            # 3.4 s, over the 3 s asked before)
            assert time.monotonic() - t0 < 8
            pid = int(pid_path.read_text())
            if not escape:  # killed with the worker's process group: no orphan
                deadline = time.monotonic() + 2  # (it may take a moment to be a zombie)
                while alive(pid) and time.monotonic() < deadline:  # noqa: ASYNC110 - no event for it
                    await asyncio.sleep(0.02)
                assert not alive(pid)
            assert (await asyncio.wait_for(c.call("leaves_a_child", {}), 10)).ok  # a new worker serves
            assert c.backend.stats()["leaves_a_child"]["lost"] == 1
        finally:
            if pid_path.exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid_path.read_text()), signal.SIGKILL)


async def test_deadline_while_queued_answers_on_time_without_killing_the_worker():
    async with local(max_workers=1) as c:
        await c.backend.warmup(["sleepy"])
        first = asyncio.create_task(c.call("sleepy", {"seconds": 3.0}))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        r = await c.call("sleepy", {"seconds": 0}, deadline_s=0.1)
        # at its deadline, not when the worker it queued for is free (3 s)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 1.5
        assert r.started is False
        assert (await first).ok
        assert c.backend.stats()["sleepy"]["timeouts"] == 0 and c.backend.stats()["sleepy"]["lost"] == 0


async def test_a_deadline_passed_in_a_workers_own_queue_says_the_call_did_not_start():
    """A synchronous worker takes calls in batches and runs them in turn: a call behind a
    slow one waits in the worker, not started, when its deadline passes. It was answered
    "deadline passed while running", which the reader of a tool's failure took as the tool's
    own slowness; ``Result.started`` now says it never began, and the message says where it
    waited. The slow one, cut as it runs, began."""
    async with local(max_workers=1) as c:
        await c.backend.warmup(["sleepy"])
        assert (await c.call("sleepy", {"seconds": 0})).ok  # a quick answer: calls now go in batches
        first = asyncio.create_task(c.call("sleepy", {"seconds": 1.5}, deadline_s=0.8))
        await asyncio.sleep(0)  # sent first, in the same batch
        r = await c.call("sleepy", {"seconds": 0}, deadline_s=0.4)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and r.started is False, r.error
        assert "while running" not in r.error.message
        ran = await first
        assert ran.error.type == ErrorCode.DEADLINE_EXCEEDED and ran.started is True, ran.error
        assert c.backend.stats()["sleepy"]["lost"] == 0  # nothing was killed for it


async def test_a_plain_call_cut_in_its_worker_at_the_deadline_is_deadline_exceeded():
    """An async handler is cut at its call's deadline in the worker too. When that reply came
    in before the call's own timer fired (the loop was busy past the deadline: it handles
    sockets before timers), the caller got a FunctionTimeout, which the breaker counts."""
    async with local(max_workers=1, warm=1) as c:
        await c.warmup(["async_sleepy"])
        call = asyncio.create_task(c.call("async_sleepy", {"seconds": 5.0}, deadline_s=0.4))
        await asyncio.sleep(0.1)  # sent: running in its worker
        time.sleep(1.5)  # noqa: ASYNC251 - the loop busy past the deadline, as under load
        r = await call
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and r.started is True, r.error
        assert c._fns["async_sleepy"].consecutive_failures == 0
        assert c.backend.stats()["async_sleepy"]["lost"] == 0  # cancelled in the worker, not killed


async def test_cancelling_an_async_call_cancels_it_in_the_worker(tmp_path):
    path = tmp_path / "out"
    async with local() as c:
        await c.call("slow_write", {"path": str(tmp_path / "warm"), "seconds": 0})
        task = asyncio.create_task(c.call("slow_write", {"path": str(path), "seconds": 0.4}))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.sleep(0.6)
        assert not path.exists()
        assert (await c.call("slow_write", {"path": str(path), "seconds": 0})).ok


class _Transport(asyncio.Transport):
    """What a worker's ``_Serve`` writes, kept: a worker run in the test's own process."""

    def __init__(self):
        super().__init__()
        self.out: list[bytes] = []

    def write(self, data):
        self.out.append(data)

    def is_closing(self):
        return False


def _serve_in_process(entry: str):
    import mmap

    from fabric.backends._wire import SLOT_SIZE
    from fabric.runner import FunctionRunner
    from fabric.worker import _Serve

    loop = asyncio.get_running_loop()
    serve = _Serve(FunctionRunner.from_entry(entry), mmap.mmap(-1, SLOT_SIZE), None, loop.create_future())
    transport = _Transport()
    serve.connection_made(transport)
    return serve, transport


async def _replies(transport: _Transport) -> list:
    """The results the worker sent, once it sent some (polled: at most 3 s)."""
    from fabric.backends._wire import FrameReader

    for _ in range(300):
        if transport.out:
            break
        await asyncio.sleep(0.01)
    return [item for _, items in FrameReader().feed(b"".join(transport.out)) for item in items]


async def test_a_worker_keeps_an_extend_that_comes_before_its_async_call_s_timer():
    """The worker reads ("calls") and ("extend") in one chunk: the extend comes before the
    call's task has run and made its timer; the moved deadline must still apply."""
    from fabric.backends._wire import pack
    from fabric.protocol import encode_payload

    serve, transport = _serve_in_process("sample_fns:async_sleepy")
    now = time.monotonic_ns()
    raw = encode_payload({"seconds": 0.6})
    # sent with a 0.2 s deadline, then (the same chunk) moved to 10 s
    serve.data_received(
        pack(("calls", [(1, raw, now + int(0.2e9), 0.2)])) + pack(("extend", 1, now + int(10e9)))
    )
    ((cid, ok, res, *_),) = await _replies(transport)
    assert cid == 1 and ok, res
    assert not serve.tasks and not serve.timers and not serve.pending


async def test_a_worker_answers_an_async_call_cancelled_in_the_chunk_that_brought_it():
    """("calls") and ("cancel") in one chunk (a hedge cancelled as it was dispatched): the
    call's task is cancelled before it first runs, so its own code never replied. The parent
    held the call for good, one of the worker's places gone (at max_concurrency=1, every
    later call of the function hung)."""
    from fabric.backends._wire import pack
    from fabric.protocol import encode_payload

    serve, transport = _serve_in_process("sample_fns:async_sleepy")
    raw = encode_payload({"seconds": 0.6})
    serve.data_received(pack(("calls", [(1, raw, 0, 10.0)])) + pack(("cancel", 1)))
    ((cid, ok, res, *_),) = await _replies(transport)
    assert cid == 1 and not ok and res[0] == ErrorCode.CANCELLED
    assert not serve.tasks and not serve.timers and not serve.pending
