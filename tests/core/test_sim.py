"""The rollout simulator on hand-made cases whose answers are worked out by hand."""

from __future__ import annotations

import pytest

from core.sim import EngineProfile, Simulator, TrajSpec, Turn, Worker, oracle, preset, uniform_turns
from core.sim.workload import env_latency_normal

# 10 ms per decode iteration whatever the batch, no prefill cost: times are easy to add up
FLAT = EngineProfile(batch_sizes=(1, 256), step_ms_table=(10.0, 10.0), max_batch=256, prefill_ratio=0.0)


def test_step_time_interpolates_and_extrapolates():
    p = EngineProfile(batch_sizes=(1, 9), step_ms_table=(10.0, 18.0), max_batch=64)
    assert (
        p.step_ms(1) == 10.0 and p.step_ms(5) == pytest.approx(14.0) and p.step_ms(18) == pytest.approx(36.0)
    )
    with pytest.raises(ValueError):
        EngineProfile(batch_sizes=(8, 1), step_ms_table=(1.0, 2.0))
    with pytest.raises(ValueError):
        EngineProfile(batch_sizes=(1,), step_ms_table=(1.0, 2.0))


def test_worker_virtual_clock_with_a_changing_batch():
    p = EngineProfile(batch_sizes=(1, 2), step_ms_table=(10.0, 20.0), max_batch=8, prefill_ratio=0.0)
    w = Worker("w", p)
    w.admit(0.0, "a", 0, 100, 0, "a")  # alone: 10 ms per token
    w.admit(500.0, "b", 1, 10, 0, "b")  # a has 50 left; both now run at 20 ms per iteration
    assert w.next_completion_ms() == pytest.approx(700.0)  # b: 10 iterations x 20 ms
    assert w.complete(700.0) == "b"
    assert w.next_completion_ms() == pytest.approx(1100.0)  # a: 40 left, alone again
    assert w.complete(1100.0) == "a" and w.busy_ms == pytest.approx(1100.0)


def test_prefix_cache_skips_the_history_it_holds():
    p = EngineProfile(batch_sizes=(1,), step_ms_table=(10.0,), prefill_ratio=0.5, max_batch=8)
    w = Worker("w", p)
    w.admit(0.0, "t1", 0, 10, 100, "t")  # 100 prompt tokens: 50 extra iterations
    assert w.next_completion_ms() == pytest.approx(600.0)
    w.complete(600.0)
    w.admit(600.0, "t2", 1, 10, 130, "t")  # 110 of 130 cached: 20 new, 10 extra iterations
    assert w.next_completion_ms() == pytest.approx(600.0 + 200.0)


def test_one_trajectory_adds_up():
    traj = TrajSpec("t", 0, (Turn(100, tool_ms=500.0), Turn(50)))
    r = Simulator([traj], profile=FLAT).run()
    assert r.makespan_ms == pytest.approx(100 * 10 + 500 + 50 * 10)


def test_batch_mode_waits_for_the_slowest_environment_each_turn():
    fast = TrajSpec("fast", 0, (Turn(10, 100.0), Turn(10, 100.0), Turn(10)))
    slow = TrajSpec("slow", 0, (Turn(10, 1000.0), Turn(10, 100.0), Turn(10)))
    traj = Simulator([fast, slow], profile=FLAT, mode="trajectory").run()
    batch = Simulator([fast, slow], profile=FLAT, mode="batch").run()
    # trajectory-level: fast ends at 3x100 + 2x100 = 500; slow at 300 + 1100 = 1400
    assert traj.finish_ms == pytest.approx({"fast": 500.0, "slow": 1400.0})
    # batch-level: every turn waits for the slower one: fast finishes with slow
    assert batch.finish_ms == pytest.approx({"fast": 1400.0, "slow": 1400.0})


