"""Queueing policies: which waiting turn an engine runs next.

* ``fcfs``: arrival order.
* ``rr``: step-centric round robin, what current RL frameworks do: every trajectory's
  turn ``k`` runs before any trajectory's turn ``k + 1``.
* ``sjf``: shortest predicted remaining work first (online agent serving).
* ``pps``: progressive priority (Heddle): *longest* predicted trajectory first, so the
  long tail starts early and the step's makespan shrinks; the priority is re-read every
  time a turn is pushed (the prediction sharpens turn by turn), and a running request may
  be preempted by a waiting one predicted much longer.
* ``cmlfq``: causal multi-level feedback queue (Libra): levels move on what tool calls
  returned, not on predicted lengths (see ``CMLFQ``).

Every policy is a heap keyed by a tuple that ends with the request's ``seq``, so equal
priorities are first come, first served and the order is deterministic.
"""

from __future__ import annotations

import heapq
import numbers
from abc import abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

from core.sched.base import Outcome, QueuePolicy, Request


class _HeapPolicy(QueuePolicy):
    def __init__(self) -> None:
        self._heap: list[tuple[Any, ...]] = []

    @abstractmethod
    def key(self, req: Request, now: float) -> tuple[Any, ...]:
        """The heap key (lowest first); ``seq`` is appended as the tie-breaker."""

    def push(self, req: Request, now: float) -> None:
        heapq.heappush(self._heap, (*self.key(req, now), req.seq, req))

    def pop(self, now: float) -> Request | None:
        return heapq.heappop(self._heap)[-1] if self._heap else None

    def discard(self, seq: int) -> None:
        _remove(self._heap, seq)

    def peek(self) -> Request | None:
        return self._heap[0][-1] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


class FCFS(_HeapPolicy):
    name = "fcfs"

    def key(self, req: Request, now: float) -> tuple[Any, ...]:
        return (req.arrival,)


class RoundRobin(_HeapPolicy):
    name = "rr"

    def key(self, req: Request, now: float) -> tuple[Any, ...]:
        return (req.turn, req.arrival)


class SJF(_HeapPolicy):
    """Unknown predictions go last: a request with no estimate is not assumed short."""

    name = "sjf"

    def key(self, req: Request, now: float) -> tuple[Any, ...]:
        return (req.predicted_remaining, req.arrival)


class ProgressivePriority(_HeapPolicy):
    """Longest predicted *total* first; unknown predictions go first (a new trajectory may
    be the long one, and its first turn tells the predictor most)."""

    name = "pps"
    preemptive = True

    def __init__(self, preempt_ratio: float = 2.0) -> None:
        super().__init__()
        # nan passed "< 1" and then never preempted (nothing is > nan * size), silently
        if not _number(preempt_ratio) or not preempt_ratio >= 1.0:
            raise ValueError(
                f"preempt_ratio must be a number >= 1 (inf: never preempt), got {preempt_ratio!r}"
            )
        self.preempt_ratio = preempt_ratio

    @staticmethod
    def _size(req: Request) -> float:
        return float("inf") if req.predicted_total is None else req.predicted_total

    def key(self, req: Request, now: float) -> tuple[Any, ...]:
        return (-self._size(req), req.arrival)

    def preempt(self, running: Iterable[Request], now: float) -> list[Request]:
        """Running requests whose trajectory is predicted more than ``preempt_ratio`` times
        shorter than the longest waiting ones, one per waiting request, shortest first."""
        waiting = sorted((self._size(r) for _, _, _, r in self._heap), reverse=True)
        if not waiting:
            return []
        victims: list[Request] = []
        for r in sorted(running, key=self._size):
            if len(victims) == len(waiting) or self._size(r) == float("inf"):
                # an unknown-length turn is never "much longer" than another unknown one
                # (inf >= 2 * inf): preempting it only re-admitted it at once
                break
            # strictly longer: with >=, two zero-length predictions (0 >= 2 * 0) evicted a
            # running turn for an equal one, which was re-admitted at once
            if waiting[len(victims)] > self.preempt_ratio * self._size(r):
                victims.append(r)
        return victims


