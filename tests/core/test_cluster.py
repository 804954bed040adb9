"""Cluster-level policies on hand-made cases: the cyclic-horizon ring and packing (PlexRL),
the periodic global planner and its step pipeline (Libra)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from core.sched.horizon import Job, Packing, Phase, Ring, dedicated_nodes, pack, place
from core.sched.planner import (
    CostModel,
    GlobalPlanner,
    Split,
    StepObservation,
    _finish,
    best_split,
    run_pipeline,
)
from core.sched.segtree import SegmentTree, arcs

# -- segment tree and ring


def test_segment_tree_matches_a_brute_force_array():
    rng = random.Random(0)
    for size in (1, 2, 7, 37, 64):
        tree, ref = SegmentTree(size), np.zeros(size, dtype=int)
        for _ in range(300):
            lo = rng.randrange(size)
            hi = rng.randrange(lo + 1, size + 1)
            if rng.random() < 0.5:
                v = rng.randint(-3, 5)
                tree.add(lo, hi, v)
                ref[lo:hi] += v
            else:
                assert tree.max(lo, hi) == ref[lo:hi].max()


def test_segment_tree_rejects_bad_ranges():
    tree = SegmentTree(8)
    with pytest.raises(ValueError, match="not inside"):
        tree.add(3, 9, 1)
    with pytest.raises(ValueError, match="empty range"):
        tree.max(4, 4)
    with pytest.raises(ValueError, match=">= 1 slot"):
        SegmentTree(0)


def test_arcs_split_an_interval_that_wraps_around():
    assert arcs(8, 4, 10) == [(8, 10), (0, 2)]
    assert arcs(12, 3, 10) == [(2, 5)]
    assert arcs(3, 10, 10) == [(3, 10), (0, 3)]
    assert arcs(5, 0, 10) == []


def test_ring_occupancy_matches_a_brute_force_ring_with_wrap_around():
    rng = random.Random(1)
    horizon, cap = 23, 3
    ring = Ring(horizon, ["x", "y"], capacity=cap)
    ref = {"x": np.zeros(horizon, dtype=int), "y": np.zeros(horizon, dtype=int)}
    held: dict[str, list[tuple[str, int, int]]] = {}
    for i in range(400):
        node, start, length = rng.choice("xy"), rng.randrange(-30, 60), rng.randint(0, horizon)
        slots = [(start + k) % horizon for k in range(length)]
        peak = int(ref[node][slots].max()) if slots else 0
        assert ring.peak(node, start, length) == peak
        assert ring.fits(node, start, length) == (peak + 1 <= cap)
        if peak + 1 <= cap and rng.random() < 0.7:
            job = f"j{i % 9}"
            ring.add(node, start, length, job)  # an empty interval holds nothing
            ref[node][slots] += 1
            if length:
                held.setdefault(job, []).append((node, start, length))
        elif held and rng.random() < 0.3:
            job = rng.choice(sorted(held))
            intervals = held.pop(job)
            assert ring.remove(job) == len(intervals)
            for n, s, ln in intervals:
                ref[n][[(s + k) % horizon for k in range(ln)]] -= 1
        for n in "xy":
            assert ring.load(n) == ref[n].sum()


def test_fits_add_remove_and_intervals():
    ring = Ring(10, 2)
    ring.add("node0", 8, 4, "a")  # slots 8, 9, 0, 1
    assert not ring.fits("node0", 0, 1)
    assert ring.fits("node0", 2, 6)
    assert ring.fits("node1", 0, 10)
    with pytest.raises(ValueError, match="does not fit on 'node0'"):
        ring.add("node0", 1, 2, "b")
    ring.add("node0", 2, 6, "b")
    assert [(iv.job, iv.start, iv.end) for iv in ring.intervals("node0")] == [("b", 2, 8), ("a", 8, 12)]
    assert ring.used_nodes() == ["node0"] and ring.jobs == ["a", "b"]
    assert ring.remove("a") == 1
    assert ring.fits("node0", 8, 4) and not ring.fits("node0", 3, 1)
    assert ring.load("node0") == 6


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda r: r.fits("node0", 0, -1), "length must be >= 0"),
        (lambda r: r.fits("node0", 0, 11), "does not fit on a ring of 10"),
        (lambda r: r.fits("nope", 0, 1), "unknown node 'nope'"),
        (lambda r: r.add("nope", 0, 1, "a"), "unknown node"),
        (lambda r: r.fits("node0", 0, 1, amount=0), "amount must be >= 1"),
        (lambda r: r.remove("ghost"), "holds nothing"),
        (lambda r: r.intervals("nope"), "unknown node"),
    ],
)
def test_ring_rejects_bad_inputs(call, message):
    with pytest.raises(ValueError, match=message):
        call(Ring(10, 2))


def test_ring_construction_is_validated():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Ring(10, 2, capacity=0)
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        Ring(0, 2)
    with pytest.raises(ValueError, match="at least one node"):
        Ring(10, 0)
    with pytest.raises(ValueError, match="unique"):
        Ring(10, ["a", "a"])


# -- jobs and packing


def check_feasible(packing: Packing, jobs: list[Job]) -> None:
    """Rebuild every node's occupancy from the placements alone and check the constraints."""
    ring = packing.ring
    occ = {n: np.zeros(ring.horizon, dtype=int) for n in ring.nodes}
    by_name = {j.name: j for j in jobs}
    for name, p in packing.placements.items():
        job = by_name[name]
        start = p.offset
        services: dict[str, set[str]] = {}
        for phase, nodes in zip(job.phases, p.nodes, strict=True):
            assert len(set(nodes)) == phase.nodes
            first = services.setdefault(phase.service, set(nodes))
            assert set(nodes) <= first
            for node in nodes:
                for t in range(start, start + ring.horizon, job.period):
                    occ[node][[(t + k) % ring.horizon for k in range(phase.slots)]] += phase.amount
            start += phase.slots
        if not job.colocate:
            sets = list(services.values())
            assert all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1 :])
    for n in ring.nodes:
        assert occ[n].max(initial=0) <= ring.capacity
        assert occ[n].sum() == ring.load(n)


