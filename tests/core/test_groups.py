"""GroupRunner: launching a group with redundancy, re-runs, giving up.

The env manager is a fake whose ``run`` follows a script (a short sleep, then a status), so
every race here is decided by the script's timings, a few milliseconds apart. Aborting and
closing: test_groups_aborting.py; with the real proxy: test_groups_proxy.py."""

from __future__ import annotations

import asyncio

# test_job_loop.py imports the fakes from this module, where they were first
from groups_helpers import FakeManager, Harness, job, sample_of
from groups_helpers import FakeProxy as FakeProxy

# ----------------------------------------------------------------------------- launching


async def test_a_group_launches_group_size_plus_redundancy_of_one_task():
    h = Harness(job(group_size=3, redundancy=2), FakeManager(default=(10.0, "ok")))
    g = h.start(seed=11, version=4, group_id="g1")
    assert g.id == "g1" and h.runner.groups == {"g1": g}
    await asyncio.sleep(0)
    assert len(h.manager.launched) == 5 and len(set(h.manager.ids())) == 5
    for task, _, version, barrier in h.manager.launched:
        assert (task.env, task.seed, task.group_id, task.greedy) == (h.cfg.envs[0], 11, "g1", False)
        assert version == 4 and barrier is None
    assert h.runner.running() == 5 and h.runner.rolling_groups() == 1
    assert h.runner.metrics["trajectories_started"] == 5
    await h.runner.aclose()


async def test_the_first_group_size_finishers_are_submitted_and_the_extras_aborted():
    script = [(0.03, "ok"), (5.0, "ok"), (0.01, "truncated"), (5.0, "ok"), (0.02, "ok")]
    h = Harness(job(group_size=3, redundancy=2), FakeManager(script))
    g = h.start()
    await h.settle()
    ids = h.manager.ids()
    winners, extras = [ids[2], ids[4], ids[0]], {ids[1], ids[3]}
    assert h.submitted_ids() == winners  # in finishing order
    assert set(h.proxy.aborted) == extras  # their LLM turns are stopped...
    assert set(h.manager.cancelled) == extras  # ...and their runs (and sessions) cancelled
    assert h.runner.aborted_ids == extras
    assert g.closed == "full" and g.finished == 3 and not g.running
    assert h.runner.metrics["redundant_aborted"] == 2 and h.runner.metrics["aborted"] == 2
    assert h.runner.rolling_groups() == 0
    assert [t.id for t in h.finished] == winners  # cancelled runs end with no trajectory
    assert set(h.cancelled) == extras  # but the job's accounting hears of them


async def test_an_extra_that_finishes_in_the_race_is_dropped_not_submitted():
    # all three end in the same loop iteration: the third's outcome arrives after the group filled
    h = Harness(job(group_size=2, redundancy=1), FakeManager(default=(0.0, "ok")))
    h.start()
    await h.settle()
    assert len(h.submitted) == 2 and h.runner.metrics["extra"] == 1
    third = (set(h.manager.ids()) - set(h.submitted_ids())).pop()
    assert third in h.proxy.aborted and h.runner.metrics["aborted"] == 0  # it was not stopped in time
    # but it was asked to stop: the job's check that no aborted trajectory is trained covers it
    assert third in h.runner.aborted_ids


async def test_aborted_ids_are_kept_only_while_their_version_can_still_be_trained():
    # a long job aborts redundant members every step: the ids the job checks batches against
    # stay within the asynchronous bound's window instead of growing for the whole run
    h = Harness(job(group_size=2, redundancy=1), FakeManager(default=(0.01, "ok")))
    by_version: dict[int, set[str]] = {}
    for version in (2, 3, 4):
        before = set(h.manager.ids())
        h.start(seed=version, version=version)
        await h.settle()
        by_version[version] = (set(h.manager.ids()) - before) - set(h.submitted_ids())
        assert len(by_version[version]) == 1
    assert h.runner.aborted_ids == set().union(*by_version.values())
    h.runner.forget_aborted_before(3)  # versions 3 and 4 may still be served
    assert h.runner.aborted_ids == by_version[3] | by_version[4]
    h.runner.forget_aborted_before(5)
    assert h.runner.aborted_ids == set() and not h.runner._aborted_by_version


