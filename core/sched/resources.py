"""Adaptive model parallelism (Heddle): how many GPUs each rollout worker gets.

A worker with model-parallel degree ``d`` holds ``d`` GPUs and decodes ``speedup[d]`` times
faster than one GPU (sub-linear: communication). Long trajectories want high-MP workers,
short ones low-MP ones. The search is simulated annealing over the list of degrees (a
multiset summing to at most the GPU budget), started from a sort-initialised guess, and
each candidate is scored by placing the predicted lengths on it (longest trajectories on
the fastest workers, ``presorted_dp``'s cost per worker). Seeded: the same inputs give the
same plan.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from core.sched.placement import speed_partition

#: Decode speed relative to one GPU, by model-parallel degree (a profile table; the
#: simulator and benchmarks pass measured ones).
DEFAULT_SPEEDUP: dict[int, float] = {1: 1.0, 2: 1.8, 4: 3.2, 8: 5.6}


def makespan(
    lengths: Sequence[float], degrees: Sequence[int], speedup: dict[int, float], a: float = 0.1
) -> float:
    """The step's makespan on workers of these degrees: the lengths sorted longest first go
    in contiguous groups to the workers sorted fastest first, and a group's batch time
    (``presorted_dp``'s cost) is divided by its worker's speed. The split is the one that
    minimises the makespan: bisection on it, each worker in turn taking the longest group it
    can finish in time (the fastest workers get the longest trajectories)."""
    if not degrees:
        return math.inf
    order = sorted(lengths, reverse=True)
    speeds = sorted((speedup[d] for d in degrees), reverse=True)
    return speed_partition(order, speeds, 1.0, a)[0]


def sort_initialised(lengths: Sequence[float], budget: int, speedup: dict[int, float]) -> list[int]:
    """The starting guess: one high-MP worker per very long trajectory (the top 10% of the
    lengths), MP=1 workers for the rest of the budget."""
    order = sorted(lengths, reverse=True)
    top = max(max(speedup), 1)
    long_ones = max(1, len(order) // 10)
    degrees: list[int] = []
    used = 0
    for _ in range(long_ones):
        if used + top > budget // 2:
            break
        degrees.append(top)
        used += top
    degrees += [1] * (budget - used)
    return degrees


def anneal(
    lengths: Sequence[float],
    budget: int,
    speedup: dict[int, float] | None = None,
    *,
    iterations: int = 2000,
    seed: int = 0,
    a: float = 0.1,
) -> tuple[list[int], float]:
    """``(degrees, makespan)``: per-worker MP degrees using at most ``budget`` GPUs."""
    speedup = dict(speedup or DEFAULT_SPEEDUP)
    if not _whole(budget) or budget < 1:
        raise ValueError(f"the GPU budget must be a whole number >= 1, got {budget!r}")
    if 1 not in speedup:
        raise ValueError("the speedup table needs MP=1")
    # a degree 0 worker holds no GPU (a split of 1 into 0 + 1 made workers for free), and a
    # speed <= 0 or nan made makespans negative or nan (the search on them never ended)
    if bad := {d: v for d, v in speedup.items() if not _whole(d) or d < 1 or not 0 < v < math.inf}:
        raise ValueError(f"speedup maps whole degrees >= 1 to finite speeds > 0; got {bad}")
    if not all(0 <= x < math.inf for x in lengths):
        raise ValueError("predicted lengths must be finite and >= 0")
    if not lengths:
        return [1] * budget, 0.0
    rng = random.Random(seed)
    current = sort_initialised(lengths, budget, speedup)
    cost = makespan(lengths, current, speedup, a)
    best, best_cost = list(current), cost
    temp = cost * 0.1
    degrees = sorted(speedup)
    for _ in range(iterations):
        cand = list(current)
        move = rng.random()
        if move < 0.5 and len(cand) >= 2:  # merge two workers into one of the combined degree
            i, j = rng.sample(range(len(cand)), 2)
            merged = cand[i] + cand[j]
            if merged not in speedup:
                continue
            cand = [d for k, d in enumerate(cand) if k not in (i, j)] + [merged]
        else:  # split a worker into two smaller ones
            splittable = [k for k, d in enumerate(cand) if d > 1]
            if not splittable:
                continue
            k = rng.choice(splittable)
            half = max(x for x in degrees if x < cand[k])
            rest = cand[k] - half
            if rest not in speedup:
                continue
            cand = [d for idx, d in enumerate(cand) if idx != k] + [half, rest]
        c = makespan(lengths, cand, speedup, a)
        if c < cost or rng.random() < math.exp((cost - c) / max(temp, 1e-12)):
            current, cost = cand, c
            if c < best_cost:
                best, best_cost = sorted(cand, reverse=True), c
        temp *= 0.997
    return best, best_cost


def _whole(x: object) -> bool:
    """An integer, not a bool."""
    return isinstance(x, int) and not isinstance(x, bool)
