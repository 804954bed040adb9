"""The LLM proxy's weight updates (see ``core.rollout.llm_proxy``, "Weights")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from core.rollout.engines.base import EngineError
from core.rollout.proxy_recovery import ProxyRecovery
from core.rollout.proxy_state import _unwrap
from core.rollout.replica_base import Replica, ReplicaGone, ReplicaLost

# one logger for the proxy, whichever of its modules speaks
log = logging.getLogger("core.rollout.llm_proxy")


class ProxyWeights(ProxyRecovery):
    """Weight updates: every healthy replica swaps; one that fails or hangs is recovered."""

    async def update_weights(self, version: int, state: Any) -> None:
        """Install ``state`` (a state dict, or ``[ObjectRef]`` of one) as ``version`` on every
        replica. A replica that is down gets it when it comes back.

        ``version`` names these weights for good: an engine skips a version it holds without
        looking at the weights (``Engine.swap``), so other weights must never be sent under a
        number sent before, refused or not (a replica may have loaded a refused update). The
        job never does: see ``Engine.swap`` for why."""
        if version < self.version:
            raise EngineError(f"weights version {version} is older than the proxy's {self.version}")
        t0 = time.perf_counter()
        # the weights become the latest (what a recovery loads) once a replica took them,
        # and an update no replica could load publishes nothing: a recovery meanwhile waits
        # for the update to be decided (``_revive``), not for its slowest replica
        decided = False

        def decide() -> None:
            nonlocal decided
            if not decided:
                decided = True
                self._undecided -= 1
                if not self._undecided:
                    self._decided.set()

        self._undecided += 1
        self._decided.clear()
        try:
            await self._update(version, state, decide)
        finally:
            decide()
        self.metrics["weight_updates"] += 1
        self.metrics["weight_update_ms"] += round((time.perf_counter() - t0) * 1000)

    async def _update(self, version: int, state: Any, decide: Callable[[], None]) -> None:
        def publish() -> None:
            # the latest is set before the recoveries waiting for the decision are woken
            if self._latest is None or self._latest[0] <= version:
                self._latest = (version, state)
            decide()

        async def swap(replica: Replica) -> None:
            await self._swap_within(replica, version, _unwrap(state))
            publish()  # one replica took them: the update can no longer be refused

        # a replica being recovered is skipped: its recovery loads the latest weights before
        # it serves, and a stuck one held every update for swap_timeout_s again
        replicas = [r for rs in self.groups.values() for r in rs if self._healthy(r)]
        results = await asyncio.gather(*(swap(r) for r in replicas), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, Exception):
                raise res
        lost = [(r, res) for r, res in zip(replicas, results, strict=True) if isinstance(res, ReplicaLost)]
        failed = [
            (r, res)
            for r, res in zip(replicas, results, strict=True)
            if isinstance(res, Exception) and not isinstance(res, ReplicaLost)
        ]
        for r, err in failed:
            self.metrics["swap_errors"] += 1
            log.error("replica %s failed to load weights version %d: %r", r.name, version, err)
        if failed and not any(res is None for res in results):
            # no replica took them: the weights are at fault (a shape no engine accepts), not
            # a replica; each keeps the weights it holds, and the job stops on the error
            for r, err in lost:
                self._spawn_recover(r, gone=isinstance(err, ReplicaGone))
            raise failed[0][1]
        publish()  # (no replica took them, none refused them: those lost are reloaded)
        self.version = version
        for r, err in lost:
            self._spawn_recover(r, gone=isinstance(err, ReplicaGone))
        # the engine's own error (out of memory while loading): left in service it would
        # serve the old weights (every turn found stale); its recovery routes around it,
        # reloads the latest, and drops it if the reload fails too
        for r, _ in failed:
            self._spawn_recover(r, gone=False)

    async def _swap_within(self, replica: Replica, version: int, state: Any) -> None:
        try:
            async with asyncio.timeout(self.swap_timeout_s):
                await self._on(replica, replica.swap(version, state))
        except TimeoutError:
            self.metrics["swap_timeouts"] += 1
            log.warning(
                "replica %s did not swap in weights version %d within %g s; recovering it",
                replica.name,
                version,
                self.swap_timeout_s,
            )
            took = f"the weights swap took over {self.swap_timeout_s:g} s"
            raise ReplicaLost(f"{replica.name}: {took}") from None
