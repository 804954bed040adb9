"""Cyclic-horizon placement (PlexRL): pack periodic RL jobs onto shared GPU nodes.

Why: an RL job repeats the same phases every step (rollout on R nodes, its long tail on a
few, training on T nodes) with durations that change slowly. On nodes of its own a job
holds its peak node count for the whole period while the phases that need fewer nodes
leave the rest idle; the gaps come from the job's shape (asymmetric phase sizes, long
tails), so no job-local trick removes them. Across jobs they are anti-correlated: one
job's training fits into another's tail. PlexRL fills them by time-slicing resident models
across jobs; this module is the placement half of that, at phase granularity.

Because every job repeats with its period, a placement feasible over one hyper-period (a
common multiple of the periods, ``H`` slots) is feasible forever: each node's future is a
ring of ``H`` slots. Per node a segment tree over the ring (range add, range max, lazy
tags) answers "does this phase fit here at this offset" with one O(log H) max query per
repetition; an arc that wraps past ``H`` is split in two. Beside it, the node's interval
set (which job holds which ``[start, end)``) lets a job be removed exactly.

``pack`` places jobs largest first (node-slots per hyper-period). For each job every phase
offset in ``[0, period)`` is tried; each phase takes nodes already in use (busiest first:
best fit) before empty ones, and the offset opening the fewest new nodes wins (ties: the
earliest). A phase runs on the same nodes every period (models stay resident: PlexRL's
affinity constraint), so a placement is one offset plus one node set per phase. Switching
a node between jobs is free here (resident models, time-sliced); pad phases to charge it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from core.sched.segtree import SegmentTree, arcs


class Interval(NamedTuple):
    """A job's hold on a node: slots ``[start, end)`` (``end`` may pass the horizon: it wraps)."""

    job: str
    start: int
    end: int
    amount: int


