"""What ``check_function`` reports of functions that run in the check but fail, or stall
their worker, once deployed."""

from __future__ import annotations

import asyncio
import time

import pytest

from fabric.registry import Registry
from fabric.testing import ConformanceError, check_function

REG = Registry()
_EXAMPLE = ({"traj": "a"},)


@REG.tool(examples=({"q": "a"},))
def huge_int(q: str) -> int:
    return 10**5000  # encoded, but no JSON parser reads it back (over 4,300 digits)


@REG.reward(examples=_EXAMPLE)
def huge_reward(traj: str) -> int:
    return 10**5000


@REG.reward(examples=_EXAMPLE, timeout_s=0.05)
def sync_past_its_limit(traj: str) -> float:
    time.sleep(0.2)  # a worker kills the call at 0.05 s: FunctionTimeout every time
    return 1.0


@REG.reward(examples=_EXAMPLE, timeout_s=0.05)
async def async_past_its_limit(traj: str) -> float:
    await asyncio.sleep(0.2)
    return 1.0


@REG.reward(examples=_EXAMPLE)
async def blocks_its_loop(traj: str) -> float:
    time.sleep(1.2)  # noqa: ASYNC251 - the blocking call in async def under test
    return 1.0


@REG.reward(examples=_EXAMPLE)
async def awaits(traj: str) -> float:
    await asyncio.sleep(0.05)
    return 1.0


def problems_of(name: str) -> str:
    with pytest.raises(ConformanceError) as e:
        check_function(name, REG)
    return "\n".join(e.value.problems)


def test_a_result_that_cannot_be_read_back_is_listed():
    """It passed for a tool (the result was never decoded) and raised ValueError out of
    check_function for a reward; a worker answers every call of it ResultNotSerializable."""
    assert "example 0: returned a value that cannot be read back as JSON" in problems_of("huge_int")
    assert "example 0: returned a value that cannot be read back as JSON" in problems_of("huge_reward")


def test_an_example_past_timeout_s_is_listed_sync_or_async():
    """A synchronous function ran to its end in the check, past its timeout_s: deployed,
    its worker is killed there and every such call fails FunctionTimeout."""
    assert "example 0 ran past its timeout_s=0.05" in problems_of("sync_past_its_limit")
    assert "example 0 failed: FunctionTimeout" in problems_of("async_past_its_limit")


def test_an_async_function_that_blocks_its_event_loop_is_listed():
    report = problems_of("blocks_its_loop")
    assert "blocked its event loop" in report and "asyncio.to_thread" in report


def test_an_async_function_that_awaits_passes():
    check_function("awaits", REG)


_WARMED = False


@REG.reward(examples=_EXAMPLE)
async def blocks_once(traj: str) -> float:
    """Blocks on its first call only, as a lazy import of a heavy module does: a worker's
    cold start, not a call that stalls its worker every time."""
    global _WARMED
    if not _WARMED:
        _WARMED = True
        time.sleep(1.2)  # noqa: ASYNC251 - a one-time blocking warm-up under test
    return 1.0


def test_an_async_function_that_blocks_on_its_first_call_only_passes():
    check_function("blocks_once", REG)
