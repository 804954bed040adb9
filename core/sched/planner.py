"""Periodic global planner over an elastic GPU pool (Libra).

Why: a disaggregated RL job splits its GPUs between rollout and training, and with the two
stages overlapped (rollout of step s+1 runs while step s trains) a step takes as long as
the slower one. The right split moves during training: responses grow longer as the policy
learns to reason, decoding gets slower per token (the KV cache holds fewer sequences and
every decode step reads more of it) while training's cost per token stays flat, and the
longest trajectory sets a floor on the rollout that no extra GPU lowers. A split balanced
at step 0 drifts out of balance. Libra re-plans it every ``period_steps`` steps from what
it observed, and switches nodes without blocking: a node moving from training to rollout
finishes its training step and joins the running rollout (and the other way round), so no
stage waits for a global barrier.

The planner's model of a step, fitted on the last window of observations::

    rollout(g) = max(W_r / g, tail)        training(N - g) = W_t / (N - g)

``W_r`` and ``W_t`` are the GPU-seconds each stage was busy and ``tail`` the longest
trajectory's own decode time. Each is extrapolated along its linear trend to the middle of
the next period (lengths drift, so the window's mean lags behind), and the split
minimising ``max(rollout, training)`` is found by scanning every ``g``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Split:
    rollout_gpus: int
    train_gpus: int

    def __post_init__(self) -> None:
        if self.rollout_gpus < 1 or self.train_gpus < 1:
            raise ValueError(f"each role needs >= 1 GPU, got {self.rollout_gpus}/{self.train_gpus}")

    @property
    def total(self) -> int:
        return self.rollout_gpus + self.train_gpus


@dataclass(frozen=True)
class StepObservation:
    rollout_gpu_s: float
    """GPU-seconds the rollout GPUs spent decoding (busy time summed over them)."""
    train_gpu_s: float
    tail_s: float = 0.0
    """The longest trajectory's own decode time: more rollout GPUs cannot shorten it."""

    def __post_init__(self) -> None:
        # nan passed a "< 0" check, and the plan it fed came out 1 rollout GPU, silently
        if not all(0 <= x < math.inf for x in (self.rollout_gpu_s, self.train_gpu_s, self.tail_s)):
            raise ValueError(f"observed times must be finite and >= 0, got {self}")


def best_split(
    total_gpus: int,
    rollout_gpu_s: float,
    train_gpu_s: float,
    tail_s: float = 0.0,
    min_rollout: int = 1,
    min_train: int = 1,
) -> Split:
    """The split minimising ``max(rollout, training)``. The tail is a floor under every
    split, so it never moves the optimum, only widens it into a range of equally good
    splits; among them the one balancing the bulk work ``W_r / g`` against ``W_t / (N - g)``
    wins, which stays right when the next step's tail is shorter than predicted (the
    longest trajectory is the noisiest statistic of a step)."""
    if total_gpus < min_rollout + min_train:
        raise ValueError(
            f"{total_gpus} GPUs cannot give {min_rollout} to rollout and {min_train} to training"
        )
    if not all(0 <= x < math.inf for x in (rollout_gpu_s, train_gpu_s, tail_s)):
        raise ValueError(f"stage times must be finite and >= 0, got {rollout_gpu_s}, {train_gpu_s}, {tail_s}")
    g = np.arange(min_rollout, total_gpus - min_train + 1)
    roll = np.maximum(rollout_gpu_s / g, tail_s)
    train = train_gpu_s / (total_gpus - g)
    bulk = np.maximum(rollout_gpu_s / g, train)
    key = np.lexsort((bulk, np.maximum(roll, train)))
    r = int(g[key[0]])
    return Split(r, total_gpus - r)