def test_two_complementary_jobs_share_nodes():
    # each rolls out on 2 nodes for 3 slots and trains on 4 for 1: alone, 4 nodes each
    a, b = Job.rl("a", 3, 2, 1, 4), Job.rl("b", 3, 2, 1, 4)
    assert dedicated_nodes([a, b]) == 8
    packing = pack([a, b], 10)
    assert packing.nodes_used == 6 and not packing.unplaced
    assert packing.placements["b"].offset != packing.placements["a"].offset
    check_feasible(packing, [a, b])


def test_rollout_heavy_and_training_heavy_disaggregated_jobs_fill_each_others_gaps():
    a = Job.rl("a", 3, 4, 1, 4, colocate=False)  # rollout-heavy
    b = Job.rl("b", 1, 4, 3, 4, colocate=False)  # training-heavy
    assert dedicated_nodes([a, b]) == 16
    packing = pack([a, b], 16)
    assert packing.nodes_used == 8 and packing.utilisation == 1.0
    check_feasible(packing, [a, b])


def test_jobs_of_different_periods_share_a_hyper_period():
    a, b = Job.rl("a", 1, 2, 1, 2), Job.rl("b", 2, 1, 1, 1)
    packing = pack([a, b], 6)
    assert packing.ring.horizon == 6
    check_feasible(packing, [a, b])


