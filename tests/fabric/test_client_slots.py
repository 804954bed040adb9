"""A function's ``max_concurrency`` slots: a call waiting for one ends at its deadline; a
hedge takes one or is not sent, past the limit only within its allowance; a slot is held
while a call let go (abandoned at its deadline, a hedge's loser) still runs on the backend."""

from __future__ import annotations

import asyncio
import time

import pytest
from client_fns import REG
from client_helpers import _ManualBackend, make

from fabric.client import Client, ClientConfig
from fabric.errors import ErrorCode
from fabric.testing import FakeBackend, Fault


@pytest.mark.parametrize("backend", ["fake", "inproc"])
async def test_a_call_waiting_for_a_concurrency_slot_ends_at_its_deadline(backend):
    fake = FakeBackend(REG)
    async with Client(backend=fake if backend == "fake" else "inproc", registry=REG) as c:
        busy = asyncio.create_task(c.call("one_at_a_time", {"seconds": 1.0}))  # holds the only slot
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        r = await c.call("one_at_a_time", {"seconds": 0.0}, deadline_s=0.1)
        assert time.monotonic() - t0 < 0.5  # at its deadline, not when the slot frees (1 s)
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED
        assert "waited for a concurrency slot" in r.error.message and "nothing was sent" in r.error.message
        assert r.started is False
        assert (await busy).ok
        assert (await c.call("one_at_a_time", {"seconds": 0.0}, deadline_s=0.5)).ok  # no slot leaked
        assert c.metrics()["one_at_a_time"]["errors"] == {"DeadlineExceeded": 1}
    if backend == "fake":
        assert [i.payload["seconds"] for i in fake.invocations] == [1.0, 0.0]  # not the one that gave up


async def test_a_hedge_takes_a_concurrency_slot_or_is_not_sent():
    """max_concurrency bounds the calls in flight, hedges included: a hedge sent while its
    caller held the only slot made two in flight (a limit a paid or rate-limited dependency
    relies on)."""
    c, fake = make(hedge={"min_samples": 5, "max_share": 1.0})
    await c.map("one_at_a_time", [{"seconds": 0}] * 10)
    fake.inject("one_at_a_time", Fault(delay_s=0.3))  # a straggler, due a hedge; no slot is free
    r = await c.call("one_at_a_time", {"seconds": 0})
    assert r.ok and not r.hedged
    assert not any(i.hedge for i in fake.invocations) and c.metrics()["one_at_a_time"]["hedges"] == 0
    # with a slot free the hedge takes it, and gives it back when it ends (here: it won)
    await c.map("two_at_a_time", [{"seconds": 0}] * 10)
    fake.inject("two_at_a_time", Fault(delay_s=5.0))
    r = await c.call("two_at_a_time", {"seconds": 0})
    assert r.ok and r.hedged and c.metrics()["two_at_a_time"]["hedge_wins"] == 1
    sem = c._fns["two_at_a_time"].sem
    assert sem.take_now() and sem.take_now() and not sem.take_now()  # both slots free again
    sem.release()
    sem.release()


async def test_a_saturated_function_is_hedged_within_its_allowance_past_the_limit():
    """Every slot held by a waiting caller (a saturated function) is exactly when a straggler
    needs a hedge: hedges may go past max_concurrency by over_limit_share of it, no more."""
    c, fake = make(hedge={"min_samples": 5, "max_share": 1.0, "over_limit_share": 0.5})
    await c.map("two_at_a_time", [{"seconds": 0}] * 10)
    fake.inject("two_at_a_time", Fault(delay_s=1.0))  # both callers' calls straggle
    a, b = await asyncio.gather(*(c.call("two_at_a_time", {"seconds": 0}) for _ in range(2)))
    # an allowance of int(0.5 * 2) = 1: one of the two stragglers is hedged, and wins
    assert a.ok and b.ok and [a.hedged, b.hedged].count(True) == 1
    fn = c._fns["two_at_a_time"]
    assert fn.hedges_over_limit == 0 and fn.sem.take_now() and fn.sem.take_now()  # all given back
    fn.sem.release()
    fn.sem.release()


