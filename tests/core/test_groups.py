"""GroupRunner: redundancy with prompt aborts, re-runs, giving up, stale groups, closing.

The env manager is a fake whose ``run`` follows a script (a short sleep, then a status), so
every race here is decided by the script's timings, a few milliseconds apart."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from core.config import JobConfig
from core.rollout.engines.base import Completion, Engine, GenerateRequest
from core.rollout.env_manager import EnvManager, Task, TurnBarrier
from core.rollout.groups import GroupRunner, GroupState
from core.rollout.llm_proxy import LLMProxy, LocalReplica
from core.sample import Sample
from envpool.api import Observation, StepResult
from fabric.protocol import Trajectory

Plan = tuple[float, str]  # (seconds, status); status "raise" makes run raise


def job(group_size: int = 3, redundancy: int = 0, max_reruns: int = 3) -> JobConfig:
    return JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat"}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": group_size,
            "redundancy": redundancy,
            "rollout": {"max_reruns": max_reruns},
        },
        check_references=False,
    )


class FakeManager:
    """``run`` plays the next plan of the script (launch order), or ``default`` when the
    script is used up; records each launch, and which runs were cancelled."""

    def __init__(self, script: list[Plan] | None = None, default: Plan = (0.001, "ok")):
        self.script = list(script or [])
        self.default = default
        self.launched: list[tuple[Task, str, int, TurnBarrier | None]] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []

    async def run(
        self, task: Task, *, version: int, traj_id: str | None = None, barrier: TurnBarrier | None = None
    ) -> Trajectory:
        assert traj_id is not None
        self.launched.append((task, traj_id, version, barrier))
        delay, status = self.script.pop(0) if self.script else self.default
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append(traj_id)
            raise
        finally:
            if barrier is not None:
                await barrier.leave()
        if status == "raise":
            raise RuntimeError("a bug in the manager")
        self.finished.append(traj_id)
        info: dict[str, Any] = {"start_version": version}
        if status == "infra_failed":
            info["error"] = "EnvLogicError: KeyError: 'oops'"
        return Trajectory(
            id=traj_id,
            status=status,  # type: ignore[arg-type]
            task={"tag": task.env.tag, "group_id": task.group_id},
            info=info,
        )

    def ids(self) -> list[str]:
        return [tid for _, tid, _, _ in self.launched]


class FakeProxy:
    def __init__(self, abort_s: float = 0.0) -> None:
        self.abort_s = abort_s  # an abort's round trip (a Ray call to a busy proxy actor)
        self.aborted: list[str] = []
        self.released: list[str] = []

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        raise AssertionError("the runner never generates: its manager does")

    async def abort(self, traj_id: str) -> int:
        self.aborted.append(traj_id)
        await asyncio.sleep(self.abort_s)
        return 1

    async def release(self, traj_id: str) -> None:
        self.released.append(traj_id)


class Harness:
    def __init__(self, cfg: JobConfig, manager: FakeManager, *, abort_s: float = 0.0):
        self.cfg = cfg
        self.manager = manager
        self.proxy = FakeProxy(abort_s)
        self.submitted: list[Trajectory] = []
        self.finished: list[Trajectory] = []
        self.cancelled: list[str] = []
        self.given_up: list[GroupState] = []
        self.runner = GroupRunner(
            cfg,
            manager,  # type: ignore[arg-type]
            self.proxy,
            submit=self.submitted.append,
            on_finished=self.finished.append,
            on_given_up=self.given_up.append,
            on_cancelled=self.cancelled.append,
        )

    def start(self, seed: int = 7, version: int = 2, **kw: Any) -> GroupState:
        return self.runner.start(self.cfg.envs[0], seed, version, **kw)

    async def settle(self, within: float = 5.0) -> None:
        """Until nothing runs and every abort is through."""
        async with asyncio.timeout(within):
            while self.runner.running() or self.runner._aborting:  # noqa: ASYNC110 - no event for "idle"
                await asyncio.sleep(0.002)
        await asyncio.sleep(0)

    def submitted_ids(self) -> list[str]:
        return [t.id for t in self.submitted]

    def by_status(self) -> Counter[str]:
        return Counter(t.status for t in self.submitted)


def sample_of(traj: Trajectory, gid: str) -> Sample:
    return Sample(traj=traj, tag="lat", group_id=gid, version=0, status="reward_failed")


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


# ----------------------------------------------------------------------------- with the real proxy


class _OneTokenEngine(Engine):
    name = "fake"

    async def _generate(self, request: GenerateRequest) -> Completion:
        await asyncio.sleep(0.01)  # a group's members get their turn in one batch
        return Completion(
            request_id=request.request_id,
            text="go",
            prompt_ids=[1],
            token_ids=[2],
            logprobs=[-0.1],
            policy_version=self.version,
            finish_reason="stop",
        )

    async def _abort(self, request_id: str) -> None: ...

    async def _load_weights(self, state: Any, version: int) -> None: ...


class _OneStepSession:
    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="start"), {}

    async def step(self, action: Any) -> StepResult:
        await asyncio.sleep(0.001)
        return StepResult(obs=Observation(text="end"), reward=1.0, terminated=True)


class _Pool:
    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_OneStepSession]:
        yield _OneStepSession()


async def test_the_proxy_forgets_every_trajectory_of_a_redundant_group():
    # members finishing as their group fills release before the runner's abort arrives: the
    # proxy once kept those ids for the rest of the job (every redundant member leaked)
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat", "max_turns": 1}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": 2,
            "redundancy": 2,
        },
        check_references=False,
    )
    proxy = LLMProxy({"default": [LocalReplica(_OneTokenEngine())]})
    manager = EnvManager(cfg, _Pool(), proxy)  # type: ignore[arg-type]
    runner = GroupRunner(cfg, manager, proxy, submit=lambda t: None)
    for i in range(20):
        runner.start(cfg.envs[0], i, 0)
    async with asyncio.timeout(10):
        while runner.running() or runner._aborting or manager._releasing:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert runner.metrics["redundant_aborted"] + runner.metrics["extra"] > 0
    assert proxy._aborted == set(), f"{len(proxy._aborted)} ids left"
    assert proxy.stats()["trajectories"] == 0


class _HeldEngine(Engine):
    """A turn runs until it is aborted; each abort is counted and takes a replica's round trip."""

    name = "held"

    def __init__(self) -> None:
        super().__init__()
        self.aborts: Counter[str] = Counter()
        self._stop: dict[str, asyncio.Event] = {}

    async def _generate(self, request: GenerateRequest) -> Completion:
        await self._stop.setdefault(request.request_id, asyncio.Event()).wait()
        return Completion(
            request_id=request.request_id,
            text="",
            prompt_ids=[1],
            token_ids=[],
            logprobs=[],
            policy_version=self.version,
            finish_reason="abort",
        )

    async def _abort(self, request_id: str) -> None:
        self.aborts[request_id] += 1
        await asyncio.sleep(0.02)  # the replica's answer
        self._stop.setdefault(request_id, asyncio.Event()).set()

    async def _load_weights(self, state: Any, version: int) -> None: ...


