"""The training-loop simulator (``core.sim.pipeline``) on cases worked out by hand."""

from __future__ import annotations

import random

import pytest

from core.sim import EngineProfile, Simulator, TrajSpec, Turn
from core.sim.pipeline import (
    RolloutPlan,
    StepWorkload,
    Timeline,
    preset_steps,
    run_timeline,
    simulate,
    simulate_rollouts,
    with_failures,
)
from core.sim.reward import RewardPool, RewardStage, fixed_ms

# 10 ms per decode iteration whatever the batch, no prefill: a trajectory alone takes 10 ms a
# token, and with enough slots trajectories do not slow each other down
FLAT = EngineProfile(batch_sizes=(1, 256), step_ms_table=(10.0, 10.0), max_batch=256, prefill_ratio=0.0)


def two_trajectories(step: int, per_group: int) -> list[TrajSpec]:
    """One group: 100 tokens (1,000 ms) and 50 tokens (500 ms), no prompt."""
    return [TrajSpec(f"s{step}a", 0, (Turn(100),)), TrajSpec(f"s{step}b", 0, (Turn(50),))]


def timeline(bound: int = 0, reward: RewardStage | None = None) -> Timeline:
    """Reward 200 ms each on one dedicated worker, 2 ms per trained token, 100 ms sync."""
    return Timeline(bound, reward or RewardStage("dedicated", 1, fixed_ms(200.0)), 2.0, 100.0)


def test_synchronous_step_is_rollout_plus_reward_plus_train_plus_sync():
    res = simulate(two_trajectories, RolloutPlan(steps=3, group_size=2), timeline(), profile=FLAT)
    # rollout 1,000; two rewards of 200 after it; 150 tokens x 2 ms; 100 ms sync
    assert [s.rollout_start_ms for s in res.steps] == pytest.approx([0.0, 1800.0, 3600.0])
    s0 = res.steps[0]
    assert (s0.rollout_end_ms, s0.reward_end_ms, s0.train_end_ms, s0.synced_ms) == pytest.approx(
        (1000.0, 1400.0, 1700.0, 1800.0)
    )
    assert res.makespan_ms == pytest.approx(3 * 1800.0)
    assert all(s.staleness == 0 for s in res.steps)
    assert res.throughput == pytest.approx(6 / 5.4)


def test_bound_one_overlaps_rollout_with_reward_and_training():
    res = simulate(two_trajectories, RolloutPlan(steps=3, group_size=2), timeline(bound=1), profile=FLAT)
    # rollout 1 needs no new weights: it starts when rollout 0 ends; rollout 2 needs step 0's
    # weights (synced at 1,800) and the engines (free at 2,000). The reward worker is busy
    # until 1,400 with step 0, and the trainer until 1,800
    assert [s.rollout_start_ms for s in res.steps] == pytest.approx([0.0, 1000.0, 2000.0])
    assert [s.synced_ms for s in res.steps] == pytest.approx([1800.0, 2800.0, 3800.0])
    assert [s.version for s in res.steps] == [0, 0, 1]
    assert max(s.staleness for s in res.steps) == 1


def test_throughput_never_drops_with_a_larger_bound_and_staleness_stays_within_it():
    wl = preset_steps("coding", 4, seed=5)
    rollouts = simulate_rollouts(
        wl, RolloutPlan(steps=8, group_size=4), workers=2, profile=EngineProfile(max_batch=8)
    )
    tokens = sum(r.trained_tokens for r in rollouts) / len(rollouts)
    mean = sum(r.duration_ms for r in rollouts) / len(rollouts)
    reward = RewardStage("dedicated", 2, fixed_ms(1000.0))
    last = 0.0
    for bound in range(5):
        res = run_timeline(rollouts, Timeline(bound, reward, 0.8 * mean / tokens, 5000.0), workers=2)
        assert res.throughput >= last - 1e-12
        assert max(s.staleness for s in res.steps) <= bound
        last = res.throughput
    assert last > run_timeline(rollouts, Timeline(0, reward, 0.8 * mean / tokens, 5000.0)).throughput


def test_trainer_time_is_proportional_to_trained_tokens():
    res = simulate(two_trajectories, RolloutPlan(steps=1, group_size=2), timeline(), profile=FLAT)
    s = res.steps[0]
    assert res.rollouts[0].trained_tokens == 150
    assert s.train_end_ms - s.train_start_ms == pytest.approx(2.0 * 150)


def test_abort_frees_the_slot_for_another_group():
    two_slots = EngineProfile(batch_sizes=(1, 2), step_ms_table=(10.0, 10.0), max_batch=2, prefill_ratio=0.0)
    trajs = [
        TrajSpec("a", 0, (Turn(10),), group=0),
        TrajSpec("b", 0, (Turn(100),), group=0),
        TrajSpec("c", 0, (Turn(30),), group=1),
        TrajSpec("e", 0, (Turn(30),), group=2),
    ]
    kept = Simulator(trajs, profile=two_slots, keep_per_group=1).run()
    # a ends at 100 and b is aborted then: c and e take both slots and end at 400
    assert kept.finish_ms == pytest.approx({"a": 100.0, "c": 400.0, "e": 400.0})
    assert kept.meta["aborted"] == ["b"] and kept.makespan_ms == pytest.approx(400.0)
    # without the abort e waits for c's slot (400) and b runs to 1,000
    plain = Simulator(trajs, profile=two_slots).run()
    assert plain.finish_ms["e"] == pytest.approx(700.0) and plain.makespan_ms == pytest.approx(1000.0)
    assert "aborted" not in plain.meta


