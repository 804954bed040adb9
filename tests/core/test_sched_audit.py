"""Regression tests from a review of the scheduling policies and the simulator (units,
clocks and rules end to end): each pins a failure that was demonstrated before its fix."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from proxy_fakes import Fake
from proxy_fakes import req as one_turn
from pydantic import ValidationError

from core.config_sections import RolloutConfig
from core.rollout.llm_proxy import LLMProxy, ReplicaLost
from core.rollout.scheduling import TurnScheduler
from core.sched.base import Request
from core.sched.planner import CostModel, GlobalPlanner, Split, StepObservation, best_split, run_pipeline
from core.sched.queueing import CMLFQ
from core.sim import Simulator, TrajSpec, Turn
from core.sim.reward import RewardPool, RewardStage


def test_a_trajectory_that_moves_worker_in_the_simulator_keeps_its_cmlfq_level():
    # The real path keeps C-MLFQ's levels in one store for every replica's queue, so a
    # trajectory cache_affinity moves keeps its level; the simulator gave each worker a
    # queue of its own, and a moved trajectory started again at level 0 there.
    trajs = [
        # two turns whose tool calls error: level 1 after the first, level 2 after the second
        TrajSpec("a", 16, (Turn(1500, 10.0, "tool_error"), Turn(1500, 10.0, "tool_error"), Turn(10))),
        TrajSpec("c", 16, (Turn(6000),)),  # keeps a's first worker loaded
        TrajSpec("x", 16, (Turn(10),)),  # predicted long at first: the other worker is x's
    ]

    def predict(spec: TrajSpec, turn: int) -> float:
        if spec.id != "a":
            return {"x": 10_000.0, "c": 100.0}[spec.id]
        # a stays on its worker at turn 1, and has little left at turn 2: it moves then
        return {0: 100.0, 1: 10_000.0}.get(turn, sum(t.gen_tokens for t in spec.turns[:turn]) + 1.0)

    sim = Simulator(trajs, workers=2, scheduler="cmlfq", placement="cache_affinity", predictor=predict)
    levels: list[tuple[str, int, int]] = []
    for name, queue in sim.queues.items():
        push = queue.push

        def spy(req: Request, now: float, _push=push, _name=name, _q=queue) -> None:
            _push(req, now)
            if req.trajectory == "a":
                levels.append((_name, req.turn, _q.level_of("a")))  # type: ignore[attr-defined]

        queue.push = spy  # type: ignore[method-assign]
    res = sim.run()
    assert res.meta["migrations"] == 1
    (home, _, _), (_, _, one), (moved, _, two) = levels
    assert moved != home and one == 1
    assert two == 2  # was 1: 0 on the new worker's queue, then one level down


@pytest.mark.parametrize(
    ("scheduler", "options"),
    [
        # failed at the first turn that waited, in the proxy: TypeError comparing float and str
        ("cmlfq", {"aging_s": "30"}),
        # nan: never aged, a demoted turn starved behind every later level-0 one
        ("cmlfq", {"aging_s": float("nan")}),
        ("cmlfq", {"aging_s": -5.0}),
        ("cmlfq", {"quantum_tokens": (2048, 8192, -1)}),
        ("cmlfq", {"quantum_tokens": (8192, 2048, 32768)}),
        ("cmlfq", {"buckets": -2}),  # bucket(0) was -3
        # nan: never preempted (waiting > nan * size is always false)
        ("pps", {"preempt_ratio": float("nan")}),
    ],
)
def test_queue_policy_options_that_cannot_work_are_refused_by_the_job_config(scheduler, options):
    with pytest.raises(ValidationError, match="scheduler_options do not fit"):
        RolloutConfig(scheduler=scheduler, scheduler_options=options)


def test_aging_periods_that_work_are_still_taken():
    # a demoted turn that waited long goes before a later level-0 one
    def first(aging_s: float) -> str:
        q = CMLFQ(levels=4, quantum_tokens=(1, 2, 3), aging_s=aging_s)
        q.push(Request("old", arrival=0.0, tokens_so_far=50), 0.0)
        q.push(Request("new", arrival=1000.0), 1000.0)
        r = q.pop(1000.0)
        assert r is not None
        return r.trajectory

    assert first(30.0) == "old"
    assert first(0.0) == "old"  # (0: every waiting turn goes up at once, as tests use it)


def test_dedicated_reward_workers_take_a_batch_in_the_order_it_is_handed_over():
    # The rollout's batch arrives at once, in finish order; the pool sorted the jobs by
    # (arrival, service), so equal arrivals ran shortest first (not first come, first
    # served): the long judge started last and the batch ended at 11 instead of 10.
    pool = RewardPool(RewardStage("dedicated", 2))
    assert pool.serve([(0.0, 10.0), (0.0, 1.0), (0.0, 1.0)]) == 10.0
    # arrivals still go in time order
    pool = RewardPool(RewardStage("dedicated", 1))
    assert pool.serve([(5.0, 1.0), (0.0, 2.0)]) == 6.0


class _Scripted(GlobalPlanner):
    """Moves to ``to`` before step 1, whatever it observed."""

    def __init__(self, start: Split, to: Split) -> None:
        super().__init__(start.total, 1, initial=start)
        self.to = to

    def due(self, step: int) -> bool:
        return step == 1

    def plan(self, observations: Sequence[StepObservation]) -> Split:
        self.split = self.to
        return self.to


#: 100 tokens/s per GPU both ways, no KV slowdown, no tail: 1,000 tokens are 10 GPU-s a stage.
_FLAT = CostModel(decode_tok_s=100.0, kv_half_tokens=1e15, seq_tok_s=1e15, train_tok_s=100.0)


def test_gpus_moving_from_rollout_to_training_join_the_running_training_step():
    # Split 8/2 -> 5/5 before step 1. Step 0: rollout [0, 1.25] on 8 GPUs; its training starts
    # at 1.25 on 2 GPUs, the moment step 1's rollout starts on 5: the 3 that leave the
    # rollout are free then and join that training, as GPUs moving the other way join the
    # running rollout. They sat out instead until step 1's training (makespan 8.25 s).
    steps = [[100.0] * 10] * 2
    out = run_pipeline(steps, _Scripted(Split(8, 2), Split(5, 5)), _FLAT)
    assert out["makespan_s"] == pytest.approx(5.25)  # training 0 on 5 GPUs: [1.25, 3.25]
    # with a 1 s switch they join at 2.25: 2 GPU-s done by then, 8 over 5 GPUs
    out = run_pipeline(steps, _Scripted(Split(8, 2), Split(5, 5)), _FLAT, switch_s=1.0)
    assert out["makespan_s"] == pytest.approx(3.85 + 2.0)
    # blocking: training 0 waits for them (starts at 2.25 on 5 GPUs)
    out = run_pipeline(steps, _Scripted(Split(8, 2), Split(5, 5)), _FLAT, switch_s=1.0, blocking=True)
    assert out["makespan_s"] == pytest.approx(4.25 + 2.0)


def test_gpus_moving_from_training_to_rollout_still_join_the_running_rollout():
    # Split 2/8 -> 5/5: rollout 1 starts at 5 on 2 GPUs, the 3 join when training 0 ends
    # (6.25): 2.5 GPU-s done, 7.5 over 5; training 1 then [7.75, 9.75]
    steps = [[100.0] * 10] * 2
    out = run_pipeline(steps, _Scripted(Split(2, 8), Split(5, 5)), _FLAT)
    assert out["makespan_s"] == pytest.approx(9.75)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_planner_observation_that_is_not_a_finite_time_is_refused(bad):
    # a nan (a step's lengths held one) passed the ">= 0" check and the planner re-split the
    # pool to 1 rollout GPU, the worst split, silently; inf rollout work did the same
    with pytest.raises(ValueError, match="finite"):
        StepObservation(bad, 50.0)
    with pytest.raises(ValueError, match="finite"):
        CostModel().observe([100.0, bad])
    with pytest.raises(ValueError, match="finite"):
        best_split(16, bad, 50.0)


async def test_a_turn_rerun_after_its_replica_was_lost_moves_its_cmlfq_level_once():
    # A turn lost with its replica is admitted again (the rerun) with the same request: C-MLFQ
    # applied its tool outcome again, so one tool error cost two levels (a timeout four). The
    # simulator admits every turn once.
    r = Fake("r", fail=[None, ReplicaLost("died")], ping_down=float("inf"))
    ok = Fake("ok")
    sched = TurnScheduler("cmlfq", slots=4)
    proxy = LLMProxy({"default": [r, ok]}, recover_timeout_s=60, scheduler=sched)
    try:
        levels: dict[str, int] = sched._queue_options["level_store"]
        await asyncio.wait_for(proxy.generate("t", "x", one_turn(request_id="t/0", metadata={"turn": 0})), 5)
        meta = {"turn": 1, "outcome": "tool_error"}
        c = await asyncio.wait_for(proxy.generate("t", "x", one_turn(request_id="t/1", metadata=meta)), 5)
        assert c.request_id == "t/1" and ok.generated == ["t/1#rerun1"]  # it was lost and rerun
        assert levels["t"] == 1  # was 2
    finally:
        await proxy.aclose()


async def test_a_turn_admitted_again_keeps_the_level_its_first_admission_gave():
    # the scheduler alone: a turn's second admission (a rerun, or a replica that broke while
    # it waited) does not move its trajectory again; the next turn's outcome still does
    sched = TurnScheduler("cmlfq", slots=1)
    levels: dict[str, int] = sched._queue_options["level_store"]
    assert await sched.admit(1, sched.request("a", 0, 10, {}))
    sched.done(1)
    sched.finished_turn("a", 5)
    turn = sched.request("a", 1, 20, {"outcome": "timeout"})
    assert await sched.admit(1, turn)
    sched.done(1)
    assert await sched.admit(2, turn)
    assert levels["a"] == 2  # was 3 (2 + 2, the lowest of 4 levels)
    sched.done(2)
    sched.finished_turn("a", 5)
    assert await sched.admit(2, sched.request("a", 2, 30, {"outcome": "tool_error"}))
    assert levels["a"] == 3
