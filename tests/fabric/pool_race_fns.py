"""Functions for test_pool_races (top level: the local backend's workers import them)."""

from __future__ import annotations

import time

from fabric.registry import Registry

REG = Registry()


@REG.function(warm=1, timeout_s=0.5, retry={"max_attempts": 1})
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
