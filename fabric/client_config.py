"""The client's settings (``ClientConfig``): hedging, the circuit breaker, default deadline,
idempotency cache and tenant; validated once, where the client is made."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class HedgeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    quantile: float = Field(95.0, gt=50, lt=100)
    """Send the duplicate once a call has been out longer than this latency quantile."""
    max_share: float = Field(0.1, ge=0, le=1)
    """At most this share of calls get a hedge (plus a small burst)."""
    min_samples: int = Field(100, ge=1)
    """No hedging until this many latencies were observed."""
    min_delay_ms: float = Field(1.0, ge=0)
    over_limit_share: float = Field(0.1, ge=0, le=1)
    """A hedge takes a free ``max_concurrency`` slot; when every slot is held (the callers of
    a saturated function each hold one while they wait: exactly when a straggler needs a
    hedge), hedges may run past the limit, at most this share of it at once, rounded down.
    With 0.1: 6 over a limit of 64, none under a limit of 10 (``max_concurrency: 1`` stays
    strict). 0 makes the limit strict for hedges too."""


class BreakerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    failure_threshold: int = Field(20, ge=1)
    """Consecutive infrastructure failures (retryable errors, but a ``FunctionTimeout`` of a
    call that began: the function's, on its input) that open the circuit."""
    cooldown_s: float = Field(5.0, gt=0)
    """How long an open circuit fails calls fast before one probe is let through."""


class ClientConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hedge: HedgeConfig = Field(default_factory=HedgeConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    default_deadline_s: float | None = Field(None, gt=0)
    """Deadline for calls that give none (None: bounded by the function's timeout and retries)."""
    max_retry_after_s: float | None = Field(60.0, gt=0)
    """The longest a throttle's ``Retry-After`` is waited before the next attempt (a shorter one
    is waited as said, past the backoff's cap; never past the deadline). A longer one (a
    proxy's misconfigured hour, a quota spent for the day) ends the call at once with the
    ``Throttled`` failure, which says so: a call without a deadline was held for as long as the
    header said. ``None``: no bound but the deadline."""
    idempotency_cache_size: int = Field(100_000, ge=0)
    """Keys whose answer is kept (the oldest dropped first; 0: none, one execution per key
    only while it runs)."""
    idempotency_cache_bytes: int = Field(256 * 2**20, ge=0)
    """Bound on the kept answers' size, about their encoded size (the oldest dropped first): a
    few huge answers must not hold unbounded memory under a bound on keys alone. An answer
    larger than the whole bound is returned, not kept."""
    tenant: str = "default"
    version_check: Literal["warn", "refuse", "off"] = "warn"
    """What to do with an answer from other code than this client's registry holds
    (``Result.version`` is not the function's ``FunctionSpec.version`` as the call was sent or
    is now, nor, on the local backends, which run what is registered, that of code registered
    under its name since: a Lambda or Modal function not redeployed since the function was
    edited, a ``fabric serve`` not restarted).
    ``warn``: give the answer, count it (``version_mismatches``) and log one warning per
    function and pair of versions; ``refuse``: fail the call instead with ``VersionMismatch``
    (not retried: it ran); ``off``: no check. Under ``warn`` or ``refuse`` an answer of other
    code is not kept under an idempotency key, whose version is this client's, unless the
    function has side effects (they happened: kept as the caller's code's outcome would be; a
    refused one as ``OutcomeUnknown`` for code registered later too, the effect being done), and
    a kept answer says the version that gave it (under ``off`` it is kept as any answer is). An
    answer without a version (a peer with older code, a refusal) is not checked, nor is a call
    that did not start."""