# ----------------------------------------------------------------------------- re-runs


async def test_infra_failed_trajectories_are_submitted_masked_and_rerun():
    script = [(0.01, "infra_failed"), (0.02, "ok"), (0.03, "ok")]
    h = Harness(job(group_size=2), FakeManager(script, default=(0.01, "ok")))
    g = h.start(seed=5)
    await h.settle()
    ids = h.manager.ids()
    assert len(ids) == 3 and len(set(ids)) == 3
    assert [t.status for t in h.submitted] == ["infra_failed", "ok", "ok"]
    assert h.submitted_ids() == [ids[0], ids[1], ids[2]]
    assert h.manager.launched[2][0] == h.manager.launched[0][0]  # the same task, a new id
    assert g.reruns == 1 and h.runner.metrics["reruns"] == 1 and g.closed == "full"


async def test_no_rerun_while_enough_members_are_still_running():
    script = [(0.01, "infra_failed"), (0.02, "ok"), (0.03, "ok")]
    h = Harness(job(group_size=2, redundancy=1), FakeManager(script))
    g = h.start()
    await h.settle()
    assert len(h.manager.launched) == 3 and g.reruns == 0
    assert h.by_status() == {"infra_failed": 1, "ok": 2}


async def test_a_manager_bug_is_counted_and_rerun():
    h = Harness(job(group_size=2), FakeManager([(0.01, "raise"), (0.02, "ok")], default=(0.01, "ok")))
    g = h.start()
    await h.settle()
    assert h.runner.metrics["errors"] == 1 and g.reruns == 1
    assert h.by_status() == {"ok": 2} and len(h.manager.launched) == 3


async def test_a_full_disk_is_not_rerun_as_a_manager_bug(caplog):
    # the job stops on it (RemoteProxy.on_disk_full): each re-run would fail the same way
    from core.errors import DiskFullError

    class FullDisk(FakeManager):
        async def run(self, task, **kw):  # type: ignore[no-untyped-def]
            await super().run(task, **kw)
            raise DiskFullError("/run/trace.jsonl")

    h = Harness(job(group_size=2), FullDisk(default=(0.005, "ok")))
    g = h.start()
    await h.settle()
    assert h.runner.metrics["disk_full"] == 2 and h.runner.metrics["errors"] == 0
    assert g.reruns == 0 and len(h.manager.launched) == 2 and not h.submitted
    assert "raised" not in caplog.text  # no traceback per trajectory
    await h.runner.aclose()


async def test_a_failed_reward_reruns_a_member():
    h = Harness(job(group_size=2), FakeManager(default=(0.005, "ok")))
    g = h.start(group_id="g")
    await h.settle()
    assert g.closed == "full" and len(h.submitted) == 2
    h.runner.reward_failed(sample_of(h.submitted[0], "g"))
    assert g.closed is None and g.finished == 1 and h.runner.rolling_groups() == 1
    await h.settle()
    assert len(h.manager.launched) == 3 and len(h.submitted) == 3
    assert h.submitted[2].id == h.manager.ids()[2]  # the replacement, a new trajectory
    assert g.closed == "full" and g.finished == 2 and g.reruns == 1
    # a reward failure of a group nobody knows (or that is gone) changes nothing
    h.runner.reward_failed(sample_of(h.submitted[0], "unknown"))
    assert len(h.manager.launched) == 3


