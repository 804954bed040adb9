"""A call's retry budget (``retry``: ``max_attempts`` and the backoff) is the one its
function had when the call began. It was read when the first retry was due, from the spec
the client held then: the function registered again meanwhile with another policy (the
same code, new options) changed the budget of a call under way, both ways."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from fabric.client import Client
from fabric.errors import ErrorCode, Unavailable
from fabric.registry import Registry

_RUNS: list[str] = []
_GATE: dict[str, asyncio.Event] = {}


async def flaky(gate: bool = False) -> str:
    _RUNS.append("run")
    if gate:
        await _GATE["g"].wait()
    raise Unavailable("down")


def _register(reg: Registry, attempts: int) -> str:
    reg.function(
        flaky,
        name="flaky",
        timeout_s=30,
        warm=0,
        retry={"max_attempts": attempts, "initial_backoff_s": 0.001},
    )
    return "flaky"


async def _until(cond: Callable[[], bool], what: str, within_s: float = 5.0) -> None:
    limit = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < limit, what
        await asyncio.sleep(0.005)


@pytest.fixture(autouse=True)
def _clean():
    _RUNS.clear()
    _GATE.clear()
    yield
    _RUNS.clear()
    _GATE.clear()


@pytest.mark.parametrize("key", [None, "k"])
@pytest.mark.parametrize(("before", "after"), [(3, 1), (1, 4)])
async def test_a_call_keeps_the_retry_budget_it_began_with(key, before, after):
    reg = Registry()
    name = _register(reg, before)
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        _GATE["g"] = asyncio.Event()
        first = asyncio.create_task(c.call(name, {"gate": True}, idempotency_key=key))
        await _until(lambda: _RUNS == ["run"], "the call did not start")
        _register(reg, after)  # the same code, another retry policy
        assert reg.get(name).retry.max_attempts == after
        other = await c.call(name, {})  # a call made now: the new policy (and the client holds it)
        assert other.attempts == after, other
        _RUNS.clear()
        _GATE["g"].set()
        r = await first
        assert r.error is not None and r.error.type == ErrorCode.UNAVAILABLE, r.error
        assert r.attempts == before, (r.attempts, r.error.message)
        assert len(_RUNS) == before - 1  # its retries, sent after the gate opened
