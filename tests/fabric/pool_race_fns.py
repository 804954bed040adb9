"""Functions for test_pool_races (top level: the local backend's workers import them)."""

from __future__ import annotations

import asyncio
import os
import time

from fabric.registry import Registry

REG = Registry()

GATE_ENV = "FABRIC_TEST_SETUP_GATE"
"""A file's path: ``gated``'s setup hook waits until the test creates it (the workers inherit
the parent's environment)."""


@REG.function(warm=1, timeout_s=0.5, retry={"max_attempts": 1})
def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@REG.function(warm=1, max_concurrency=4, retry={"max_attempts": 1})
async def anap(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return seconds


def _gated_setup() -> None:
    gate = os.environ.get(GATE_ENV)
    while gate and not os.path.exists(gate):
        time.sleep(0.01)


@REG.function(warm=1, setup=_gated_setup)
def gated(x: int = 0) -> int:
    return x


def _break_the_runner() -> None:
    """In the worker: the runner's ``run_async`` raises for a payload that asks it to, as a
    bug of fabric's own there would (the function's raises are outcomes, never raised)."""
    from fabric.runner import FunctionRunner

    real = FunctionRunner.run_async

    async def run_async(self, raw, timeout_s, on_timer=None):
        if b"boom" in raw:
            raise RuntimeError("a bug in the runner")
        return await real(self, raw, timeout_s, on_timer)

    FunctionRunner.run_async = run_async


@REG.function(warm=1, timeout_s=1, max_concurrency=4, retry={"max_attempts": 1}, setup=_break_the_runner)
async def fragile(boom: bool = False) -> bool:
    return boom