class CMLFQ(QueuePolicy):
    """Causal multi-level feedback queue.

    Level 0 is served first. A trajectory's level moves on the outcome of its last tool
    call, the signal that it is about to end or about to go on:

    * ``success`` (tests pass, the answer checks out): to level 0, it is nearly done and
      finishing it frees its slot and its KV cache;
    * ``tool_error`` / ``test_failure``: down one level, another round of fixing follows;
    * ``timeout``: down two levels;
    * ``ok`` or nothing: stays.

    Plus the classic MLFQ rules, by tokens and by waiting: a trajectory that has generated
    more than ``quantum_tokens[i]`` in all is at level ``i + 1`` or lower, so one long turn
    can drop it several levels at once (the quanta set a floor from the total, not a step
    per turn: only ``success``, and aging while a turn waits, lift it above); and a request
    that waited longer than ``aging_s`` seconds goes up one level per ``aging_s`` waited (no
    starvation). ``bucket(level)`` maps levels onto heterogeneous engine buckets
    (small-batch, low-latency engines for the top levels).
    """

    name = "cmlfq"
    MOVES: ClassVar[dict[Outcome, int]] = {
        "success": -99,
        "tool_error": 1,
        "test_failure": 1,
        "timeout": 2,
        "ok": 0,
    }

    def __init__(
        self,
        levels: int = 4,
        quantum_tokens: tuple[int, ...] = (2048, 8192, 32768),
        aging_s: float = 30.0,
        buckets: int | None = None,
        level_store: dict[str, int] | None = None,
    ) -> None:
        """``level_store``: where trajectories' levels are kept; queues that share one (the
        real path's per-replica queues) keep a trajectory's level when it moves replica."""
        # a float failed as a TypeError from a slice below, and True (YAML's yes) ran as 1 level
        if not isinstance(levels, int) or isinstance(levels, bool) or levels < 1:
            raise ValueError(f"levels must be >= 1 (a whole number), got {levels!r}")
        if len(quantum_tokens) < levels - 1:
            raise ValueError(f"quantum_tokens needs {levels - 1} entries (one per level but the last)")
        quantum = tuple(quantum_tokens[: levels - 1])
        # the levels' token budgets grow downwards: a smaller one below a larger one sends a
        # trajectory to the lower level before the upper one's budget is spent
        if not all(_number(q) and q >= 0 for q in quantum) or list(quantum) != sorted(quantum):
            raise ValueError(f"quantum_tokens must be numbers >= 0, non-decreasing, got {quantum}")
        # checked here, where the job config is validated: a string failed the first pop (in
        # the proxy, mid-run) and nan never aged anything (starvation, the rule's promise)
        if not _number(aging_s) or not aging_s >= 0:
            raise ValueError(f"aging_s must be a number of seconds >= 0 (inf: no aging), got {aging_s!r}")
        if buckets is not None and (not isinstance(buckets, int) or isinstance(buckets, bool) or buckets < 1):
            raise ValueError(f"buckets must be an integer >= 1, got {buckets!r}")
        self.levels = levels
        self.quantum = quantum
        self.aging_s = aging_s
        self.buckets = buckets or levels
        self._level: dict[str, int] = level_store if level_store is not None else {}
        self._queues: list[list[tuple[float, int, Request]]] = [[] for _ in range(levels)]

    def level_of(self, trajectory: str) -> int:
        return self._level.get(trajectory, 0)

    def bucket(self, level: int) -> int:
        """The engine bucket serving ``level`` (levels spread evenly over the buckets)."""
        return min(level * self.buckets // self.levels, self.buckets - 1)

    def _classify(self, req: Request) -> int:
        if req.last_outcome == "success":
            return 0  # nearly done, whatever it generated so far: the quantum does not apply
        level = self._level.get(req.trajectory, 0)
        if req.last_outcome is not None:
            level += self.MOVES[req.last_outcome]
        # the quantum: past level i's budget of generated tokens, at least level i + 1
        for i, q in enumerate(self.quantum):
            if req.tokens_so_far > q:
                level = max(level, i + 1)
        return min(max(level, 0), self.levels - 1)

    def observe(self, req: Request) -> None:
        """A turn admitted without queueing (a free slot): its outcome moves the trajectory's
        level all the same, as every turn's does in the simulator."""
        self._level[req.trajectory] = self._classify(req)

    def push(self, req: Request, now: float) -> None:
        level = self._classify(req)
        self._level[req.trajectory] = level
        heapq.heappush(self._queues[level], (req.arrival, req.seq, req))

    def _age(self, now: float) -> None:
        # bottom level first, so a request that waited several aging periods climbs as many
        # levels, whenever the queue is polled
        for level in range(self.levels - 1, 0, -1):
            queue = self._queues[level]
            while queue and now - queue[0][0] > self.aging_s:
                stamp, seq, req = heapq.heappop(queue)
                # a trajectory forget() dropped has ended: its entry is a turn aborted while it
                # waited (popped and skipped later), and writing its level kept the id for good
                if req.trajectory in self._level:
                    self._level[req.trajectory] = level - 1
                # re-stamped with when it went up (not ``now``: that would lose the time it
                # waited since, and make its level depend on how often pop is called)
                heapq.heappush(self._queues[level - 1], (stamp + self.aging_s, seq, req))

    def pop(self, now: float) -> Request | None:
        self._age(now)
        for queue in self._queues:
            if queue:
                return heapq.heappop(queue)[-1]
        return None

    def discard(self, seq: int) -> None:
        """Out of the line at once, not when it comes up: aging a left-over entry wrote its
        level into the store the queues share, over the level of a trajectory that went on
        elsewhere (a turn that waited on a replica that broke ran on another, and its later
        turns moved its level since)."""
        for queue in self._queues:
            if _remove(queue, seq):
                return

    def forget(self, trajectory: str) -> None:
        """The trajectory finished: drop its level."""
        self._level.pop(trajectory, None)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues)


def _remove(heap: list[tuple[Any, ...]], seq: int) -> bool:
    """Take the entry of request ``seq`` (an entry's last two items: seq, request) out of
    ``heap``; O(n), for the rare turn that leaves a line without running."""
    for i, entry in enumerate(heap):
        if entry[-2] == seq:
            heap[i] = heap[-1]
            heap.pop()
            heapq.heapify(heap)
            return True
    return False


def _number(x: object) -> bool:
    """A real number, not a bool (YAML's ``yes``) and not nan."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x == x


QUEUE_POLICIES: dict[str, type[QueuePolicy]] = {
    p.name: p for p in (FCFS, RoundRobin, SJF, ProgressivePriority, CMLFQ)
}


def make_queue_policy(name: str, **options: Any) -> QueuePolicy:
    try:
        cls = QUEUE_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduler {name!r}; known: {', '.join(sorted(QUEUE_POLICIES))}") from None
    return cls(**options)