def test_random_packings_are_feasible_and_never_worse_than_dedicated():
    rng = random.Random(2)
    for trial in range(15):
        jobs = []
        for i in range(rng.randint(1, 4)):
            r, t = rng.randint(1, 5), rng.randint(1, 3)
            tail = rng.randint(0, 2)
            jobs.append(
                Job.rl(f"j{i}", r, rng.randint(1, 4), t, rng.randint(1, 4), tail, 1, colocate=trial % 2 == 0)
            )
        period = max(j.period for j in jobs)
        jobs = [j for j in jobs if period % j.period == 0]
        packing = pack(jobs, 40, horizon=period)
        assert not packing.unplaced
        assert packing.nodes_used <= dedicated_nodes(jobs)
        check_feasible(packing, jobs)


def test_a_job_that_cannot_fit_is_left_unplaced():
    small, big = Job.rl("small", 2, 2, 2, 2), Job.rl("big", 2, 3, 2, 3)
    packing = pack([small, big], 2)
    assert packing.unplaced == ["big"] and list(packing.placements) == ["small"]
    check_feasible(packing, [small, big])
    assert place(Ring(4, 2), Job("wide", (Phase("p", 1, 1, amount=2),))) is None


def test_job_and_packing_inputs_are_validated():
    with pytest.raises(ValueError, match="must be >= 1"):
        Phase("p", 0, 1)
    with pytest.raises(ValueError, match="no phases"):
        Job("j", ())
    with pytest.raises(ValueError, match="more than the 2"):
        Job.rl("j", 2, 2, 1, 1, tail_slots=1, tail_nodes=3)
    with pytest.raises(ValueError, match="does not divide the horizon"):
        place(Ring(5, 4), Job.rl("j", 1, 1, 1, 1))
    with pytest.raises(ValueError, match="unique"):
        pack([Job.rl("j", 1, 1, 1, 1), Job.rl("j", 2, 1, 1, 1)], 4)
    ring = Ring(2, 4)
    place(ring, Job.rl("j", 1, 1, 1, 1))
    with pytest.raises(ValueError, match="already on the ring"):
        place(ring, Job.rl("j", 1, 1, 1, 1))


# -- global planner


def test_best_split_balances_the_two_stages():
    assert best_split(10, 800.0, 200.0) == Split(8, 2)
    assert best_split(10, 200.0, 800.0) == Split(2, 8)
    # a 50 s tail bounds every split from 2 to 8 rollout GPUs alike: the one balancing the bulk
    # work wins, so a shorter tail next step does not leave the rollout starved
    assert best_split(10, 100.0, 90.0, tail_s=50.0) == Split(5, 5)
    assert best_split(10, 100.0, 90.0, tail_s=0.0) == Split(5, 5)


def test_planner_moves_gpus_toward_the_slower_stage():
    planner = GlobalPlanner(16, period_steps=4)
    assert planner.split == Split(8, 8)
    slow_rollout = [StepObservation(rollout_gpu_s=300.0, train_gpu_s=100.0)] * 4
    assert planner.plan(slow_rollout).rollout_gpus > 8
    slow_train = [StepObservation(rollout_gpu_s=100.0, train_gpu_s=300.0)] * 4
    assert planner.plan(slow_train).rollout_gpus < 8


def test_planner_respects_the_total_and_the_minimum_per_role():
    planner = GlobalPlanner(6, 1)
    only_rollout = planner.plan([StepObservation(1000.0, 0.0)])
    assert only_rollout == Split(5, 1) and only_rollout.total == 6
    assert planner.plan([StepObservation(0.0, 1000.0)]) == Split(1, 5)
    bounded = GlobalPlanner(10, 1, min_rollout=3, min_train=2)
    assert bounded.plan([StepObservation(0.0, 1000.0)]) == Split(3, 7)
    assert bounded.plan([StepObservation(1000.0, 0.0)]) == Split(8, 2)


def test_planner_extrapolates_a_drifting_workload():
    growing = [StepObservation(100.0 + 10 * i, 100.0) for i in range(5)]
    w_r, w_t, _ = GlobalPlanner(8, 5).predict(growing)
    assert w_r == pytest.approx(100 + 10 * (4 + 3)) and w_t == pytest.approx(100.0)
    w_r, _, _ = GlobalPlanner(8, 5, extrapolate=False).predict(growing)
    assert w_r == pytest.approx(120.0)


