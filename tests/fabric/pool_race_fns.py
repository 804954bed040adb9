"""Functions for test_pool_races (top level: the local backend's workers import them)."""

from __future__ import annotations

import asyncio
import time

from fabric.registry import Registry

REG = Registry()


@REG.function(warm=1, timeout_s=0.5, retry={"max_attempts": 1})
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@REG.function(warm=1, max_concurrency=4, retry={"max_attempts": 1})
async def anap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds
