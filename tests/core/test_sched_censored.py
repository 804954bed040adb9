"""The length predictor and trajectories cut short: with redundant rollouts the slowest
members of every group are aborted, and a predictor that learns only the finished ones
learns the fast ones. Aborted members are right-censored samples (at least as long as they
got)."""

from __future__ import annotations

import random

from core.rollout.scheduling import TurnScheduler
from core.sched.base import Outcome
from core.sched.predictor import LengthPredictor

Turns = list[tuple[int, Outcome]]


def _cut(turns: Turns, at: int) -> Turns:
    """The turns a member had finished when the group completed (``at`` tokens in)."""
    out: Turns = []
    reached = 0
    for n, outcome in turns:
        if reached + n > at:
            break
        reached += n
        out.append((n, outcome))
    return out


def test_aborted_slowest_members_move_the_estimate_toward_the_true_length():
    # groups of 4, the group complete when 2 have finished, the other 2 aborted then (every
    # member decodes at the same pace: an aborted one got as far as the second finisher).
    # Learnt on the finished pair alone, a new task's estimate came out ~40% short
    rng = random.Random(0)
    old, new, full = (LengthPredictor(refit_every=4) for _ in range(3))
    censored = 0
    for _ in range(300):
        group: list[Turns] = [
            [(rng.randint(50, 150), "ok") for _ in range(rng.randint(1, 12))] for _ in range(4)
        ]
        group.sort(key=lambda t: sum(n for n, _ in t))
        for member in group:
            full.observe(100, member)  # what every member would have run to
        for member in group[:2]:
            old.observe(100, member)
            new.observe(100, member)
        at = sum(n for n, _ in group[1])
        for member in group[2:]:
            reached = _cut(member, at)
            censored += bool(reached)  # (one cut in its first turn got nothing to learn)
            new.observe_censored(100, reached)
    truth, before, after = (p.predict(100, 0, 0, []) for p in (full, old, new))
    assert truth is not None and before is not None and after is not None
    assert before < 0.7 * truth  # the bias the finished members alone teach
    assert abs(after - truth) < abs(before - truth) / 3
    assert old.trajectories_seen == new.trajectories_seen == 600
    assert new.trajectories_censored == censored > 500 and old.trajectories_censored == 0


def test_a_trajectory_cut_short_early_does_not_teach_that_trajectories_are_short():
    # a container lost at turn 1: its reached length is far below the prediction, so it
    # says next to nothing (the old rule, not learning it at all, was right for it)
    p = LengthPredictor(refit_every=1)
    rng = random.Random(1)
    for _ in range(100):
        p.observe(100, [(rng.randint(80, 120), "ok") for _ in range(5)])
    before = p.predict(100, 0, 0, [])
    for _ in range(100):
        p.observe_censored(100, [(100, "ok")])
    after = p.predict(100, 0, 0, [])
    assert before is not None and after is not None
    assert after >= 0.98 * before


def test_a_censored_trajectory_before_any_finished_one_is_not_learnt():
    p = LengthPredictor(refit_every=1)
    p.observe_censored(100, [(10, "ok")])  # nothing to impute its length with
    p.observe_censored(100, [])
    assert p.predict(100, 0, 0, []) is None and p.trajectories_censored == 0


def test_the_scheduler_learns_an_aborted_trajectory_as_censored():
    sched = TurnScheduler("sjf", predictor=LengthPredictor(refit_every=1))
    sched.request("done", 0, 10, {})
    sched.finished_turn("done", 50)
    sched.release("done")
    before = sched.predictor.predict(10, 0, 0, [])
    sched.request("cut", 0, 10, {})
    sched.finished_turn("cut", 500)
    sched.release("cut", finished=False)  # what the proxy's release of an aborted one says
    assert sched.predictor.trajectories_seen == 1 and sched.predictor.trajectories_censored == 1
    assert sched.stats()["predictor_censored"] == 1
    after = sched.predictor.predict(10, 0, 0, [])
    assert before is not None and after is not None and after > before  # it raised the estimate
