"""Review of the client's version check (``ClientConfig.version_check``) where it meets the
idempotency rules and the circuit breaker: an outcome of other code than the caller's is
still read for what it says of the world (it may have run; it did not start; the function
answered), as the caller's own code's outcome is."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from version_fns import NEW, OLD, RUNS

from fabric.backends.inproc import InprocBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import SPEC_ATTR, Registry

OLD_SEND = OLD.get("send").version


class OldCodeFails(InprocBackend):
    """The old code's deployment, answering ``fail`` (an outcome of that code: its version)
    for the first ``times`` calls, then running it."""

    def __init__(
        self,
        fail: ErrorCode,
        times: int = 10**9,
        *,
        started: bool | None = None,
        message: str = "worker died",
    ) -> None:
        super().__init__(OLD)
        self.fail, self.times, self.started, self.sent, self.message = fail, times, started, 0, message

    async def _run(self, inv: Invocation, keyed: Any) -> Result:
        self.sent += 1
        if self.sent > self.times:
            return await super()._run(inv, keyed)
        r = Result.failure(
            self.fail, self.message, function=inv.function, request_id=inv.request_id, started=self.started
        )
        r.version = OLD.get(inv.function).version
        return r


@pytest.fixture(autouse=True)
def _runs():
    RUNS.clear()
    yield
    RUNS.clear()


async def test_a_side_effect_of_other_code_that_may_have_run_keeps_outcome_unknown():
    """The old code's worker died in a call of a tool with side effects: the effect may
    have happened. Before: the raw WorkerLost (retryable) was kept under the key, so every
    later caller with the key got a cached WorkerLost to retry, forever, and no effect key
    was kept for code registered later; the caller's own code's WorkerLost keeps
    OutcomeUnknown."""
    backend = OldCodeFails(ErrorCode.WORKER_LOST)
    async with Client(backend=backend, registry=NEW) as c:
        first = await c.call("send", {"x": 1}, idempotency_key="traj-1")
        again = await c.call("send", {"x": 1}, idempotency_key="traj-1")
    assert first.error.type == ErrorCode.WORKER_LOST and first.attempts == 1  # may have run: not retried
    assert again.cached and again.error.type == ErrorCode.OUTCOME_UNKNOWN and not again.retryable
    assert backend.sent == 1


async def test_a_side_effect_of_other_code_that_did_not_start_leaves_the_key_free():
    """A call of the old code's deployment that provably did not run (refused before it
    started, version and all): nothing happened, so the key is free, as after the caller's own
    code's. Before: kept under the key, every later caller with it got the refusal and the
    call never ran."""
    backend = OldCodeFails(ErrorCode.DEADLINE_EXCEEDED, times=1, started=False)
    async with Client(backend=backend, registry=NEW) as c:
        first = await c.call("send", {"x": 1}, idempotency_key="traj-2")
        again = await c.call("send", {"x": 1}, idempotency_key="traj-2")
    assert first.error.type == ErrorCode.DEADLINE_EXCEEDED and first.started is False
    assert again.ok and not again.cached and RUNS == ["send-old"]


async def test_refuse_does_not_say_a_call_that_did_not_start_ran():
    """A local pool answers a call it found past its deadline before starting it
    (DeadlineExceeded, started=False) with its version. Refused as VersionMismatch, it read
    started=True, "It ran, effects and all": a caller that trusts ``started`` gave up a call
    safe to send again."""
    backend = OldCodeFails(ErrorCode.DEADLINE_EXCEEDED, started=False)
    async with Client(backend=backend, registry=NEW, config={"version_check": "refuse"}) as c:
        r = await c.call("scale", {"x": 1})
        m = c.metrics()["scale"]
    assert r.error.type == ErrorCode.DEADLINE_EXCEEDED and r.started is False
    assert m["version_mismatches"] == 0  # no code answered


async def test_a_refused_answer_of_other_code_closes_the_circuit():
    """The breaker opened on infrastructure failures; after the cooldown the probe reaches
    the old code, which answers: the infrastructure works. Under refuse the VersionMismatch
    neither reset nor counted the failures, so the circuit stayed half-open for good: one
    probe at a time, every concurrent call refused CircuitOpen."""

    class Outage(InprocBackend):
        down = True

        async def _run(self, inv: Invocation, keyed: Any) -> Result:
            if self.down:  # the transport's failure: no code answered, no version
                return Result.failure(
                    ErrorCode.TRANSPORT, "down", function=inv.function, request_id=inv.request_id
                )
            return await super()._run(inv, keyed)

    backend = Outage(OLD)
    cfg = {"version_check": "refuse", "breaker": {"failure_threshold": 1, "cooldown_s": 0.01}}
    async with Client(backend=backend, registry=NEW, config=cfg) as c:
        down = await c.call("scale", {"x": 1})
        assert not down.ok
        backend.down = False
        await asyncio.sleep(0.05)  # past the cooldown: the next call is the probe
        probe = await c.call("scale", {"x": 1})
        assert probe.error.type == ErrorCode.VERSION_MISMATCH
        both = await asyncio.gather(c.call("scale", {"x": 2}), c.call("scale", {"x": 3}))
    assert [r.error.type for r in both] == [ErrorCode.VERSION_MISMATCH] * 2


# ----------------------------------------------------------------------------- refused side effects


def _send(x: int) -> int:
    return x  # never run: the backends here run OLD's code


async def test_a_refused_side_effect_is_not_run_again_by_code_registered_later():
    """Under refuse, a tool with side effects answered by the old code's deployment: its
    effect happened, and its answer was refused. Only the VersionMismatch was kept, under the
    key of the code registered then: the function registered again (the fix made, say) and
    called with the same key ran the effect again. An OutcomeUnknown is kept for every code
    of the function, as for a side effect that may have run."""
    reg = Registry()
    reg.tool(name="send", warm=0, side_effects=True)(_send)
    spec = getattr(_send, SPEC_ATTR)
    async with Client(backend=InprocBackend(OLD), registry=reg, config={"version_check": "refuse"}) as c:
        first = await c.call("send", {"x": 1}, idempotency_key="traj-3")
        setattr(_send, SPEC_ATTR, spec.model_copy(update={"version": "edited"}))
        try:
            reg.add(_send)  # registered again with new code
        finally:
            setattr(_send, SPEC_ATTR, spec)
        again = await c.call("send", {"x": 1}, idempotency_key="traj-3")
    assert first.error.type == ErrorCode.VERSION_MISMATCH
    assert RUNS == ["send-old"], f"the effect ran again: {RUNS}"
    assert again.cached and again.error.type == ErrorCode.OUTCOME_UNKNOWN and not again.retryable
    assert "refused" in again.error.message and "new idempotency key" in again.error.message


async def test_a_refused_side_effect_too_large_to_keep_is_not_run_again():
    """The VersionMismatch of a refused side effect says what the other code answered (here
    a long error); larger than idempotency_cache_bytes, it was not kept, and nothing else
    was: the next call with the key ran the effect again. As for a side effect's answer too
    large to keep, an OutcomeUnknown is kept instead."""
    backend = OldCodeFails(ErrorCode.USER_ERROR, message="x" * 5000)
    cfg = {"version_check": "refuse", "idempotency_cache_bytes": 2000}
    async with Client(backend=backend, registry=NEW, config=cfg) as c:
        first = await c.call("send", {"x": 1}, idempotency_key="traj-4")
        again = await c.call("send", {"x": 1}, idempotency_key="traj-4")
    assert first.error.type == ErrorCode.VERSION_MISMATCH and "x" * 5000 in first.error.message
    assert backend.sent == 1, "the effect ran again"
    assert again.cached and again.error.type == ErrorCode.OUTCOME_UNKNOWN and not again.retryable


async def test_a_side_effect_of_other_code_too_large_to_keep_is_not_run_again():
    """The same under warn, for the other code's answer: too large to keep, it was returned
    and nothing kept, where the caller's own code's keeps OutcomeUnknown."""

    class BigAnswer(InprocBackend):
        async def _run(self, inv: Invocation, keyed: Any) -> Result:
            r = await super()._run(inv, keyed)
            r.value = "v" * 5000
            return r

    async with Client(backend=BigAnswer(OLD), registry=NEW, config={"idempotency_cache_bytes": 2000}) as c:
        first = await c.call("send", {"x": 1}, idempotency_key="traj-5")
        again = await c.call("send", {"x": 1}, idempotency_key="traj-5")
    assert first.ok and first.value == "v" * 5000
    assert RUNS == ["send-old"], f"the effect ran again: {RUNS}"
    assert again.cached and again.error.type == ErrorCode.OUTCOME_UNKNOWN
