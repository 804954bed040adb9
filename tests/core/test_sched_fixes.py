"""Regression tests from the second review of the rollout-scheduling research part: each pins
a defect that was demonstrated before its fix."""

from __future__ import annotations

import pytest

from core.sim import EngineProfile, Simulator, TrajSpec, Turn, preset

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