def test_planner_timing_and_empty_history():
    planner = GlobalPlanner(8, period_steps=3)
    assert [s for s in range(10) if planner.due(s)] == [3, 6, 9]
    assert planner.plan([]) == Split(4, 4)


def test_planner_inputs_are_validated():
    with pytest.raises(ValueError, match="cannot give"):
        GlobalPlanner(1)
    with pytest.raises(ValueError, match="period must be >= 1"):
        GlobalPlanner(4, 0)
    with pytest.raises(ValueError, match="window must be >= 1"):
        GlobalPlanner(4, 2, window=0)
    with pytest.raises(ValueError, match="uses 5 GPUs, not 4"):
        GlobalPlanner(4, 2, initial=Split(3, 2))
    with pytest.raises(ValueError, match="minimum of >= 1"):
        GlobalPlanner(4, 2, min_train=0)
    with pytest.raises(ValueError, match="each role needs >= 1 GPU"):
        Split(0, 4)
    with pytest.raises(ValueError, match=">= 0"):
        StepObservation(-1.0, 0.0)
    with pytest.raises(ValueError, match="nothing observed"):
        GlobalPlanner(4).predict([])


# -- pipeline

#: 100 tokens/s per GPU both ways, no KV slowdown, no tail: a step of 1,000 tokens is 10 GPU-s a stage.
FLAT = CostModel(decode_tok_s=100.0, kv_half_tokens=1e15, seq_tok_s=1e15, train_tok_s=100.0)


def test_pipeline_overlaps_rollout_with_the_previous_training_step():
    steps = [[100.0] * 10] * 3
    assert run_pipeline(steps, Split(5, 5), FLAT)["makespan_s"] == pytest.approx(8.0)  # 2 s a stage
    # rollout 1.25 s, training 5 s; step 2's rollout waits for step 0's weights (6.25 s)
    out = run_pipeline(steps, Split(8, 2), FLAT)
    assert out["makespan_s"] == pytest.approx(16.25)
    assert out["gpu_hours"] == pytest.approx(10 * 16.25 / 3600)


def test_gpus_joining_a_stage_speed_up_the_remaining_work():
    assert _finish(0.0, 10.0, 2, 3, 2.0) == pytest.approx(3.2)  # 4 done by t=2, then 6 over 5 GPUs
    assert _finish(0.0, 10.0, 2, 3, 0.0) == pytest.approx(2.0)
    assert _finish(1.0, 4.0, 2, 3, 9.0) == pytest.approx(3.0)  # done before they arrive


def test_planner_beats_the_step0_split_when_lengths_grow_and_blocking_switches_cost_more():
    # decoding slows 5x over the run (KV pressure) while training's cost per token stays flat
    cost = CostModel(kv_half_tokens=1000.0, seq_tok_s=1e15)
    rng = np.random.default_rng(0)
    steps = [rng.lognormal(np.log(m), 0.5, 128) for m in np.geomspace(500, 4000, 40)]
    first = cost.observe(steps[0])
    at_step0 = best_split(16, first.rollout_gpu_s, first.train_gpu_s, first.tail_s)
    fixed = run_pipeline(steps, at_step0, cost)
    planned = run_pipeline(steps, GlobalPlanner(16, 5, initial=at_step0), cost)
    assert planned["makespan_s"] < 0.9 * fixed["makespan_s"]
    assert planned["final_rollout_gpus"] > at_step0.rollout_gpus and planned["gpu_moves"] > 0
    lazy = run_pipeline(steps, GlobalPlanner(16, 5, initial=at_step0), cost, switch_s=20.0)
    blocking = run_pipeline(steps, GlobalPlanner(16, 5, initial=at_step0), cost, switch_s=20.0, blocking=True)
    assert planned["makespan_s"] <= lazy["makespan_s"] <= blocking["makespan_s"]