class Ring:
    """Each node's occupancy over the hyper-period: ``capacity`` units per node per slot."""

    def __init__(self, horizon_slots: int, nodes: int | Sequence[str], capacity: int = 1) -> None:
        if horizon_slots < 1:
            raise ValueError(f"the horizon must be >= 1 slot, got {horizon_slots}")
        if capacity < 1:
            raise ValueError(f"a node's capacity must be >= 1, got {capacity}")
        names = [f"node{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        if not names:
            raise ValueError("a ring needs at least one node")
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        self.horizon = horizon_slots
        self.capacity = capacity
        self.nodes: tuple[str, ...] = tuple(names)
        self._trees = {n: SegmentTree(horizon_slots) for n in names}
        self._held: dict[str, list[Interval]] = {n: [] for n in names}
        self._load = dict.fromkeys(names, 0)
        self._jobs: dict[str, set[str]] = {}

    def _tree(self, node: str) -> SegmentTree:
        if node not in self._trees:
            raise ValueError(f"unknown node {node!r}")
        return self._trees[node]

    def peak(self, node: str, start: int, length: int) -> int:
        """The highest occupancy of ``node`` over the ring interval (0 for an empty one)."""
        tree = self._tree(node)
        return max((tree.max(lo, hi) for lo, hi in arcs(start, length, self.horizon)), default=0)

    def fits(self, node: str, start: int, length: int, amount: int = 1) -> bool:
        """Whether ``amount`` more units fit on ``node`` over the whole interval."""
        if amount < 1:
            raise ValueError(f"an amount must be >= 1, got {amount}")
        return self.peak(node, start, length) + amount <= self.capacity

    def add(self, node: str, start: int, length: int, job: str, amount: int = 1) -> None:
        """Give ``job`` ``amount`` units of ``node`` over the interval (which must fit; an
        empty one is checked and then holds nothing)."""
        if not self.fits(node, start, length, amount):
            raise ValueError(
                f"{job!r} does not fit on {node!r} at [{start}, {start + length}): "
                f"peak {self.peak(node, start, length)} + {amount} > capacity {self.capacity}"
            )
        if length == 0:
            return
        for lo, hi in arcs(start, length, self.horizon):
            self._trees[node].add(lo, hi, amount)
        s = start % self.horizon
        self._held[node].append(Interval(job, s, s + length, amount))
        self._load[node] += amount * length
        self._jobs.setdefault(job, set()).add(node)

    def remove(self, job: str) -> int:
        """Release everything ``job`` holds; returns how many intervals were released."""
        if job not in self._jobs:
            raise ValueError(f"job {job!r} holds nothing on this ring")
        released = 0
        for node in self._jobs.pop(job):
            keep = []
            for iv in self._held[node]:
                if iv.job != job:
                    keep.append(iv)
                    continue
                for lo, hi in arcs(iv.start, iv.end - iv.start, self.horizon):
                    self._trees[node].add(lo, hi, -iv.amount)
                self._load[node] -= iv.amount * (iv.end - iv.start)
                released += 1
            self._held[node] = keep
        return released

    def intervals(self, node: str) -> list[Interval]:
        self._tree(node)
        return sorted(self._held[node], key=lambda iv: (iv.start, iv.job))

    def load(self, node: str) -> int:
        """Busy unit-slots of ``node`` over the horizon."""
        self._tree(node)
        return self._load[node]

    def used_nodes(self) -> list[str]:
        return [n for n in self.nodes if self._held[n]]

    @property
    def jobs(self) -> list[str]:
        return sorted(self._jobs)


@dataclass(frozen=True)
class Phase:
    """``slots`` consecutive slots on ``nodes`` nodes, ``amount`` units of each. Phases of
    one ``service`` (default: the phase's name) run where its first phase was placed: a
    rollout's long tail is the stragglers left on the rollout engines."""

    name: str
    slots: int
    nodes: int
    amount: int = 1
    service: str = ""

    def __post_init__(self) -> None:
        if self.slots < 1 or self.nodes < 1 or self.amount < 1:
            raise ValueError(f"phase {self.name!r}: slots, nodes and amount must be >= 1")
        if not self.service:
            object.__setattr__(self, "service", self.name)


@dataclass(frozen=True)
class Job:
    """A periodic job: its phases run back to back, and the sequence repeats every period.
    ``colocate``: its services may share nodes (verl-style colocation); when False, each
    service keeps nodes of its own (disaggregated rollout engines and trainer)."""

    name: str
    phases: tuple[Phase, ...]
    colocate: bool = True

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError(f"job {self.name!r} has no phases")
        first: dict[str, int] = {}
        for p in self.phases:
            if p.nodes > first.setdefault(p.service, p.nodes):
                raise ValueError(
                    f"job {self.name!r}: phase {p.name!r} needs {p.nodes} nodes, more than the "
                    f"{first[p.service]} its service {p.service!r} was placed on"
                )

    @classmethod
    def rl(
        cls,
        name: str,
        rollout_slots: int,
        rollout_nodes: int,
        train_slots: int,
        train_nodes: int,
        tail_slots: int = 0,
        tail_nodes: int = 1,
        colocate: bool = True,
    ) -> Job:
        """An RL step: rollout, then its long tail on some of the rollout nodes, then training."""
        phases = [Phase("rollout", rollout_slots, rollout_nodes)]
        if tail_slots:
            phases.append(Phase("tail", tail_slots, tail_nodes, service="rollout"))
        phases.append(Phase("train", train_slots, train_nodes))
        return cls(name, tuple(phases), colocate)

    @property
    def period(self) -> int:
        return sum(p.slots for p in self.phases)

    @property
    def peak_nodes(self) -> int:
        return max(p.nodes for p in self.phases)

    @property
    def node_slots(self) -> int:
        """Busy node-slots per period."""
        return sum(p.slots * p.nodes for p in self.phases)


@dataclass(frozen=True)
class JobPlacement:
    job: str
    offset: int
    nodes: tuple[tuple[str, ...], ...]
    """The nodes of each phase, in the job's phase order."""


@dataclass
class Packing:
    ring: Ring
    placements: dict[str, JobPlacement] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)

    @property
    def nodes_used(self) -> int:
        return len(self.ring.used_nodes())

    @property
    def utilisation(self) -> float:
        """Busy share of the used nodes' capacity over the horizon."""
        used = self.ring.used_nodes()
        if not used:
            return 0.0
        busy = sum(self.ring.load(n) for n in used)
        return busy / (len(used) * self.ring.horizon * self.ring.capacity)


