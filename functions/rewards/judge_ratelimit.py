"""Client-side rate limits of ``llm_judge``: per-worker token buckets for
``requests_per_minute`` and ``tokens_per_minute``, and the token estimate a request is charged
before it is sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fabric.errors import Unavailable


class TokenBucket:
    """``per_minute`` units a minute, bursting up to one minute's worth, or ``burst`` if more.
    Reservations may take the level below zero: each caller learns how long to wait, so
    waiters queue in order."""

    def __init__(self, per_minute: float, now: float, burst: float = 0.0):
        if not per_minute > 0:
            raise ValueError(f"a rate must be above 0 a minute, got {per_minute:g}")
        # a bucket smaller than one unit (0.5 requests a minute) never covered a request at
        # once: even the first waited. ``burst`` lets one whole unit go
        self.capacity = max(per_minute, burst)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.last = now

    def reserve(self, cost: float, now: float) -> float:
        """Take ``cost`` and return the seconds until it is covered."""
        self.level = min(self.capacity, self.level + (now - self.last) * self.rate)
        self.last = now
        self.level -= cost
        return 0.0 if self.level >= 0 else -self.level / self.rate

    def give_back(self, amount: float) -> None:
        self.level = min(self.capacity, self.level + amount)


class RateLimiter:
    """Requests-per-minute and tokens-per-minute buckets of one worker. Thread-safe (sync
    functions run in threads on some backends); waiting is the caller's, so it never blocks
    an event loop."""

    def __init__(
        self,
        requests_per_minute: float | None,
        tokens_per_minute: float | None,
        clock: Callable[[], float] = time.monotonic,
    ):
        for name, rate in (
            ("requests_per_minute", requests_per_minute),
            ("tokens_per_minute", tokens_per_minute),
        ):
            if rate is not None and not rate > 0:  # 0 read as "no cap"; a negative rate never fills
                raise ValueError(f"{name} must be above 0, got {rate:g} (None: no cap)")
        self.clock = clock
        now = clock()
        # one request always fits the request bucket: the first goes at once, at any rate
        self.requests = (
            None if requests_per_minute is None else TokenBucket(requests_per_minute, now, burst=1)
        )
        self.tokens = None if tokens_per_minute is None else TokenBucket(tokens_per_minute, now)
        self._lock = threading.Lock()

    def reserve(self, tokens: int, max_wait_s: float = float("inf"), bound: str | None = None) -> float:
        """Reserve one request of ``tokens`` and return how long to wait before sending it;
        ``Unavailable`` (nothing reserved) when that is over ``max_wait_s``, which ``bound``
        names in the error if it is not the ``max_wait_s`` setting."""
        if self.tokens is not None and tokens > self.tokens.capacity:
            raise ValueError(
                f"one request needs ~{tokens} tokens, more than tokens_per_minute="
                f"{self.tokens.capacity:g}: raise tokens_per_minute or lower max_tokens"
            )
        with self._lock:
            now = self.clock()
            wait_r = self.requests.reserve(1, now) if self.requests else 0.0
            wait_t = self.tokens.reserve(tokens, now) if self.tokens else 0.0
            wait = max(wait_r, wait_t)
            if wait > max_wait_s:
                if self.requests:
                    self.requests.give_back(1)
                if self.tokens:
                    self.tokens.give_back(tokens)
        if wait > max_wait_s:
            over = bound or f"max_wait_s={max_wait_s:g}"
            raise Unavailable(
                f"llm_judge is rate limited: the next request slot is {wait:.1f} s away, over "
                f"{over} (requests_per_minute, tokens_per_minute bound one worker); "
                "send fewer concurrent calls or raise the limits if the provider allows"
            )
        return wait

    def settle(self, estimated: int, actual: int) -> None:
        """Correct a reservation with the tokens the reply says were used."""
        if self.tokens is not None:
            with self._lock:
                self.tokens.give_back(estimated - actual)


def estimate_tokens(prompt: str, max_tokens: int) -> int:
    """Upper-ish estimate of a request's tokens before sending it: ~4 characters a token
    (English BPE) for the prompt, plus the most the reply may use (providers charge that)."""
    return len(prompt) // 4 + 1 + max_tokens
