"""rl-fabric: stateless reward and tool functions behind one resilient async client.

import fabric

@fabric.reward(warm=2)
def exact(traj: fabric.Trajectory, *, ground_truth: str) -> float: ...

async with fabric.Client(backend="local") as c:
    r = await c.call("exact", {"traj": t, "ground_truth": "42"})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fabric.errors import ErrorCode, FabricError, InvocationError, Misconfigured, Unavailable
from fabric.protocol import ErrorInfo, Invocation, Message, Result, RewardResult, Timings, Trajectory
from fabric.registry import Registry, default_registry
from fabric.spec import FunctionSpec, Resources, RetryPolicy

if TYPE_CHECKING:
    from fabric.client import Client, ClientConfig

__version__ = "0.1.0"

reward = default_registry.reward
tool = default_registry.tool
function = default_registry.function


def __getattr__(name: str) -> Any:
    # the client pulls in tenacity and the backends; worker processes never need it
    if name in ("Client", "ClientConfig"):
        from fabric import client

        return getattr(client, name)
    raise AttributeError(f"module 'fabric' has no attribute {name!r}")


__all__ = [
    "Client",
    "ClientConfig",
    "ErrorCode",
    "ErrorInfo",
    "FabricError",
    "FunctionSpec",
    "Invocation",
    "InvocationError",
    "Message",
    "Misconfigured",
    "Registry",
    "Resources",
    "Result",
    "RetryPolicy",
    "RewardResult",
    "Timings",
    "Trajectory",
    "Unavailable",
    "default_registry",
    "function",
    "reward",
    "tool",
]
