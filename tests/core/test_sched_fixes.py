"""Regression tests from the second review of the rollout-scheduling research part: each pins
a defect that was demonstrated before its fix."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.cluster import turn_scheduler
from core.config import JobConfig
from core.rollout.engines.base import Completion
from core.rollout.env_manager import EnvManager, Task
from core.rollout.scheduling import TurnScheduler
from core.sched import Request, make_queue_policy
from core.sched.queueing import CMLFQ, ProgressivePriority
from core.sim import EngineProfile, Simulator, TrajSpec, Turn, oracle, preset
from envpool.api import Observation, StepResult

#: One slot, 10 ms a token, nothing prefilled: a turn of n tokens runs n * 10 ms.
ONE_SLOT = EngineProfile(
    batch_sizes=(1,), step_ms_table=(10.0,), max_batch=1, prefill_ratio=0.0, cache_tokens=0
)


@pytest.mark.parametrize(
    ("blocker_tokens", "late_start_ms", "first"),
    [
        # the slot frees at 22 s: "low" waited 20 s at the bottom level, under aging_s = 30 s,
        # so "high" (level 0) goes first. It was "low": it had aged after 30 *ms*
        (2000, 5_000.0, "high"),
        # the slot frees at 42 s: "low" waited 40 s, aged to level 0 at 32 s, before "high"
        # came (35 s)
        (4000, 35_000.0, "low"),
    ],
)
def test_cmlfq_in_the_simulator_ages_a_request_after_aging_s_seconds_not_milliseconds(
    blocker_tokens, late_start_ms, first
):
    trajs = [
        # past the 100-token quantum after its first turn: its second turn waits at level 1
        TrajSpec("low", 0, (Turn(200, 1.0), Turn(10))),
        # ready at 1 s, admitted when "low"'s first turn ends (2 s), before its second is ready
        TrajSpec("blocker", 0, (Turn(blocker_tokens),)),
        TrajSpec("high", 0, (Turn(10),)),
    ]
    result = Simulator(
        trajs,
        profile=ONE_SLOT,
        scheduler="cmlfq",
        scheduler_options={"levels": 2, "quantum_tokens": (100,), "aging_s": 30.0},
        starts_ms={"blocker": 1_000.0, "high": late_start_ms},
    ).run()
    done = sorted(("low", "high"), key=result.finish_ms.__getitem__)
    assert done[0] == first


def test_cmlfq_and_fcfs_differ_on_the_benchmark_workload():
    # sim_repro.py's C-MLFQ row: the two makespans were equal to the last digit (446,984.888 ms),
    # since every request that waited 30 ms had climbed to level 0, where the order is FCFS's
    w = preset("coding", 2000, seed=3)
    base = {"workers": 8, "placement": "least_load", "profile": EngineProfile(max_batch=32)}
    fcfs = Simulator(w.trajectories, scheduler="fcfs", **base).run().makespan_ms
    cmlfq = Simulator(w.trajectories, scheduler="cmlfq", **base).run().makespan_ms
    assert cmlfq != pytest.approx(fcfs, rel=1e-6)


# -- C-MLFQ's "success -> level 0" rule: a turn that sees a success


def test_the_coding_preset_with_a_submit_turn_shows_a_success_to_a_later_turn():
    plain = preset("coding", 200, seed=3).trajectories
    submit = preset("coding", 200, seed=3, submit_turn=True).trajectories
    for a, b in zip(plain, submit, strict=True):
        # the same task and turns; the passing turn now runs the tests, then "submit" ends it
        assert b.turns[:-2] == a.turns[:-1] and b.prompt_tokens == a.prompt_tokens
        assert b.turns[-2].gen_tokens == a.turns[-1].gen_tokens
        assert b.turns[-2].outcome == "success" and b.turns[-2].tool_ms > 0
        assert b.turns[-1].outcome == "success" and b.turns[-1].tool_ms == 0.0
    with pytest.raises(ValueError, match="submit_turn"):
        preset("math", 1, submit_turn=True)


def outcomes_queued(trajs) -> set[str | None]:
    sim = Simulator(trajs, workers=2, scheduler="cmlfq", profile=EngineProfile(max_batch=4))
    seen: set[str | None] = set()
    for q in sim.queues.values():
        push = q.push

        def spy(req, now, push=push):
            seen.add(req.last_outcome)
            push(req, now)

        q.push = spy  # type: ignore[method-assign]
    sim.run()
    return seen


def test_cmlfq_in_the_simulator_sees_a_success_only_with_the_submit_turn():
    # the plain preset's success is on its last turn: no turn ever sees it (the rule never
    # fired in sim_repro.py's C-MLFQ row)
    assert "success" not in outcomes_queued(preset("coding", 100, seed=3).trajectories)
    assert "success" in outcomes_queued(preset("coding", 100, seed=3, submit_turn=True).trajectories)


class _Session:
    """An env that runs its tests at turn 0 (they pass: ``info["outcome"]`` "success", the
    episode goes on) and ends at turn 1 (submit, reward 1)."""

    def __init__(self) -> None:
        self.steps = 0

    async def reset(self, seed=None):
        return Observation(text="fix the module"), {}

    async def step(self, action):
        self.steps += 1
        if self.steps == 1:
            return StepResult(obs=Observation(text="Tests: 3 passed"), info={"outcome": "success"})
        done = {"outcome": "success"}
        return StepResult(obs=Observation(text="Solved"), reward=1.0, terminated=True, info=done)


class _Pool:
    @contextlib.asynccontextmanager
    async def session(self, env_id, image=None, env_kwargs=None):
        yield _Session()


class _SchedProxy:
    """What the LLM proxy does with a turn's metadata under a turn scheduler: the ``Request``
    C-MLFQ orders (``core.rollout.proxy_routing``)."""

    def __init__(self, sched: TurnScheduler) -> None:
        self.sched = sched
        self.requests: list[Request] = []

    async def generate(self, traj_id, tag, request):
        r = self.sched.request(traj_id, request.metadata["turn"], 10, request.metadata)
        self.requests.append(r)
        self.sched.finished_turn(traj_id, 2)
        return Completion(
            request_id=request.request_id,
            text="run_tests",
            prompt_ids=[0],
            token_ids=[1, 2],
            logprobs=[-0.1, -0.1],
            policy_version=0,
            finish_reason="stop",
        )

    async def abort(self, traj_id):
        return 0

    async def release(self, traj_id):
        self.sched.release(traj_id)


async def test_an_envs_mid_episode_success_reaches_the_turn_scheduler():
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "code-repair-v1", "tag": "code", "max_turns": 5}],
            "rewards": {"code": [{"function": "unused"}]},
        },
        check_references=False,
    )
    sched = TurnScheduler("cmlfq", scheduler_options={"levels": 3, "quantum_tokens": (1, 1)})
    proxy = _SchedProxy(sched)
    traj = await EnvManager(cfg, _Pool(), proxy).run(Task(cfg.envs[0], 0, "g"), version=0, traj_id="t")
    assert traj.status == "ok"
    # the turn after the passing test run carries its success, and C-MLFQ puts it at level 0
    # though the trajectory is past every level's token quantum; the final step's success
    # goes nowhere: no turn follows it
    assert [r.last_outcome for r in proxy.requests] == [None, "success"]
    q = make_queue_policy("cmlfq", levels=3, quantum_tokens=(1, 1))
    q.push(proxy.requests[1], 0.0)
    assert isinstance(q, CMLFQ) and q.level_of("t") == 0


# -- cache_affinity re-decides at every turn in the simulator, as on the real path


def _moving_case(placement: str) -> float:
    # one slot per worker, 10 ms a token, a prompt token costs a decode token. "c" is
    # predicted long, so "a" (short) is placed beside "b" on w1; "c" is in fact done at
    # 0.1 s. When "a"'s second turn is ready (2.1 s), w1 runs "b" until 11.1 s and w0 is idle
    p = EngineProfile(batch_sizes=(1,), step_ms_table=(10.0,), max_batch=1, prefill_ratio=1.0)
    trajs = [
        TrajSpec("a", 100, (Turn(10, 1000.0), Turn(10))),
        TrajSpec("b", 0, (Turn(1000),)),
        TrajSpec("c", 0, (Turn(10),)),
    ]
    guess = {"a": 20.0, "b": 1000.0, "c": 2000.0}
    sim = Simulator(trajs, workers=2, profile=p, placement=placement, predictor=lambda s, k: guess[s.id])
    result = sim.run()
    assert result.meta["migrations"] == (1 if placement == "cache_affinity" else 0)
    return result.finish_ms["a"]


def test_cache_affinity_moves_a_trajectory_between_turns_and_pays_its_prefill():
    # it moves to w0 and prefills its whole context there (100 + 10 + 64 tool tokens), none
    # cached: 2.1 s + (174 + 10) x 10 ms. It was placed once, like least_load, and waited
    # for "b" (then a cache hit: 64 + 10 tokens)
    assert _moving_case("cache_affinity") == pytest.approx(2100.0 + 1840.0)
    assert _moving_case("least_load") == pytest.approx(11_100.0 + 740.0)


def test_cache_affinity_and_least_load_differ_on_the_placement_benchmark():
    # sim_repro.py's placement row: both were 283,348.405 ms (the same one-time placement)
    w = preset("coding", 2000, seed=1).trajectories
    base = {"workers": 16, "scheduler": "pps", "predictor": oracle, "profile": EngineProfile(max_batch=32)}
    least = Simulator(w, placement="least_load", **base).run()
    cache = Simulator(w, placement="cache_affinity", **base).run()
    assert cache.meta["migrations"] > 0 and least.meta["migrations"] == 0
    assert cache.makespan_ms != pytest.approx(least.makespan_ms, rel=1e-6)


# -- the proxy's slots per replica default to what the engine batches


@pytest.mark.parametrize(
    ("engine", "slots"),
    [
        ({"backend": "vllm", "model": "m", "kwargs": {"max_num_seqs": 8}}, 8),  # it was 64
        ({"backend": "vllm", "model": "m", "kwargs": {"engine_args": {"max_num_seqs": 12}}}, 12),
        ({"backend": "vllm", "model": "m"}, 256),  # vLLM's own default
        ({"backend": "torch", "kwargs": {"max_batch_size": 16}}, 16),
        ({"backend": "torch"}, 64),  # TorchEngineConfig's default
        ({"backend": "openai", "model": "m", "kwargs": {"max_concurrency": 24}}, 24),
    ],
)
def test_the_slots_per_replica_default_to_the_engines_batch(engine, slots):
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "frozenlake-v1", "tag": "lake"}],
            "rewards": {"lake": [{"function": "env_return"}]},
            "engine": engine,
            # (a trainer that can train what the engine serves: the config refuses the others)
            "trainer": {"backend": "torch"}
            if engine["backend"] == "torch"
            else {"backend": "megatron", "kwargs": {"hf_model": "m"}},
            "rollout": {"scheduler": "pps"},
        },
        check_references=False,
    )
    sched = turn_scheduler(cfg)
    assert sched is not None and sched.slots == slots


# -- pps preempts only for a waiting turn predicted *longer*


def test_pps_does_not_preempt_for_a_waiting_turn_of_the_same_zero_length():
    q = ProgressivePriority()
    q.push(Request(trajectory="w", arrival=0.0, predicted_total=0.0), 0.0)
    # 0 >= 2 * 0: the running one was evicted for an equal one, and came back at once
    assert q.preempt([Request(trajectory="r", arrival=0.0, predicted_total=0.0)], 0.0) == []
    # much longer still preempts
    q.push(Request(trajectory="long", arrival=0.0, predicted_total=10.0), 0.0)
    running = Request(trajectory="r", arrival=0.0, predicted_total=0.0)
    assert q.preempt([running], 0.0) == [running]


def test_pps_in_the_simulator_does_not_evict_zero_length_turns_for_each_other():
    trajs = [TrajSpec(f"t{i}", 10, (Turn(0, 5.0), Turn(0))) for i in range(4)]
    result = Simulator(trajs, profile=ONE_SLOT, scheduler="pps", predictor=oracle).run()
    assert result.preemptions == 0


def test_cmlfq_one_long_turn_drops_a_trajectory_several_levels_as_its_docstring_says():
    # the docstring said "goes down one level"; the quanta set a floor from the total tokens
    q = CMLFQ(levels=4, quantum_tokens=(100, 200, 300))
    q.push(Request(trajectory="t", arrival=0.0, turn=1, tokens_so_far=50), 0.0)
    assert q.level_of("t") == 0
    q.pop(0.0)
    q.push(Request(trajectory="t", arrival=1.0, turn=2, tokens_so_far=250), 1.0)
    assert q.level_of("t") == 2


def test_sim_repro_times_the_simulator_with_a_command_of_its_own():
    # README's "10,000 trajectories in 2.9 s" had no command: `sim_repro.py --speed 10000`
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "sim_repro.py"), "--speed", "50", "--workers", "2"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
        timeout=120,
    )
    got = json.loads(out.stdout)
    assert got["trajectories"] == 50 and got["workers"] == 2 and got["placement"] == "presorted_dp"
    assert got["turns"] >= 50 and got["simulated_makespan_s"] > 0 and isinstance(got["seconds"], float)
