"""Hedging: a copy of a straggling call sent after the function's p95, the first answer
winning (under the call's key for a keyed call); no hedge where disabled, for side effects
or past the cap; which copy wins when a copy fails (a backend answered by hand). A hedge's
concurrency slot is in test_client_slots.py, a hedge whose sending fails in
test_client_hedge_failures.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from client_fns import REG
from client_helpers import _ManualBackend, make

from fabric.client import Client, ClientConfig
from fabric.errors import ErrorCode
from fabric.protocol import Result
from fabric.testing import Fault


async def _warm_latency(c: Client, n: int = 30) -> None:
    await c.map("nap", [{"seconds": 0.001}] * n)


async def test_hedge_fires_after_p95_and_first_answer_wins():
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.5})
    await _warm_latency(c)
    fake.inject("nap", Fault(delay_s=5.0))  # the primary straggles, the hedge does not
    t0 = time.monotonic()
    r = await c.call("nap", {"seconds": 0.001, "tag": 9})
    assert r.ok and r.value == 9 and r.hedged
    assert time.monotonic() - t0 < 2.5  # the hedge's answer, not the straggler's (5 s)
    m = c.metrics()["nap"]
    assert m["hedges"] == 1 and m["hedge_wins"] == 1
    assert (
        fake.invocations[-1].hedge
        and fake.invocations[-1].idempotency_key == fake.invocations[-2].idempotency_key
    )


async def test_a_hedge_fires_after_the_current_p95_when_the_p95_dropped():
    c, fake = make(hedge={"min_samples": 5})
    async with c:
        fake.inject("nap", *(Fault(delay_s=0.5) for _ in range(5)))
        await c.map("nap", [{"seconds": 0}] * 5)  # the first p95: 0.5 s
        fake.inject("nap", Fault(delay_s=3.0))
        x = asyncio.create_task(c.call("nap", {"seconds": 0}))  # its hedge is due in 0.5 s
        await asyncio.sleep(0.01)
        for _ in range(123):  # the 128th latency recomputes the p95: under a millisecond now
            await c.call("nap", {"seconds": 0})
        fake.inject("nap", Fault(delay_s=3.0))
        t0 = time.monotonic()
        y = await c.call("nap", {"seconds": 0})  # its hedge is due in min_delay_ms, not after x's
        assert y.ok and y.hedged and time.monotonic() - t0 < 0.2
        assert (await x).hedged


async def test_a_keyed_call_is_hedged_under_its_key_and_its_answer_cached():
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.5})
    async with c:
        await _warm_latency(c)
        fake.inject("nap", Fault(delay_s=5.0))  # the primary straggles, the hedge does not
        t0 = time.monotonic()
        r = await c.call("nap", {"seconds": 0.001, "tag": 9}, idempotency_key="h")
        assert r.ok and r.value == 9 and r.hedged and not r.cached
        assert time.monotonic() - t0 < 2.5  # the hedge's answer, not the straggler's (5 s)
        primary, dup = fake.invocations[-2:]
        assert dup.hedge and dup.idempotency_key == primary.idempotency_key
        assert fake.executions[primary.idempotency_key] == 1  # the straggler was cancelled
        again = await c.call("nap", {"seconds": 0.001, "tag": 9}, idempotency_key="h")
        assert again.cached and again.value == 9 and len(fake.invocations) == 32


async def test_a_keyed_hedge_that_did_not_start_in_time_does_not_win_over_its_running_primary():
    """A keyed execution's copy answered DeadlineExceeded never started (its backend does not
    answer such a call early once it runs): like a retryable failure, it waits for the other
    copy, which may be running, instead of ending the execution with a failure."""
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.5})
    async with c:
        await _warm_latency(c)
        # the primary straggles and then succeeds; the hedge is answered as queued past its deadline
        fake.inject("nap", Fault(delay_s=0.5), Fault(code=ErrorCode.DEADLINE_EXCEEDED))
        r = await c.call("nap", {"seconds": 0.001, "tag": 9}, idempotency_key="h", deadline_s=5)
        assert r.ok and r.value == 9 and r.hedged, r.error
        assert fake.invocations[-1].hedge and c.metrics()["nap"]["hedge_wins"] == 0


async def test_no_hedge_when_disabled_or_for_side_effects():
    c, fake = make(hedge={"min_samples": 20, "enabled": False})
    await _warm_latency(c)
    fake.inject("nap", Fault(delay_s=0.3))
    r = await c.call("nap", {"seconds": 0.001})
    assert r.ok and not r.hedged
    c2, fake2 = make(hedge={"min_samples": 5})
    await c2.map("effect", [{"x": i} for i in range(10)])
    fake2.inject("effect", Fault(delay_s=0.3))
    r = await c2.call("effect", {"x": 1})
    assert r.ok and not r.hedged and not any(i.hedge for i in fake2.invocations)


async def test_a_function_declared_hedge_false_is_never_hedged_not_even_when_asked():
    c, fake = make(hedge={"min_samples": 5})
    await c.map("paid_nap", [{"seconds": 0.001}] * 10)
    fake.inject("paid_nap", Fault(delay_s=0.3))
    r = await c.call("paid_nap", {"seconds": 0.001, "tag": 4}, hedge=True)
    assert r.ok and r.value == 4 and not r.hedged
    assert not any(i.hedge for i in fake.invocations) and c.metrics()["paid_nap"]["hedges"] == 0
    # the same straggler on a function that allows hedges is hedged: the setting is what differs
    await _warm_latency(c)
    fake.inject("nap", Fault(delay_s=0.3))
    assert (await c.call("nap", {"seconds": 0.001})).hedged


async def test_hedges_are_capped():
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.0})
    await _warm_latency(c)
    for _ in range(8):
        fake.inject("nap", Fault(delay_s=0.2))
    await c.map("nap", [{"seconds": 0.001}] * 8)
    assert c.metrics()["nap"]["hedges"] == 5  # the burst allowance, then nothing


async def _manual_with_p95(**cfg) -> tuple[Client, _ManualBackend]:
    """A client whose ``nap`` has a p95 to hedge after (five quick answers)."""
    manual = _ManualBackend()
    c = Client(backend=manual, registry=REG, config=ClientConfig.model_validate(cfg))
    calls = [asyncio.create_task(c.call("nap", {"seconds": 0})) for _ in range(5)]
    for _ in range(5):
        manual.answer(*await manual.next())
    assert all(r.ok for r in await asyncio.gather(*calls))
    return c, manual


async def test_a_hedge_that_failed_too_is_no_win():
    """A primary failed retryably while its hedge ran on; the hedge failed as well. Both copies
    failed, the call was retried and answered: hedge_wins counted the failed hedge as a win."""
    c, manual = await _manual_with_p95(hedge={"min_samples": 5, "max_share": 1.0})
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()  # sent after the p95
    assert hedge.hedge and not primary.hedge
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    await asyncio.sleep(0)  # one loop turn: the primary's answer is seen (it waits for the hedge)
    manual.answer(hedge, h, ErrorCode.WORKER_LOST)
    retry, f = await manual.next()
    assert retry.attempt == 2
    manual.answer(retry, f)
    assert (await call).ok
    m = c.metrics()["nap"]
    assert m["hedges"] == 1 and m["hedge_wins"] == 0
    # a hedge whose answer is the call's, after its primary failed, is a win
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    await asyncio.sleep(0)
    manual.answer(hedge, h)
    assert (await call).ok and c.metrics()["nap"]["hedge_wins"] == 1


async def test_a_failed_copy_never_wins_over_an_answer_that_came_in_the_same_loop_turn():
    """The primary's retryable failure and its hedge's answer came in one loop turn (two
    workers' replies read in one select): the failure's callback, run first, saw no copy
    still out and ended the call with it, so the call was retried though it had its answer."""
    c, manual = await _manual_with_p95(hedge={"min_samples": 5, "max_share": 1.0})
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    manual.answer(hedge, h)  # before the primary's callback ran
    r = await call
    assert r.ok and r.attempts == 1 and r.hedged, r.error
    m = c.metrics()["nap"]
    assert m["retries"] == 0 and m["hedge_wins"] == 1 and len(manual.invocations) == 7
    # the other way round: the hedge failed, the primary answered, in one turn
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(hedge, h, ErrorCode.NOT_STARTED)
    manual.answer(primary, p)
    r = await call
    assert r.ok and r.attempts == 1 and c.metrics()["nap"]["hedge_wins"] == 1


async def test_a_call_hedged_then_retried_is_marked_hedged():
    """Result.hedged is "True when a hedge was sent for this call": a call whose first attempt
    was hedged (both copies failed) and whose retry answered came back hedged=False."""
    c, manual = await _manual_with_p95(hedge={"min_samples": 5, "max_share": 1.0})
    call = asyncio.create_task(c.call("nap", {"seconds": 0}))
    primary, p = await manual.next()
    hedge, h = await manual.next()
    manual.answer(primary, p, ErrorCode.WORKER_LOST)
    manual.answer(hedge, h, ErrorCode.WORKER_LOST)
    retry, f = await manual.next()
    # the retry is answered before its own hedge could be sent
    manual.answer(retry, f)
    r = await call
    assert r.ok and r.attempts == 2 and r.hedged
    assert [i.hedge for i in manual.invocations[5:]] == [False, True, False]


class _SaysWhatBegan(_ManualBackend):
    """Says which of its calls began (``Backend.started``), as the local backends do."""

    def __init__(self) -> None:
        super().__init__()
        self.began: set[asyncio.Future] = set()

    def started(self, function: str, fut: asyncio.Future) -> bool | None:
        return fut in self.began


async def _five_answered(c: Client, manual: _ManualBackend) -> None:
    """Five calls answered at once: the hedge's p95 (``min_samples: 5``) is known."""
    warm = [asyncio.create_task(c.call("nap", {"seconds": 0})) for _ in range(5)]
    for _ in range(5):
        manual.answer(*await manual.next())
    await asyncio.gather(*warm)


async def test_a_hedged_call_began_when_either_copy_did():
    """The primary's deadline passed before it began (queued) while its hedge ran: the call
    began, and its answer says so (``Result.started``), not the primary's "never started"."""
    manual = _SaysWhatBegan()
    cfg = ClientConfig.model_validate({"hedge": {"min_samples": 5}})
    async with Client(backend=manual, registry=REG, config=cfg) as c:
        await _five_answered(c, manual)
        call = asyncio.create_task(c.call("nap", {"seconds": 0}, deadline_s=30))
        inv, primary = await manual.next()
        hinv, hedge = await manual.next()  # sent after the p95
        assert hinv.hedge
        manual.began.add(hedge)
        primary.set_result(
            Result.failure(
                ErrorCode.DEADLINE_EXCEEDED,
                "deadline passed while queued",
                function=inv.function,
                request_id=inv.request_id,
                started=False,
            )
        )
        r = await call
        assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and r.hedged and r.started is True


@pytest.mark.parametrize("says", [True, False])
async def test_a_call_abandoned_at_its_deadline_began_unless_its_backend_says_not(says):
    """The client stops waiting at the deadline: the call began if its backend says so, and
    never began if it says not (a local call still queued); a backend that cannot know (a
    request sent to Lambda, Modal, a fabric serve) has it read as begun: it may run there."""
    manual = _SaysWhatBegan() if says else _ManualBackend()
    async with Client(backend=manual, registry=REG, config={"hedge": {"enabled": False}}) as c:
        r = await c.call("nap", {"seconds": 0}, deadline_s=0.2)
    assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and "backend answered" in r.error.message
    assert r.started is (not says)


async def test_a_hedged_call_abandoned_while_a_failed_copy_may_have_run_says_it_began():
    """The primary failed without an answer (its backend's future raised: it was sent, and
    may have run) and the hedge, still queued, was abandoned at the deadline: whether the
    call began is not known, and is read as begun, not as the queued hedge's "never began"."""
    manual = _SaysWhatBegan()
    cfg = ClientConfig.model_validate({"hedge": {"min_samples": 5}})
    async with Client(backend=manual, registry=REG, config=cfg) as c:
        await _five_answered(c, manual)
        call = asyncio.create_task(c.call("nap", {"seconds": 0}, deadline_s=1.0))
        _, primary = await manual.next()
        hinv, _ = await manual.next()  # sent after the p95; queued (not in manual.began)
        assert hinv.hedge
        primary.set_exception(RuntimeError("the backend broke after sending it"))
        r = await call
    assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and r.started is True


async def test_a_hedged_call_abandoned_at_its_deadline_is_marked_hedged():
    """Result.hedged is "True when a hedge was sent for this call": one whose primary and
    hedge were both still out at its deadline came back hedged=False."""
    manual = _SaysWhatBegan()
    cfg = ClientConfig.model_validate({"hedge": {"min_samples": 5}})
    async with Client(backend=manual, registry=REG, config=cfg) as c:
        await _five_answered(c, manual)
        call = asyncio.create_task(c.call("nap", {"seconds": 0}, deadline_s=0.5))
        await manual.next()
        hinv, _ = await manual.next()  # sent after the p95; neither copy answers
        assert hinv.hedge
        r = await call
    assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and r.hedged
    assert c.metrics()["nap"]["hedges"] == 1


async def test_a_call_that_ended_leaves_nothing_of_it_to_its_hedge_timer():
    """A call's hedge waited in the function's hedge clock until the p95 delay passed, the
    call long over: it held the call's invocation (payload and encoded bytes) and answer, so
    a slow function's calls (a p95 of minutes) kept every payload of that long alive."""
    import gc
    import weakref

    c, fake = make(hedge={"min_samples": 5, "min_delay_ms": 600_000})  # due in 10 minutes
    async with c:
        await _warm_latency(c, 5)
        r = await c.call("nap", {"seconds": 0, "tag": 1})
        assert r.ok and not r.hedged
        inv = weakref.ref(fake.invocations[-1])
        fake.invocations.clear()  # the fake's record of what it was sent
        # and its out-of-order path (the loop's timer heap): a call due before the FIFO's last
        c.config.hedge.min_delay_ms = 300_000
        assert (await c.call("nap", {"seconds": 0, "tag": 2})).ok
        early = weakref.ref(fake.invocations[-1])
        fake.invocations.clear()
        gc.collect()
        assert inv() is None, "the hedge timer holds the finished call's invocation"
        assert early() is None, "the loop's timer holds the finished call's invocation"
