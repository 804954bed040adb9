"""Functions the CLI, bench and conformance tests run (top level: workers and
``check_function`` import them by entry point)."""

from __future__ import annotations

import asyncio
import threading
import time

from fabric.registry import Registry

REG = Registry()
_EXAMPLE = ({"traj": "a"},)
SLOW_CALLS = 0
"""Calls of ``cli_slow`` in this process (the bench's in-process ones; workers count their own)."""
RELEASE = threading.Event()
"""Set by a test to end ``cli_hangs`` calls left running in its process."""


@REG.reward(examples=_EXAMPLE)
def cli_raises(traj: str) -> float:
    raise ValueError("bad trajectory")


@REG.reward(examples=_EXAMPLE)
def cli_prints(traj: str) -> float:
    print("debug:", traj)
    return 1.0


@REG.reward(examples=_EXAMPLE)
def cli_slow(traj: str) -> float:
    global SLOW_CALLS
    SLOW_CALLS += 1
    time.sleep(0.02)
    return 1.0


@REG.reward(examples=_EXAMPLE)
async def cli_async(traj: str) -> float:
    await asyncio.sleep(0.002)
    return 1.0


def _no_model() -> None:
    raise RuntimeError("no model here")


@REG.reward(examples=_EXAMPLE, setup=_no_model)
def cli_bad_setup(traj: str) -> float:
    return 1.0


@REG.reward(examples=_EXAMPLE, timeout_s=0.3, retry={"max_attempts": 1})
def cli_hangs(traj: str = "") -> float:
    RELEASE.wait(60)
    return 1.0


@REG.reward(examples=({"traj": "a", "weight": float("nan")},))
def cli_nan_example(traj: str, weight: float = 1.0) -> float:
    return 1.0


@REG.reward(examples=_EXAMPLE, retry={"max_attempts": 1})
def cli_fails_in_workers(traj: str) -> float:
    """Answers in the bench's own process (its direct measurement) and fails in every worker."""
    import os

    if "FABRIC_WORKER_FD" in os.environ:
        raise RuntimeError("this worker cannot score")
    return 1.0


_WORKER_CALLS = 0


@REG.reward(examples=_EXAMPLE, retry={"max_attempts": 1}, hedge=False)
def cli_fails_every_other_call_in_workers(traj: str) -> float:
    """Every second call in a worker fails (the first answers: the cold-start call)."""
    import os

    global _WORKER_CALLS
    if "FABRIC_WORKER_FD" in os.environ:
        _WORKER_CALLS += 1
        if _WORKER_CALLS % 2 == 0:
            raise RuntimeError("even call")
    return 1.0


_CALLS_HERE = 0


@REG.reward(examples=_EXAMPLE, retry={"max_attempts": 1}, hedge=False)
def cli_fails_every_other_call(traj: str) -> float:
    """Every second call in each process fails, wherever it runs (a Ray actor too); the
    bench's own direct calls answer."""
    global _CALLS_HERE
    if threading.current_thread().name == "fabric-bench-direct":
        return 1.0
    _CALLS_HERE += 1
    if _CALLS_HERE % 2 == 0:
        raise RuntimeError("even call")
    return 1.0


@REG.reward(examples=_EXAMPLE)
def cli_slower_in_the_bench(traj: str) -> float:
    """Slower in the benchmark's own process (its direct calls) than in a worker: a negative
    overhead, as a heavy function's noise gives."""
    time.sleep(0.02 if threading.current_thread().name == "fabric-bench-direct" else 0.002)
    return 1.0