async def test_the_over_limit_allowance_is_not_cut_by_float_rounding():
    """int(0.29 * 100) is 28 (0.29 * 100 == 28.999...): one hedge fewer than the documented
    share of the limit went over it."""
    from fabric.client_state import FnState

    fn = FnState(REG.get("double").model_copy(update={"max_concurrency": 100}), 0.95)
    while fn.sem.take_now():
        pass  # take every slot: the limit is full
    taken = [fn.take_hedge_slot(0.29) for _ in range(30)]
    assert sum(t is not None for t in taken) == 29


class _RunsOnBackend(_ManualBackend):
    """A backend whose copies run on after their caller let them go (a synchronous handler in
    a local worker), until the test ends the run: ``settled`` says so, as the local pool's does."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[asyncio.Future, asyncio.Future] = {}

    def settled(self, function: str, fut: asyncio.Future) -> asyncio.Future | None:
        if not fut.cancelled():
            return None  # answered: its run is over
        return self.runs.setdefault(fut, asyncio.get_running_loop().create_future())

    def end_run(self, fut: asyncio.Future) -> None:
        self.runs.setdefault(fut, asyncio.get_running_loop().create_future()).set_result(None)


async def _sent_or_waiting(backend: _ManualBackend, n: int) -> int:
    """How many invocations were sent after the calls made so far took their turn."""
    for _ in range(n):
        await asyncio.sleep(0)  # each call runs up to its send or to its wait for a slot
    return len(backend.invocations)


async def test_a_slot_is_held_while_an_abandoned_call_still_runs_on_the_backend():
    """max_concurrency counts calls running, not callers waiting: a call abandoned at its
    deadline (the worker is not killed for it, a synchronous handler runs to its end) gave
    its slot back at once, and the next call ran beside it (two runs of a function limited
    to one, against the paid or rate-limited dependency the limit protects)."""
    backend = _RunsOnBackend()
    c = Client(
        backend=backend, registry=REG, config=ClientConfig.model_validate({"hedge": {"enabled": False}})
    )
    r = await c.call("one_at_a_time", {"seconds": 0}, deadline_s=0.05)
    assert r.error.type == ErrorCode.DEADLINE_EXCEEDED
    abandoned = backend.futures[0]
    assert abandoned.cancelled()
    nxt = asyncio.create_task(c.call("one_at_a_time", {"seconds": 0}))
    assert await _sent_or_waiting(backend, 5) == 1  # waits: the abandoned run holds the slot
    backend.end_run(abandoned)
    inv, fut = await backend.next()
    inv, fut = await backend.next()
    backend.answer(inv, fut)
    assert (await nxt).ok


async def test_a_hedge_loser_holds_its_slot_until_its_run_ends():
    """A hedge "takes one of the function's max_concurrency slots until it ends": the loser
    that a synchronous worker runs on after it was cancelled gave its slot back at once."""
    backend = _RunsOnBackend()
    c = Client(
        backend=backend,
        registry=REG,
        config=ClientConfig.model_validate({"hedge": {"min_samples": 5, "max_share": 1.0}}),
    )
    warm = [asyncio.create_task(c.call("two_at_a_time", {"seconds": 0})) for _ in range(5)]
    for _ in range(5):
        backend.answer(*await backend.next())
    await asyncio.gather(*warm)
    call = asyncio.create_task(c.call("two_at_a_time", {"seconds": 0}))
    primary, p = await backend.next()
    hedge, h = await backend.next()
    assert hedge.hedge
    backend.answer(primary, p)  # the primary wins; the hedge is cancelled, and runs on
    assert (await call).ok and h.cancelled()
    others = [asyncio.create_task(c.call("two_at_a_time", {"seconds": 0})) for _ in range(2)]
    assert await _sent_or_waiting(backend, 5) == 8  # one slot is free, the hedge's run holds the other
    backend.end_run(h)
    assert await _sent_or_waiting(backend, 5) == 9
    for _ in range(2):
        backend.answer(*await backend.next())
    assert all(r.ok for r in await asyncio.gather(*others))
