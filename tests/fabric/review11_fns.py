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
