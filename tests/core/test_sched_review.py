"""Regression tests from an adversarial review of ``core/sched`` and ``core/sim``: each pins
a failure that was demonstrated before its fix."""

from __future__ import annotations

import json

import pytest

from core.sched import Request
from core.sched.multiplex import Task, run_worker
from core.sched.placement import PresortedDP
from core.sched.queueing import CMLFQ
from core.sim import EngineProfile, Simulator, TrajSpec, Turn, Worker, preset
from core.sim.trace import TraceError, load_trace


def test_a_blocking_prefill_of_an_evicted_request_does_not_stall_a_later_one():
    # 100 prompt tokens at 1 decode token each, 10 ms a token: a 1 s prefill that blocks
    p = EngineProfile(
        batch_sizes=(1,), step_ms_table=(10.0,), prefill_blocks=True, prefill_ratio=1.0, cache_tokens=0
    )
    w = Worker("w", p)
    w.admit(0.0, "a", 0, 5, 100, "a")
    assert w.next_completion_ms() == pytest.approx(1050.0)
    w.evict(10.0, "a")  # aborted 10 ms into its prefill: the worker is empty
    w.admit(100_000.0, "b", 1, 5, 0, "b")  # much later, nothing to prefill: 5 tokens
    # it was 101,040: the 990 ms of the evicted request's prefill were still charged
    assert w.next_completion_ms() == pytest.approx(100_050.0)
    assert w.busy_ms == pytest.approx(10.0)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: Turn(-500),  # finished 6 s before the step began
        lambda: Turn(10, -5000.0),  # the next turn ready before this one ended: time ran backwards
        lambda: Turn(10, float("nan")),  # every finish time and the makespan came out nan
        lambda: Turn(10, float("inf")),
        lambda: Turn(10, 0.0, "ok", -64),
        lambda: TrajSpec("a", -100_000, (Turn(10),)),  # a negative context cut the prefill cost
        lambda: TrajSpec("a", 10, ()),  # IndexError deep in the simulator
    ],
)
def test_a_workload_that_would_run_time_backwards_is_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_a_trace_with_a_negative_prompt_is_refused_with_its_line(tmp_path):
    row = {
        "trajectory": "a",
        "turn": 0,
        "ready": 0,
        "start": 0,
        "end": 1,
        "gen_tokens": 3,
        "prompt_tokens": -5,
    }
    p = tmp_path / "trace.jsonl"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(TraceError, match=r"trace\.jsonl:1: .*prompt_tokens >= 0"):
        load_trace(p)


def test_two_trajectories_with_one_id_are_refused():
    # they were merged: one finish time, the second's turns run on the first's state
    twins = [TrajSpec("a", 10, (Turn(10),)), TrajSpec("a", 10, (Turn(1000),))]
    with pytest.raises(ValueError, match="'a'"):
        Simulator(twins)


@pytest.mark.parametrize("starts", [{"b": 5.0}, {"a": float("nan")}, {"a": float("inf")}])
def test_start_times_must_name_a_trajectory_and_be_finite(starts):
    # an unknown id was ignored, a nan start ran the trajectory at 0
    with pytest.raises(ValueError, match="starts_ms"):
        Simulator([TrajSpec("a", 10, (Turn(10),))], starts_ms=starts)


@pytest.mark.parametrize(
    "profile",
    [
        {"max_batch": 0},  # nothing was ever admitted: makespan 0 and no trajectory finished
        {"step_ms_table": (0.0,) * 6},  # every turn took no time
        {"step_ms_table": (-1.0,) * 6},  # finished before it started
        {"step_ms_table": (float("nan"),) * 6},
        {"prefill_ratio": -1.0},  # a long prompt made its turn finish at -11,880 ms
        {"cache_tokens": -1},
    ],
)
def test_an_engine_profile_that_cannot_run_is_refused(profile):
    with pytest.raises(ValueError):
        EngineProfile(**profile)


@pytest.mark.parametrize("speed", [0.0, -1.0, float("nan"), float("inf")])
def test_a_worker_speed_must_be_positive_and_finite(speed):
    # 0 raised ZeroDivisionError mid-run; -1 finished the step at -122 ms
    with pytest.raises(ValueError, match="speed"):
        Simulator([TrajSpec("a", 10, (Turn(10),))], speeds=[speed])


def test_a_run_that_leaves_a_trajectory_unfinished_says_so(monkeypatch):
    # a run whose events ran out with trajectories still waiting returned a makespan of
    # those that finished as if it were the step's
    sim = Simulator([TrajSpec("a", 10, (Turn(10),)), TrajSpec("b", 10, (Turn(10),))], workers=2)
    monkeypatch.setattr(sim, "_dispatch", lambda w, now: None)  # a lost completion
    with pytest.raises(RuntimeError, match="'a', 'b'"):
        sim.run()


