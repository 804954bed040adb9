"""The LLM proxy: one front door to the policy's engine replicas (a Ray actor in the job).

    proxy = LLMProxy({"default": [replica_a, replica_b], "H800": [replica_c]},
                     affinity={"frozenlake": "H800"})
    c = await proxy.generate(traj_id, "frozenlake", GenerateRequest(...))   # one turn
    await proxy.abort(traj_id)                    # its turn in flight returns "abort"
    await proxy.update_weights(3, [state_ref])    # suspend, load, resume every replica

Routing. A tag's generation runs on the replicas of its hardware group (``hw_affinity``
maps tags to Ray custom resources; the job places each group's replicas on them). Within
the group a trajectory sticks to the replica that served its first turn (**trajectory
affinity**: that replica's prefix cache holds the conversation so far); a new trajectory
goes to the least loaded one. ``release`` ends a trajectory's affinity, and aborts a turn
it left running or waiting (its caller timed out or was cancelled: under Ray the proxy's
side of a call runs on without its caller, and after ``release`` nothing could stop it); a
turn sent before the release that reaches the proxy after it (Ray does not order an
actor's calls) is answered ``abort`` without running (``turns_after_release``).

Weights. ``update_weights`` swaps every replica (suspend: the step in flight finishes;
load; resume) and remembers the latest version, so that a replica Ray restarted after a
crash gets it back before it serves again. The weights are published (the latest) only
once a replica took them: a recovery during an update waits for that (or the refusal). Every completion
carries the version that produced it.

Replica loss. A call that fails because the replica's process died (``ReplicaLost``), or a
turn answered with weights older than the proxy published before it was sent (the process
died while idle and Ray restarted it on its initial weights, which no error said), is
recovered here: wait for Ray to restart the actor (``max_restarts``), reload the latest
weights, run the turn again (a turn has no side effects: it is only tokens). So is a
replica whose process is up but whose engine died (``ReplicaEngineDead``, from the engine's
``EngineDeadError``: vLLM's engine core process died, the torch engine's batching loop
ended): every turn sent to it failed at once, so, never holding one in flight, it drew
most new turns by least-loaded routing. Its recovery first restarts it
(``Replica.restart``: a replica actor exits for Ray to restart it, an engine in this
process is closed and started again), then pings and reloads it as above. A replica
whose weight swap fails (the engine's own error) or takes past ``swap_timeout_s`` is
recovered too; an update fails only when no replica loaded its weights. While a replica
recovers its group's turns go to the others (the lost turn, new turns and those waiting
for a slot on it) when one is healthy, and weight updates skip it (its recovery loads the
latest); only a group with none healthy waits for a recovery, and a trajectory aborted or
released meanwhile stops waiting at once. A replica not back within ``recover_timeout_s``
(a ping or a reload it never answers included), or whose reload fails, leaves the group,
and the turns still running on it move to another replica; a group with none left fails
the turn with ``NoReplicaError``, which the env manager records as an ``infra_failed``
trajectory. A replica that left is tried again in the background (after
``rejoin_first_s``, backing off to ``rejoin_max_s``): once it answers, what it was running
is aborted, it gets the latest weights and rejoins its group. Only one gone for good
(``ReplicaGone``: Ray cannot place it) is never tried again. With no rejoin
(``rejoin_first_s`` None) what a dropped replica was running is aborted at once instead,
best effort (one round bounded by ``abort_timeout_s``): alive, it ran those turns, rerun
elsewhere, to their end for nobody.

The proxy actor itself is made without ``max_restarts`` (``core.cluster``): a restarted
proxy would come back from its constructor's arguments, at weights version 0 with no
record of the latest weights (a replica restarted after that is never reloaded, and its
stale turns are not even noticed), with every trajectory's affinity and abort flag and
every turn's request id gone (turns left running on the engines could not be stopped),
and with the turn scheduler's trace truncated. Its death stops the job with
``ProxyDiedError`` instead (``core.rollout.replicas.RemoteProxy``); resume from a
checkpoint.

Modules: ``replica_base`` (``Replica``, ``LocalReplica``, the replica errors),
``proxy_state`` (the state and shared helpers), ``proxy_routing`` (turns, aborts,
releases), ``proxy_weights`` (weight updates), ``proxy_recovery`` (recovery, drop, rejoin),
``wakes`` (the waits a recovery, a drop or an abort ends early); ``LLMProxy`` puts them
together.
"""

from __future__ import annotations

import asyncio
from typing import Any

from core.rollout.proxy_routing import ProxyRouting
from core.rollout.proxy_state import proxy_options
from core.rollout.proxy_weights import ProxyWeights
from core.rollout.replica_base import (
    LocalReplica,
    NoReplicaError,
    Replica,
    ReplicaEngineDead,
    ReplicaGone,
    ReplicaLost,
    swap_weights,
)

__all__ = [
    "LLMProxy",
    "LocalReplica",
    "NoReplicaError",
    "Replica",
    "ReplicaEngineDead",
    "ReplicaGone",
    "ReplicaLost",
    "proxy_options",
    "swap_weights",
]


class LLMProxy(ProxyRouting, ProxyWeights):
    """The proxy (a Ray actor in the job): ``ProxyRouting`` routes turns, ``ProxyWeights``
    swaps weights, ``ProxyRecovery`` recovers replicas, over ``ProxyState``."""

    async def aclose(self) -> None:
        """Stop the background work: recoveries, rejoins, aborts of turns that moved on."""
        tasks = [*self._recovering.values(), *self._rejoining.values(), *self._background]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.scheduler is not None:
            self.scheduler.close()

    def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "replicas": {g: [r.name for r in rs] for g, rs in self.groups.items()},
            "trajectories": len(self._sticky),
            **self.metrics,
            **({"scheduler": self.scheduler.stats()} if self.scheduler is not None else {}),
        }
