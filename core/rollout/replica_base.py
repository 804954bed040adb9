"""How the LLM proxy reaches an engine replica, and how a replica fails.

``Replica`` is the proxy's view of one engine: ``LocalReplica`` in the proxy's own process
(tests, single-process runs), ``core.rollout.replicas.RayReplica`` as a Ray actor. A replica
whose process died raises ``ReplicaLost`` (it may come back: Ray restarts it), one that
cannot come back ``ReplicaGone``; a tag's group with no replica left is ``NoReplicaError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from core.rollout.engines.base import Completion, Engine, EngineError, GenerateRequest


class ReplicaLost(EngineError):
    """The replica's process died or is restarting; the call may be retried on it later."""


class ReplicaGone(ReplicaLost):
    """The replica died for good (out of restarts)."""


class NoReplicaError(EngineError):
    """No replica is left to serve a tag's hardware group."""


class Replica(ABC):
    """How the proxy reaches one engine: in this process or as a Ray actor."""

    name: str = "replica"

    @abstractmethod
    async def generate(self, request: GenerateRequest) -> Completion: ...

    @abstractmethod
    async def abort(self, request_id: str) -> bool: ...

    @abstractmethod
    async def swap(self, version: int, state: Any) -> None:
        """Suspend, load ``state`` as ``version``, resume."""

    @abstractmethod
    async def ping(self) -> int:
        """The replica's weights version (raises ``ReplicaLost`` while it is down)."""


class LocalReplica(Replica):
    """An engine in the proxy's own process (tests, single-process runs)."""

    def __init__(self, engine: Engine, name: str = "local"):
        self.engine, self.name = engine, name

    async def generate(self, request: GenerateRequest) -> Completion:
        return await self.engine.generate(request)

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def swap(self, version: int, state: Any) -> None:
        await swap_weights(self.engine, version, state)

    async def ping(self) -> int:
        return self.engine.version


async def swap_weights(engine: Engine, version: int, state: Mapping[str, Any]) -> None:
    await engine.swap(state, version)
