"""Placements on workers of different speeds (heterogeneous GPUs, model-parallel degrees)."""

from __future__ import annotations

import itertools

import pytest

from core.sched import Request
from core.sched.base import Placement
from core.sched.placement import (
    CacheAffinity,
    LeastLoad,
    PresortedDP,
    fast_partition,
    group_cost,
    speed_partition,
    worker_order,
)
from core.sched.resources import makespan
from core.sim import Simulator, TrajSpec, Turn
from core.sim.simulator import oracle


def _reqs(lengths: list[float]) -> list[Request]:
    return [Request(f"t{i}", 0.0, predicted_total=n) for i, n in enumerate(lengths)]


def test_worker_names_are_ordered_by_their_numbers():
    names = [f"w{k}" for k in range(12)]
    assert sorted(names, key=worker_order) == names
    assert sorted(["w10", "w2", "w1"]) == ["w1", "w10", "w2"]  # what string order would do


def test_equal_workers_are_filled_in_number_order():
    workers = {f"w{k}": 0.0 for k in range(12)}
    out = LeastLoad().place(_reqs([100 - k for k in range(3)]), workers)
    assert [out[f"t{i}"] for i in range(3)] == ["w0", "w1", "w2"]


@pytest.mark.parametrize("policy", [LeastLoad, CacheAffinity, PresortedDP])
def test_a_faster_worker_gets_more_of_the_work(policy):
    reqs = _reqs([100.0] * 10)
    out = policy().place(reqs, {"slow": 0.0, "fast": 0.0}, {"slow": 1.0, "fast": 4.0})
    on_fast = sum(1 for w in out.values() if w == "fast")
    assert on_fast >= 7, out
    # the same call without speeds balances by count: the speeds did the difference
    blind = policy().place(reqs, {"slow": 0.0, "fast": 0.0})
    assert sum(1 for w in blind.values() if w == "fast") <= 5


def test_equal_speeds_place_exactly_as_no_speeds():
    reqs = _reqs([50, 40, 30, 20, 10, 5])
    workers = {"w0": 0.0, "w1": 3.0, "w2": 0.0}
    for policy in (LeastLoad(), CacheAffinity(), PresortedDP()):
        assert policy.place(reqs, workers, dict.fromkeys(workers, 2.0)) == policy.place(reqs, workers)


def test_presorted_dp_puts_the_longest_group_on_the_fastest_worker():
    reqs = _reqs([1000, 900, 10, 10, 10, 10])
    out = PresortedDP().place(reqs, {"a": 0.0, "b": 0.0, "c": 0.0}, {"a": 1.0, "b": 8.0, "c": 1.0})
    assert out["t0"] == "b"


@pytest.mark.parametrize("speeds", [{"w0": 1.0}, {"w0": 1.0, "w1": 0.0}, {"w0": 1.0, "w1": float("nan")}])
def test_speeds_must_cover_every_worker_and_be_positive(speeds):
    with pytest.raises(ValueError, match="speed"):
        LeastLoad().place(_reqs([1.0]), {"w0": 0.0, "w1": 0.0}, speeds)


def test_speed_partition_with_equal_speeds_is_fast_partition():
    lengths = sorted([37.0, 5, 9, 120, 64, 3, 3, 18, 77, 41], reverse=True)
    for m in range(1, 6):
        assert speed_partition(lengths, [1.0] * m) == fast_partition(lengths, m)


def test_speed_partition_is_the_best_contiguous_split_onto_ordered_workers():
    lengths = [90.0, 70, 40, 30, 20, 10, 5]
    speeds = [3.0, 1.5, 1.0]
    got, cuts = speed_partition(lengths, speeds)
    n = len(lengths)
    best = min(
        max(
            group_cost(lengths, a, b) / s
            for (a, b), s in zip(itertools.pairwise((0, *c, n)), speeds, strict=False)
        )
        for k in range(len(speeds))
        for c in itertools.combinations(range(1, n), k)
    )
    assert got == pytest.approx(best, rel=1e-6)
    assert cuts[0] == 0 and cuts[-1] == n


def test_adaptive_mp_makespan_uses_the_same_split():
    lengths = [300.0, 120, 80, 60, 10]
    assert (
        makespan(lengths, [4, 1], {1: 1.0, 4: 3.2})
        == speed_partition(sorted(lengths, reverse=True), [3.2, 1.0])[0]
    )


class _SpeedBlind(Placement):
    """A placement written for equal workers (no ``speeds`` parameter)."""

    name = "blind"

    def place(self, reqs, workers):  # type: ignore[override]
        return PresortedDP().place(reqs, workers)


def test_the_simulator_gives_placements_the_worker_speeds():
    trajs = [TrajSpec(f"t{i}", 0, (Turn(400),)) for i in range(16)]
    # batched decoding: one long trajectory on the slow worker outlasts all of them on the
    # fast one, which presorted_dp's batch cost (and only a speed-aware split) sees
    aware = Simulator(trajs, workers=2, speeds=[4.0, 1.0], predictor=oracle, placement="presorted_dp").run()
    blind_sim = Simulator(trajs, workers=2, speeds=[4.0, 1.0], predictor=oracle)
    blind_sim.placement = _SpeedBlind()
    blind = blind_sim.run()
    assert aware.makespan_ms < 0.5 * blind.makespan_ms
    # and equal workers call a placement without speeds, so one that takes none still runs
    eq = Simulator(trajs, workers=2, predictor=oracle)
    eq.placement = _SpeedBlind()
    assert eq.run().makespan_ms > 0


def test_cache_affinity_leaves_a_home_too_slow_to_finish_the_trajectory_in_time():
    # the home's backlog was weighed in time but not its share of this trajectory's work:
    # an idle home 100x slower kept the trajectory (done at 10,000 instead of 100)
    home_slow = Request("t", 0.0, predicted_total=1000.0, worker="slow")
    speeds = {"slow": 0.1, "fast": 10.0}
    assert CacheAffinity().place([home_slow], {"slow": 0.0, "fast": 0.0}, speeds) == {"t": "fast"}
    # a home a little slower still keeps it: done at 100 there, 83 on the other
    home = Request("t", 0.0, predicted_total=100.0, worker="w0")
    assert CacheAffinity().place([home], {"w0": 0.0, "w1": 0.0}, {"w0": 1.0, "w1": 1.2}) == {"t": "w0"}
