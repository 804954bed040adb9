"""The job's Ray side: Ray itself (started unless the caller did), the engine replicas per
hardware group (``engine.hw_affinity``), the ``LLMProxy`` in front of them with its turn
scheduler, and the ``TrainerActor``.

    cluster = Cluster(cfg)
    async with cluster.start(init_bundle) as proxy:   # a RemoteProxy for the env managers
        ...                                            # cluster.proxy / .trainer / .replicas

GPU reservations and custom resources the Ray cluster cannot meet are refused as a
``ConfigError`` before any actor is made, instead of leaving the actors pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from core.config import DEFAULT_AFFINITY, JobConfig
from core.config_backends import TorchEngineConfig
from core.errors import ConfigError, StartupTimeout
from core.rollout.engines.openai_ import OpenAIEngineConfig
from core.rollout.llm_proxy import LLMProxy, proxy_options
from core.rollout.replicas import EngineReplicaActor, RayReplica, RemoteProxy
from core.rollout.scheduling import TurnScheduler
from core.trainer.actor import TrainerActor


async def start_ray() -> None:
    """Start a local Ray, in a worker thread: ``ray.init`` puts its own SIGTERM handler in
    place of the caller's only when called in the main thread (``sys.exit(15)``, raised
    wherever the start was: Ray's agents, started by then, ran on for 30 s and more after the
    job had gone). Off the main thread the caller's handler stays, and a stop meanwhile (the
    task cancelled: SIGTERM, Ctrl-C) waits for the start, which no one can interrupt, then
    shuts Ray down, so nothing it started outlives the job. Ray's core worker still installs
    its own handler as the start ends: the caller puts its own back (``on_ray_init``)."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    def init() -> None:
        with _quiet_thread_warning():
            ray.init(
                num_cpus=os.cpu_count() or 1,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.ERROR,
                configure_logging=False,
            )

    start = asyncio.ensure_future(asyncio.to_thread(init))
    try:
        await asyncio.shield(start)
    except asyncio.CancelledError:
        # every further cancellation too (a second Ctrl-C: asyncio.run cancels the task
        # again) waits for the start: left then, Ray came up after, with no one to stop it
        while not start.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({start})
        if not start.cancelled() and start.exception() is None and ray.is_initialized():
            ray.shutdown()  # (a start that failed meanwhile: nothing to stop)
        raise