class _AsRayActor:
    """The proxy as env managers and the runner reach it under Ray. Each call runs in the
    actor on its own: a caller that stops waiting (a cancelled trajectory) does not stop it.
    And Ray runs an async actor's calls in no guaranteed order (docs: "Actor Task Execution
    Order"): here a trajectory's abort reaches the actor just after its release, when one is
    sent (within a bound: a redundant member's abort has no release to follow)."""

    def __init__(self, proxy: LLMProxy) -> None:
        self.proxy = proxy
        self._released: dict[str, asyncio.Event] = {}
        self.calls: set[asyncio.Task[Any]] = set()

    async def _in_actor(self, coro: Any) -> Any:
        t = asyncio.ensure_future(coro)
        self.calls.add(t)
        t.add_done_callback(self.calls.discard)
        return await asyncio.shield(t)

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        c: Completion = await self._in_actor(self.proxy.generate(traj_id, tag, request))
        return c

    async def abort(self, traj_id: str) -> int:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await self._released.setdefault(traj_id, asyncio.Event()).wait()
        n: int = await self._in_actor(self.proxy.abort(traj_id))
        return n

    async def release(self, traj_id: str) -> None:
        call = self._in_actor(self.proxy.release(traj_id))
        done = asyncio.ensure_future(call)
        await asyncio.sleep(0)  # the release is in the actor first
        self._released.setdefault(traj_id, asyncio.Event()).set()
        await done


