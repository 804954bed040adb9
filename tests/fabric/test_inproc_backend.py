"""The inproc backend's own behaviour: what its threads hold, as the callers that admit calls
to it (the client's ``max_concurrency`` slots, ``fabric serve``'s gate) count it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from fabric.backends.inproc import InprocBackend
from fabric.errors import ErrorCode
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


async def test_a_deadline_says_whether_the_call_had_begun():
    """A synchronous call that waited for a thread (each held by a call that runs on) and
    whose deadline passed there never began: ``Result.started`` says so, and its message no
    longer says it passed "while running"; one cut while it ran began, synchronous or async."""
    reg = Registry()
    release = threading.Event()

    @reg.function(name="held", warm=0, timeout_s=30, max_concurrency=1)  # one thread
    def held() -> bool:
        release.wait(10)
        return True

    @reg.function(name="napping", warm=0, timeout_s=30)
    async def napping() -> bool:
        await asyncio.sleep(10)
        return True

    async with InprocBackend(reg) as backend:
        cut = await backend.invoke(Invocation(function="napping", payload={}, deadline=time.time() + 0.2))
        assert cut.error.type == ErrorCode.DEADLINE_EXCEEDED and cut.started is True, cut.error
        try:
            running = backend.submit(Invocation(function="held", payload={}, deadline=time.time() + 0.3))
            await asyncio.sleep(0.05)  # on the one thread
            waiting = backend.submit(Invocation(function="held", payload={}, deadline=time.time() + 0.3))
            await asyncio.sleep(0.05)
            # what a client that gives up on them asks (Backend.started)
            assert backend.started("held", running) is True and backend.started("held", waiting) is False
            ran, queued = await asyncio.gather(running, waiting)
            late = await backend.invoke(Invocation(function="held", payload={}, deadline=time.time() - 1))
        finally:
            release.set()
    assert ran.error.type == ErrorCode.DEADLINE_EXCEEDED and ran.started is True, ran.error
    assert "while running" in ran.error.message
    assert queued.error.type == ErrorCode.DEADLINE_EXCEEDED and queued.started is False, queued.error
    assert "did not start" in queued.error.message
    assert late.error.type == ErrorCode.DEADLINE_EXCEEDED and late.started is False


@pytest.mark.parametrize(
    ("name", "payload", "message"),
    [
        ("raises_unprintable", {}, "Unprintable: <exception str() failed>"),
        ("async_raises_unprintable", {}, "Unprintable: <exception str() failed>"),
        ("checked", {"n": -1}, "LookupError: no entry for -1"),
        ("async_checked", {"n": -1}, "LookupError: no entry for -1"),
        ("nested", {"depth": 250}, None),
    ],
)
async def test_the_functions_own_raises_and_deep_values_are_its_answers(name, payload, message):
    """What the runner shares with the local backend's workers: a raise whose str() raises and
    an argument check raising past pydantic were a retryable TransportError here (the runner
    raised them), a value nested past pydantic-core's parse limit too."""
    from reply_fns import REG

    async with InprocBackend(REG) as backend:
        r = await backend.invoke(Invocation(function=name, payload=payload))
        if message is None:
            assert r.ok and r.error is None
        else:
            assert r.error is not None and (r.error.type, r.error.message) == (ErrorCode.USER_ERROR, message)


async def test_an_int_past_the_parsers_digit_limit_is_the_functions_answer():
    """An int of more than 4,300 digits: the runner writes it, neither parser reads it back;
    the decode raised out of the backend (a retryable TransportError to a client)."""
    from reply_fns import REG

    async with InprocBackend(REG) as backend:
        r = await backend.invoke(Invocation(function="power_of_ten", payload={"digits": 5000}))
    assert r.error is not None and r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE, r.error
    assert r.started is True and "power_of_ten" in r.error.message


@pytest.mark.parametrize("library", ["numpy", "torch"])
@pytest.mark.parametrize("backend_kind", ["inproc", "local"])
async def test_a_reward_of_array_library_values_is_answered_with_their_values(library, backend_kind):
    """A numpy float32 (``arr.mean()``), a 0-d torch tensor, an int64: each was a final
    ResultNotSerializable, on every call of such a reward (TRL trained on all None)."""
    pytest.importorskip(library)
    from reply_fns import REG

    from fabric.backends.local import LocalBackend, LocalConfig

    backend = (
        InprocBackend(REG) if backend_kind == "inproc" else LocalBackend(REG, LocalConfig(max_workers=1))
    )
    async with backend:
        payload = {"completion": "abc", "library": library}
        r = await backend.invoke(Invocation(function="numpy_score", payload=payload))
    assert r.ok, r.error
    assert r.value == {"score": 0.5, "tokens": 3, "per_token": [0.25, 0.75]}


async def test_a_close_answers_the_calls_in_flight_backend_closed():
    """The close left the calls under way running: an async call went on to its end after the
    client's ``async with`` had exited (its answer, 5 s later, an ordinary result of a closed
    backend). As the local backend does, the close cancels an async handler and answers its
    call ``BackendClosed``; a synchronous one cannot be stopped in its thread: its call is
    answered at once, the thread runs on, and one still queued for a thread never runs."""
    from fabric.client import Client

    reg = Registry()
    entered, release = threading.Event(), threading.Event()
    cancelled: list[bool] = []

    @reg.function(name="napping", warm=0, timeout_s=60)
    async def napping() -> bool:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return True

    @reg.function(name="held", warm=0, timeout_s=60, max_concurrency=1)  # one thread
    def held() -> bool:
        entered.set()
        release.wait(30)
        return True

    try:
        async with Client(backend="inproc", registry=reg) as c:
            nap = asyncio.create_task(c.call("napping"))
            running = asyncio.create_task(c.call("held"))
            for _ in range(3000):  # until its thread runs it (bounded: 30 s)
                if entered.is_set():
                    break
                await asyncio.sleep(0.01)
            assert entered.is_set(), "the handler never started"
            waiting = c.backend.submit(Invocation(function="held", payload={}))
            await asyncio.sleep(0.05)
        # bounded waits, in case the calls run on (a hang, not a speed, is what fails here)
        done, _ = await asyncio.wait([nap, running, waiting], timeout=10)
        assert len(done) == 3, "the calls in flight ran on past the close"
        assert cancelled == [True]  # the async handler saw its cancellation
        assert not release.is_set()  # the thread still runs its call
        for t, started in ((nap, True), (running, True), (waiting, False)):
            r = t.result()
            assert r.error is not None and r.error.type == ErrorCode.BACKEND_CLOSED, r.error
            assert r.started is started, r
    finally:
        release.set()
