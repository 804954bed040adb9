"""Functions that report ``fabric.runner.time_left_s()`` from inside their run (imported by
the local backend's workers by this module's name)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fabric.registry import Registry
from fabric.runner import time_left_s

REG = Registry()


@REG.function(warm=0, timeout_s=5)
async def time_left(nap: float = 0.0) -> list[float | None]:
    """What the run has left at its start and after ``nap`` seconds."""
    before = time_left_s()
    await asyncio.sleep(nap)
    return [before, time_left_s()]


@REG.function(warm=0, timeout_s=5)
def time_left_sync(nap: float = 0.0) -> list[float | None]:
    """What a synchronous run has left at its start and after ``nap`` seconds."""
    before = time_left_s()
    time.sleep(nap)
    return [before, time_left_s()]


@REG.function(warm=0, timeout_s=20)
async def time_left_moving(started: str) -> list[float | None]:
    """Waits, within its run's limit, until what it has left grows (a later deadline came)."""
    Path(started).touch()  # noqa: ASYNC240 - a marker file, instant
    before = time_left_s()
    assert before is not None
    # no event to wait on: the move is only seen by asking; cut at its limit if it never comes
    while (time_left_s() or 0.0) < before + 2.0:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    return [before, time_left_s()]


@REG.function(warm=0, timeout_s=5)
async def time_left_in_a_thread() -> float | None:
    """What a blocking helper the handler runs on a thread (asyncio.to_thread) reads."""
    return await asyncio.to_thread(time_left_s)