@contextlib.contextmanager
def _quiet_thread_warning() -> Iterator[None]:
    """Drops the warning ``ray.init`` logs off the main thread ("SIGTERM handler is not set
    because current thread is not the main thread"): that is what ``start_ray`` wants, and
    every job's start printed it."""

    def drop(record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()

    logger = logging.getLogger("ray._private.worker")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


class Cluster:
    """The Ray actors of one job; ``start`` makes them and kills them on the way out."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        # live handles, for tests and fault injection while the job runs
        self.replicas: list[Any] = []
        self.proxy: Any = None
        self.remote_proxy: RemoteProxy | None = None  # the proxy's methods as coroutines
        self.trainer: Any = None

    @contextlib.asynccontextmanager
    async def start(
        self, bundle: str | None, *, on_ray_init: Callable[[], None] | None = None
    ) -> AsyncIterator[RemoteProxy]:
        """Ray (started here unless the caller did), the engine replicas per hardware group,
        the proxy, the trainer; all killed on the way out. ``on_ray_init``: called right after
        this starts Ray, whose ``ray.init`` replaces the process's SIGTERM handler (the job
        puts its own back there)."""
        import ray

        started = False
        if not ray.is_initialized():
            await start_ray()
            started = True
            if on_ray_init is not None:
                on_ray_init()
        cfg = self.cfg
        actors: list[Any] = []
        try:
            groups = self._hw_groups()
            self._check_gpus(len(groups))
            replica_cls = ray.remote(EngineReplicaActor)
            by_group: dict[str, list[RayReplica]] = {}
            for group, resource in groups.items():
                for i in range(cfg.engine.replicas):
                    name = f"{group}-{i}"
                    opts: dict[str, Any] = {
                        "max_restarts": cfg.engine.max_restarts,
                        "max_concurrency": 10_000,
                        "num_cpus": 0,
                    }
                    if resource is not None:
                        opts["resources"] = {resource: 1}
                    if cfg.engine.gpus:
                        opts["num_gpus"] = cfg.engine.gpus
                    h = replica_cls.options(**opts).remote(
                        cfg.engine.backend,
                        bundle,
                        cfg.engine.kwargs,
                        seed=cfg.seed + i,
                        name=name,
                        model=cfg.engine.model,
                    )
                    actors.append(h)
                    self.replicas.append(h)
                    by_group.setdefault(group, []).append(RayReplica(h, name))
            affinity = {tag: tag_group for tag, tag_group in cfg.engine.hw_affinity.items()}
            proxy = (
                ray.remote(LLMProxy)
                # never restarted: a new proxy would not know the published weights, the
                # trajectories' replicas or the turns in flight (core.rollout.llm_proxy); its
                # death stops the job with ProxyDiedError (RemoteProxy), to be resumed
                .options(max_concurrency=100_000, num_cpus=0, max_restarts=0)
                .remote(
                    by_group,
                    affinity=affinity,
                    scheduler=turn_scheduler(cfg),
                    **proxy_options(cfg.engine),
                )
            )
            actors.append(proxy)
            trainer = (
                # "io": a checkpoint's write is waited for there, beside the steps (which
                # keep the default group's one thread: never two at once)
                # (Ray's stubs do not list concurrency_groups among ray.remote's keywords)
                ray.remote(concurrency_groups={"io": 1})(TrainerActor)  # type: ignore[call-overload]
                .options(num_cpus=0, num_gpus=cfg.trainer.gpus)
                .remote(
                    cfg.trainer,
                    bundle,
                    total_steps=cfg.steps,
                    temperature=cfg.engine.temperature,
                    seed=cfg.seed,
                )
            )
            actors.append(trainer)
            self.proxy, self.trainer = proxy, trainer
            # surface a replica or trainer that cannot start (bad kwargs) now, not mid-run
            names = [r.name for rs in by_group.values() for r in rs] + ["proxy", "trainer"]
            # (actors holds the replicas in by_group's order, then the proxy and the trainer)
            await wait_ready(dict(zip(names, actors, strict=True)), cfg.engine.start_timeout_s)
            self.remote_proxy = RemoteProxy(proxy)
            yield self.remote_proxy
        finally:
            for a in actors:
                with contextlib.suppress(Exception):
                    ray.kill(a, no_restart=True)
            if started:
                ray.shutdown()

    def _check_gpus(self, groups: int) -> None:
        """Refuse, before any actor is made, GPU reservations the cluster cannot meet: Ray
        would otherwise leave the actors pending and the job waiting forever."""
        import ray

        engine, trainer = self.cfg.engine, self.cfg.trainer
        want = engine.gpus * engine.replicas * groups + trainer.gpus
        have = ray.cluster_resources().get("GPU", 0.0)
        if want <= have + 1e-9:
            shares = [engine.gpus] * (engine.replicas * groups) + [trainer.gpus]
            cards = [int(n.get("Resources", {}).get("GPU", 0)) for n in ray.nodes() if n.get("Alive")]
            unplaceable = gpu_packing_problem(shares, cards)
            if unplaceable:
                key = "engine.num_gpus" if engine.gpus else "trainer.num_gpus"
                raise ConfigError([(key, f"{unplaceable}; lower engine.replicas or the num_gpus fractions")])
        if want > have + 1e-9:
            raise ConfigError(
                [
                    (
                        "engine.num_gpus" if engine.gpus else "trainer.num_gpus",
                        f"the job reserves {want:g} GPU(s) ({engine.replicas * groups} engine replica(s) x "
                        f"{engine.gpus:g} + trainer {trainer.gpus:g}) and the Ray cluster has {have:g}; "
                        "lower engine.replicas or the num_gpus fractions (0.5 + 0.5 share one card)",
                    )
                ]
            )

    def _hw_groups(self) -> dict[str, str | None]:
        """Replica group -> the Ray custom resource its replicas need (None: anywhere).
        Groups are named by their resource; tags without affinity use ``default``."""
        import ray

        aff = self.cfg.engine.hw_affinity
        groups: dict[str, str | None] = {}
        tags = {e.tag for e in self.cfg.envs}
        if not aff or any(t not in aff for t in tags) or DEFAULT_AFFINITY in aff:
            groups[DEFAULT_AFFINITY] = aff.get(DEFAULT_AFFINITY)
        for tag, resource in aff.items():
            if tag != DEFAULT_AFFINITY:
                groups[resource] = resource
        have = ray.cluster_resources()
        missing = sorted({r for r in groups.values() if r is not None and have.get(r, 0) < 1})
        if missing:
            raise ConfigError(
                [
                    (
                        "engine.hw_affinity",
                        f"no Ray node offers the resource(s) {missing}; start the cluster with them "
                        f"(ray start --resources='{{\"{missing[0]}\": 1}}') or drop the affinity",
                    )
                ]
            )
        return groups


#: vLLM's ``max_num_seqs`` when the job does not set it (its long-standing default; newer
#: versions may pick another by GPU: set it, or ``rollout.slots_per_replica``, to be sure)
VLLM_MAX_NUM_SEQS = 256


def engine_batch(cfg: JobConfig) -> int:
    """How many turns one replica runs at once, by the engine's own setting: the torch
    engine's ``max_batch_size``, vLLM's ``max_num_seqs`` (in ``engine.kwargs`` or its
    ``engine_args``), the openai engine's ``max_concurrency``. The turn scheduler's default
    slots: fewer leave the engine's batch part empty, more queue inside the engine, where
    the policy does not order them."""
    kw = cfg.engine.kwargs
    if cfg.engine.backend == "vllm":
        args = kw.get("engine_args")
        # a top-level one wins, as the engine merges them (vllm_._config_from)
        given = kw.get("max_num_seqs", args.get("max_num_seqs") if isinstance(args, dict) else None)
        return int(given or VLLM_MAX_NUM_SEQS)
    if cfg.engine.backend == "openai":
        return int(kw.get("max_concurrency") or OpenAIEngineConfig.model_fields["max_concurrency"].default)
    return int(kw.get("max_batch_size") or TorchEngineConfig.model_fields["max_batch_size"].default)


def turn_scheduler(cfg: JobConfig) -> TurnScheduler | None:
    """The proxy's turn scheduler for ``cfg.rollout``; None keeps the plain path (every turn
    straight to its replica) when nothing asks for a policy, a slot limit or a trace."""
    r = cfg.rollout
    if r.scheduler == "fcfs" and r.placement == "affinity" and r.slots_per_replica is None and not r.trace:
        return None
    slots = r.slots_per_replica or engine_batch(cfg)
    return TurnScheduler(
        r.scheduler,
        r.placement,
        slots=slots,
        scheduler_options=r.scheduler_options,
        trace=Path(cfg.run_dir).resolve() / "trace.jsonl" if r.trace else None,
    )


def gpu_packing_problem(shares: list[float], cards: list[int]) -> str | None:
    """Why GPU reservations that fit the cluster's total cannot be placed card by card, or
    None. Ray puts a fraction on one card and a whole number on whole cards of one node, so
    two shares above one half never share a card: 3 x 0.6 on 2 GPUs fit the total (1.8) and
    left an actor pending for ever. Only what no placement can meet is refused (a
    necessary condition, never a false alarm)."""
    big = [s for s in shares if s > 0.5]
    whole_cards = sum(math.ceil(s) for s in big)
    if whole_cards > sum(cards):
        listed = ", ".join(f"{s:g}" for s in sorted(big, reverse=True))
        return (
            f"the reservations above half a card ({listed}) need {whole_cards} cards of their own "
            f"and the Ray cluster has {sum(cards)} GPU(s): two of them never share a card"
        )
    widest, largest = max((s for s in shares if s >= 1), default=0.0), max(cards, default=0)
    if widest > largest:
        return f"a reservation of {widest:g} GPUs needs one node with that many; the largest has {largest}"
    return None


async def wait_ready(actors: dict[str, Any], timeout_s: float) -> None:
    """Wait until every actor (by name) is made; its constructor's error at once, and
    ``StartupTimeout`` naming the ones still not ready after ``timeout_s``."""
    waits = {asyncio.ensure_future(a.__ray_ready__.remote()): name for name, a in actors.items()}
    try:
        done, pending = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
        for w in done:
            if (e := w.exception()) is not None:
                raise e
        if pending:
            late = ", ".join(sorted(waits[w] for w in pending))
            raise StartupTimeout(
                f"not ready after {timeout_s:g} s: {late} (a constructor still running, such as a "
                "large model's load, or an actor Ray cannot place: `ray status` lists pending "
                "demands); raise engine.start_timeout_s if it is only slow"
            )
    finally:
        for w in waits:
            w.cancel()
