"""Review of the trajectory-level rollout (session 11): what an adversarial reading of the
proxy, the turn scheduler, the env manager and the group runner found, each pinned by a test
that failed before its fix."""

from __future__ import annotations

import asyncio
from typing import Any

from test_turn_scheduler import GatedReplica, req, settle

from core.rollout.llm_proxy import LLMProxy
from core.rollout.scheduling import TurnScheduler


async def test_cmlfq_aging_a_released_trajectorys_left_over_turn_does_not_bring_its_level_back():
    # An aborted turn leaves the line (its waiter goes) but its entry stays in the policy's
    # heap until a slot frees; C-MLFQ's aging lifted that entry's trajectory a level, which
    # wrote the level of a trajectory its release had forgotten back into the store shared
    # by every replica's queue: one id kept for the job's life per aborted waiting turn
    # (redundant members are aborted while they wait, every group, under load).
    rep = GatedReplica()
    sched = TurnScheduler("cmlfq", slots=1, scheduler_options={"aging_s": 0.0})
    proxy = LLMProxy({"default": [rep]}, scheduler=sched)
    busy = asyncio.ensure_future(proxy.generate("busy", "t", req("busy")))
    await settle()
    doomed = asyncio.ensure_future(proxy.generate("doomed", "t", req("doomed", 1, outcome="tool_error")))
    await settle()
    levels: dict[str, Any] = sched._queue_options["level_store"]
    assert sched.waiting_of("doomed") == 1 and levels["doomed"] == 1
    await proxy.release("doomed")  # its caller went away (a redundant member aborted)
    assert (await asyncio.wait_for(doomed, 1)).finish_reason == "abort"
    assert "doomed" not in levels
    await asyncio.sleep(0.01)  # past aging_s: the next pop ages the left-over entry
    rep.open("busy/0")
    await busy
    await proxy.release("busy")
    await settle()
    assert rep.started == ["busy/0"]  # it never ran
    assert levels == {}, levels
