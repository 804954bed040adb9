"""The ``core.sched`` policies on the real rollout path: the LLM proxy's turn scheduler.

Without a scheduler the proxy hands every turn to its replica at once and the engine runs
them first come, first served (up to its batch size, the rest wait inside the engine). A
``TurnScheduler`` takes that waiting line out of the engine and into the proxy, where a
policy can order it:

* **admission**: at most ``slots`` turns run on a replica; the others wait in the replica's
  ``QueuePolicy`` (``rollout.scheduler``: fcfs, rr, sjf, pps, cmlfq), so the policy decides
  which turn the engine gets next;
* **placement** (``rollout.placement``): which replica a trajectory's turns go to. At every
  turn (the trajectory has just come back from its tool call, so a move costs nothing on
  the critical path) ``cache_affinity`` and ``presorted_dp`` may move it; ``least_load``
  places a trajectory once, by predicted work;
* **prediction**: a progressive ``LengthPredictor`` learns each finished trajectory's
  length from (prompt size, turn, tokens so far, tool outcomes), and each aborted one's as
  a lower bound (censored: at least what it reached), and predicts the running ones at
  every turn; a request's ``metadata["predicted_total"]`` overrides it (an oracle, or an
  estimate from the task).

Preemption of running turns (``pps``) is simulator-only: the engines here cannot hand back
a turn's partial KV cache, and aborting a turn to restart it later throws its tokens away.

The scheduler also writes the **trace** the simulator replays (``core.sim.trace``): one
JSON line per turn, with when the turn became ready, started and ended, its sizes and its
replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, get_args

from core.errors import writing
from core.sched import Request, make_placement, make_queue_policy
from core.sched.base import Outcome, Placement, QueuePolicy
from core.sched.placement import predicted_work, stable_relabel
from core.sched.queueing import CMLFQ

if TYPE_CHECKING:
    from core.sched.predictor import LengthPredictor

OUTCOMES: frozenset[str] = frozenset(get_args(Outcome))


@dataclass
class _Traj:
    prompt_tokens: int = -1
    tokens: int = 0
    turns: list[tuple[int, Outcome]] = field(default_factory=list)
    predicted: float | None = None
    replica: int | None = None
    classified: int | None = None
    """The ``seq`` of the turn whose tool outcome last moved its C-MLFQ level."""


@dataclass
class _Slots:
    """One replica's admission: running turns and the policy's waiting line."""

    queue: QueuePolicy
    running: int = 0
    waiting: dict[int, tuple[str, asyncio.Future[bool]]] = field(default_factory=dict)
    """seq -> (trajectory, admitted?)"""


class TurnScheduler:
    def __init__(
        self,
        scheduler: str = "fcfs",
        placement: str = "affinity",
        *,
        slots: int = 64,
        scheduler_options: dict[str, Any] | None = None,
        predictor: LengthPredictor | None = None,
        trace: Path | str | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.scheduler, self.slots = scheduler, slots
        self._options = dict(scheduler_options or {})
        make_queue_policy(scheduler, **self._options)  # fail here, not at the first turn
        # C-MLFQ's levels in one store for every replica's queue: a trajectory that moves
        # replica (cache_affinity, presorted_dp) keeps its level instead of starting at 0
        self._queue_options = dict(self._options)
        if scheduler == "cmlfq":
            self._queue_options["level_store"] = {}
        self.placement: Placement | None = None if placement == "affinity" else make_placement(placement)
        if predictor is None:
            # imported here: the LLM proxy's actor imports this module at every job's start,
            # most jobs without a scheduler, and the predictor's numpy was 0.1 s of CPU there
            from core.sched.predictor import LengthPredictor

            predictor = LengthPredictor(refit_every=8)
        self.predictor = predictor
        self._replicas: dict[int, _Slots] = {}
        self._trajs: dict[str, _Traj] = {}
        self._t0 = time.monotonic()
        self.trace_path = None if trace is None else Path(trace)
        self._trace: IO[str] | None = None  # opened at the first record: the scheduler is
        # built in the job's driver and pickled to the proxy actor
        self._trace_opened = False
        """Once opened, the trace is opened again (a record after ``close``) to append."""
        self.admitted = 0
        self.queued = 0
        self.migrations = 0

    # ------------------------------------------------------------------ requests
    def request(self, traj_id: str, turn: int, prompt_tokens: int, metadata: dict[str, Any]) -> Request:
        """The ``Request`` a turn is scheduled as, with the trajectory's prediction updated."""
        t = self._trajs.setdefault(traj_id, _Traj())
        if t.prompt_tokens < 0:
            t.prompt_tokens = prompt_tokens
        outcome = metadata.get("outcome")
        last: Outcome | None = outcome if outcome in OUTCOMES else None
        if last is not None and t.turns:
            t.turns[-1] = (t.turns[-1][0], last)  # what the previous turn's tool call returned
        hint = metadata.get("predicted_total")
        if isinstance(hint, (int, float)) and not isinstance(hint, bool) and hint > 0:
            t.predicted = float(hint)
        else:
            t.predicted = self.predictor.predict(t.prompt_tokens, turn, t.tokens, [o for _, o in t.turns])
        return Request(
            trajectory=traj_id,
            arrival=time.monotonic() - self._t0,
            turn=turn,
            prompt_tokens=prompt_tokens,
            tokens_so_far=t.tokens,
            predicted_total=t.predicted,
            last_outcome=last,
        )

    def place(self, req: Request, candidates: Sequence[int], sticky: int | None) -> int | None:
        """The replica (an index into ``candidates``' ids) for this turn, or ``None`` to let
        the proxy keep its trajectory affinity."""
        if self.placement is None:
            return None
        t = self._trajs[req.trajectory]
        if sticky in candidates and self.placement.name == "least_load":
            return sticky  # placed once
        names = {str(c): c for c in candidates}
        others = [
            _as_request(tid, other, other.replica)
            for tid, other in self._trajs.items()
            if tid != req.trajectory and other.replica in candidates
        ]
        req.worker = str(sticky) if sticky in candidates else None
        if self.placement.name == "presorted_dp":
            # re-partition every trajectory of the group; only this one moves now (it is
            # between turns), the others move at their own next turn
            split = self.placement.place([*others, req], dict.fromkeys(names, 0.0))
            now = {o.trajectory: o.worker for o in others if o.worker is not None}
            if req.worker is not None:
                now[req.trajectory] = req.worker
            target = stable_relabel(split, now)[req.trajectory]
        else:
            # a replica's load: the predicted work of the trajectories placed there
            load = dict.fromkeys(names, 0.0)
            for o in others:
                load[str(o.worker)] += predicted_work(o)
            target = self.placement.place([req], load)[req.trajectory]
        chosen = names[target]
        if sticky is not None and sticky != chosen:
            self.migrations += 1
        t.replica = chosen
        return chosen

    # ------------------------------------------------------------------ admission
    async def admit(self, replica: int, req: Request) -> bool:
        """Wait for a slot on ``replica``. False: the turn was cancelled while waiting."""
        s = self._replicas.get(replica)
        if s is None:
            s = self._replicas[replica] = _Slots(make_queue_policy(self.scheduler, **self._queue_options))
        t = self._trajs.get(req.trajectory)
        if t is not None:  # None: released meanwhile (its turn ends aborted); not re-created
            t.replica = replica
            if isinstance(s.queue, CMLFQ) and req.last_outcome is not None:
                if t.classified == req.seq:
                    # admitted again (a rerun after its replica was lost, or one that broke
                    # while it waited): its outcome moved the level at its first admission,
                    # and applied twice one tool error cost two levels. (A copy: the caller's
                    # request keeps its outcome for the trace.)
                    req = dataclasses.replace(req, last_outcome=None)
                else:
                    t.classified = req.seq
        if s.running < self.slots and not len(s.queue):
            if isinstance(s.queue, CMLFQ):
                s.queue.observe(req)  # its outcome moves its level though it never queued
            s.running += 1
            self.admitted += 1
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        s.waiting[req.seq] = (req.trajectory, fut)
        s.queue.push(req, req.arrival)
        self.queued += 1
        try:
            return await fut
        except asyncio.CancelledError:
            s.waiting.pop(req.seq, None)
            if fut.done() and not fut.cancelled() and fut.result():
                self.done(replica)  # admitted just as the caller went away: hand the slot on
            elif not fut.done() or fut.cancelled():
                # still in the line (its replica broke, or its caller went away; awaited, the
                # future was cancelled with it): out of it now, since the same request may
                # wait on another replica meanwhile
                s.queue.discard(req.seq)
            raise

    def done(self, replica: int) -> None:
        """A turn on ``replica`` ended: its slot goes to the policy's next waiting turn."""
        s = self._replicas[replica]
        s.running -= 1
        now = time.monotonic() - self._t0
        while s.running < self.slots and len(s.queue):
            nxt = s.queue.pop(now)
            assert nxt is not None
            entry = s.waiting.pop(nxt.seq, None)
            if entry is None or entry[1].done():
                continue  # cancelled while waiting (a policy that keeps it: see ``discard``)
            fut = entry[1]
            s.running += 1
            self.admitted += 1
            fut.set_result(True)

    def waiting_of(self, traj_id: str) -> int:
        """Turns of the trajectory waiting for a slot."""
        return sum(
            1
            for s in self._replicas.values()
            for owner, fut in s.waiting.values()
            if owner == traj_id and not fut.done()
        )

    def cancel(self, traj_id: str) -> None:
        """The trajectory was aborted: its waiting turns leave the line without running."""
        for s in self._replicas.values():
            for seq, (owner, fut) in list(s.waiting.items()):
                if owner == traj_id and not fut.done():
                    del s.waiting[seq]
                    s.queue.discard(seq)
                    fut.set_result(False)

    # ------------------------------------------------------------------ trajectories
    def finished_turn(self, traj_id: str, tokens: int, outcome: Outcome = "ok") -> None:
        t = self._trajs.get(traj_id)
        if t is None:
            return  # released while the turn ran: re-creating it would keep it forever
        t.tokens += tokens
        t.turns.append((tokens, outcome))

    def release(self, traj_id: str, *, finished: bool = True) -> None:
        """The trajectory ended: learn its length, forget it. Not ``finished`` (aborted, cut
        off): its length is only known to be at least what it reached, and learnt so; left
        out, redundancy's aborted slowest members left the predictor the fast ones only."""
        t = self._trajs.pop(traj_id, None)
        for s in self._replicas.values():
            if isinstance(s.queue, CMLFQ):
                s.queue.forget(traj_id)  # (one store: the first forgets it for all)
        if t is not None and t.turns and t.prompt_tokens >= 0:
            if finished:
                self.predictor.observe(t.prompt_tokens, t.turns)
            else:
                self.predictor.observe_censored(t.prompt_tokens, t.turns)

    def record(self, **row: Any) -> None:
        if self.trace_path is None:
            return
        # in the proxy actor: a bare OSError reached the driver as any turn's error, so
        # every trajectory was re-run until the groups were given up, and the job stopped
        # with a RolloutError that never said the disk was full
        with writing(self.trace_path):
            if self._trace is None:
                self.trace_path.parent.mkdir(parents=True, exist_ok=True)
                # a turn that ends after close (the proxy's aclose does not wait for turns in
                # flight) appends: "w" again truncated every line written before it
                self._trace = self.trace_path.open("a" if self._trace_opened else "w", buffering=1)
                self._trace_opened = True
            self._trace.write(json.dumps(row, separators=(",", ":")) + "\n")

    def now(self) -> float:
        return time.monotonic() - self._t0

    def close(self) -> None:
        trace, self._trace = self._trace, None
        if trace is not None and self.trace_path is not None:
            with writing(self.trace_path):  # (the flush of a line a full disk refused)
                trace.close()

    def stats(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler,
            "placement": self.placement.name if self.placement else "affinity",
            "turns_admitted": self.admitted,
            "turns_queued": self.queued,
            "waiting": sum(len(s.waiting) for s in self._replicas.values()),
            "migrations": self.migrations,
            "predictor_trained_on": self.predictor.trajectories_seen,
            "predictor_censored": self.predictor.trajectories_censored,
        }


def _as_request(traj_id: str, t: _Traj, worker: int | None) -> Request:
    return Request(
        trajectory=traj_id,
        arrival=0.0,
        tokens_so_far=t.tokens,
        predicted_total=t.predicted,
        worker=None if worker is None else str(worker),
    )
