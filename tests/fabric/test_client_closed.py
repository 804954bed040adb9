"""A closed ``Client``: every call after ``aclose`` is refused ``BackendClosed`` (nothing
sent), ``warmup`` and ``async with`` raise ``BackendClosedError``, whoever owns the backend.
A backend passed in stays open after the client's close, and calls through the closed
client ran on it: a side-effecting keyed call cut by the close left its key free, and the
same key ran the effect a second time."""

from __future__ import annotations

import asyncio

import pytest
from client_helpers import make

from fabric.errors import BackendClosedError, ErrorCode
from fabric.testing import Fault


def _closed(r) -> bool:
    return not r.ok and r.error.type == ErrorCode.BACKEND_CLOSED and r.started is False


async def test_a_call_after_close_is_refused_and_nothing_is_sent():
    c, fake = make()
    assert (await c.call("double", {"x": 1})).ok
    await c.aclose()
    assert c.closed and not fake.closed  # the backend is the test's: still open
    r = await c.call("double", {"x": 2})
    assert _closed(r) and "client is closed" in r.error.message
    keyed = await c.call("double", {"x": 2}, idempotency_key="k")
    assert _closed(keyed)
    assert len(fake.invocations) == 1  # only the call made before the close


async def test_map_and_stream_after_close_answer_each_payload_backend_closed():
    c, fake = make()
    await c.aclose()
    mapped = await c.map("double", [{"x": 1}, {"x": 2}])
    assert [r.index for r in mapped] == [0, 1] and all(_closed(r) for r in mapped)
    streamed = [r async for r in c.stream("double", [{"x": 1}, {"x": 2}])]
    assert sorted(r.index for r in streamed) == [0, 1] and all(_closed(r) for r in streamed)
    assert fake.invocations == []


async def test_a_side_effect_cut_by_the_close_does_not_run_again_under_its_key(tmp_path):
    path = tmp_path / "deliveries"
    payload = {"path": str(path), "seconds": 0.3}
    c, fake = make()  # the FakeBackend is the test's: the client does not close it
    first = asyncio.create_task(c.call("deliver", payload, idempotency_key="b"))
    await asyncio.sleep(0.05)  # sent: the effect is under way
    await c.aclose()
    # it may have run (the close let it go, and a backend may run it on): OutcomeUnknown, as
    # any keyed side effect that may have run, not a Cancelled that says nothing of the effect
    assert (await first).error.type == ErrorCode.OUTCOME_UNKNOWN
    again = await c.call("deliver", payload, idempotency_key="b")
    await asyncio.sleep(0.5)  # what a second run would have needed to deliver
    assert _closed(again)
    # sent once, cut at the close: where a backend lets the cut run go on, a second one
    # under the key would have been a second effect
    assert [inv.function for inv in fake.invocations] == ["deliver"]


async def test_a_call_arriving_while_the_client_closes_is_refused():
    c, fake = make()
    first = asyncio.create_task(c.call("nap", {"seconds": 30}, idempotency_key="a"))
    await asyncio.sleep(0)  # its execution runs
    closing = asyncio.create_task(c.aclose())
    await asyncio.sleep(0)  # the close cancelled it, and waits for it to end
    late = await c.call("double", {"x": 1}, idempotency_key="b")
    await closing
    assert _closed(late)
    assert (await first).error.type == ErrorCode.CANCELLED
    assert "double" not in [inv.function for inv in fake.invocations]


async def test_warmup_and_reentry_after_close_raise_backend_closed():
    c, fake = make()
    async with c:
        pass
    assert c.closed and not fake.closed
    with pytest.raises(BackendClosedError, match="client is closed"):
        await c.warmup()
    with pytest.raises(BackendClosedError, match="client is closed"):
        async with c:
            pass  # pragma: no cover
    await c.aclose()  # closing again is a no-op


async def test_a_call_waiting_for_a_slot_at_the_close_is_not_sent():
    c, fake = make()
    holder = asyncio.create_task(c.call("one_at_a_time", {"seconds": 0.2}))
    await asyncio.sleep(0.05)  # sent: it holds the function's only slot
    waiting = asyncio.create_task(c.call("one_at_a_time", {"seconds": 0.2}))
    await asyncio.sleep(0.05)  # in line for the slot
    await c.aclose()
    assert (await holder).ok  # sent before the close, on a backend that stays open
    assert _closed(await waiting)
    assert len(fake.invocations) == 1


async def test_a_call_retrying_at_the_close_sends_no_further_attempt():
    c, fake = make()
    # slow_retry: 20 attempts, 10 ms apart; each fails (retryable) after 50 ms
    fake.inject("slow_retry", *(Fault(code=ErrorCode.UNAVAILABLE, delay_s=0.05) for _ in range(20)))
    call = asyncio.create_task(c.call("slow_retry", {"x": 1}))
    for _ in range(3000):  # until it retries (bounded: 30 s)
        if len(fake.invocations) >= 2:
            break
        await asyncio.sleep(0.01)
    await c.aclose()
    sent = len(fake.invocations)  # the attempt in flight at the close ends as it does
    r = await call
    assert not r.ok and r.error.type == ErrorCode.UNAVAILABLE  # its last real failure
    assert "not retried: the client closed" in r.error.message
    assert len(fake.invocations) == sent < 20


async def test_a_call_in_flight_at_the_close_sends_no_hedge():
    # a hedge is due 50 ms after the primary is sent (min_delay_ms; the p95 is under it)
    c, fake = make(hedge={"min_samples": 20, "max_share": 0.5, "min_delay_ms": 50})
    await c.map("nap", [{"seconds": 0.001}] * 30)
    fake.inject("nap", Fault(delay_s=0.3))  # the primary straggles past the hedge's time
    call = asyncio.create_task(c.call("nap", {"seconds": 0.001, "tag": 9}))
    for _ in range(3000):  # until the primary is sent (bounded: 30 s)
        if len(fake.invocations) == 31:
            break
        await asyncio.sleep(0.001)
    await c.aclose()  # before the hedge's time
    r = await call
    assert r.ok and r.value == 9 and not r.hedged  # the primary's answer: it was sent before
    assert len(fake.invocations) == 31 and c.metrics()["nap"]["hedges"] == 0