async def test_a_reward_failure_while_the_redundant_rollouts_are_being_aborted_reruns_at_once():
    # the group fills (2 of 2 + 1); its redundant rollout's abort takes 50 ms, and meanwhile
    # a member's reward fails: the group must not count the rollout being stopped, or nothing
    # runs for it once that rollout ends (in sync mode the step then waits forever)
    script = [(0.005, "ok"), (0.01, "ok"), (10.0, "ok")]
    h = Harness(job(group_size=2, redundancy=1), FakeManager(script), abort_s=0.05)
    g = h.start(group_id="g")
    async with asyncio.timeout(5):
        while g.closed != "full":  # noqa: ASYNC110 - no event for "full"
            await asyncio.sleep(0.001)
    assert len(g.running) == 1 and g.aborting == set(g.running)  # its abort is in flight
    h.runner.reward_failed(sample_of(h.submitted[0], "g"))
    assert len(h.manager.launched) == 3 and g.closed is None
    await asyncio.sleep(0)
    assert len(h.manager.launched) == 4, "the replacement waits for the abort to go through"
    await h.settle()
    assert g.closed == "full" and g.finished == 2 and g.reruns == 1
    assert h.submitted_ids() == [h.manager.ids()[0], h.manager.ids()[1], h.manager.ids()[3]]
    assert h.manager.cancelled == [h.manager.ids()[2]] and h.proxy.aborted == [h.manager.ids()[2]]
    assert h.runner.metrics["redundant_aborted"] == 1  # not counted again when it refilled


async def test_a_member_cancelled_from_outside_an_open_group_is_replaced():
    h = Harness(job(group_size=2), FakeManager([(0.005, "ok"), (10.0, "ok")], default=(0.005, "ok")))
    g = h.start(group_id="g")
    await asyncio.sleep(0.001)
    g.running[h.manager.ids()[1]].cancel()  # the slow one, by someone else than the runner
    await h.settle()
    assert g.closed == "full" and g.finished == 2 and g.reruns == 1 and len(h.manager.launched) == 3


async def test_a_member_cancelled_while_the_runner_closes_is_not_replaced():
    h = Harness(job(group_size=2), FakeManager([(0.005, "ok"), (10.0, "ok")], default=(0.005, "ok")))
    g = h.start(group_id="g")
    await asyncio.sleep(0.001)
    h.runner._closing = True  # aclose has begun (a shutdown cancels from outside too)
    g.running[h.manager.ids()[1]].cancel()
    await asyncio.sleep(0.05)
    assert g.reruns == 0 and len(h.manager.launched) == 2  # nothing new started
    await h.runner.aclose()
    assert h.runner.running() == 0


async def test_a_group_out_of_reruns_is_given_up():
    script = [(0.01, "infra_failed"), (0.02, "infra_failed"), (5.0, "ok")]
    h = Harness(job(group_size=2, max_reruns=1), FakeManager(script))
    g = h.start(group_id="g")
    await h.settle()
    ids = h.manager.ids()
    assert len(ids) == 3  # two members and one re-run
    assert h.given_up == [g] and g.closed == "given_up"
    assert h.runner.metrics["given_up"] == 1
    assert h.submitted_ids() == ids[:2] and h.by_status() == {"infra_failed": 2}
    assert h.manager.cancelled == [ids[2]] and h.proxy.aborted == [ids[2]]  # its last member stopped
    assert "g" not in h.runner.groups and h.runner.rolling_groups() == 0


async def test_a_given_up_group_says_its_last_error(caplog):
    # "given up after 3 re-runs" alone: the cause (an environment that raised) was nowhere
    h = Harness(job(group_size=2, max_reruns=0), FakeManager([(0.001, "infra_failed")], default=(5.0, "ok")))
    with caplog.at_level("WARNING", logger="core.rollout.groups"):
        g = h.start(group_id="g")
        await h.settle()
    assert h.given_up == [g]
    assert "group g given up after 0 re-runs; the last error: EnvLogicError: KeyError: 'oops'" in caplog.text


async def test_reward_failures_count_against_the_reruns_too():
    h = Harness(job(group_size=2, max_reruns=0), FakeManager(default=(0.005, "ok")))
    g = h.start(group_id="g")
    await h.settle()
    h.runner.reward_failed(sample_of(h.submitted[0], "g"))
    assert h.given_up == [g] and g.closed == "given_up" and len(h.manager.launched) == 2
