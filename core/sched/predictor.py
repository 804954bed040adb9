"""Progressive length prediction: a trajectory's total length, re-estimated every turn.

An online ridge regression on ``log(total tokens)`` over what is known at turn ``k``: the
prompt length, the turn index, the tokens generated so far, and the tool outcomes so far
(counts of each outcome and the last one). It learns from finished trajectories: each of
their turns is one sample (the features then, the length in the end). The sufficient
statistics ``X'X`` and ``X'y`` are kept with a forgetting factor, so the model follows the
policy as its length distribution drifts, and a refit is one small linear solve.

A trajectory cut short (aborted: a redundant group's slowest members once the group is
complete, a timeout, a lost container) is a right-censored sample: its length is at least
what it reached. Learning only the finished ones learns a biased sample, since redundancy
aborts the slowest members of every group, so the lengths come out short.
``observe_censored`` takes such a trajectory in the same model (Buckley-James style): each
turn's target is the expected log length given that it is at least the reached one, under
the current model's prediction for that turn and a Gaussian residual whose spread is
tracked from the finished trajectories' one-step-ahead errors. A censored sample never
pulls a prediction down (its target is at least the model's own), and one cut short early
(a container lost at turn 2) adds next to nothing.

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
        # the finished samples' squared errors against the model of their time (forgotten
        # like the statistics): the residual spread censored samples are imputed with
        self._sq_err = 0.0
        self._n_err = 0.0
        self.trajectories_seen = 0
        """Finished trajectories learnt."""
        self.trajectories_censored = 0
        """Trajectories cut short, learnt as lower bounds (``observe_censored``)."""

    def observe(self, prompt_tokens: int, turns: Sequence[tuple[int, Outcome]]) -> None:
        """A finished trajectory: its turns as ``(generated tokens, outcome)``."""
        y = math.log1p(sum(n for n, _ in turns))
        for x in _samples(prompt_tokens, turns):
            if self._w is not None:
                self._sq_err = self.forget * self._sq_err + float(y - x @ self._w) ** 2
                self._n_err = self.forget * self._n_err + 1.0
            self._learn(x, y)
        self.trajectories_seen += 1
        self._learnt()

    def observe_censored(self, prompt_tokens: int, turns: Sequence[tuple[int, Outcome]]) -> None:
        """A trajectory cut short after ``turns``: its length is at least their tokens.
        Ignored before any finished trajectory was learnt (nothing to impute with: the
        reached length alone as the target would teach that trajectories end where cut)."""
        if self._w is None or not turns:
            return
        if self._pending:
            # imputed against the statistics as they are: the last refit's model may be up
            # to refit_every - 1 trajectories old, and a target near its (shorter, after a
            # drift) prediction pulled the next refit down
            self.refit()
        floor = math.log1p(sum(n for n, _ in turns))
        sigma = math.sqrt(self._sq_err / self._n_err) if self._n_err > 0 else 0.0
        for x in _samples(prompt_tokens, turns):
            self._learn(x, _mean_above(float(x @ self._w), sigma, floor))
        self.trajectories_censored += 1
        self._learnt()

    def _learn(self, x: np.ndarray, y: float) -> None:
        self._xtx = self.forget * self._xtx + np.outer(x, x)
        self._xty = self.forget * self._xty + y * x

    def _learnt(self) -> None:
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


def _samples(prompt_tokens: int, turns: Sequence[tuple[int, Outcome]]) -> list[np.ndarray]:
    """A trajectory's samples: the features at each of its turns."""
    out = []
    so_far = 0
    outcomes: list[Outcome] = []
    for k, (n, outcome) in enumerate(turns):
        out.append(features(prompt_tokens, k, so_far, outcomes))
        so_far += n
        outcomes.append(outcome)
    return out


def _mean_above(mu: float, sigma: float, floor: float) -> float:
    """``E[y | y >= floor]`` for ``y ~ N(mu, sigma^2)``: ``mu + sigma * phi(a) / (1 - Phi(a))``
    with ``a = (floor - mu) / sigma`` (the inverse Mills ratio); ``max(mu, floor)`` with no
    spread known."""
    if sigma <= 0:
        return max(mu, floor)
    a = (floor - mu) / sigma
    tail = 0.5 * math.erfc(a / math.sqrt(2))
    if a > 30 or tail <= 0:
        mills = a + 1 / a  # the ratio's asymptote, where the tail underflows
    else:
        mills = math.exp(-0.5 * a * a) / math.sqrt(2 * math.pi) / tail
    return max(mu + sigma * mills, floor)


def pearson(a: Sequence[float], b: Sequence[float]) -> float:
    return float(np.corrcoef(np.asarray(a, float), np.asarray(b, float))[0, 1])


def top_recall(pred: Sequence[float], true: Sequence[float], share: float = 0.1) -> float:
    """Of the truly longest ``share``, the fraction the prediction also ranks in its top ``share``."""
    k = max(1, int(len(true) * share))
    top_true = set(np.argsort(np.asarray(true))[-k:])
    top_pred = set(np.argsort(np.asarray(pred))[-k:])
    return len(top_true & top_pred) / k
