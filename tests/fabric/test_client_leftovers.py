"""Items left open in the client and its inproc backend: a synchronous call that never got a
thread within its ``timeout_s`` is back-pressure (``Throttled``, not run), not the function's
``FunctionTimeout``; the idempotency cache is bounded in bytes as well as in keys."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fabric.backends.inproc import InprocBackend
from fabric.client import Client
from fabric.errors import SAFE_TO_RETRY, ErrorCode
from fabric.protocol import Invocation
from fabric.registry import Registry

# ----------------------------------------------------------------------------- thread starved


def _starved_registry(release: threading.Event) -> Registry:
    """``hold`` and ``effect``: the inproc thread pool is as wide as their ``max_concurrency``
    together (3), and three ``hold`` calls sent past the client hold every thread."""
    reg = Registry()

    @reg.function(name="hold", warm=0, timeout_s=30, max_concurrency=2)
    def hold() -> bool:
        release.wait(30)
        return True

    @reg.function(
        name="effect", warm=0, timeout_s=0.3, max_concurrency=1, side_effects=True, retry={"max_attempts": 1}
    )
    def effect() -> str:
        return "applied"

    return reg


@contextmanager
def _released(release: threading.Event) -> Iterator[None]:
    try:
        yield
    finally:
        release.set()  # the held threads end with the test


async def _hold_every_thread(backend: InprocBackend) -> list[asyncio.Future]:
    """Calls sent past any client, each holding one of the backend's threads until released."""
    held = [backend.submit(Invocation(function="hold", payload={})) for _ in range(2)]
    for _ in range(3000):  # until both run (bounded: 30 s)
        if all(backend.started("hold", f) for f in held):
            break
        await asyncio.sleep(0.01)
    assert all(backend.started("hold", f) for f in held), "the holding calls never started"
    # "effect" raised the cap to 3 (its runner was made): a third holder takes the last one
    third = backend.submit(Invocation(function="hold", payload={}))
    for _ in range(3000):
        if backend.started("hold", third):
            break
        await asyncio.sleep(0.01)
    assert backend.started("hold", third), "the third holding call never started"
    return [*held, third]


async def test_a_call_that_never_got_a_thread_is_throttled_not_a_function_timeout():
    """Every thread is held (by calls that run on, sent past the client's slots): the call
    waited for one past its ``timeout_s`` and never ran. It was answered ``FunctionTimeout``,
    which says the function ran past its limit: the job scored it as the response's fault
    (``failure_score``), a side-effecting call was not retried though it provably never ran.
    It is the backend's back-pressure, answered as Lambda answers a function whose
    concurrency is all in use: ``Throttled``, not started, safe to retry."""
    release = threading.Event()
    reg = _starved_registry(release)
    with _released(release):
        async with InprocBackend(reg) as backend:
            backend._runner("effect")  # its thread reserved, as its first call does
            await _hold_every_thread(backend)
            r = await backend.invoke(Invocation(function="effect", payload={}))
    assert r.error is not None and r.error.type == ErrorCode.THROTTLED, r.error
    assert r.started is False and r.retryable and r.error.type in SAFE_TO_RETRY
    assert "did not start" in r.error.message


async def test_a_keyed_side_effect_that_never_got_a_thread_is_not_left_outcome_unknown():
    """Through the client, under an idempotency key: a side effect that never ran kept a
    final ``OutcomeUnknown`` under its key (a ``FunctionTimeout`` may have run), so it could
    never run under that key. Not run, the key stays free: the next call with it runs."""
    release = threading.Event()
    reg = _starved_registry(release)
    with _released(release):
        backend = InprocBackend(reg)
        async with Client(backend=backend, registry=reg, config={"hedge": {"enabled": False}}) as c:
            backend._runner("effect")
            held = await _hold_every_thread(backend)
            starved = await c.call("effect", {}, idempotency_key="order-1")
            assert starved.error is not None and starved.error.type == ErrorCode.THROTTLED, starved.error
            release.set()
            await asyncio.gather(*held)
            again = await c.call("effect", {}, idempotency_key="order-1")
    assert again.ok and again.value == "applied" and not again.cached, again.error