@pytest.mark.parametrize("bad", [float("nan"), -5.0])
def test_a_prediction_that_is_nan_or_negative_is_refused(bad):
    with pytest.raises(ValueError, match="predicted_total"):
        Request("t", arrival=0.0, predicted_total=bad)


@pytest.mark.parametrize("policy", ["sjf", "pps"])
def test_one_nan_prediction_cannot_scramble_the_order_of_the_others(policy):
    # a nan key breaks the heap's order silently: sjf popped 10, 30, 20, 40, nan, 50 and
    # pps 50, 30, 20, 40, nan, 10. A predictor that returns nan now fails the run at once
    w = [TrajSpec(f"t{i}", 10, (Turn(10),)) for i in range(3)]
    with pytest.raises(ValueError, match="predicted_total"):
        Simulator(w, scheduler=policy, predictor=lambda spec, turn: float("nan")).run()


def test_hrrs_refuses_an_unknown_policy_instead_of_running_fcfs():
    tasks = [Task("a", 0.0, 1.0, 5.0)]
    with pytest.raises(ValueError, match="HRRS"):
        run_worker(tasks, policy="HRRS")  # ran FCFS, and the benchmark would report it as HRRS


@pytest.mark.parametrize(
    "task",
    [
        lambda: Task("a", 0.0, 0.0, 0.0),  # ZeroDivisionError in the response ratio
        lambda: Task("a", 0.0, -10.0, 0.0),  # a makespan of -10 s
        lambda: Task("a", 0.0, 1.0, -15.0),
        lambda: Task("a", float("nan"), 1.0, 0.0),
    ],
)
def test_a_task_that_takes_no_or_negative_time_is_refused(task):
    with pytest.raises(ValueError):
        task()


def test_a_simulator_runs_once():
    # a second run went on from the first one's end state: makespan 38 s instead of 206 s,
    # utilisation 5.7
    sim = Simulator(preset("coding", 50, seed=0).trajectories, workers=2)
    first = sim.run()
    assert first.utilisation <= 1.0
    with pytest.raises(RuntimeError, match="once"):
        sim.run()


def test_cmlfq_aging_does_not_depend_on_how_often_the_queue_is_polled():
    # "x" is at the bottom (level 3) from t=0; aging_s = 30 lifts it a level per 30 s of
    # waiting, so it is at level 0 from t=90, before "y" arrives at level 0 (t=95). The queue
    # was first polled at t=100: x went up one level only (re-stamped at 100) and y ran first;
    # polled at 31, 62 and 93 s, x ran first. A policy's order must not depend on the poll times
    def order(polls: list[float]) -> list[str]:
        q = CMLFQ(levels=4, quantum_tokens=(1, 2, 3), aging_s=30.0)
        q.push(Request("x", arrival=0.0, tokens_so_far=5), 0.0)
        q._age(0.0)
        for t in polls:
            q._age(t)  # what a pop does before it picks
        q.push(Request("y", arrival=95.0), 95.0)
        return [r.trajectory for r in q.drain(100.0)]

    assert order([31.0, 62.0, 93.0]) == ["x", "y"]
    assert order([]) == ["x", "y"]


def test_presorted_dp_never_migrates_onto_a_worker_that_is_gone():
    # t0 and t1 were on a worker that left; relabelling matched a group to it by overlap
    # and moved t2 there: {"t2": "gone"}
    reqs = [Request(f"t{i}", 0.0, predicted_total=100.0 * (i + 1)) for i in range(4)]
    current = {"t0": "gone", "t1": "gone", "t2": "w0", "t3": "w1"}
    workers = {"w0": 0.0, "w1": 0.0}
    moves = PresortedDP().migrations(current, reqs, workers, {"t0", "t1", "t2", "t3"})
    assert set(moves.values()) <= set(workers)
    assert {"t0", "t1"} <= set(moves)  # the gone worker's trajectories do move


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"ridge": 0}, "ridge must be"),
        ({"ridge": float("nan")}, "ridge must be"),
        ({"refit_every": 0}, "refit_every must be"),
    ],
)
def test_a_length_predictor_that_cannot_fit_is_refused_at_once(kw, says):
    # ridge=0 was taken and the first refit failed with numpy's "Singular matrix", mid-run
    from core.sched.predictor import LengthPredictor

    with pytest.raises(ValueError, match=says):
        LengthPredictor(**kw)
