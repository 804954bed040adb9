"""How the LLM proxy reaches an engine replica, and how a replica fails.

``Replica`` is the proxy's view of one engine: ``LocalReplica`` in the proxy's own process
(tests, single-process runs), ``core.rollout.replicas.RayReplica`` as a Ray actor. A replica
whose process died raises ``ReplicaLost`` (it may come back: Ray restarts it), one that
cannot come back ``ReplicaGone``; a tag's group with no replica left is ``NoReplicaError``.
One whose process is up but whose engine died (``EngineDeadError``) raises
``ReplicaEngineDead``, a loss too: its recovery restarts it (``Replica.restart``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from core.rollout.engines.base import Completion, Engine, EngineDeadError, EngineError, GenerateRequest


class ReplicaLost(EngineError):
    """The replica's process died or is restarting; the call may be retried on it later."""


class ReplicaGone(ReplicaLost):
    """The replica died for good (out of restarts)."""


class ReplicaEngineDead(ReplicaLost):
    """The replica's engine died though its process is up: every turn sent to it failed at
    once with the engine's error (vLLM's engine core process died), and least-loaded routing,
    seeing none in flight, sent it most new turns. A loss like any other: its turns move on
    and its recovery restarts it (``Replica.restart``) before it reloads the latest weights."""


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
        """The replica's weights version (raises ``ReplicaLost`` while it is down,
        ``ReplicaEngineDead`` while its engine is dead)."""

    async def restart(self) -> None:  # noqa: B027 - optional: a replica that cannot is dropped
        """Restart a dead engine (its ping raised ``ReplicaEngineDead``); the recovery pings
        again after it. One that cannot stays dead, and its recovery drops it once
        ``recover_timeout_s`` is over, saying why."""


class LocalReplica(Replica):
    """An engine in the proxy's own process (tests, single-process runs)."""

    def __init__(self, engine: Engine, name: str = "local"):
        self.engine, self.name = engine, name

    async def generate(self, request: GenerateRequest) -> Completion:
        try:
            return await self.engine.generate(request)
        except EngineDeadError as e:
            raise ReplicaEngineDead(f"{self.name}: {e}") from e

    async def abort(self, request_id: str) -> bool:
        return await self.engine.abort(request_id)

    async def swap(self, version: int, state: Any) -> None:
        try:
            await swap_weights(self.engine, version, state)
        except EngineDeadError as e:
            raise ReplicaEngineDead(f"{self.name}: {e}") from e

    async def ping(self) -> int:
        try:
            self.engine.check_alive()
        except EngineDeadError as e:
            raise ReplicaEngineDead(f"{self.name}: {e}") from e
        return self.engine.version

    async def restart(self) -> None:
        """In this process: the engine's own restart (close its backend, start it again)."""
        await self.engine.restart()


async def swap_weights(engine: Engine, version: int, state: Mapping[str, Any]) -> None:
    await engine.swap(state, version)
