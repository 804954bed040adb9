"""A synchronous tool for the tests that run tools on the local backend's worker processes
(importable there: a worker takes its parent's ``sys.path``)."""

from __future__ import annotations

import time

import fabric

REG = fabric.Registry()


@REG.tool(warm=1, timeout_s=30)
def sleeper(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"
