"""Engine replicas as Ray actors, and the adapters the proxy and env managers call them by.

    handle = ray.remote(EngineReplicaActor).options(max_restarts=3, resources={"H800": 1}).remote(...)
    proxy = LLMProxy({"H800": [RayReplica(handle, "H800-0")]})

``EngineReplicaActor`` owns one ``Engine`` (built in its own process from the job's policy
bundle, so a restarted actor rebuilds it and the proxy reloads the latest weights).
``RayReplica`` turns Ray's actor failures into ``ReplicaLost`` for the proxy, and its
engine's death (``EngineDeadError``, the process up) into ``ReplicaEngineDead``, whose
recovery has Ray restart the actor (``restart``).
``RemoteProxy`` is what an env manager holds: the proxy actor's methods as coroutines, its
death turned into ``ProxyDiedError`` (and told to ``on_died`` once).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from core.config_backends import TORCH_ENGINE_KEYS
from core.errors import DiskFullError, ProxyDiedError, disk_full
from core.rollout.coalesce import Answer, Coalescer, answer_all
from core.rollout.engines.base import Completion, Engine, EngineDeadError, GenerateRequest, engine_registry
from core.rollout.llm_proxy import Replica, ReplicaEngineDead, ReplicaGone, ReplicaLost, swap_weights

if TYPE_CHECKING:
    # not at run time: the proxy actor unpickles RayReplica (this module) and never needs
    # torch, whose import was a third of a job's start (three actor processes, two cores)
    from core.policy.bundle import PolicyBundle

log = logging.getLogger(__name__)


def make_engine(
    backend: str, bundle: PolicyBundle | str | None, kwargs: dict[str, Any], *, seed: int, model: str
) -> Engine:
    """The job's engine for ``backend``: the torch engine runs the bundle's ``TinyLM``;
    other backends get ``model`` (the job's ``engine.model``) and ``kwargs`` as they are."""
    if backend == "torch":
        from core.policy.bundle import PolicyBundle
        from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig

        if bundle is None:
            raise ValueError("the torch engine needs the job's policy bundle")
        if isinstance(bundle, str):
            bundle = PolicyBundle.load(bundle)
        # JobConfig refused any other key; the rest shape the model (the bundle has it)
        serving = {k: v for k, v in kwargs.items() if k in TORCH_ENGINE_KEYS}
        return TorchEngine(bundle.model(), bundle.tok(), TorchEngineConfig(seed=seed, **serving))
    if "model" in kwargs:
        raise ValueError("give the model as engine.model, not in engine.kwargs")
    if backend == "vllm":
        # the job's seed, one per replica (engine.kwargs.seed overrides it): every replica
        # sampled unseeded requests from the same stream at vLLM's seed 0
        kwargs = {"seed": seed, **kwargs}
    return engine_registry.create(backend, model=model, **kwargs)


#: Request ids an engine replica actor remembers (the newest) that an abort found nowhere.
OVERTAKEN_WINDOW = 65_536


class EngineReplicaActor:
    """One engine replica in its own process (wrap with ``ray.remote``)."""

    def __init__(
        self,
        backend: str,
        bundle: PolicyBundle | str | None,
        kwargs: dict[str, Any],
        *,
        seed: int,
        name: str,
        model: str,
    ):
        self.name = name
        self.engine = make_engine(backend, bundle, kwargs, seed=seed, model=model)
        # request ids an abort found nowhere: the proxy's turn waits up to the coalescing
        # window before it is sent here while its abort goes at once, and Ray runs an async
        # actor's calls in any order, so an abort can arrive before its turn, which then ran
        # to its end for nobody, holding a batch slot. Such a turn is answered aborted. A
        # blind abort of a finished turn is remembered too (the window bounds them): the
        # proxy never sends an id again once it asked to abort it (a rerun has its own)
        self._overtaken: OrderedDict[str, None] = OrderedDict()

    async def generate(self, request: GenerateRequest) -> Completion:
        if request.request_id in self._overtaken:
            del self._overtaken[request.request_id]
            return Completion.not_run(request, self.engine.version)
        return await self.engine.generate(request)

    async def generate_many(self, requests: list[GenerateRequest]) -> AsyncIterator[list[Answer]]:
        """Coalesced turns (see ``core.rollout.coalesce``), answered as each finishes."""
        async for answers in answer_all((r.request_id, self.generate(r)) for r in requests):
            yield answers

    async def abort(self, request_id: str) -> bool:
        stopped = await self.engine.abort(request_id)
        if not stopped:
            self._overtaken[request_id] = None
            if len(self._overtaken) > OVERTAKEN_WINDOW:
                self._overtaken.popitem(last=False)
        return stopped

    async def swap(self, version: int, state: Any) -> None:
        await swap_weights(self.engine, version, state)

    async def ping(self) -> int:
        self.engine.check_alive()  # a dead engine's replica is not back (ReplicaEngineDead)
        return self.engine.version

    def restart(self) -> bool:
        """Exit this process if its engine is dead, so that Ray restarts the actor: a fresh
        process rebuilds the engine (a vLLM engine core that died may have left its GPU
        memory in any state), and the proxy's recovery reloads the latest weights. False,
        and nothing done, when the engine is alive: the call reached the process Ray
        restarted already (a kill from outside could have hit that one too)."""
        why = self.engine.dead
        if why is None:
            return False
        log.error(
            "engine replica %s: its engine is dead (%s); exiting for Ray to restart it",
            self.name,
            why,
        )
        logging.shutdown()  # (the exit skips the handlers' flush)
        os._exit(1)  # not exit_actor(): Ray restarts an actor only after an unexpected exit

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.engine.version, **getattr(self.engine, "stats", {})}


