"""Review of the trajectory-level rollout (session 11): what an adversarial reading of the
proxy, the turn scheduler, the env manager and the group runner found, each pinned by a test
that failed before its fix."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from proxy_fakes import Fake, engine, tiny, until
from proxy_fakes import req as one_turn
from test_turn_scheduler import GatedReplica, req, settle

from core.buffer import SampleBuffer
from core.config import JobConfig
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.env_manager import EnvManager, Task
from core.rollout.groups import GroupRunner
from core.rollout.llm_proxy import LLMProxy, LocalReplica, ReplicaLost
from core.rollout.scheduling import TurnScheduler
from core.sample import Sample
from envpool.api import Observation, StepResult
from envpool.errors import SessionLost
from fabric.protocol import RewardResult, Trajectory


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


# ----------------------------------------------------------------------------- the whole rollout


class _Session:
    """An episode of one to five steps; now and then a step hangs past the trajectory
    timeout (a slow tool), which ends its trajectory ``infra_failed``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="you are at row 0"), {}

    async def step(self, action: Any) -> StepResult:
        await asyncio.sleep(0.3 if self.rng.random() < 0.05 else self.rng.random() * 0.004)
        done = self.rng.random() < 0.3
        return StepResult(obs=Observation(text="you are at row 1"), reward=float(done), terminated=done)


class _Pool:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.open = 0

    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_Session]:
        self.open += 1
        try:
            yield _Session(self.rng)
        finally:
            self.open -= 1


class _Unreachable(LocalReplica):
    """Every ``every``-th turn the replica is cut off (Ray's ActorUnavailableError): the call
    fails, the turn runs on in the engine, and the first ping after it fails too."""

    def __init__(self, engine: Any, name: str, every: int) -> None:
        super().__init__(engine, name)
        self.every, self.calls, self.down = every, 0, False
        self.cut_off: set[asyncio.Task[Any]] = set()

    async def generate(self, request: GenerateRequest) -> Completion:
        self.calls += 1
        if self.calls % self.every == 0:
            t = asyncio.ensure_future(self.engine.generate(request))
            self.cut_off.add(t)
            t.add_done_callback(self.cut_off.discard)
            self.down = True
            await asyncio.sleep(0)
            raise ReplicaLost(f"{self.name} unreachable")
        return await super().generate(request)

    async def ping(self) -> int:
        if self.down:
            self.down = False
            raise ReplicaLost(f"{self.name} still unreachable")
        return await super().ping()


class _AsRay:
    """The proxy as the job reaches it: each call runs in the actor on its own (a caller
    that goes away does not stop it) and calls start in any order (a random delay each)."""

    def __init__(self, proxy: LLMProxy, rng: random.Random) -> None:
        self.proxy, self.rng = proxy, rng
        self.calls: set[asyncio.Task[Any]] = set()

    async def _in_actor(self, coro: Any) -> Any:
        async def later() -> Any:
            await asyncio.sleep(self.rng.random() * 0.003)
            return await coro

        t = asyncio.ensure_future(later())
        self.calls.add(t)
        t.add_done_callback(self.calls.discard)
        return await asyncio.shield(t)

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        c: Completion = await self._in_actor(self.proxy.generate(traj_id, tag, request))
        return c

    async def abort(self, traj_id: str) -> int:
        n: int = await self._in_actor(self.proxy.abort(traj_id))
        return n

    async def release(self, traj_id: str) -> None:
        await self._in_actor(self.proxy.release(traj_id))


