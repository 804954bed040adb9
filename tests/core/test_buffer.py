"""SampleBuffer: group completion, masking, extras, the asynchronous bound, exactly-once,
blocking batches and metrics. Deterministic: no sleeps beyond a few milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from core.buffer import SampleBuffer
from core.errors import BufferClosedError
from core.sample import Sample
from fabric.protocol import Message, RewardResult, Trajectory


def sample(
    tid: str, group: str, version: int = 0, score: float = 1.0, status: str = "ok", tag: str = "t"
) -> Sample:
    s = Sample(traj=Trajectory(id=tid), tag=tag, group_id=group, version=version, status=status)  # type: ignore[arg-type]
    if status == "ok":
        s.reward = RewardResult(score=score)
    return s


def fill(buf: SampleBuffer, group: str, n: int, version: int = 0, start: int = 0) -> list[str]:
    return [buf.put(sample(f"{group}-{i}", group, version, score=i)) for i in range(start, start + n)]


class Aborts:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, gid: str, reason: str) -> None:
        self.calls.append((gid, reason))


async def test_a_group_completes_with_group_size_valid_samples():
    aborts = Aborts()
    buf = SampleBuffer(group_size=3, alpha=1, on_abort=aborts)
    assert fill(buf, "g", 3) == ["accepted", "accepted", "completed"]
    assert aborts.calls == [("g", "complete")]  # the rollout side aborts the group's extras
    [g] = await buf.get_batch(1)
    assert g.id == "g" and g.version == 0 and g.scores == [0.0, 1.0, 2.0]


async def test_masked_samples_never_count_and_never_reach_the_trainer():
    buf = SampleBuffer(group_size=2, alpha=1)
    assert buf.put(sample("a", "g", status="infra_failed")) == "masked"
    assert buf.put(sample("b", "g", status="reward_failed")) == "masked"
    assert buf.put(sample("c", "g", status="aborted")) == "masked"
    assert buf.put(sample("d", "g")) == "accepted"
    assert buf.ready_groups() == 0
    # a re-run of the infra-failed trajectory (same id) is accepted: the failure did not count
    assert buf.put(sample("a", "g")) == "completed"
    [g] = await buf.get_batch(1)
    assert [s.id for s in g.samples] == ["d", "a"] and all(not s.masked for s in g.samples)
    assert buf.metrics()["dropped"] == {"infra_failed": 1, "reward_failed": 1, "aborted": 1}


async def test_an_ok_sample_without_reward_is_a_bug():
    buf = SampleBuffer(group_size=2, alpha=1)
    with pytest.raises(ValueError, match="has no reward"):
        buf.put(Sample(traj=Trajectory(id="x"), tag="t", group_id="g", version=0))


async def test_extras_beyond_group_size_are_dropped_and_reported():
    buf = SampleBuffer(group_size=2, alpha=1)
    assert fill(buf, "g", 4) == ["accepted", "completed", "extra", "extra"]
    [g] = await buf.get_batch(1)
    assert len(g.samples) == 2
    assert buf.put(sample("late", "g")) == "extra"  # also after the group was served
    assert buf.metrics()["dropped"] == {"extra": 3}


async def test_duplicates_are_ignored_and_counted():
    buf = SampleBuffer(group_size=3, alpha=1)
    assert buf.put(sample("a", "g")) == "accepted"
    assert buf.put(sample("a", "g", score=0.5)) == "duplicate"
    assert buf.put(sample("a", "g", status="infra_failed")) == "duplicate"
    m = buf.metrics()
    assert m["accepted"] == 1 and m["pending_samples"] == 1 and m["dropped"] == {"duplicate": 2}


async def test_advance_drops_groups_beyond_the_bound_and_tells_the_rollout_side():
    aborts = Aborts()
    buf = SampleBuffer(group_size=2, alpha=1, on_abort=aborts)
    fill(buf, "old", 1, version=0)  # pending, started under v0
    fill(buf, "ready-old", 2, version=0)  # complete, not yet served
    fill(buf, "fresh", 1, version=1)
    aborts.calls.clear()
    assert buf.advance(1) == []  # v0 is still within alpha=1 of v1
    dropped = buf.advance(2)
    assert sorted(dropped) == ["old", "ready-old"]
    assert sorted(aborts.calls) == [("old", "stale"), ("ready-old", "stale")]
    assert buf.bound == 1 and buf.is_stale(0) and not buf.is_stale(1)
    m = buf.metrics()
    assert m["dropped"] == {"stale": 3} and m["ready_groups"] == 0 and m["pending_groups"] == 1
    # a late member of a dropped group, and a trajectory started under a stale version
    assert buf.put(sample("old-9", "old", version=0)) == "stale"
    assert buf.put(sample("x-0", "new", version=0)) == "stale"
    assert buf.put(sample("x-1", "new", version=2)) == "stale"  # the group is closed now
    assert ("new", "stale") in aborts.calls
    assert fill(buf, "fresh", 1, version=2, start=1) == ["completed"]
    [g] = await buf.get_batch(1)
    assert g.id == "fresh" and g.version == 1  # as old as its oldest member


async def test_a_stale_member_makes_its_whole_pending_group_stale():
    buf = SampleBuffer(group_size=3, alpha=0, version=1)
    buf.put(sample("a", "g", version=1))
    assert buf.put(sample("b", "g", version=0)) == "stale"
    assert buf.metrics()["dropped"] == {"stale": 2} and buf.metrics()["pending_groups"] == 0


async def test_alpha_zero_is_on_policy():
    buf = SampleBuffer(group_size=1, alpha=0)
    buf.put(sample("a", "g0", version=0))
    assert buf.advance(1) == ["g0"]
    with pytest.raises(ValueError, match="versions only go up"):
        buf.advance(0)


async def test_open_group_registers_in_flight_groups_and_refuses_pointless_ones():
    aborts = Aborts()
    buf = SampleBuffer(group_size=2, alpha=1, version=3, on_abort=aborts)
    assert buf.open_group("g", 3)
    assert not buf.open_group("too-old", 1)
    assert buf.metrics()["pending_groups"] == 1
    assert buf.advance(5) == ["g"] and aborts.calls == [("g", "stale")]  # no sample came yet
    assert not buf.open_group("g", 5)  # closed for good


async def test_a_group_the_rollout_side_gave_up_is_closed_and_never_reported_stale():
    aborts = Aborts()
    buf = SampleBuffer(group_size=3, alpha=1, on_abort=aborts)
    assert buf.open_group("g", 0) and fill(buf, "g", 1) == ["accepted"]
    buf.drop("g")
    assert buf.metrics()["pending_groups"] == 0 and buf.metrics()["dropped"] == {"given_up": 1}
    assert buf.put(sample("late", "g")) == "given_up"  # a member's reward that was under way
    assert not buf.open_group("g", 0)
    assert buf.advance(5) == [] and aborts.calls == []  # counted once, by the one who gave it up
    assert buf.metrics()["dropped"] == {"given_up": 2}
    # a group complete already is the trainer's: dropping it changes nothing
    buf2 = SampleBuffer(group_size=1, alpha=1)
    fill(buf2, "done", 1)
    buf2.drop("done")
    assert [g.id for g in await buf2.get_batch(1)] == ["done"]


async def test_get_batch_returns_oldest_groups_first():
    buf = SampleBuffer(group_size=1, alpha=5, version=3)
    for gid, v in [("v3", 3), ("v1", 1), ("v2a", 2), ("v2b", 2)]:
        buf.put(sample(gid, gid, version=v))
    assert [g.id for g in await buf.get_batch(3)] == ["v1", "v2a", "v2b"]
    assert [g.id for g in await buf.get_batch(1)] == ["v3"]


async def test_get_batch_blocks_until_enough_groups_are_complete():
    buf = SampleBuffer(group_size=2, alpha=1)
    task = asyncio.create_task(buf.get_batch(2))
    fill(buf, "a", 2)
    await asyncio.sleep(0)
    assert not task.done()  # one of two
    fill(buf, "b", 1)
    await asyncio.sleep(0)
    assert not task.done()
    fill(buf, "b", 1, start=1)
    groups = await asyncio.wait_for(task, 1)
    assert [g.id for g in groups] == ["a", "b"]
    assert buf.metrics()["trainer_wait_s"]["count"] == 1


async def test_get_batch_timeout_takes_nothing():
    buf = SampleBuffer(group_size=1, alpha=1)
    buf.put(sample("a", "a"))
    with pytest.raises(TimeoutError, match="1 of 2 groups ready"):
        await buf.get_batch(2, timeout=0.01)
    assert buf.ready_groups() == 1 and buf.metrics()["waiters"] == 0
    [g] = await buf.get_batch(1, timeout=0.01)
    assert g.id == "a"


async def test_a_cancelled_waiter_gives_its_groups_back():
    buf = SampleBuffer(group_size=1, alpha=1)
    task = asyncio.create_task(buf.get_batch(1))
    await asyncio.sleep(0)
    buf.put(sample("a", "a"))  # handed to the waiter at once...
    task.cancel()  # ...which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await task
    assert buf.ready_groups() == 1
    assert [g.id for g in await buf.get_batch(1)] == ["a"]
    assert buf.metrics()["served_groups"] == 1


async def test_waiters_are_served_in_order():
    buf = SampleBuffer(group_size=1, alpha=1)
    first = asyncio.create_task(buf.get_batch(2))
    await asyncio.sleep(0)
    second = asyncio.create_task(buf.get_batch(1))
    await asyncio.sleep(0)
    buf.put(sample("a", "a"))
    await asyncio.sleep(0)
    assert not second.done()  # the first waiter is owed the first groups
    buf.put(sample("b", "b"))
    buf.put(sample("c", "c"))
    assert [g.id for g in await first] == ["a", "b"]
    assert [g.id for g in await second] == ["c"]


@pytest.mark.parametrize("leave", ["timeout", "cancel"])
async def test_a_waiter_that_leaves_lets_the_next_one_take_the_ready_groups(leave):
    """The first waiter is owed the first groups; once it leaves empty-handed, the one
    behind it is served from what is ready, not only at the next put."""
    buf = SampleBuffer(group_size=1, alpha=1)
    first = asyncio.create_task(buf.get_batch(3, timeout=0.01 if leave == "timeout" else None))
    await asyncio.sleep(0)
    second = asyncio.create_task(buf.get_batch(1, timeout=5))
    await asyncio.sleep(0)
    buf.put(sample("a", "a"))
    buf.put(sample("b", "b"))
    if leave == "cancel":
        first.cancel()
    with pytest.raises((TimeoutError, asyncio.CancelledError)):
        await first
    for _ in range(3):
        await asyncio.sleep(0)
    assert second.done()  # it waited on for a put that may never come
    assert [g.id for g in second.result()] == ["a"]
    assert buf.ready_groups() == 1 and buf.metrics()["waiters"] == 0


async def test_close_wakes_waiters_and_refuses_puts():
    async with SampleBuffer(group_size=1, alpha=1) as buf:
        task = asyncio.create_task(buf.get_batch(1))
        await asyncio.sleep(0)
    with pytest.raises(BufferClosedError):
        await task
    assert buf.put(sample("a", "a")) == "closed"
    with pytest.raises(BufferClosedError):
        await buf.get_batch(1)


async def test_metrics_staleness_histogram_wait_time_and_queue_sizes():
    buf = SampleBuffer(group_size=2, alpha=2)
    fill(buf, "g0", 2, version=0)
    buf.advance(1)
    fill(buf, "g1", 2, version=1)
    fill(buf, "g2", 1, version=1)
    buf.put(sample("bad", "g2", status="infra_failed"))
    task = asyncio.create_task(buf.get_batch(3))
    await asyncio.sleep(0.02)
    fill(buf, "g3", 2, version=1)
    await task
    m = buf.metrics()
    assert m["version"] == 1 and m["bound"] == -1
    assert m["staleness"] == {0: 4, 1: 2} and m["staleness_mean"] == pytest.approx(2 / 6)
    assert m["served_groups"] == 3 and m["served_samples"] == 6 and m["completed_groups"] == 3
    assert m["pending_groups"] == 1 and m["pending_samples"] == 1 and m["ready_groups"] == 0
    assert m["dropped"] == {"infra_failed": 1}
    assert m["trainer_wait_s"]["total"] >= 0.015 and m["trainer_wait_s"]["max"] >= 0.015


async def test_a_failing_abort_callback_does_not_break_the_buffer():
    def broken(gid: str, reason: str) -> None:
        raise RuntimeError("rollout side bug")

    buf = SampleBuffer(group_size=1, alpha=1, on_abort=broken)
    assert buf.put(sample("a", "a")) == "completed"
    assert buf.ready_groups() == 1 and buf.metrics()["abort_callback_errors"] == 1


async def test_exactly_once_memory_is_bounded():
    buf = SampleBuffer(group_size=10, alpha=1, memory=2)
    for tid in "abc":
        buf.put(sample(tid, "g"))
    assert buf.put(sample("c", "g")) == "duplicate"
    assert buf.put(sample("a", "g")) == "accepted"  # forgotten: outside the window


def test_sample_reads_the_bookkeeping_from_the_trajectory():
    t = Trajectory(
        id="t1",
        task={"tag": "frozenlake", "group_id": "g7"},
        messages=[Message(role="assistant", content="left", policy_version=4)],
    )
    s = Sample.of(t)
    assert (s.tag, s.group_id, s.version, s.status) == ("frozenlake", "g7", 4, "ok")
    t.info["start_version"] = 3
    assert Sample.of(t).version == 3
    assert Sample.of(t, version=9, group_id="x").version == 9
    failed = Trajectory(id="t2", status="infra_failed", task={"tag": "a", "group_id": "g"})
    assert Sample.of(failed, version=0).masked
    with pytest.raises(ValueError, match="lacks task\\['group_id'\\], info\\['start_version'\\]"):
        Sample.of(Trajectory(task={"tag": "a"}))