# ----------------------------------------------------------------------------- cache bytes

_MB = 1_000_000


def _sized_registry(side_effects: bool = False) -> tuple[Registry, dict[str, int]]:
    reg = Registry()
    runs: dict[str, int] = {}

    @reg.function(name="sized", warm=0, timeout_s=30, side_effects=side_effects)
    def sized(tag: str, size: int) -> str:
        runs[tag] = runs.get(tag, 0) + 1
        return "x" * size

    return reg, runs


async def test_the_idempotency_cache_is_bounded_in_bytes_dropping_the_oldest():
    """The cache was bounded by keys only (100,000): a few huge answers (a judge's long
    rationale, a verifier's logs) kept that many times their size. Its answers' size is
    bounded too (about their encoded size): past it, the oldest keys are dropped first."""
    reg, runs = _sized_registry()
    config = {"hedge": {"enabled": False}, "idempotency_cache_bytes": int(2.5 * _MB)}
    async with Client(backend="inproc", registry=reg, config=config) as c:
        for tag in ("k1", "k2", "k3", "k4"):
            r = await c.call("sized", {"tag": tag, "size": _MB}, idempotency_key=tag)
            assert r.ok and len(r.value) == _MB
        # the two newest fit in 2.5 MB: kept
        for tag in ("k4", "k3"):
            r = await c.call("sized", {"tag": tag, "size": _MB}, idempotency_key=tag)
            assert r.ok and r.cached, tag
        # the oldest were dropped: their keys run again
        r = await c.call("sized", {"tag": "k1", "size": _MB}, idempotency_key="k1")
        assert r.ok and not r.cached
    assert runs == {"k1": 2, "k2": 1, "k3": 1, "k4": 1}


async def test_an_answer_larger_than_the_whole_bound_is_not_kept_and_drops_nothing():
    """One answer over the byte bound is returned, not kept (its key runs again), and the
    smaller answers already kept stay: they are not all dropped to make room that is not there."""
    reg, runs = _sized_registry()
    config = {"hedge": {"enabled": False}, "idempotency_cache_bytes": _MB}
    async with Client(backend="inproc", registry=reg, config=config) as c:
        assert (await c.call("sized", {"tag": "small", "size": 10}, idempotency_key="small")).ok
        huge = await c.call("sized", {"tag": "huge", "size": 2 * _MB}, idempotency_key="huge")
        assert huge.ok and len(huge.value) == 2 * _MB
        assert (await c.call("sized", {"tag": "small", "size": 10}, idempotency_key="small")).cached
        again = await c.call("sized", {"tag": "huge", "size": 2 * _MB}, idempotency_key="huge")
        assert again.ok and not again.cached
    assert runs == {"small": 1, "huge": 2}


async def test_a_side_effects_answer_too_large_to_keep_is_not_run_again_under_its_key():
    """Not kept, a side effect's answer let the next call with its key apply the effect
    again: a stand-in is kept instead, saying the call ran and why its answer is gone."""
    reg, runs = _sized_registry(side_effects=True)
    config = {"hedge": {"enabled": False}, "idempotency_cache_bytes": _MB}
    async with Client(backend="inproc", registry=reg, config=config) as c:
        huge = await c.call("sized", {"tag": "huge", "size": 2 * _MB}, idempotency_key="huge")
        assert huge.ok and len(huge.value) == 2 * _MB
        again = await c.call("sized", {"tag": "huge", "size": 2 * _MB}, idempotency_key="huge")
        assert not again.ok and again.cached and again.error.type == ErrorCode.OUTCOME_UNKNOWN
        assert "ran and answered" in again.error.message and "idempotency_cache_bytes" in again.error.message
    assert runs == {"huge": 1}
