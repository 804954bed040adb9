"""A simulated rollout engine worker: continuous batching at the granularity of completions.

Decode cost depends on the batch: one decode iteration over ``b`` running requests takes
``profile.step_ms(b)`` (a measured table, linearly interpolated). Rather than stepping
token by token, the worker keeps a *virtual token clock* ``V``: the number of tokens every
running request has generated since the worker started. ``V`` advances at
``1 / step_ms(b)`` tokens per ms while ``b`` requests run, so a request admitted at ``V0``
needing ``n`` tokens finishes when ``V`` reaches ``V0 + n``. Finishing times sit in a heap,
and every admission or completion costs O(log b). That is what lets a 10,000-trajectory
step simulate in seconds.

Prefill is charged as extra virtual tokens (``prefill_ratio`` decode tokens per prompt
token). A trajectory's earlier turns that this worker still caches are not prefilled again.
"""

from __future__ import annotations

import bisect
import heapq
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineProfile:
    """Per-iteration decode time by batch size, from a profile of the real engine."""

    batch_sizes: Sequence[int] = (1, 8, 32, 64, 128, 256)
    step_ms_table: Sequence[float] = (12.0, 13.0, 16.0, 20.0, 28.0, 45.0)
    max_batch: int = 256
    prefill_ratio: float = 0.02
    """Decode-token equivalents per prompt token (prefill is compute-bound and batched)."""
    cache_tokens: int = 2_000_000
    """Prefix cache capacity per worker (tokens of history it keeps between turns)."""
    prefill_blocks: bool = False
    """True: a prefill stalls every running request for its duration (an engine that runs
    a whole prefill pass between decode steps, like the torch engine or vLLM without
    chunked prefill). False: it delays only its own request (chunked prefill)."""

    def __post_init__(self) -> None:
        if len(self.batch_sizes) != len(self.step_ms_table) or not self.batch_sizes:
            raise ValueError("batch_sizes and step_ms_table must be non-empty and of equal length")
        if list(self.batch_sizes) != sorted(self.batch_sizes):
            raise ValueError("batch_sizes must be increasing")
        # a zero, negative or nan rate runs the clock backwards or admits nothing, silently
        if self.batch_sizes[0] < 1 or not all(0 < y < math.inf for y in self.step_ms_table):
            raise ValueError("batch sizes must be >= 1 and step times finite and > 0")
        # slots are whole: 2.5 ran 3 turns at once (free slots 0.5 > 0) and True ran 1
        whole = isinstance(self.max_batch, numbers.Integral) and not isinstance(self.max_batch, bool)
        if not whole or self.max_batch < 1:
            raise ValueError(f"max_batch must be a whole number >= 1, got {self.max_batch!r}")
        if not 0 <= self.prefill_ratio < math.inf or self.cache_tokens < 0:
            raise ValueError("prefill_ratio must be finite and >= 0, cache_tokens >= 0")

    def step_ms(self, b: int) -> float:
        xs, ys = self.batch_sizes, self.step_ms_table
        if b <= xs[0]:
            return ys[0]
        if b >= xs[-1]:
            return ys[-1] * b / xs[-1]  # past the table: linear in b
        k = bisect.bisect_left(xs, b)
        x0, x1, y0, y1 = xs[k - 1], xs[k], ys[k - 1], ys[k]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


@dataclass
class Worker:
    name: str
    profile: EngineProfile
    speed: float = 1.0
    """Decode speed relative to the profile (model parallelism, a faster GPU)."""
    V: float = 0.0
    stall_ms: float = 0.0
    """Prefill time still ahead (``prefill_blocks``): wall time in which ``V`` stands still."""
    last_ms: float = 0.0
    busy_ms: float = 0.0
    running: list[tuple[float, int, Any]] = field(default_factory=list)
    version: int = 0
    """Bumped at every change: an older scheduled completion event is stale."""
    cached: dict[str, int] = field(default_factory=dict)
    """Trajectory -> history tokens this worker holds in its prefix cache (LRU order)."""
    cached_total: int = 0

    @property
    def free_slots(self) -> int:
        return self.profile.max_batch - len(self.running)

    def advance(self, now_ms: float) -> None:
        b = len(self.running)
        if not b:
            # an idle worker stalls nothing: a prefill still ahead belonged to requests that
            # were evicted (aborted), and must not hold up whatever is admitted next
            self.stall_ms = 0.0
        elif now_ms > self.last_ms:
            dt = now_ms - self.last_ms
            self.busy_ms += dt
            stalled = min(self.stall_ms, dt)
            self.stall_ms -= stalled
            self.V += (dt - stalled) * self.speed / self.profile.step_ms(b)
        self.last_ms = now_ms

    def admit(
        self,
        now_ms: float,
        item: Any,
        seq: int,
        decode_tokens: float,
        prompt_tokens: int,
        trajectory: str,
        *,
        resume: bool = False,
    ) -> None:
        """``resume``: a preempted turn coming back for its remaining tokens; it prefills
        nothing and leaves the prefix cache's entry (its whole history) as it is."""
        self.advance(now_ms)
        # without a prefix cache every turn re-reads its prompt
        caching = self.profile.cache_tokens > 0 and not resume
        held = self.cached.pop(trajectory, 0) if caching else 0
        to_prefill = max(prompt_tokens - held, 0)
        prefill = to_prefill * self.profile.prefill_ratio  # in decode tokens
        if self.profile.prefill_blocks:
            self.stall_ms += prefill * self.profile.step_ms_table[0] / self.speed
            prefill = 0.0
        heapq.heappush(self.running, (self.V + decode_tokens + prefill, seq, item))
        if caching:
            # the history after this turn, most recently used last
            history = prompt_tokens + int(decode_tokens)
            self.cached[trajectory] = history
            self.cached_total += history - held
            while self.cached_total > self.profile.cache_tokens and len(self.cached) > 1:
                oldest = next(iter(self.cached))
                self.cached_total -= self.cached.pop(oldest)
        self.version += 1

    def next_completion_ms(self) -> float | None:
        if not self.running:
            return None
        b = len(self.running)
        return (
            self.last_ms
            + self.stall_ms
            + (self.running[0][0] - self.V) * self.profile.step_ms(b) / self.speed
        )

    def complete(self, now_ms: float) -> Any:
        self.advance(now_ms)
        _, _, item = heapq.heappop(self.running)
        self.version += 1
        return item

    def evict(self, now_ms: float, item: Any) -> float:
        """Preempt ``item``: returns the decode tokens it still had to generate."""
        self.advance(now_ms)
        for k, (finish, _, it) in enumerate(self.running):
            if it is item:
                self.running.pop(k)
                heapq.heapify(self.running)
                self.version += 1
                return max(finish - self.V, 0.0)
        raise KeyError("not running here")