async def test_a_shutdown_stops_each_running_trajectory_once():
    # aclose asked the proxy to abort every running trajectory and cancelled it too: the
    # cancelled trajectory's release aborts the turn it left running, so each turn had two
    # aborts in flight, and under Ray (calls to an async actor run in any order) both
    # reached the engine replica. Each is stopped once now: cancelled, its turn aborted by
    # its release
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat", "max_turns": 1}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": 2,
        },
        check_references=False,
    )
    engine = _HeldEngine()
    proxy = LLMProxy({"default": [LocalReplica(engine)]})
    remote = _AsRayActor(proxy)
    manager = EnvManager(cfg, _Pool(), remote)  # type: ignore[arg-type]
    runner = GroupRunner(cfg, manager, remote, submit=lambda t: None)
    for i in range(2):
        runner.start(cfg.envs[0], i, 0)
    async with asyncio.timeout(5):
        while engine.num_inflight < 4:  # noqa: ASYNC110 - every turn reached the engine
            await asyncio.sleep(0.002)
    turns = set(engine._inflight)
    await runner.aclose()
    async with asyncio.timeout(5):
        while remote.calls:  # the actor's side of the calls ends too
            await asyncio.gather(*remote.calls, return_exceptions=True)
    assert dict(engine.aborts) == dict.fromkeys(turns, 1)
    assert engine.num_inflight == 0 and proxy.stats()["trajectories"] == 0 and proxy._aborted == set()
    assert runner.running() == 0 and runner.metrics["aborted"] == 4
    await proxy.aclose()


class _HeldUnlessStepping(_HeldEngine):
    """Holds the turns of tag ``held`` until aborted; answers the others at once."""

    async def _generate(self, request: GenerateRequest) -> Completion:
        if request.metadata.get("tag") == "held":
            return await super()._generate(request)
        return Completion(
            request_id=request.request_id,
            text="go",
            prompt_ids=[1],
            token_ids=[2],
            logprobs=[-0.1],
            policy_version=self.version,
            finish_reason="stop",
        )


class _StepHangs:
    """A session whose step never returns (an environment step in progress)."""

    def __init__(self, stepping: list[int]) -> None:
        self.stepping = stepping

    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="start"), {}

    async def step(self, action: Any) -> StepResult:
        self.stepping.append(1)
        await asyncio.Event().wait()
        raise AssertionError("never answered")


class _PoolByEnv:
    def __init__(self) -> None:
        self.stepping: list[int] = []

    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[Any]:
        hangs = (kw.get("env_kwargs") or {}).get("turns") == 9
        yield _StepHangs(self.stepping) if hangs else _OneStepSession()


async def test_a_shutdown_aborts_each_turn_once_whatever_each_member_was_doing():
    # at aclose: group a's members are being aborted already (a stale group: the runner's
    # abort in flight), group b's are in a turn, group c's in an environment step. Each
    # turn in flight is aborted once (a's by the runner's abort, b's by the release of the
    # cancelled trajectory), a member in a step has no turn to abort, and the proxy forgets
    # every one of them
    cfg = JobConfig.from_dict(
        {
            "envs": [
                {"id": "latency-v0", "tag": "held", "max_turns": 1},
                {"id": "latency-v0", "tag": "stepping", "max_turns": 1, "kwargs": {"turns": 9}},
            ],
            "rewards": {"held": [{"function": "unused"}], "stepping": [{"function": "unused"}]},
            "group_size": 2,
        },
        check_references=False,
    )
    engine = _HeldUnlessStepping()
    proxy = LLMProxy({"default": [LocalReplica(engine)]})
    remote = _AsRayActor(proxy)
    pool = _PoolByEnv()
    manager = EnvManager(cfg, pool, remote)  # type: ignore[arg-type]
    runner = GroupRunner(cfg, manager, remote, submit=lambda t: None)
    a = runner.start(cfg.envs[0], 0, 0)
    runner.start(cfg.envs[0], 1, 0)
    runner.start(cfg.envs[1], 2, 0)
    async with asyncio.timeout(5):
        while engine.num_inflight < 4 or len(pool.stepping) < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.002)
    turns = set(engine._inflight)
    runner.abort_group(a.id, "stale")
    assert a.aborting == set(a.running)
    await runner.aclose()
    async with asyncio.timeout(5):
        while remote.calls:
            await asyncio.gather(*remote.calls, return_exceptions=True)
    assert dict(engine.aborts) == dict.fromkeys(turns, 1)
    assert engine.num_inflight == 0 and proxy.stats()["trajectories"] == 0 and proxy._aborted == set()
    assert runner.running() == 0 and runner.metrics["aborted"] == 6
    await proxy.aclose()
