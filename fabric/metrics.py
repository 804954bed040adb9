"""Per-function call metrics: counters, a latency histogram, the latencies of recent calls
(the snapshot's p50/p95/p99) and a window of recent answered attempts (the p95 the client
hedges after)."""

from __future__ import annotations

import bisect
from collections import Counter, deque
from typing import Any

#: Histogram bucket upper bounds in milliseconds (Prometheus style, +Inf implied).
BUCKETS_MS: tuple[float, ...] = (
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    25,
    50,
    100,
    250,
    500,
    1000,
    2500,
    5000,
    10000,
)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class LatencyWindow:
    """Recent latencies; quantiles are recomputed every ``every`` samples, not per call."""

    __slots__ = ("_every", "_n", "_q", "_value", "samples")

    def __init__(self, size: int = 2048, q: float = 95.0, every: int = 128):
        self.samples: deque[float] = deque(maxlen=size)
        self._q = q
        self._every = every
        self._n = 0
        self._value: float | None = None

    def add(self, ms: float) -> None:
        self.samples.append(ms)
        self._n += 1
        if self._n % self._every == 0:
            self._value = percentile(sorted(self.samples), self._q)

    def quantile(self, min_samples: int) -> float | None:
        if self._n < min_samples:
            return None
        if self._value is None:
            self._value = percentile(sorted(self.samples), self._q)
        return self._value


class FunctionMetrics:
    """Counters of one function. ``ok``, ``errors``, the latency histogram and
    ``cold_starts`` count outcomes: of each call, except that the one execution under an
    idempotency key counts its own outcome once, when it ends, even when the caller that
    started it gave up first (its latency is from that caller's call). A caller answered with
    a key's kept answer counts in ``cache_hits``; one whose deadline passed while the keyed
    execution it waited for went on counts in ``gave_up`` (not an error: the execution goes on,
    and its outcome is counted when it ends). An execution that sent nothing (every caller's
    deadline passed while it waited for a concurrency slot) counts no outcome: its callers
    count in ``gave_up``."""

    __slots__ = (
        "buckets",
        "cache_hits",
        "calls",
        "cold_starts",
        "errors",
        "gave_up",
        "hedge_wins",
        "hedges",
        "latency_sum_ms",
        "ok",
        "recent",
        "retries",
        "version_mismatches",
        "window",
    )

    def __init__(self, hedge_quantile: float = 95.0) -> None:
        self.calls = 0
        self.ok = 0
        self.errors: Counter[str] = Counter()
        self.retries = 0
        self.hedges = 0
        self.hedge_wins = 0
        self.cold_starts = 0
        self.cache_hits = 0
        self.gave_up = 0
        self.version_mismatches = 0
        """Answers from other code than the client's registry holds (``ClientConfig.version_check``)."""
        self.buckets = [0] * (len(BUCKETS_MS) + 1)
        self.latency_sum_ms = 0.0
        self.recent: deque[float] = deque(maxlen=2048)
        """Latencies of the recent calls' outcomes, as the histogram counts them (retries and
        backoffs included, failures too): the snapshot's quantiles."""
        self.window = LatencyWindow(q=hedge_quantile)
        """Latencies of recent successful attempts, one copy each, cold starts left out: the
        hedge delay. Not the calls' (a call that failed and was retried is not one sample of it)."""

    def observe(self, ms: float) -> None:
        self.buckets[bisect.bisect_left(BUCKETS_MS, ms)] += 1
        self.latency_sum_ms += ms
        self.recent.append(ms)

    def snapshot(self) -> dict[str, Any]:
        recent = sorted(self.recent)
        return {
            "calls": self.calls,
            "ok": self.ok,
            "errors": dict(self.errors),
            "retries": self.retries,
            "hedges": self.hedges,
            "hedge_wins": self.hedge_wins,
            "cold_starts": self.cold_starts,
            "cache_hits": self.cache_hits,
            "gave_up": self.gave_up,
            "version_mismatches": self.version_mismatches,
            "latency_ms": {
                "p50": percentile(recent, 50),
                "p95": percentile(recent, 95),
                "p99": percentile(recent, 99),
                "sum": self.latency_sum_ms,
                "buckets": dict(zip([*map(str, BUCKETS_MS), "+Inf"], self.buckets, strict=True)),
            },
        }
