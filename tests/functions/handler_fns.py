"""Functions the Lambda handler tests serve (``RL_FABRIC_MODULES=...,handler_fns``).

They run in the test process, so ``CALLS`` counts real executions: what idempotency is
supposed to prevent."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fabric.errors import Unavailable
from fabric.registry import Registry
from fabric.runner import time_left_s

REG = Registry()
CALLS: Counter[str] = Counter()
"""Executions per function and key, e.g. ``CALLS["counted:a"]``."""


@REG.function
def counted(key: str, salt: int = 0) -> dict[str, Any]:
    """Counts its executions."""
    CALLS[f"counted:{key}"] += 1
    return {"key": key, "n": CALLS[f"counted:{key}"]}


@REG.function
def flaky(key: str, fail_times: int = 1) -> str:
    """Fails with the retryable ``Unavailable`` the first ``fail_times`` executions per key."""
    CALLS[f"flaky:{key}"] += 1
    if CALLS[f"flaky:{key}"] <= fail_times:
        raise Unavailable(f"judge endpoint overloaded (execution {CALLS[f'flaky:{key}']})")
    return "recovered"


@REG.function
def broken(key: str) -> str:
    """A deterministic user error (final, so it is cached under an idempotency key)."""
    CALLS[f"broken:{key}"] += 1
    raise ValueError(f"bad input {key!r}")


@REG.function
async def async_double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


@REG.function
async def async_sleepy(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "woke"


@REG.tool(side_effects=True)
async def async_effect(key: str, seconds: float) -> str:
    """A side effect first, then slow bookkeeping."""
    CALLS[f"async_effect:{key}"] += 1
    await asyncio.sleep(seconds)
    return "done"


@REG.function
async def loop_id() -> int:
    """Which event loop ran the call: the handler keeps one per container."""
    return id(asyncio.get_running_loop())


@REG.function
def sync_time_left() -> float | None:
    return time_left_s()


@REG.function
def big(key: str, n: int, char: str = "x") -> str:
    """A result of ``n`` characters (over 350 KB it cannot be stored for idempotency)."""
    CALLS[f"big:{key}"] += 1
    return char * n


def _failing_setup() -> Any:
    raise RuntimeError("model weights not found")


@REG.function(setup=_failing_setup)
def needs_setup(x: int, ctx: Any = None) -> int:
    return x


@REG.function
def reentrant(key: str) -> dict[str, Any]:
    """Invokes the handler again with its own idempotency key while it is itself in
    progress: the inner call must be refused as in progress, not run."""
    from fabric.protocol import Invocation
    from functions import handler

    inner = Invocation(function="reentrant", payload={"key": key}, idempotency_key=key)
    return handler.handler(inner.model_dump(mode="json"), LambdaContext(aws_request_id="inner"))


@dataclass
class LambdaContext:
    """The attributes of Lambda's context object that powertools reads."""

    function_name: str = "rl-fabric-test"
    memory_limit_in_mb: int = 512
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:123456789012:function:rl-fabric-test"
    aws_request_id: str = "aws-request-1"
    remaining_ms: int = 30_000

    def get_remaining_time_in_millis(self) -> int:
        return self.remaining_ms
