"""Functions for the client tests (run in-process by FakeBackend; top level, so that the
few tests with real worker processes can import them there too)."""

from __future__ import annotations

import asyncio
import time

from fabric.errors import Unavailable
from fabric.registry import Registry

REG = Registry()


@REG.function(retry={"max_attempts": 3, "initial_backoff_s": 0.001, "max_backoff_s": 0.01})
def double(x: int) -> int:
    return 2 * x


@REG.function(retry={"max_attempts": 20, "initial_backoff_s": 0.01, "max_backoff_s": 0.01})
def slow_retry(x: int) -> int:
    return x


@REG.function()
def fail_user(x: int) -> int:
    raise KeyError(x)


@REG.tool(side_effects=True, retry={"max_attempts": 3, "initial_backoff_s": 0.001})
def effect(x: int) -> int:
    return x


@REG.function()
async def nap(seconds: float, tag: int = 0) -> int:
    await asyncio.sleep(seconds)
    return tag


@REG.function(hedge=False)
async def paid_nap(seconds: float, tag: int = 0) -> int:
    """Like ``nap``, but each call costs money: never hedged."""
    await asyncio.sleep(seconds)
    return tag


@REG.tool(side_effects=True, timeout_s=10)
def charge(path: str, amount: int, seconds: float = 0.0) -> int:
    """A side effect (a payment appended to ``path``), then slow work."""
    with open(path, "a") as f:
        f.write(f"{amount}\n")
    time.sleep(seconds)
    return amount


@REG.tool(side_effects=True, timeout_s=10)
async def deliver(path: str, seconds: float) -> str:
    """An async side effect that lands at the end (a delivery appended to ``path`` after
    ``seconds`` of work): a run cancelled before then leaves no line."""
    await asyncio.sleep(seconds)
    with open(path, "a") as f:  # noqa: ASYNC230 - a tiny write is the side effect under test
        f.write("delivered\n")
    return "delivered"


@REG.function(retry={"max_attempts": 5, "initial_backoff_s": 5.0, "max_backoff_s": 5.0})
def overloaded() -> int:
    """A dependency that is always down; its backoff (up to 5 s) dwarfs the tests' deadlines."""
    raise Unavailable("judge endpoint overloaded")


@REG.function(max_concurrency=1)
async def one_at_a_time(seconds: float) -> float:
    """Holds the client's only concurrency slot for ``seconds``."""
    await asyncio.sleep(seconds)
    return seconds


@REG.function(max_concurrency=2)
async def two_at_a_time(seconds: float) -> float:
    """Two calls in flight at most (hedges included)."""
    await asyncio.sleep(seconds)
    return seconds
