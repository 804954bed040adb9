"""GroupRunner: aborting groups (stale, complete), closing the runner, and the invariants
of many groups at once (never a trajectory twice, never more than group_size finished).

The env manager is a fake whose ``run`` follows a script (groups_helpers.py)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from groups_helpers import FakeManager, Harness, job, sample_of

from core.rollout.env_manager import TurnBarrier
from fabric.protocol import Trajectory

# ----------------------------------------------------------------------------- aborting


async def test_abort_group_stale_cancels_everything_of_the_group():
    h = Harness(job(group_size=2, redundancy=1), FakeManager(default=(10.0, "ok")))
    g = h.start(group_id="old")
    other = h.start(group_id="new")
    await asyncio.sleep(0.01)
    h.runner.abort_group("old", "stale")
    async with asyncio.timeout(5):
        while g.running or h.runner._aborting:  # noqa: ASYNC110 - no event for "all stopped"
            await asyncio.sleep(0.002)
    old_ids = set(h.manager.ids()[:3])
    assert set(h.manager.cancelled) == old_ids and set(h.proxy.aborted) == old_ids
    assert h.runner.aborted_ids == old_ids and not h.submitted
    assert g.closed == "stale" and "old" not in h.runner.groups
    assert h.runner.metrics["stale_groups"] == 1
    assert other.closed is None and len(other.running) == 3  # the other group rolls on
    assert h.runner.rolling_groups() == 1
    h.runner.reward_failed(sample_of(Trajectory(id="x"), "old"))  # too late: ignored
    assert len(h.manager.launched) == 6
    h.runner.abort_group("nobody", "stale")  # unknown: nothing happens
    await h.runner.aclose()


async def test_abort_group_complete_forgets_a_full_group():
    h = Harness(job(group_size=2), FakeManager(default=(0.005, "ok")))
    g = h.start(group_id="g")
    await h.settle()
    assert "g" in h.runner.groups  # full: kept until its rewards complete (a reward may fail)
    h.runner.abort_group("g", "complete")
    assert "g" not in h.runner.groups and g.closed == "full"
    h.runner.reward_failed(sample_of(h.submitted[0], "g"))
    assert len(h.manager.launched) == 2


async def test_a_stale_group_with_nothing_running_is_forgotten():
    h = Harness(job(group_size=2), FakeManager(default=(0.005, "ok")))
    h.start(group_id="g")
    await h.settle()  # full, waiting for its rewards
    h.runner.abort_group("g", "stale")  # the buffer's bound dropped it before they came
    await h.settle()
    assert "g" not in h.runner.groups


async def test_rolling_groups_counts_groups_short_of_group_size():
    script = [(0.005, "ok"), (0.005, "ok")] + [(10.0, "ok")] * 4
    h = Harness(job(group_size=2), FakeManager(script))
    assert h.runner.rolling_groups() == 0
    h.start(group_id="a")
    h.start(group_id="b")
    h.start(group_id="c")
    assert h.runner.rolling_groups() == 3
    a = h.runner.groups["a"]
    async with asyncio.timeout(5):
        while a.closed is None:  # noqa: ASYNC110 - "changed" is set for any group
            await asyncio.sleep(0.002)
    assert h.runner.rolling_groups() == 2  # "a" filled
    h.runner.abort_group("b", "stale")
    assert h.runner.rolling_groups() == 1
    assert h.runner.changed.is_set()
    await h.runner.aclose()
    assert h.runner.rolling_groups() == 0


async def test_aclose_leaves_no_task_running():
    h = Harness(job(group_size=3, redundancy=1), FakeManager(default=(10.0, "ok")))
    for i in range(3):
        h.start(group_id=f"g{i}")
    await asyncio.sleep(0.01)
    await h.runner.aclose()
    assert h.runner.running() == 0 and not h.runner._aborting
    assert len(h.manager.cancelled) == 12 and not h.submitted
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert leftover == []


async def test_members_join_the_groups_barrier():
    barrier = TurnBarrier()
    h = Harness(job(group_size=2, redundancy=1), FakeManager(default=(0.005, "ok")))
    h.start(barrier=barrier)
    assert barrier._members == 3
    await asyncio.sleep(0)
    assert all(b is barrier for _, _, _, b in h.manager.launched)
    await h.settle()
    assert barrier._members == 0  # every member left (finished or aborted)


# ----------------------------------------------------------------------------- invariants


async def test_many_groups_never_submit_a_trajectory_twice_nor_more_than_group_size_finished():
    rng = random.Random(0)
    statuses = ["ok"] * 6 + ["truncated", "infra_failed", "aborted", "raise"]
    script = [(rng.uniform(0, 0.02), rng.choice(statuses)) for _ in range(400)]
    h = Harness(job(group_size=3, redundancy=1, max_reruns=2), FakeManager(script, default=(0.001, "ok")))
    groups = [h.start(seed=i, group_id=f"g{i}") for i in range(12)]
    await asyncio.sleep(0.005)
    h.runner.abort_group("g3", "stale")
    await h.settle()
    reward_failed: Counter[str] = Counter()
    for t in list(h.submitted[:6]):  # a few rewards fail: their groups re-run a member
        gid = t.task["group_id"]
        if t.status == "ok" and gid != "g3":
            h.runner.reward_failed(sample_of(t, gid))
            reward_failed[gid] += 1
    await h.settle()
    ids = h.submitted_ids()
    assert len(ids) == len(set(ids)), "a trajectory was submitted twice"
    assert not set(ids) & h.runner.aborted_ids
    finished = Counter(t.task["group_id"] for t in h.submitted if t.status in ("ok", "truncated"))
    for g in groups:
        assert finished[g.id] <= 3 + reward_failed[g.id]  # group_size, plus replacements of failed rewards
        if g.closed == "full":
            assert g.finished == 3
    assert h.runner.running() == 0