def _try(ring: Ring, job: Job, offset: int, order: list[str]) -> tuple[tuple[str, ...], ...] | None:
    """Put ``job`` on ``ring`` at ``offset`` (nodes tried in ``order``); None if it cannot."""
    reps = ring.horizon // job.period
    chosen: list[tuple[str, ...]] = []
    held: dict[str, list[str]] = {}
    start = offset
    for phase in job.phases:
        starts = [start + k * job.period for k in range(reps)]
        if phase.service in held:
            candidates = held[phase.service]
        else:
            taken = set() if job.colocate else {n for ns in held.values() for n in ns}
            candidates = [n for n in order if n not in taken]
        picks: list[str] = []
        for node in candidates:
            if len(picks) == phase.nodes:
                break
            if all(ring.fits(node, s, phase.slots, phase.amount) for s in starts):
                picks.append(node)
        if len(picks) < phase.nodes:
            if chosen:
                ring.remove(job.name)
            return None
        _hold(ring, job, phase, start, picks)
        held.setdefault(phase.service, picks)
        chosen.append(tuple(picks))
        start += phase.slots
    return tuple(chosen)


def _hold(ring: Ring, job: Job, phase: Phase, start: int, nodes: Iterable[str]) -> None:
    """Give ``job``'s ``phase`` (first run at ``start``) its nodes in every period of the ring."""
    for node in nodes:
        for k in range(ring.horizon // job.period):
            ring.add(node, start + k * job.period, phase.slots, job.name, phase.amount)


def place(ring: Ring, job: Job) -> JobPlacement | None:
    """Place ``job`` at the offset that opens the fewest unused nodes; None if none fits."""
    if ring.horizon % job.period:
        raise ValueError(f"job {job.name!r}: period {job.period} does not divide the horizon {ring.horizon}")
    if job.name in ring.jobs:
        raise ValueError(f"job {job.name!r} is already on the ring")
    used = sorted(ring.used_nodes(), key=lambda n: -ring.load(n))
    # empty nodes are interchangeable: the job never needs more than its phases' total
    in_use = set(used)
    empty = [n for n in ring.nodes if n not in in_use]
    order = used + empty[: sum(p.nodes for p in job.phases)]
    best: tuple[int, int, tuple[tuple[str, ...], ...]] | None = None
    for offset in range(job.period):
        nodes = _try(ring, job, offset, order)
        if nodes is None:
            continue
        ring.remove(job.name)
        opened = len({n for phase in nodes for n in phase} - in_use)
        if best is None or opened < best[0]:
            best = (opened, offset, nodes)
            if opened == 0:
                break
    if best is None:
        return None
    _, offset, nodes = best
    start = offset
    for phase, picks in zip(job.phases, nodes, strict=True):
        _hold(ring, job, phase, start, picks)
        start += phase.slots
    return JobPlacement(job.name, offset, nodes)


def pack(
    jobs: Iterable[Job], nodes: int | Sequence[str], capacity: int = 1, horizon: int | None = None
) -> Packing:
    """Place ``jobs`` on one shared pool, largest first. ``horizon`` defaults to the least
    common multiple of the periods; jobs that fit nowhere are listed in ``unplaced``."""
    jobs = list(jobs)
    if len({j.name for j in jobs}) != len(jobs):
        raise ValueError("job names must be unique")
    if horizon is None:
        horizon = math.lcm(*(j.period for j in jobs)) if jobs else 1
    ring = Ring(horizon, nodes, capacity)
    packing = Packing(ring)
    reps = {j.name: horizon // j.period for j in jobs}
    for job in sorted(jobs, key=lambda j: (-j.node_slots * reps[j.name], -j.peak_nodes, j.name)):
        p = place(ring, job)
        if p is None:
            packing.unplaced.append(job.name)
        else:
            packing.placements[job.name] = p
    return packing


def dedicated_nodes(jobs: Iterable[Job], capacity: int = 1) -> int:
    """The baseline: every job alone on nodes of its own (laid out as its ``colocate`` says)."""
    total = 0
    for job in jobs:
        alone = pack([job], sum(p.nodes for p in job.phases), capacity)
        if alone.unplaced:
            raise ValueError(f"job {job.name!r} does not fit even on nodes of its own")
        total += alone.nodes_used
    return total
