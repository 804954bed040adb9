"""Progressive length prediction: a trajectory's total length, re-estimated every turn.

An online ridge regression on ``log(total tokens)`` over what is known at turn ``k``: the
prompt length, the turn index, the tokens generated so far, and the tool outcomes so far
(counts of each outcome and the last one). It learns from finished trajectories: each of
their turns is one sample (the features then, the length in the end). The sufficient
statistics ``X'X`` and ``X'y`` are kept with a forgetting factor, so the model follows the
policy as its length distribution drifts, and a refit is one small linear solve.

The prediction is never below what the trajectory has already generated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from core.sched.base import Outcome

OUTCOMES: tuple[Outcome, ...] = ("ok", "tool_error", "test_failure", "timeout", "success")
_DIM = 5 + 2 * len(OUTCOMES)


def features(prompt_tokens: int, turn: int, tokens_so_far: int, outcomes: Sequence[Outcome]) -> np.ndarray:
    x = np.zeros(_DIM)
    x[0] = 1.0
    x[1] = math.log1p(prompt_tokens)
    x[2] = turn
    x[3] = math.log1p(tokens_so_far)
    x[4] = math.log1p(tokens_so_far / turn) if turn else 0.0  # tokens per turn so far
    for o in outcomes:
        x[5 + OUTCOMES.index(o)] += 1.0
    if outcomes:
        x[5 + len(OUTCOMES) + OUTCOMES.index(outcomes[-1])] = 1.0
    return x


class LengthPredictor:
    def __init__(self, ridge: float = 1.0, forget: float = 0.9999, refit_every: int = 32) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        # ridge 0 made the first refit a singular solve (numpy's "Singular matrix", mid-run)
        if not (math.isfinite(ridge) and ridge > 0):
            raise ValueError(f"ridge must be a finite number > 0, got {ridge}")
        if refit_every < 1:
            raise ValueError(f"refit_every must be >= 1, got {refit_every}")
        self.ridge = ridge
        self.forget = forget
        self.refit_every = refit_every
        self._xtx = np.zeros((_DIM, _DIM))
        self._xty = np.zeros(_DIM)
        self._w: np.ndarray | None = None
        self._pending = 0
        self.trajectories_seen = 0

    def observe(self, prompt_tokens: int, turns: Sequence[tuple[int, Outcome]]) -> None:
        """A finished trajectory: its turns as ``(generated tokens, outcome)``."""
        total = sum(n for n, _ in turns)
        y = math.log1p(total)
        so_far = 0
        outcomes: list[Outcome] = []
        for k, (n, outcome) in enumerate(turns):
            x = features(prompt_tokens, k, so_far, outcomes)
            self._xtx = self.forget * self._xtx + np.outer(x, x)
            self._xty = self.forget * self._xty + y * x
            so_far += n
            outcomes.append(outcome)
        self.trajectories_seen += 1
        self._pending += 1
        if self._w is None or self._pending >= self.refit_every:
            self.refit()

    def refit(self) -> None:
        a = self._xtx + self.ridge * np.eye(_DIM)
        self._w = np.linalg.solve(a, self._xty)
        self._pending = 0

    def predict(
        self, prompt_tokens: int, turn: int, tokens_so_far: int, outcomes: Sequence[Outcome]
    ) -> float | None:
        """The predicted total tokens; ``None`` before anything was observed."""
        if self._w is None:
            return None
        log_total = float(features(prompt_tokens, turn, tokens_so_far, outcomes) @ self._w)
        return max(math.expm1(min(log_total, 30.0)), tokens_so_far + 1.0)


def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    return float(np.corrcoef(np.asarray(a, float), np.asarray(b, float))[0, 1])


def top_recall(pred: Sequence[float], true: Sequence[float], share: float = 0.1) -> float:
    """Of the truly longest ``share``, the fraction the prediction also ranks in its top ``share``."""
    k = max(1, int(len(true) * share))
    top_true = set(np.argsort(np.asarray(true))[-k:])
    top_pred = set(np.argsort(np.asarray(pred))[-k:])
    return len(top_true & top_pred) / k
