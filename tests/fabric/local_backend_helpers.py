"""What the local backend's test modules (test_local_backend*.py) share: a client on the
local backend over sample_fns' functions, a process probe, and a poll with a bound."""

from __future__ import annotations

import asyncio
import os
import time

from sample_fns import REG

from fabric.backends.base import LocalConfig
from fabric.client import Client


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:  # gone, or reaped between the open and the read (ESRCH)
        return False


def local(**kw) -> Client:
    return Client(backend=LocalConfig(**kw), registry=REG)


async def _until(predicate, what: str, within_s: float = 10.0) -> None:
    """Poll ``predicate`` until it holds (a loaded machine may take a while)."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)
