"""What the rollout schedulers decide about, and the ABCs they implement.

A ``Request`` is one pending LLM turn of a trajectory: the unit a queueing policy orders
and a placement policy puts on an engine worker. The same objects drive the real LLM proxy
and the simulator (``core.sim``), so a policy is tested once and measured twice.

Three decisions, three ABCs:

* ``QueuePolicy``: which waiting request runs next (and which running one to preempt);
* ``Placement``: which worker a trajectory's requests go to;
* a policy's name in ``QUEUE_POLICIES`` / ``PLACEMENTS`` is what a job config selects.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

#: Tool-return outcomes C-MLFQ reacts to (``Request.last_outcome``).
Outcome = Literal["ok", "tool_error", "test_failure", "timeout", "success"]

_seq = itertools.count()


@dataclass(eq=False)
class Request:
    """One turn of a trajectory waiting for (or running on) an engine."""

    trajectory: str
    arrival: float
    """When this turn became ready (the previous tool call or env step returned), in seconds:
    C-MLFQ's aging compares it with ``aging_s`` (the simulator converts its ms clock)."""
    turn: int = 0
    prompt_tokens: int = 0
    tokens_so_far: int = 0
    """Tokens the trajectory has generated in earlier turns."""
    predicted_total: float | None = None
    """The length predictor's current estimate of the trajectory's total tokens."""
    last_outcome: Outcome | None = None
    worker: str | None = None
    """Where the trajectory's prefix cache lives (its previous turn's worker)."""
    remaining_tokens: float | None = None
    """Set when the request was preempted: the decode tokens it still has to generate."""
    seq: int = field(default_factory=lambda: next(_seq))
    """Tie-breaker: first come, first served among equals."""

    def __post_init__(self) -> None:
        # a nan key breaks a policy's heap order silently, for every request queued with it
        p = self.predicted_total
        if p is not None and not p >= 0:
            raise ValueError(f"{self.trajectory}: predicted_total must be >= 0 (or None), got {p}")

    @property
    def predicted_remaining(self) -> float:
        if self.predicted_total is None:
            return float("inf")
        return max(self.predicted_total - self.tokens_so_far, 0.0)


class QueuePolicy(ABC):
    """Orders waiting requests. ``push`` / ``pop`` are O(log n) in every built-in policy."""

    name: ClassVar[str]
    preemptive: ClassVar[bool] = False

    @abstractmethod
    def push(self, req: Request, now: float) -> None: ...

    @abstractmethod
    def pop(self, now: float) -> Request | None:
        """The next request to run, or ``None`` when none waits."""

    @abstractmethod
    def __len__(self) -> int: ...

    def discard(self, seq: int) -> None:
        """The waiting request ``seq`` left the line without running (its trajectory was
        aborted, or the turn went to another worker). Without this a policy keeps it until it
        comes up, counted in ``len`` and, in a policy that keeps state per trajectory, read
        as if it still waited (default: nothing; the caller skips it when it is popped)."""
        return None

    def preempt(self, running: Iterable[Request], now: float) -> list[Request]:
        """Running requests that should yield their slot to a waiting one (none by default)."""
        return []

    def drain(self, now: float) -> list[Request]:
        out = []
        while (r := self.pop(now)) is not None:
            out.append(r)
        return out


class Placement(ABC):
    """Puts trajectories on workers."""

    name: ClassVar[str]

    @abstractmethod
    def place(
        self, reqs: list[Request], workers: dict[str, float], speeds: Mapping[str, float] | None = None
    ) -> dict[str, str]:
        """``trajectory -> worker`` for ``reqs``; ``workers`` maps each worker to its current
        load (tokens it still has to generate). ``speeds`` (decode speed relative to the
        profile, by worker; absent: all 1) is passed only when the workers differ, so a
        placement of one's own written for equal workers keeps working."""