class RayReplica(Replica):
    """The proxy's handle on an ``EngineReplicaActor``."""

    def __init__(self, handle: Any, name: str):
        self.handle, self.name = handle, name
        self._coalescer: Coalescer | None = None

    def __getstate__(self) -> dict[str, Any]:  # shipped to the proxy actor: no loop state
        return {"handle": self.handle, "name": self.name, "_coalescer": None}

    def _lost(self, e: BaseException) -> BaseException:
        import ray.exceptions as rex

        if isinstance(e, rex.ActorUnschedulableError):
            return ReplicaGone(f"{self.name}: {_first_line(e)}")
        if isinstance(e, rex.RayActorError):
            return ReplicaLost(f"{self.name}: {_first_line(e)}")
        return e

    async def _call(self, method: str, *args: Any) -> Any:
        import ray.exceptions as rex

        try:
            return await getattr(self.handle, method).remote(*args)
        except rex.ActorDiedError as e:
            # Ray says "died" both for a process that will restart and for one out of
            # restarts; the proxy's ping tells them apart (a gone actor never answers)
            raise ReplicaLost(f"{self.name}: {_first_line(e)}") from e
        except rex.RayActorError as e:  # unavailable: restarting, or the node is unreachable
            raise ReplicaLost(f"{self.name}: {_first_line(e)}") from e
        except rex.ActorUnschedulableError as e:
            raise ReplicaGone(f"{self.name}: {_first_line(e)}") from e
        except Exception as e:
            # Ray's RayTaskError is an instance of the error the actor raised, its cause
            cause = getattr(e, "cause", None)
            if isinstance(cause, EngineDeadError) or isinstance(e, EngineDeadError):
                raise ReplicaEngineDead(f"{self.name}: {_first_line(cause or e)}") from e
            raise

    async def generate(self, request: GenerateRequest) -> Completion:
        if self._coalescer is None:
            many = self.handle.generate_many.options(num_returns="streaming")
            self._coalescer = Coalescer(many.remote, on_error=self._lost)
        try:
            result: Completion = await self._coalescer.call(request.request_id, request)
        except EngineDeadError as e:  # (an answer's error comes back as itself)
            raise ReplicaEngineDead(f"{self.name}: {e}") from e
        return result

    async def abort(self, request_id: str) -> bool:
        return bool(await self._call("abort", request_id))

    async def swap(self, version: int, state: Any) -> None:
        await self._call("swap", version, state)

    async def ping(self) -> int:
        return int(await self._call("ping"))

    async def restart(self) -> None:
        """Have the actor exit if its engine is dead (``EngineReplicaActor.restart``): Ray
        restarts it (``engine.max_restarts``); the recovery's pings wait for the new one."""
        try:
            await self._call("restart")
        except ReplicaLost:
            pass  # it exited, as asked: Ray restarts it


