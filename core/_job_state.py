"""What the layers of a ``Job`` share: the state it keeps while it runs, and the live
handles of its Ray actors.

The job is built in layers, each in its own module and each on the one before: its
checkpoints (``_job_checkpoints``), what a run leaves on record (``_job_summary``), the
groups it starts and the callbacks that close them (``_job_groups``), its setup
(``_job_setup``), and the run itself (``job.Job``). The state is declared here, so that each
layer type-checks on its own, and set in ``Job.__init__``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from core.buffer import SampleBuffer
from core.checkpoint import Checkpoints
from core.cluster import Cluster
from core.config import JobConfig
from core.errors import TrainerTimeout, disk_full
from core.evaluation import Evaluator
from core.report import RunDir
from core.rewards import RewardStream
from core.rollout.groups import GroupRunner
from core.rollout.replicas import RemoteProxy
from core.tally import Tally
from fabric.registry import Registry

T = TypeVar("T")


class JobState:
    """Everything a job keeps while it runs (see ``job.Job``, which sets it)."""

    cfg: JobConfig
    source: str | None
    resume: bool
    allow_changes: tuple[str, ...]
    _changes: list[tuple[str, str]]
    checkpoints: Checkpoints
    _resume_from: tuple[Path, dict[str, Any]] | None
    _checkpoint_s: list[float]
    _checkpoint_blocked_s: list[float]
    _checkpoint_task: asyncio.Task[None] | None
    _wall_before: float
    registry: Registry | None
    progress_enabled: bool
    rng: random.Random
    cluster: Cluster
    pool: Any
    runner: GroupRunner | None
    buffer: SampleBuffer | None
    stream: RewardStream | None
    step: int
    version: int
    tally: Tally
    _groups_live: int
    evaluator: Evaluator
    run_dir: RunDir | None
    _give_up_streak: int
    _fatal: asyncio.Future[None] | None
    _t0: float
    _pretrained: dict[str, float]

    @property
    def evals(self) -> list[dict[str, Any]]:
        return self.evaluator.rows

    # live handles, for tests and fault injection while the job runs
    @property
    def replicas(self) -> list[Any]:
        return self.cluster.replicas

    @property
    def proxy_handle(self) -> Any:
        return self.cluster.proxy

    @property
    def trainer_handle(self) -> Any:
        return self.cluster.trainer

    @property
    def proxy(self) -> RemoteProxy:
        """The proxy actor's methods as coroutines (``proxy.call`` for any other): its death
        raised as ``ProxyDiedError``."""
        assert self.cluster.remote_proxy is not None, "the cluster is not started"
        return self.cluster.remote_proxy

    async def _from_trainer(self, call: Awaitable[T], what: str) -> T:
        """A trainer actor call's result (``what`` it is, for the error), or
        ``TrainerTimeout`` past ``trainer.call_timeout_s``: a trainer stuck in a call (a hung
        collective, a deadlocked loader) held the job's step loop for ever."""
        limit = self.cfg.trainer.call_timeout_s
        scope = asyncio.timeout(limit)
        try:
            async with scope:
                return await call
        except TimeoutError:
            if not scope.expired():
                raise
            raise TrainerTimeout(
                f"the trainer's {what} did not return within trainer.call_timeout_s={limit:g} s: "
                "the trainer actor is stuck, or slower than that (then raise trainer.call_timeout_s)"
            ) from None
        except Exception as e:
            # the disk the trainer writes a checkpoint to is full: the one line that names the
            # file, not Ray's error around it (the actor's traceback, printed whole)
            full = disk_full(getattr(e, "cause", None))
            if full is None:
                raise
            raise full from None
