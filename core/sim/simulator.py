"""Discrete-event simulation of one rollout step.

Trajectories are placed on engine workers by a ``core.sched`` placement. ``least_load`` and
``presorted_dp`` place once, at the start (the worker keeps the prefix cache);
``cache_affinity`` re-decides at every later turn, as the real path's turn scheduler does,
against each worker's predicted remaining work: a trajectory that moves prefills its whole
context on its new worker (``SimResult.meta["migrations"]`` counts the moves). The real
path re-partitions ``presorted_dp`` at every turn too; here that would cost a partition of
every live trajectory per turn (tens of seconds for the benchmark's step), so the
simulator keeps its first split. Each worker orders its waiting turns with its own
``core.sched`` queue policy and runs up to ``max_batch`` of them with continuous batching
(``core.sim.engine``). After a turn's generation comes its tool or environment call, then
the next turn.

Two interaction modes:

* ``trajectory``: every trajectory goes on by itself (the fabric's env managers);
* ``batch``: the step moves turn by turn. Turn ``k``'s tool calls start when every turn-``k``
  generation is done, and turn ``k + 1`` starts when every tool call has returned (what
  batch-level frameworks do).

The result holds the makespan, each trajectory's finish time and the workers' utilisation.

Redundant rollouts (``keep_per_group``): a group launches more trajectories than it needs;
once ``keep_per_group`` of them have finished, the others are aborted and their engine slots
and prefix cache freed, as a real job cancels its requests (trajectory mode only).
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from core.sched import Request, make_placement, make_queue_policy
from core.sched.base import QueuePolicy
from core.sched.placement import predicted_work
from core.sched.predictor import LengthPredictor
from core.sim.engine import EngineProfile, Worker
from core.sim.workload import TrajSpec

Predictor = Callable[[TrajSpec, int], float | None]


def oracle(spec: TrajSpec, turn: int) -> float | None:
    """The true total length: the best any predictor can do."""
    return float(spec.total_tokens)


def no_prediction(spec: TrajSpec, turn: int) -> float | None:
    return None


def progressive(model: LengthPredictor) -> Predictor:
    """A trained ``LengthPredictor`` as the simulator's predictor: at turn ``k`` it sees the
    prompt and the first ``k`` turns (tokens and tool outcomes), nothing later."""

    def predict(spec: TrajSpec, turn: int) -> float | None:
        done = spec.turns[:turn]
        return model.predict(
            spec.prompt_tokens, turn, sum(t.gen_tokens for t in done), [t.outcome for t in done]
        )

    return predict


def _s(now_ms: float) -> float:
    """The simulator's clock (ms) as the queue policies read time: in seconds, as on the
    real path (C-MLFQ's ``aging_s``; a request's ``arrival``)."""
    return now_ms / 1000.0


@dataclass
class SimResult:
    makespan_ms: float
    finish_ms: dict[str, float]
    utilisation: float
    """Mean over workers of busy time / makespan."""
    events: int
    preemptions: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Live:
    spec: TrajSpec
    turn: int = 0
    tokens_so_far: int = 0
    history: int = 0


class Simulator:
    def __init__(
        self,
        trajectories: list[TrajSpec],
        *,
        workers: int = 1,
        profile: EngineProfile | None = None,
        speeds: list[float] | None = None,
        scheduler: str = "fcfs",
        placement: str = "least_load",
        mode: Literal["trajectory", "batch"] = "trajectory",
        predictor: Predictor = no_prediction,
        scheduler_options: dict[str, Any] | None = None,
        placement_options: dict[str, Any] | None = None,
        keep_per_group: int | None = None,
        starts_ms: dict[str, float] | None = None,
    ) -> None:
        if mode not in ("trajectory", "batch"):
            raise ValueError(f"mode must be 'trajectory' or 'batch', got {mode!r}")
        if keep_per_group is not None:
            if keep_per_group < 1:
                raise ValueError(f"keep_per_group must be at least 1, got {keep_per_group}")
            if mode != "trajectory":
                raise ValueError("keep_per_group (redundant rollouts) needs mode='trajectory'")
        if workers < 1:
            raise ValueError("need at least one worker")
        profile = profile or EngineProfile()
        speeds = speeds or [1.0] * workers
        if len(speeds) != workers:
            raise ValueError("one speed per worker")
        if not all(0 < v < math.inf for v in speeds):
            raise ValueError(f"worker speeds must be finite and > 0, got {speeds}")
        ids = [t.id for t in trajectories]
        if len(set(ids)) != len(ids):
            twins = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"trajectory ids must be unique; repeated: {', '.join(map(repr, twins))}")
        self.trajs = trajectories
        self.workers = {f"w{k}": Worker(f"w{k}", profile, speed=speeds[k]) for k in range(workers)}
        options = dict(scheduler_options or {})
        if scheduler == "cmlfq":
            # one store of C-MLFQ's levels for every worker's queue, as on the real path (the
            # proxy's TurnScheduler): a trajectory cache_affinity moves keeps its level
            # instead of starting again at 0 on its new worker
            options.setdefault("level_store", {})
        self.queues: dict[str, QueuePolicy] = {
            w: make_queue_policy(scheduler, **options) for w in self.workers
        }
        self.placement = make_placement(placement, **(placement_options or {}))
        self.mode = mode
        self.predictor = predictor
        self._events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self._live = {t.id: _Live(t) for t in trajectories}
        self._where: dict[str, str] = {}
        self._finish: dict[str, float] = {}
        self._held: dict[tuple[str, int], list[str]] = {}  # batch mode: barrier -> waiting trajectories
        # batch mode: how many trajectories have a turn k (the barrier's size), counted once
        self._reaching = [
            sum(1 for t in trajectories if len(t.turns) > k)
            for k in range(max((len(t.turns) for t in trajectories), default=0))
        ]
        self.preemptions = 0
        self.migrations = 0
        # cache_affinity re-decides at every turn (see the module's docstring), against each
        # worker's load: the predicted remaining work of the live trajectories placed there
        self._moves = self.placement.name == "cache_affinity"
        self._work: dict[str, float] = {}
        self._load = dict.fromkeys(self.workers, 0.0)
        self._ran = False
        self.keep = keep_per_group
        self._groups: dict[int, list[str]] = {}
        for t in trajectories:
            self._groups.setdefault(t.group, []).append(t.id)
        self._kept: dict[int, int] = {}
        self._aborted: set[str] = set()
        self.starts = dict(starts_ms or {})
        """When each trajectory's first turn is ready (a replayed trace); absent: at 0."""
        if not all(0 <= v < math.inf for v in self.starts.values()):
            raise ValueError("starts_ms must be finite and >= 0")
        if unknown := sorted(set(self.starts) - set(ids)):
            raise ValueError(f"starts_ms names trajectories not in the workload: {unknown[:5]}")

    # -- events
    def _at(self, t: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))

    def run(self) -> SimResult:
        # the workers, queues and trajectories hold the run's state: a second run would go
        # on from where the first ended (time, busy time and turns counted twice)
        if self._ran:
            raise RuntimeError("a Simulator runs once: make a new one for another run")
        self._ran = True
        reqs = [self._request(self._live[t.id], self.starts.get(t.id, 0.0)) for t in self.trajs]
        loads = {w: 0.0 for w in self.workers}
        speeds = {w: worker.speed for w, worker in self.workers.items()}
        # speeds only when they differ, and only to a placement that takes them (one of
        # one's own written for equal workers places as if they were)
        takes_speeds = "speeds" in inspect.signature(self.placement.place).parameters
        self._speeds = speeds if takes_speeds and len(set(speeds.values())) > 1 else None
        if self._speeds is not None:
            self._where = self.placement.place(reqs, loads, self._speeds)
        else:
            self._where = self.placement.place(reqs, loads)
        if self._moves:
            for r in reqs:
                self._work[r.trajectory] = work = predicted_work(r)
                self._load[self._where[r.trajectory]] += work
        for r in reqs:
            start = self.starts.get(r.trajectory, 0.0)
            if start > 0:
                self._at(start, "ready", r)
            else:
                self._ready(r, 0.0)
        events = 0
        now = 0.0
        while self._events:
            now, _, kind, payload = heapq.heappop(self._events)
            events += 1
            if kind == "done":
                name, version = payload
                w = self.workers[name]
                if version != w.version:
                    continue  # the worker changed since: a newer event stands
                self._generated(w.complete(now), now)
                self._dispatch(w, now)
            elif kind == "tool_done":
                self._after_tool(payload, now)
            elif kind == "ready":
                self._ready(payload, now)
            elif kind == "finish":
                self._finished(payload, now)
        # every trajectory ends finished or aborted: one missing lost a completion, and the
        # makespan of the others is not the step's
        if lost := [t.id for t in self.trajs if t.id not in self._finish and t.id not in self._aborted]:
            raise RuntimeError(f"the run ended with {len(lost)} trajectories unfinished: {lost[:5]}")
        makespan = max(self._finish.values(), default=0.0)
        util = (
            sum(w.busy_ms for w in self.workers.values()) / (len(self.workers) * makespan)
            if makespan
            else 0.0
        )
        meta: dict[str, Any] = {"migrations": self.migrations}
        if self.keep is not None:
            meta["aborted"] = sorted(self._aborted)
        return SimResult(makespan, dict(self._finish), util, events, self.preemptions, meta)

    # -- steps
    def _request(self, live: _Live, now: float) -> Request:
        return Request(
            trajectory=live.spec.id,
            arrival=_s(now),
            turn=live.turn,
            prompt_tokens=live.spec.prompt_tokens + live.history,
            tokens_so_far=live.tokens_so_far,
            predicted_total=self.predictor(live.spec, live.turn),
            last_outcome=live.spec.turns[live.turn - 1].outcome if live.turn else None,
            worker=self._where.get(live.spec.id),
        )

    def _ready(self, req: Request, now: float) -> None:
        if req.trajectory in self._aborted:
            return
        if self._moves and req.turn > 0:
            self._replace(req)
        name = self._where[req.trajectory]
        self.queues[name].push(req, _s(now))
        self._dispatch(self.workers[name], now)

    def _replace(self, req: Request) -> None:
        """Re-decide ``req``'s trajectory's worker between turns, as the real path does: the
        others' predicted work against its own, with its prefix cache's worker as home."""
        tid = req.trajectory
        home = self._where[tid]
        self._load[home] -= self._work.pop(tid, 0.0)
        if self._speeds is not None:
            target = self.placement.place([req], dict(self._load), self._speeds)[tid]
        else:
            target = self.placement.place([req], dict(self._load))[tid]
        self._work[tid] = work = predicted_work(req)
        self._load[target] += work
        if target != home:
            # the new worker holds none of its context: it prefills it all at admission (the
            # old one keeps its copy until the cache evicts it)
            self.migrations += 1
            self._where[tid] = target
            req.worker = target

    def _unload(self, trajectory: str) -> None:
        if self._moves:
            self._load[self._where[trajectory]] -= self._work.pop(trajectory, 0.0)

    def _dispatch(self, w: Worker, now: float) -> None:
        queue = self.queues[w.name]
        while w.free_slots > 0 and (req := self._pop_live(queue, now)) is not None:
            self._admit(w, req, now)
        if queue.preemptive and len(queue) and w.free_slots == 0:
            for victim in queue.preempt([item for _, _, item in w.running], _s(now)):
                left = w.evict(now, victim)
                self.preemptions += 1
                victim.remaining_tokens = left  # it waits again, with what it has left
                queue.push(victim, _s(now))
                nxt = self._pop_live(queue, now)
                assert nxt is not None
                self._admit(w, nxt, now)
        t = w.next_completion_ms()
        if t is not None:
            self._at(t, "done", (w.name, w.version))

    def _pop_live(self, queue: QueuePolicy, now: float) -> Request | None:
        """The queue's next request, dropping those of aborted trajectories on the way (the
        policies have no removal, so aborted turns are skipped when they come up)."""
        req = queue.pop(_s(now))
        while req is not None and req.trajectory in self._aborted:
            req = queue.pop(_s(now))
        return req

    def _admit(self, w: Worker, req: Request, now: float) -> None:
        live = self._live[req.trajectory]
        left = req.remaining_tokens
        tokens = live.spec.turns[live.turn].gen_tokens if left is None else left
        resume = left is not None  # preempted: its prompt is in the KV cache it kept
        w.admit(now, req, req.seq, tokens, 0 if resume else req.prompt_tokens, req.trajectory, resume=resume)

    def _generated(self, req: Request, now: float) -> None:
        live = self._live[req.trajectory]
        turn = live.spec.turns[live.turn]
        live.tokens_so_far += turn.gen_tokens
        live.history += turn.gen_tokens
        if self.mode == "batch":
            self._barrier(("gen", live.turn), live, now)
        else:
            self._start_tool(live, now)

    def _start_tool(self, live: _Live, now: float) -> None:
        turn = live.spec.turns[live.turn]
        if live.turn == len(live.spec.turns) - 1:
            self._unload(live.spec.id)  # its work is done: no longer a worker's load
            if self.keep is None:
                self._finish[live.spec.id] = now + turn.tool_ms
            else:  # the group's count changes when it really finishes
                self._at(now + turn.tool_ms, "finish", live.spec.id)
            return
        self._at(now + turn.tool_ms, "tool_done", live.spec.id)

    def _after_tool(self, trajectory: str, now: float) -> None:
        if trajectory in self._aborted:
            return
        live = self._live[trajectory]
        live.history += live.spec.turns[live.turn].tool_tokens  # the tool's output joins the context
        live.turn += 1
        if self.mode == "batch":
            self._barrier(("tool", live.turn), live, now)
        else:
            self._ready(self._request(live, now), now)

    def _barrier(self, key: tuple[str, int], live: _Live, now: float) -> None:
        """Batch mode: hold ``live`` until every trajectory that has this turn reached it."""
        kind, turn = key
        expected = self._reaching[turn]
        waiting = self._held.setdefault(key, [])
        waiting.append(live.spec.id)
        if len(waiting) < expected:
            return
        for tid in self._held.pop(key):
            other = self._live[tid]
            if kind == "gen":
                self._start_tool(other, now)
            else:
                self._at(now, "ready", self._request(other, now))

    def _finished(self, trajectory: str, now: float) -> None:
        """Redundant rollouts: record a finisher; the group's ``keep``-th one aborts the rest."""
        if trajectory in self._aborted:
            return
        self._finish[trajectory] = now
        group = self._live[trajectory].spec.group
        self._kept[group] = self._kept.get(group, 0) + 1
        if self._kept[group] != self.keep:
            return
        for tid in self._groups[group]:
            if tid not in self._finish:
                self._abort(tid, now)

    def _abort(self, trajectory: str, now: float) -> None:
        """Free what ``trajectory`` holds: its running turn's slot and its prefix cache. Its
        pending tool call, and a queued turn, are dropped when they come up (a preemptive
        queue drops it at once)."""
        self._aborted.add(trajectory)
        self._unload(trajectory)
        w = self.workers[self._where[trajectory]]
        w.cached_total -= w.cached.pop(trajectory, 0)
        queue = self.queues[w.name]
        if queue.preemptive:  # it preempts on what waits: an aborted turn must not count
            for req in queue.drain(_s(now)):
                if req.trajectory not in self._aborted:
                    queue.push(req, _s(now))
        for _, _, item in w.running:
            if item.trajectory == trajectory:
                w.evict(now, item)
                self._dispatch(w, now)  # refill the slot and reschedule the worker's completion
                break