T = TypeVar("T")


class RemoteProxy:
    """An ``LLMProxy`` actor's methods as coroutines (what env managers hold). Once the actor
    died, every call raises ``ProxyDiedError`` (without a Ray call) and ``on_died`` is
    told, once: the job stops on it. A full disk under a file the actor writes (the turn
    scheduler's trace) is raised as ``DiskFullError`` and told to ``on_disk_full``, once:
    the job stops on it too."""

    def __init__(
        self,
        handle: Any,
        on_died: Callable[[ProxyDiedError], None] | None = None,
        on_disk_full: Callable[[DiskFullError], None] | None = None,
    ):
        self.handle = handle
        self.on_died = on_died
        self.on_disk_full = on_disk_full
        self.died: str | None = None
        """Why the actor is dead (Ray's word), once a call found it so."""
        self._disk_full_told = False
        self._coalescer: Coalescer | None = None

    def _translated(self, e: BaseException) -> BaseException:
        # a turn's error comes back as itself (an answer of generate_many), another call's
        # as Ray's RayTaskError around it
        full = disk_full(e) or disk_full(getattr(e, "cause", None))
        if full is not None:
            if not self._disk_full_told and self.on_disk_full is not None:
                self._disk_full_told = True
                self.on_disk_full(full)
            return full
        cause = proxy_died(e)
        if cause is None:
            return e
        first = self.died is None
        self.died = self.died or cause
        err = ProxyDiedError(self.died)
        if first and self.on_died is not None:
            self.on_died(ProxyDiedError(self.died))
        return err

    def _check(self) -> None:
        if self.died is not None:
            raise ProxyDiedError(self.died)

    async def call(self, aw: Awaitable[T]) -> T:
        """``aw`` (a call of the proxy actor), its death raised as ``ProxyDiedError``."""
        if self.died is not None:
            if asyncio.iscoroutine(aw):
                aw.close()
            raise ProxyDiedError(self.died)
        try:
            return await aw
        except Exception as e:
            err = self._translated(e)
            if err is e:
                raise
            raise err from None

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        self._check()
        if self._coalescer is None:
            send = self.handle.generate_many.options(num_returns="streaming").remote
            self._coalescer = Coalescer(send, on_error=self._translated)
        turn = self._coalescer.call(request.request_id, (traj_id, tag, request))
        result: Completion = await self.call(turn)
        return result

    async def abort(self, traj_id: str) -> int:
        self._check()  # before .remote(), which sends the call
        return int(await self.call(self.handle.abort.remote(traj_id)))

    async def release(self, traj_id: str) -> None:
        self._check()
        await self.call(self.handle.release.remote(traj_id))


def proxy_died(e: BaseException) -> str | None:
    """The message of ``ProxyDiedError`` when ``e`` says the proxy actor died, else None.
    (Ray's ActorUnavailableError, a node unreachable for a while, is not death.)"""
    import ray.exceptions as rex

    if not isinstance(e, rex.ActorDiedError):
        return None
    return (
        f"the LLM proxy actor died ({_first_line(e)}); the job cannot go on without it: a "
        "restarted proxy would not know the published weights, the trajectories' replicas "
        "or the turns in flight. Resume from the latest checkpoint (--resume; set "
        "checkpoint.every to have one)"
    )


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
