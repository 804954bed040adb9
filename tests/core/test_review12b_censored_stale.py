"""A censored trajectory (``LengthPredictor.observe_censored``) never pulls a prediction
down: its targets are imputed above the model's prediction. The model they were imputed
with was the one of the last refit, up to ``refit_every - 1`` trajectories old: after a run
of longer finished trajectories not yet refit, a censored one's targets sat near the old,
shorter prediction, below what the statistics already held, and dragged the next refit's
prediction down (found by review)."""

from __future__ import annotations

import copy

from core.sched.predictor import LengthPredictor


def _turns(per_turn: int, n: int) -> list[tuple[int, str]]:
    return [(per_turn, "ok")] * n


def test_a_censored_trajectory_never_lowers_the_prediction_against_the_statistics_not_yet_refit() -> None:
    p = LengthPredictor(refit_every=32)
    for _ in range(3):  # the first refit: trajectories of ~400 tokens
        p.observe(100, _turns(100, 4))
    p.refit()
    for _ in range(20):  # the policy drifted: ~40000 tokens, learnt but not yet refit
        p.observe(100, _turns(10_000, 4))
    without = copy.deepcopy(p)
    # cut off early (a container lost in its first turn): a lower bound that says little
    p.observe_censored(100, _turns(500, 1))
    p.refit()
    without.refit()
    for turn, so_far in ((0, 0), (1, 10_000), (1, 500)):
        args = (100, turn, so_far, ["ok"] * turn)
        got, before = p.predict(*args), without.predict(*args)
        assert got is not None and before is not None
        assert got >= before * 0.999, (turn, got, before)
