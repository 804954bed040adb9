"""What a turn leaves behind in a queue it left without running: a broken replica's waiting
line still holds the entries of turns that moved on to another replica. Driven on the real
path's ``TurnScheduler`` directly (no proxy, no Ray)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest

from core.rollout.scheduling import TurnScheduler
from core.sched.queueing import CMLFQ, QUEUE_POLICIES

BROKEN, OTHER = 1, 2


async def test_aging_a_broken_replicas_left_over_entry_does_not_rewrite_the_live_level():
    # One store of C-MLFQ levels for every replica's queue. A turn waited on a replica that
    # broke (the proxy's wake cancels its admission), ran on another and its trajectory went
    # on (a success lifted it to level 0). The broken replica's queue still held the entry;
    # when its slot freed, aging that entry wrote the level it was aged to (2) over the live
    # trajectory's 0.
    sched = TurnScheduler("cmlfq", slots=1, scheduler_options={"aging_s": 30.0})
    sched.request("t", 0, 10, {})
    sched.finished_turn("t", 40_000)  # past the third quantum: the bottom level, 3
    assert await sched.admit(BROKEN, sched.request("hog", 0, 10, {}))  # the only slot
    turn = sched.request("t", 1, 10, {})
    # it became ready 50 s ago: one aging period and a bit when the broken replica next pops
    turn = dataclasses.replace(turn, arrival=sched.now() - 50.0)
    waiting = asyncio.ensure_future(sched.admit(BROKEN, turn))
    await asyncio.sleep(0)
    queue = sched._replicas[BROKEN].queue
    assert isinstance(queue, CMLFQ) and len(queue) == 1 and queue.level_of("t") == 3
    waiting.cancel()  # the replica broke while the turn waited for its slot
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    assert await sched.admit(OTHER, turn)  # the turn runs elsewhere
    sched.done(OTHER)
    sched.finished_turn("t", 10)
    assert await sched.admit(OTHER, sched.request("t", 2, 20, {"outcome": "success"}))
    assert queue.level_of("t") == 0
    sched.done(BROKEN)  # the broken replica's running turn ends: it pops (and ages) its line
    assert queue.level_of("t") == 0  # was 2
    assert len(queue) == 0


@pytest.mark.parametrize("policy", sorted(QUEUE_POLICIES))
async def test_a_cancelled_trajectorys_waiting_turn_leaves_the_policys_line(policy: str):
    # cancel(): the aborted trajectory's turn is out of the line at once, not counted in it
    # (nor, under C-MLFQ, aged) until a slot frees
    sched = TurnScheduler(policy, slots=1)
    assert await sched.admit(BROKEN, sched.request("hog", 0, 10, {}))
    waiting = asyncio.ensure_future(sched.admit(BROKEN, sched.request("t", 0, 10, {})))
    await asyncio.sleep(0)
    queue = sched._replicas[BROKEN].queue
    assert len(queue) == 1
    sched.cancel("t")
    assert await waiting is False
    assert len(queue) == 0


def test_cmlfq_discard_takes_out_one_entry_and_leaves_the_rest_in_order():
    from core.sched.base import Request

    q = CMLFQ(levels=2, quantum_tokens=(100,), aging_s=float("inf"))
    a, b, c = (Request(trajectory=x, arrival=float(i)) for i, x in enumerate("abc"))
    for r in (a, b, c):
        q.push(r, 0.0)
    q.discard(b.seq)
    q.discard(12345)  # not there: nothing to do
    assert len(q) == 2
    assert [r.trajectory for r in q.drain(1.0)] == ["a", "c"]
