"""The inproc backend's own behaviour: what its threads hold, as the callers that admit calls
to it (the client's ``max_concurrency`` slots, ``fabric serve``'s gate) count it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fabric.backends.inproc import InprocBackend
from fabric.protocol import Invocation
from fabric.registry import Registry


async def test_every_admitted_synchronous_call_runs_at_once():
    """The gate (and the client) admit up to each function's ``max_concurrency`` calls, but
    the inproc backend ran synchronous handlers on 32 threads shared by every function: the
    rest waited unseen in the thread queue, their wait counted against timeout_s. Each call
    admitted now has a thread: two functions of 30 each, all 60 running together."""
    reg = Registry()
    parties = 60
    together = threading.Barrier(parties, timeout=10)  # broken (an error) if they never meet

    for name in ("a", "b"):

        @reg.function(name=name, warm=0, timeout_s=60, max_concurrency=30)
        def met() -> bool:
            together.wait()
            return True

    async with InprocBackend(reg) as backend:
        futs = [backend.submit(Invocation(function=n, payload={})) for n in ("a", "b") for _ in range(30)]
        results = await asyncio.gather(*futs)
    assert all(r.ok and r.value is True for r in results), [r.error for r in results if not r.ok][:1]


async def test_a_call_cancelled_in_the_loop_turn_its_thread_answers_stays_cancelled():
    """The wait for a synchronous handler's thread was ``asyncio.wait_for``, which on Python
    3.11 returns the inner result that lands in the loop turn its caller is cancelled and drops
    the cancellation: a losing hedge or a caller that gave up got an answer instead, and the
    task that cancelled it saw it go on. The cancel wins now."""
    reg = Registry()
    entered, release = threading.Event(), threading.Event()

    @reg.function(warm=0, timeout_s=30)
    def held() -> int:
        entered.set()
        release.wait(30)
        return 1

    async with InprocBackend(reg) as backend:
        try:
            call = backend.submit(Invocation(function="held", payload={}))
            for _ in range(3000):  # until its thread runs it (bounded: 30 s)
                if entered.is_set():
                    break
                await asyncio.sleep(0.01)
            assert entered.is_set(), "the handler never started"
            job = backend._on_threads[call]
            # the thread's answer lands (what job.finish does on the loop) in the turn the
            # caller is cancelled
            job.fut.set_result(backend._runners["held"]._encode(1))
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
        finally:
            release.set()
