"""Functions for test_pool_review11 (top level: the local backend's workers import them)."""

from __future__ import annotations

import asyncio

from fabric.registry import Registry

REG = Registry()


@REG.function(timeout_s=0.3, max_concurrency=8, retry={"max_attempts": 1})
async def stubborn(seconds: float, deaf: bool = False) -> float:
    """Sleeps ``seconds``; ``deaf``: swallowing every cancellation (a polling loop with a bare
    ``except``), its timeout included, so it runs on past ``timeout_s``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        try:
            await asyncio.sleep(0.02)
        except BaseException:  # the bug under test: every cancellation swallowed
            if not deaf:
                raise
    return seconds


@REG.function(timeout_s=0.5, max_concurrency=4)
def chaos(i: int) -> int:
    """Mostly quick; some slow (stragglers to hedge), some past the timeout, a few crash."""
    import os
    import time

    if i % 37 == 5:
        os._exit(1)
    if i % 23 == 3:
        time.sleep(1.0)  # past timeout_s: its worker is killed
    elif i % 7 == 1:
        time.sleep(0.05)
    return i


@REG.function(timeout_s=0.5, max_concurrency=4)
async def achaos(i: int) -> int:
    import os

    if i % 37 == 5:
        os._exit(1)
    if i % 23 == 3:
        await asyncio.sleep(1.0)
    elif i % 7 == 1:
        await asyncio.sleep(0.05)
    return i
