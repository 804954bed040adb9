"""``escapees.Sweeps`` gathers the sweeps of the stops under way into one scan of ``/proc``,
and only those: a sweep does not wait for stops that began after it was asked for."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Collection

import pytest

from envpool import escapees


@pytest.fixture
def swept(monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """The marks of each sweep, none run for real; ``GATHER_S`` far longer than any test
    here, so that only what the sweeps wait for decides when they run."""
    calls: list[set[str]] = []

    def sweep(tokens: Collection[str]) -> None:
        calls.append(set(tokens))

    monkeypatch.setattr(escapees, "sweep", sweep)
    monkeypatch.setattr(escapees, "GATHER_S", 600.0)
    return calls


async def test_a_sweep_does_not_wait_for_a_stop_that_began_after_it_was_asked(swept):
    # it waited until no stop at all was killing its container's group: with stops that
    # overlap (a pool's churn of one-episode containers), each began before the one before it
    # ended, and every sweep, and so every stop (and the slot it frees), waited GATHER_S (2 s)
    # though the stops it could have joined had ended long before
    sweeps = escapees.Sweeps()
    first = sweeps.killing()
    first.__enter__()
    done = sweeps.ask({"m1"})
    await asyncio.sleep(0)  # the sweep waits for the stop under way
    with sweeps.killing():  # a stop that began after the sweep was asked for
        first.__exit__(None, None, None)
        # (the bound only ends a failing test: the sweep runs within moments)
        await asyncio.wait_for(asyncio.shield(done), 10)
    assert swept == [{"m1"}]
    await sweeps.wait()


async def test_the_stops_under_way_as_a_sweep_is_asked_for_are_swept_together(swept):
    # the batching the waits are for: a close of N containers scans /proc once
    sweeps = escapees.Sweeps()
    with contextlib.ExitStack() as stack:
        stack.enter_context(sweeps.killing())
        second = sweeps.killing()
        second.__enter__()
        done1 = sweeps.ask({"m1"})
        await asyncio.sleep(0.05)
        assert swept == []  # the second stop is still killing its group
    # (the first stop's kill ended with the stack; the second's now)
    done2 = sweeps.ask({"m2"})
    second.__exit__(None, None, None)
    await asyncio.wait_for(asyncio.gather(done1, done2), 30)
    assert swept == [{"m1", "m2"}]
    await sweeps.wait()


async def test_a_sweep_cancelled_with_its_loop_fails_its_waiters_it_does_not_cancel_them(monkeypatch):
    # the loop's teardown cancels every task left, the sweeps' worker among them; a stop that
    # began in that teardown (a task made after it cancelled the others: a close in a
    # cancelled task's finally) waited for that worker's sweep, and got its CancelledError
    # though nothing cancelled it, read by its own callers as their cancellation
    started, release = threading.Event(), threading.Event()

    def sweep(tokens: Collection[str]) -> None:
        started.set()
        release.wait(30)

    monkeypatch.setattr(escapees, "sweep", sweep)
    sweeps = escapees.Sweeps()
    try:
        running = asyncio.ensure_future(sweeps.sweep({"m1"}))  # its sweep under way
        await asyncio.to_thread(started.wait, 30)
        following = asyncio.ensure_future(sweeps.sweep({"m2"}))  # for the next one
        await asyncio.sleep(0)
        assert sweeps._worker is not None
        sweeps._worker.cancel()  # as the loop's teardown does
        await asyncio.wait((running, following), timeout=30)
        for stop in (running, following):
            assert stop.done() and not stop.cancelled()
            error = stop.exception()
            assert isinstance(error, RuntimeError) and "cancelled" in str(error), error
    finally:
        release.set()
    await sweeps.wait()