def test_batch_mode_tool_calls_start_after_every_generation_of_the_turn():
    short = TrajSpec("short", 0, (Turn(10, 100.0), Turn(10)))
    long_ = TrajSpec("long", 0, (Turn(100, 100.0), Turn(10)))
    r = Simulator([short, long_], profile=FLAT, mode="batch").run()
    # turn 0 generations end at 100 and 1000 ms; tools start at 1000, end at 1100; turn 1 ends at 1200
    assert r.makespan_ms == pytest.approx(1200.0)


def test_progressive_priority_finishes_the_longest_trajectory_sooner_than_round_robin():
    one_slot = EngineProfile(batch_sizes=(1,), step_ms_table=(10.0,), max_batch=1, prefill_ratio=0.0)
    trajs = [TrajSpec(f"s{i}", 0, (Turn(20, 50.0), Turn(20))) for i in range(6)]
    trajs.append(TrajSpec("long", 0, (Turn(200, 50.0), Turn(200))))
    rr = Simulator(trajs, profile=one_slot, scheduler="rr", predictor=oracle).run()
    pps = Simulator(trajs, profile=one_slot, scheduler="pps", predictor=oracle).run()
    assert pps.finish_ms["long"] < rr.finish_ms["long"]
    assert pps.makespan_ms <= rr.makespan_ms


def test_more_workers_and_placement_shorten_a_step():
    w = preset("math", 200, seed=3)
    one = Simulator(w.trajectories, workers=1).run()
    four = Simulator(w.trajectories, workers=4, placement="presorted_dp", predictor=oracle).run()
    assert four.makespan_ms < one.makespan_ms and 0 < four.utilisation <= 1.0
    assert set(four.finish_ms) == {t.id for t in w.trajectories}


def test_trajectory_level_beats_batch_level_more_as_env_latency_varies():
    ratios = []
    for sigma in (1_000, 10_000):
        w = uniform_turns(32, 6, 100, env_latency_normal(10_000, sigma), seed=2)
        batch = Simulator(w.trajectories, mode="batch").run().makespan_ms
        traj = Simulator(w.trajectories, mode="trajectory").run().makespan_ms
        ratios.append(batch / traj)
    assert 1.0 < ratios[0] < ratios[1]


def test_workload_presets_are_seeded_and_named():
    assert preset("coding", 50, seed=1).trajectories == preset("coding", 50, seed=1).trajectories
    assert all(t.turns[-1].outcome == "success" for t in preset("coding", 50).trajectories)
    with pytest.raises(ValueError, match="unknown workload preset 'chess'"):
        preset("chess", 1)


def test_bad_simulator_settings():
    t = [TrajSpec("t", 0, (Turn(1),))]
    with pytest.raises(ValueError, match="mode must be"):
        Simulator(t, mode="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one worker"):
        Simulator(t, workers=0)
    with pytest.raises(ValueError, match="one speed per worker"):
        Simulator(t, workers=2, speeds=[1.0])
    with pytest.raises(ValueError, match="unknown scheduler"):
        Simulator(t, scheduler="lifo")


def test_a_preempted_turn_resumes_with_its_prefix_cache_whole():
    # it came back with prompt_tokens 0, and the cache entry became its remaining decode
    # tokens: the trajectory's next turn re-prefilled its whole 10k-token prompt (~2.4 s)
    w = Worker("w", EngineProfile(max_batch=4, cache_tokens=1_000_000))
    w.admit(0.0, "t", 1, 100.0, 10_000, "a")
    assert w.cached == {"a": 10_100}
    w.admit(5.0, "t", 2, 40.0, 0, "a", resume=True)
    assert w.cached == {"a": 10_100} and w.cached_total == 10_100
    trajs = [TrajSpec("short", 10_000, (Turn(100, 50.0), Turn(100))), TrajSpec("long", 100, (Turn(5000),))]
    r = Simulator(
        trajs,
        scheduler="pps",
        predictor=oracle,
        profile=EngineProfile(max_batch=1),
        starts_ms={"long": 100.0},
    ).run()
    assert r.preemptions == 1 and r.finish_ms["short"] < 66_000  # 67,244 ms with the re-prefill