async def test_an_async_rollout_with_every_fault_trains_only_whole_fresh_groups_and_leaves_nothing(tok):
    # redundancy aborts, rewards that fail (re-runs), trajectory timeouts, replicas cut off
    # mid-turn (turns re-run elsewhere, first runs aborted when back), a weight update every
    # step, a C-MLFQ turn scheduler with fewer slots than turns, and the proxy's calls out of
    # order as under Ray: every trained group is whole, fresh and never aborted, and at the
    # end no session, engine request, proxy or scheduler entry is left
    rng = random.Random(11)
    engines = [engine(tiny(tok, seed=i), tok) for i in range(2)]
    replicas = [_Unreachable(e, f"r{i}", every=13 + i) for i, e in enumerate(engines)]
    sched = TurnScheduler("cmlfq", slots=2, scheduler_options={"aging_s": 0.01})
    proxy = LLMProxy({"default": replicas}, scheduler=sched, recover_timeout_s=5.0)
    remote = _AsRay(proxy, rng)
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat", "max_turns": 5}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": 2,
            "redundancy": 1,
            "alpha": 1,
            "engine": {"max_new_tokens": 3},
            "rollout": {"max_reruns": 50, "trajectory_timeout_s": 0.2},
        },
        check_references=False,
    )
    pool = _Pool(rng)
    manager = EnvManager(cfg, pool, remote)  # type: ignore[arg-type]
    runner: GroupRunner | None = None

    def on_abort(gid: str, why: Any) -> None:
        assert runner is not None
        runner.abort_group(gid, why)

    buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=on_abort)
    scoring: set[asyncio.Task[None]] = set()

    async def score(traj: Trajectory) -> None:
        assert runner is not None
        await asyncio.sleep(rng.random() * 0.01)
        s = Sample.of(traj)
        if not s.masked:
            if rng.random() < 0.2:
                s.status, s.error = "reward_failed", "the judge was down"
                buffer.put(s)
                runner.reward_failed(s)
                return
            s.reward = RewardResult(score=rng.random())
        buffer.put(s)

    def submit(traj: Trajectory) -> None:
        t = asyncio.ensure_future(score(traj))
        scoring.add(t)
        t.add_done_callback(scoring.discard)

    runner = GroupRunner(cfg, manager, remote, submit=submit)  # type: ignore[arg-type]
    state = engines[0].model.state_dict()
    version = 0
    for _ in range(4):
        for _ in range(3):
            g = runner.start(cfg.envs[0], rng.randrange(100), version)
            buffer.open_group(g.id, version)
        groups = await buffer.get_batch(2, timeout=30)
        for group in groups:
            assert len(group.samples) == cfg.group_size
            for s in group.samples:
                assert s.id not in runner.aborted_ids and version - s.version <= cfg.alpha
                assert all(v >= s.version for v in s.traj.policy_versions())
        version += 1
        await proxy.update_weights(version, state)
        buffer.advance(version)
    await runner.aclose()
    async with asyncio.timeout(10):
        while remote.calls or scoring or proxy._background:
            await asyncio.gather(*remote.calls, *scoring, *proxy._background, return_exceptions=True)
        for r in replicas:
            await asyncio.gather(*r.cut_off, return_exceptions=True)
    assert runner.metrics["redundant_aborted"] and proxy.metrics["turns_rerun"]  # (the others: by chance)
    assert pool.open == 0 and runner.running() == 0
    assert [e.num_inflight for e in engines] == [0, 0]
    assert proxy.stats()["trajectories"] == 0 and proxy._aborted == set() and proxy._turns == {}
    assert not any(proxy._inflight.values()) and not +proxy._load
    assert sched._trajs == {} and sched._queue_options["level_store"] == {}
    assert [s.running for s in sched._replicas.values()] == [0, 0]
    for e in engines:
        await e.aclose()
    await proxy.aclose()


class _LostOnSecondStep:
    """An episode whose container is lost at its second step (``lose``), else three steps."""

    def __init__(self, lose: bool) -> None:
        self.lose, self.steps = lose, 0

    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="you are at row 0"), {}

    async def step(self, action: Any) -> StepResult:
        self.steps += 1
        if self.lose and self.steps == 2:
            raise SessionLost("the container died and its session could not be replayed")
        return StepResult(obs=Observation(text="you are at row 1"), terminated=self.steps == 3)


class _PoolLosing:
    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_LostOnSecondStep]:
        yield _LostOnSecondStep(lose=(kw.get("env_kwargs") or {}).get("lose", False))


async def test_the_length_predictor_does_not_learn_a_trajectory_its_environment_cut_short(tok):
    # an infra_failed trajectory ended where its container died, not where its episode would
    # have: learnt, it taught the predictor that trajectories are short (sjf, pps and the
    # placements rank by it), as the proxy already refuses to learn from a timed-out one
    sched = TurnScheduler("sjf", slots=4)
    proxy = LLMProxy({"default": [LocalReplica(engine(tiny(tok), tok))]}, scheduler=sched)
    cfg = JobConfig.from_dict(
        {
            "envs": [
                {"id": "latency-v0", "tag": "lat", "max_turns": 5},
                {"id": "latency-v0", "tag": "lost", "max_turns": 5, "kwargs": {"lose": True}},
            ],
            "rewards": {"lat": [{"function": "unused"}], "lost": [{"function": "unused"}]},
            "engine": {"max_new_tokens": 2},
        },
        check_references=False,
    )
    manager = EnvManager(cfg, _PoolLosing(), proxy)  # type: ignore[arg-type]
    lost = await manager.run(Task(cfg.envs[1], 1, "g1"), version=0)
    assert lost.status == "infra_failed" and lost.info["error_type"] == "SessionLost"
    assert sched.predictor.trajectories_seen == 0
    played = await manager.run(Task(cfg.envs[0], 2, "g2"), version=0)
    assert played.status == "ok" and sched.predictor.trajectories_seen == 1
    assert proxy.stats()["trajectories"] == 0 and proxy._aborted == set() and sched._trajs == {}
    await proxy.aclose()


async def test_a_turn_lost_for_the_last_time_still_gets_its_replica_recovered_and_its_run_stopped():
    # each loss of a turn but the last started the replica's recovery (routed around while
    # it is pinged and reloaded) and had the run it lost aborted once the replica answers
    # (unreachable is not dead: the run goes on in the engine). The last loss, which fails
    # the turn, did neither: that replica stayed in routing as if healthy, and its run went
    # on to max_new_tokens for nobody, holding a batch slot
    a = Fake("a", fail=[ReplicaLost("a unreachable")])
    b = Fake("b", fail=[ReplicaLost("b unreachable")])
    proxy = LLMProxy({"default": [a, b]}, max_turn_retries=1)
    with pytest.raises(ReplicaLost, match="b unreachable"):
        await proxy.generate("t", "x", one_turn(request_id="turn"))
    assert a.generated == ["turn"] and b.generated == ["turn#rerun1"]
    await until(lambda: proxy.metrics["replicas_recovered"] == 2 and not proxy._background)
    assert b.pings == 1 and b.aborted == ["turn#rerun1"]
    assert a.aborted == ["turn"]
    await proxy.aclose()