def test_redundancy_keeps_exactly_g_per_group_and_never_slows_the_step():
    wl = preset_steps("coding", 3, seed=2)
    base = simulate_rollouts(wl, RolloutPlan(steps=3, group_size=4), profile=FLAT)
    extra = simulate_rollouts(wl, RolloutPlan(steps=3, group_size=4, redundancy=2), profile=FLAT)
    for b, e in zip(base, extra, strict=True):
        groups = [t.split("t")[0] for t in e.finish_ms]  # "s{step}g{g}"
        assert sorted(groups.count(g) for g in set(groups)) == [4, 4, 4]
        assert e.launched == 18 and e.aborted == 6
        # FLAT with spare slots: the 4th finisher of 6 is never later than the 4th of the first 4
        assert e.duration_ms <= b.duration_ms
    assert sum(e.duration_ms for e in extra) < sum(b.duration_ms for b in base)


def test_raas_starts_rewards_as_trajectories_finish():
    def run(stage: RewardStage):
        return simulate(
            two_trajectories, RolloutPlan(steps=1, group_size=2), Timeline(0, stage), profile=FLAT
        )

    ded = run(RewardStage("dedicated", 1, fixed_ms(400.0)))
    raas = run(RewardStage("raas", 1, fixed_ms(400.0)))
    # dedicated: both at 1,000 -> 1,800, one GPU held 1,800 ms for 800 ms of work
    assert ded.steps[0].reward_end_ms == pytest.approx(1800.0)
    assert ded.reward_utilisation == pytest.approx(800.0 / 1800.0)
    # RaaS: 500 -> 900 (released, no keep-alive), a new instance 1,000 -> 1,400
    assert raas.steps[0].rollout_reward_ms == pytest.approx(1400.0)
    assert raas.reward_utilisation == pytest.approx(1.0)
    assert raas.reward_utilisation > ded.reward_utilisation


def test_raas_cold_start_and_keep_alive_count_as_held_time():
    pool = RewardPool(RewardStage("raas", 4, cold_start_ms=100.0, keep_alive_ms=1000.0))
    # the first starts cold (600 -> 1,000); the second reuses the warm instance
    assert pool.serve([(500.0, 400.0), (1000.0, 400.0)]) == pytest.approx(1400.0)
    assert pool.held_ms(0.0) == pytest.approx(1400.0 + 1000.0 - 500.0)
    assert pool.utilisation(0.0) == pytest.approx(800.0 / 1900.0)
    full = RewardPool(RewardStage("raas", 1))  # one instance at most: the second queues
    assert full.serve([(0.0, 300.0), (100.0, 300.0)]) == pytest.approx(600.0)


def test_failed_attempts_come_first_and_are_counted():
    spec = TrajSpec("t", 10, (Turn(100, 50.0), Turn(100, 50.0), Turn(100)))
    out, failures, lost = with_failures(spec, random.Random(3), 0.9, 700.0)
    assert failures >= 1 and out.turns[-3:] == spec.turns
    assert out.total_tokens == spec.total_tokens + lost
    assert sum(1 for t in out.turns if t.tool_ms == 700.0 and t.outcome == "tool_error") == failures
    assert with_failures(spec, random.Random(3), 0.0, 700.0) == (spec, 0, 0)


def test_failures_only_add_time():
    wl = preset_steps("search", 4, seed=1)
    clean = simulate_rollouts(wl, RolloutPlan(steps=3, group_size=4), profile=FLAT)
    faulty = simulate_rollouts(
        wl, RolloutPlan(steps=3, group_size=4, failure_prob=0.3, restart_ms=2000.0), profile=FLAT
    )
    assert all(c.failures == 0 and c.lost_tokens == 0 for c in clean)
    assert sum(f.failures for f in faulty) > 0 and sum(f.lost_tokens for f in faulty) > 0
    assert all(f.duration_ms >= c.duration_ms for c, f in zip(clean, faulty, strict=True))
    assert sum(f.duration_ms for f in faulty) > sum(c.duration_ms for c in clean)
    # trained tokens are the real trajectories', not the failed attempts'
    assert [c.trained_tokens for c in clean] == [f.trained_tokens for f in faulty]


def test_the_same_seed_gives_the_same_run():
    plan = RolloutPlan(steps=2, group_size=4, redundancy=1, failure_prob=0.2, seed=7)
    tl = Timeline(1, RewardStage("raas", 2, fixed_ms(300.0), 50.0, 500.0), 0.01, 100.0)
    runs = [simulate(preset_steps("coding", 2, seed=3), plan, tl, workers=2) for _ in range(2)]
    assert runs[0].steps == runs[1].steps and runs[0].reward_utilisation == runs[1].reward_utilisation


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="bound must be >= 0"):
        Timeline(bound=-1)
    with pytest.raises(ValueError, match="redundancy must be >= 0"):
        RolloutPlan(redundancy=-1)
    for p in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"failure_prob must be in \[0, 1\)"):
            RolloutPlan(failure_prob=p)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        RolloutPlan(steps=0)
    with pytest.raises(ValueError, match="reward mode must be"):
        RewardStage("shared")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reward workers must be at least 1"):
        RewardStage(workers=0)
    with pytest.raises(ValueError, match="every group needs 3 trajectories"):
        simulate_rollouts(two_trajectories, RolloutPlan(group_size=2, redundancy=1))
    t = [TrajSpec("t", 0, (Turn(1),))]
    with pytest.raises(ValueError, match="keep_per_group must be at least 1"):
        Simulator(t, keep_per_group=0)
    with pytest.raises(ValueError, match="needs mode='trajectory'"):
        Simulator(t, mode="batch", keep_per_group=1)


_: StepWorkload = two_trajectories  # the hand-made workload has the pipeline's signature
