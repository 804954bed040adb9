"""A reward whose time is spent waiting (an LLM judge or a remote reward model behind it),
for the isolation benchmark: what tenants then share is the pool's slots, not the CPU."""

from __future__ import annotations

import asyncio

import fabric


@fabric.reward(name="io_reward", warm=2, max_concurrency=16, timeout_s=10)
async def io_reward(answer: str, wait_ms: float = 10.0) -> float:
    await asyncio.sleep(wait_ms / 1000)
    return float(answer == "4")
