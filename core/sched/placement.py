"""Placement policies: which engine worker a trajectory runs on.

* ``least_load``: longest predicted first, each onto the least-loaded worker (LPT).
* ``cache_affinity``: stay on the worker holding the trajectory's prefix cache unless it is
  much busier than the least-loaded one (what the LLM proxy does by default).
* ``presorted_dp`` (Heddle): sort by predicted length; trajectories batched together on
  a worker finish when their longest does, and every extra one slows the batch, so long
  ones are grouped with long ones: Heddle's presorting restricts the split into ``M``
  groups to *contiguous* runs of that order. The group cost is the batch's decode time
  under continuous batching with a linear interference factor ``a``::

      cost(i, j) = c * (L[i] + a * (L[i+1] + ... + L[j-1]))    (L sorted, longest first)

  and the split minimises the largest group cost (the step's makespan) among contiguous
  splits. That is a heuristic, not the optimum over all splits: at ``a = 1`` a group costs
  its sum, and the problem is multiway number partitioning (NP-hard); ``[10, 10, 9, 9]``
  into 2 costs 20 contiguously and 19 as ``[10, 9], [10, 9]`` (a test pins the gap).
  ``dp_partition`` is the textbook O(N^2 M) dynamic program over contiguous splits (the
  reference). ``fast_partition`` finds the same contiguous optimum in O(M log N
  log(1/eps)): the cost is monotone under interval containment, so "can it be done in M
  groups of cost <= T?" is answered by greedily taking the longest feasible group, and
  bisection finds the least T. Tests check they agree.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from core.sched.base import Placement, Request


def predicted_work(req: Request) -> float:
    """The work a trajectory brings; without a prediction every trajectory counts 1 (balance
    by count, not pile everything on the first worker as zero-length work would)."""
    p = req.predicted_remaining
    return max(p, 1.0) if p != float("inf") else 1.0


def worker_order(name: str) -> tuple[str | int, ...]:
    """The tie-break among equal workers: ``w2`` before ``w10`` (digit runs compared as
    numbers), so the sixteenth worker is not the third one picked."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def worker_speeds(
    workers: Mapping[str, float], speeds: Mapping[str, float] | None
) -> dict[str, float] | None:
    """``speeds`` checked against ``workers``; ``None`` when every worker is as fast (the
    placements then take their equal-worker path, whose results do not depend on speed)."""
    if speeds is None:
        return None
    if missing := sorted(set(workers) - set(speeds), key=worker_order):
        raise ValueError(f"no speed for workers {missing}")
    out = {w: float(speeds[w]) for w in workers}
    if bad := {w: v for w, v in out.items() if not 0 < v < math.inf}:
        raise ValueError(f"worker speeds must be finite and > 0, got {bad}")
    return None if len(set(out.values())) <= 1 else out


class LeastLoad(Placement):
    """Longest first onto the worker that would finish it first: the least loaded one when
    the workers are equal (LPT), ``(load + work) / speed`` when they are not."""

    name = "least_load"

    def place(
        self, reqs: list[Request], workers: dict[str, float], speeds: Mapping[str, float] | None = None
    ) -> dict[str, str]:
        if not workers:
            raise ValueError("no workers to place on")
        speed = worker_speeds(workers, speeds)
        order = sorted(reqs, key=lambda r: (-predicted_work(r), r.seq))
        out = {}
        if speed is None:
            heap = [(load, worker_order(name), name) for name, load in workers.items()]
            heapq.heapify(heap)
            for req in order:
                load, key, name = heapq.heappop(heap)
                out[req.trajectory] = name
                heapq.heappush(heap, (load + predicted_work(req), key, name))
            return out
        # O(M) per trajectory: the best worker depends on the trajectory's own work
        backlog = dict(workers)
        for req in order:
            work = predicted_work(req)
            w = min(backlog, key=lambda w: ((backlog[w] + work) / speed[w], -speed[w], worker_order(w)))
            out[req.trajectory] = w
            backlog[w] += work
        return out


class CacheAffinity(Placement):
    name = "cache_affinity"

    def __init__(self, slack: float = 0.25) -> None:
        # nan failed every comparison below, and inf made (1 + inf) * 0 nan with an idle
        # least-loaded worker: either sent every trajectory away from its cache, silently
        if not 0 <= slack < math.inf:
            raise ValueError(f"slack must be finite and >= 0, got {slack!r}")
        self.slack = slack

    def place(
        self, reqs: list[Request], workers: dict[str, float], speeds: Mapping[str, float] | None = None
    ) -> dict[str, str]:
        if not workers:
            raise ValueError("no workers to place on")
        speed = worker_speeds(workers, speeds) or dict.fromkeys(workers, 1.0)
        load = dict(workers)
        out = {}
        for req in sorted(reqs, key=lambda r: (-predicted_work(r), r.seq)):
            work = predicted_work(req)
            least = min(load, key=lambda w: ((load[w] + work) / speed[w], worker_order(w)))
            home = req.worker
            # in time, not tokens: the home's backlog against the least one's (with the slack)
            # plus this trajectory's work there, as with equal workers (tokens, as before); on
            # the home's side also how much longer (or shorter) the work takes there, 0 with
            # equal workers: left out, an idle home 100x slower kept a long trajectory
            busiest_ok = ((1 + self.slack) * load[least] + work) / speed[least]
            slower_by = work / speed[home] - work / speed[least] if home in load else 0.0
            target = home if home in load and load[home] / speed[home] + slower_by <= busiest_ok else least
            out[req.trajectory] = target
            load[target] += work
        return out