class GlobalPlanner:
    """Re-splits ``total_gpus`` between rollout and training every ``period_steps`` steps."""

    def __init__(
        self,
        total_gpus: int,
        period_steps: int = 10,
        *,
        initial: Split | None = None,
        window: int | None = None,
        extrapolate: bool = True,
        min_rollout: int = 1,
        min_train: int = 1,
    ) -> None:
        if min_rollout < 1 or min_train < 1:
            raise ValueError("each role needs a minimum of >= 1 GPU")
        if total_gpus < min_rollout + min_train:
            raise ValueError(
                f"{total_gpus} GPUs cannot give {min_rollout} to rollout and {min_train} to training"
            )
        if period_steps < 1:
            raise ValueError(f"the planning period must be >= 1 step, got {period_steps}")
        if window is not None and window < 1:
            raise ValueError(f"the observation window must be >= 1 step, got {window}")
        half = max(min_rollout, min(total_gpus // 2, total_gpus - min_train))
        self.split = initial or Split(half, total_gpus - half)
        if self.split.total != total_gpus:
            raise ValueError(f"the initial split uses {self.split.total} GPUs, not {total_gpus}")
        self.total_gpus = total_gpus
        self.period_steps = period_steps
        self.window = window or period_steps
        self.extrapolate = extrapolate
        self.min_rollout, self.min_train = min_rollout, min_train

    def due(self, step: int) -> bool:
        """Whether the split is re-planned before ``step`` (every period, never before step 0)."""
        return step > 0 and step % self.period_steps == 0

    def predict(self, observations: Sequence[StepObservation]) -> tuple[float, float, float]:
        """``(W_r, W_t, tail)`` expected over the next period from the last window."""
        obs = list(observations)[-self.window :]
        if not obs:
            raise ValueError("nothing observed yet")
        cols = np.array([[o.rollout_gpu_s, o.train_gpu_s, o.tail_s] for o in obs])
        if not self.extrapolate or len(obs) < 2:
            return tuple(float(x) for x in cols.mean(axis=0))  # type: ignore[return-value]
        x = np.arange(len(obs), dtype=float)
        ahead = len(obs) - 1 + (self.period_steps + 1) / 2
        slope, intercept = np.polyfit(x, cols, 1)
        w_r, w_t, tail = np.maximum(intercept + slope * ahead, 0.0)
        return float(w_r), float(w_t), float(tail)

    def plan(self, observations: Sequence[StepObservation]) -> Split:
        """The split for the next period (kept when nothing has been observed)."""
        if observations:
            w_r, w_t, tail = self.predict(observations)
            self.split = best_split(self.total_gpus, w_r, w_t, tail, self.min_rollout, self.min_train)
        return self.split


@dataclass(frozen=True)
class CostModel:
    """Step times from the generated lengths (defaults: a 7B model on H100s, roughly)."""

    decode_tok_s: float = 3000.0
    """One GPU's batched decode throughput on short contexts (tokens/s)."""
    kv_half_tokens: float = 8000.0
    """Mean response length at which the per-GPU decode throughput halves."""
    seq_tok_s: float = 120.0
    """A lone sequence's decode speed: the pace of the long tail."""
    train_tok_s: float = 3800.0
    """One GPU's training throughput (forward and backward, tokens/s)."""

    def observe(self, lengths: Sequence[float] | np.ndarray) -> StepObservation:
        ls = np.asarray(lengths, dtype=float)
        if not np.all(np.isfinite(ls) & (ls >= 0)):
            raise ValueError("response lengths must be finite and >= 0")
        if ls.size == 0:
            return StepObservation(0.0, 0.0, 0.0)
        tokens = float(ls.sum())
        rate = self.decode_tok_s / (1.0 + float(ls.mean()) / self.kv_half_tokens)
        return StepObservation(tokens / rate, tokens / self.train_tok_s, float(ls.max()) / self.seq_tok_s)


def _finish(start: float, work: float, base: int, extra: int, join: float) -> float:
    """When ``work`` GPU-seconds started at ``start`` on ``base`` GPUs end, with ``extra``
    more GPUs joining at ``join`` (work is data-parallel: it spreads over whoever is there)."""
    if work <= 0:
        return start
    if extra <= 0 or join <= start:
        return start + work / (base + extra)
    done = base * (join - start)
    if done >= work:
        return start + work / base
    return join + (work - done) / (base + extra)


def run_pipeline(
    steps: Sequence[Sequence[float] | np.ndarray],
    policy: GlobalPlanner | Split,
    cost: CostModel | None = None,
    *,
    switch_s: float = 0.0,
    blocking: bool = False,
) -> dict[str, float]:
    """Run RL steps (each a list of response lengths) on one pool, one-step off-policy:
    rollout of step s needs the weights of step s - 2 and overlaps training of step s - 1.

    With a ``GlobalPlanner`` the split is re-planned when it is due, from the steps seen so
    far. GPUs changing role pay ``switch_s`` (weights reload) and join when their current
    stage ends; with ``blocking`` the stage they join waits for them instead of starting
    without them. Returns the makespan, GPU-hours, mean step time, the final rollout GPUs
    and how many GPU moves were made.
    """
    cost = cost or CostModel()
    planner = policy if isinstance(policy, GlobalPlanner) else None
    split: Split = policy.split if isinstance(policy, GlobalPlanner) else policy
    total = split.total
    seen: list[StepObservation] = []
    roll_end = train_end = train_end_2 = 0.0  # step s-1's rollout and training, step s-2's training
    train_start, train_work = 0.0, 0.0  # step s-1's training: when it started, its GPU-seconds
    moves = 0
    for s, lengths in enumerate(steps):
        old = split
        if planner is not None and planner.due(s):
            split = planner.plan(seen)
        moves += abs(split.rollout_gpus - old.rollout_gpus)
        obs = cost.observe(lengths)
        seen.append(obs)
        # GPUs joining rollout s come from training step s-1 (they finish it first); those
        # leaving the rollout finished rollout s-1 and join training s-1, which starts as
        # rollout s does (they sat out a whole step waiting for training s, an asymmetry
        # that made a move towards training look dearer than one the other way)
        to_roll = max(split.rollout_gpus - old.rollout_gpus, 0)
        to_train = max(old.rollout_gpus - split.rollout_gpus, 0)
        if to_train:
            t_join = roll_end + switch_s
            if blocking:
                train_start = max(train_start, t_join)
            train_end = _finish(train_start, train_work, old.train_gpus, to_train, t_join)
        r_start = max(roll_end, train_end_2)
        r_join = train_end + switch_s
        if blocking and to_roll:
            r_start = max(r_start, r_join)
        r_end = _finish(r_start, obs.rollout_gpu_s, split.rollout_gpus - to_roll, to_roll, r_join)
        r_end = max(r_end, r_start + obs.tail_s)
        t_start = max(r_end, train_end)
        t_end = _finish(t_start, obs.train_gpu_s, split.train_gpus, 0, t_start)
        roll_end, train_end_2, train_end = r_end, train_end, t_end
        train_start, train_work = t_start, obs.train_gpu_s
    makespan = train_end
    return {
        "makespan_s": makespan,
        "gpu_hours": total * makespan / 3600.0,
        "mean_step_s": makespan / len(steps) if steps else 0.0,
        "final_rollout_gpus": float(split.rollout_gpus),
        "gpu_moves": float(moves),
    }
