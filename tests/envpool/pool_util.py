"""Helpers shared by the pool's test modules: a pool on the echo bundle, a process probe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from envpool.pool import EnvPool
from envpool.runtimes.base import Runtime

R = TypeVar("R", bound=Runtime)


def pool(images, **cfg) -> EnvPool:
    cfg.setdefault("min_warm", 1)
    cfg.setdefault("runtime", {"heartbeat_s": 0.1})
    return EnvPool(cfg, images=images)


async def swap_runtime(p: EnvPool, runtime: R) -> R:
    """Give ``p`` another runtime (the pool only asks its runtime), closing the one it made."""
    await p.runtime.aclose()
    p.runtime = runtime
    return runtime


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a stopped container's reaped or not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:  # gone, or reaped between the open and the read (ESRCH): not alive
        return False
    return stat.rpartition(") ")[2][:1] != "Z"


async def wait_for(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until ``check()`` holds (the cap only bounds a failure)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)