# ------------------------------------------------------------------ presorted DP


def group_cost(lengths: Sequence[float], i: int, j: int, c: float = 1.0, a: float = 0.1) -> float:
    """Decode time of lengths[i:j] (sorted, longest first) batched on one worker."""
    if j <= i:
        return 0.0
    return c * (lengths[i] + a * sum(lengths[i + 1 : j]))


def dp_partition(lengths: Sequence[float], m: int, c: float = 1.0, a: float = 0.1) -> tuple[float, list[int]]:
    """The O(N^2 M) dynamic program: ``(makespan, cuts)``; group k is ``lengths[cuts[k]:cuts[k+1]]``."""
    # here, not at the top: the LLM proxy's actor imports this module at every job's start
    # and never runs the reference (numpy's import was 0.1 s of CPU there)
    import numpy as np

    n = len(lengths)
    if n == 0:
        return 0.0, [0]
    m = min(m, n)
    L = np.asarray(lengths, dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(L)])
    i = np.arange(n)[:, None]
    j = np.arange(n + 1)[None, :]
    # cost[i, j] of the group i..j-1; inf where empty
    cost = c * (L[:, None] + a * (prefix[j] - prefix[np.minimum(i + 1, n)]))
    cost = np.where(j > i, cost, np.inf)
    best = np.full((m + 1, n + 1), np.inf)
    arg = np.zeros((m + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, m + 1):
        cand = np.maximum(best[k - 1, :n][:, None], cost)  # [i, j]
        arg[k] = np.argmin(cand, axis=0)
        best[k] = cand[arg[k], np.arange(n + 1)]
    k = int(np.argmin(best[1:, n])) + 1  # fewer groups may tie: take the fewest
    cuts = [n]
    j_ = n
    for kk in range(k, 0, -1):
        j_ = int(arg[kk, j_])
        cuts.append(j_)
    return float(best[k, n]), cuts[::-1]


def fast_partition(
    lengths: Sequence[float], m: int, c: float = 1.0, a: float = 0.1, rel_eps: float = 1e-9
) -> tuple[float, list[int]]:
    """The same optimum as ``dp_partition``, exactly up to ``rel_eps``, in microseconds."""
    return speed_partition(lengths, [1.0] * m, c, a, rel_eps)


def speed_partition(
    lengths: Sequence[float], speeds: Sequence[float], c: float = 1.0, a: float = 0.1, rel_eps: float = 1e-9
) -> tuple[float, list[int]]:
    """Contiguous groups of ``lengths`` (longest first) onto workers of these ``speeds``
    (fastest first): group ``k`` costs ``group_cost / speeds[k]``, and the split minimises
    the largest. ``(makespan, cuts)``; with equal speeds, ``fast_partition``."""
    # checked before anything is computed: a negative speed gave a negative makespan (and
    # anneal's search over such plans never ended), a zero one divided by zero, and a nan
    # anywhere came out a nan makespan
    if not (_finite_positive(c) and _finite_positive(a)):
        raise ValueError(f"c and the interference factor must be finite and > 0, got c={c}, a={a}")
    if not speeds:
        raise ValueError("no workers to place on")
    if not all(_finite_positive(s) for s in speeds):
        raise ValueError(f"worker speeds must be finite and > 0, got {list(speeds)}")
    if not all(0 <= x < math.inf for x in lengths):
        raise ValueError("lengths must be finite and >= 0")
    n = len(lengths)
    if n == 0:
        return 0.0, [0]
    prefix = list(itertools.accumulate(lengths, initial=0.0))
    # the rounding of the room arithmetic below: without it, a budget equal to a group's
    # exact cost can come out a hair short (one group too many, e.g. none fits on m = 1)
    tol = 1e-12 * (prefix[-1] + max(lengths))

    def greedy(t: float) -> list[int] | None:
        cuts, i = [0], 0
        for s in speeds:
            if i == n:
                break
            # largest j with c * (L[i] + a * (prefix[j] - prefix[i+1])) <= t * s
            room = (t * s / c - lengths[i]) / a
            if room < -tol:
                return None
            j = bisect.bisect_right(prefix, prefix[i + 1] + room + tol, lo=i + 1) - 1
            i = max(j, i + 1)
            cuts.append(i)
        return cuts if i == n else None

    lo = c * max(lengths) / speeds[0]  # a group holds at least one trajectory
    hi = group_cost(lengths, 0, n, c, a) / speeds[0]  # everything in one group
    if greedy(lo) is not None:
        hi = lo
    while hi - lo > rel_eps * hi:
        mid = (lo + hi) / 2
        if greedy(mid) is None:
            lo = mid
        else:
            hi = mid
    cuts = greedy(hi)
    assert cuts is not None
    costs = (group_cost(lengths, cuts[k], cuts[k + 1], c, a) / speeds[k] for k in range(len(cuts) - 1))
    return max(costs), cuts


def _finite_positive(x: float) -> bool:
    return 0 < x < math.inf


class PresortedDP(Placement):
    name = "presorted_dp"

    def __init__(self, c: float = 1.0, interference: float = 0.1) -> None:
        # here, not at the first placement (mid-run; c = 0 as a ZeroDivisionError)
        if not (_finite_positive(c) and _finite_positive(interference)):
            raise ValueError(f"c and interference must be finite and > 0, got {c!r}, {interference!r}")
        self.c = c
        self.a = interference
        self.last_makespan = 0.0

    def place(
        self, reqs: list[Request], workers: dict[str, float], speeds: Mapping[str, float] | None = None
    ) -> dict[str, str]:
        if not workers:
            raise ValueError("no workers to place on")
        speed = worker_speeds(workers, speeds)
        order = sorted(reqs, key=lambda r: (-predicted_work(r), r.seq))
        lengths = [predicted_work(r) for r in order]
        out: dict[str, str] = {}
        if speed is not None:
            # the longest group onto the fastest worker (Heddle's pairing of long
            # trajectories with high-MP workers); equal speeds: the least loaded first
            fast = sorted(workers, key=lambda w: (-speed[w], workers[w], worker_order(w)))
            self.last_makespan, cuts = speed_partition(lengths, [speed[w] for w in fast], self.c, self.a)
            for k in range(len(cuts) - 1):
                for req in order[cuts[k] : cuts[k + 1]]:
                    out[req.trajectory] = fast[k]
            return out
        self.last_makespan, cuts = fast_partition(lengths, len(workers), self.c, self.a)
        groups = [order[cuts[k] : cuts[k + 1]] for k in range(len(cuts) - 1)]
        # the costliest group onto the least-loaded worker
        costs = [group_cost(lengths, cuts[k], cuts[k + 1], self.c, self.a) for k in range(len(groups))]
        free = sorted(workers, key=lambda w: (workers[w], worker_order(w)))
        for g, w in zip(sorted(range(len(groups)), key=lambda k: -costs[k]), free, strict=False):
            for req in groups[g]:
                out[req.trajectory] = w
        return out

    def migrations(
        self,
        current: dict[str, str],
        reqs: list[Request],
        workers: dict[str, float],
        in_tool_call: set[str],
        speeds: Mapping[str, float] | None = None,
    ) -> dict[str, str]:
        """After predictions changed: re-partition the remaining trajectories and move only
        those waiting on a tool call (a move then costs nothing on the critical path: the
        prefix is re-read at the next turn anyway). ``trajectory -> new worker``."""
        # a worker that left is no home to keep: matched to a group by overlap, it would
        # receive that group's trajectories
        live = {t: w for t, w in current.items() if w in workers}
        target = self.place(reqs, workers, speeds)
        if worker_speeds(workers, speeds) is None:
            # equal workers: a group's label is arbitrary, so keep as many where they are;
            # with speeds the label is the pairing of a group with a worker's speed
            target = stable_relabel(target, live)
        return {t: w for t, w in target.items() if t in in_tool_call and current.get(t) not in (None, w)}


def stable_relabel(target: dict[str, str], current: dict[str, str]) -> dict[str, str]:
    """The same partition as ``target``, with its groups matched to workers so that as few
    trajectories as possible move from ``current``: a group's worker label is arbitrary
    (the costliest group onto the least-loaded worker), and a relabelled split is as good.
    Greedy matching by overlap, largest first, smaller groups first among equals (they have
    fewer homes to choose from); not an optimal assignment (that is O(M^3) per turn), but
    exact when each group mostly sits on one worker, the common case between turns.
    ``current`` must name only workers that are still there: its workers become labels."""
    groups: dict[str, list[str]] = {}
    for t, w in target.items():
        groups.setdefault(w, []).append(t)
    overlap = sorted(
        (
            (-sum(current.get(t) == home for t in members), len(members), g, home)
            for g, members in groups.items()
            for home in {current[t] for t in members if t in current}
        )
    )
    rename: dict[str, str] = {}
    taken: set[str] = set()
    for _, _, g, home in overlap:
        if g not in rename and home not in taken:
            rename[g] = home
            taken.add(home)
    for g in sorted(groups):
        if g not in rename:
            # its own label if no group took it, else one that is free (there are enough:
            # as many labels as groups, plus the homes matched)
            rename[g] = g if g not in taken else min(set(groups) - taken)
            taken.add(rename[g])
    return {t: rename[w] for t, w in target.items()}


PLACEMENTS: dict[str, type[Placement]] = {p.name: p for p in (LeastLoad, CacheAffinity, PresortedDP)}


def make_placement(name: str, **options: Any) -> Placement:
    try:
        cls = PLACEMENTS[name]
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; known: {', '.join(sorted(PLACEMENTS))}") from None
    return cls(**options)
