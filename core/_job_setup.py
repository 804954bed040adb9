"""A job's setup before its first step: the policy built (the torch engine's; in a worker
thread, as it may pretrain for minutes), the constrained actions' token ids, and the fabric
client and the environment pool, each warmed up before the rollout starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

from core._job_groups import JobGroups
from core.env_images import JobImages
from core.errors import ConfigError
from core.policy.build import PolicyBundle, action_ids, build_policy
from core.report import JobProgress
from core.startup import prewarm_images, warm_rewards
from fabric.registry import Registry


class JobSetup(JobGroups):
    """What the run needs before it starts (see the module docstring)."""

    async def _build_policy(self, progress: JobProgress, images: JobImages) -> PolicyBundle:
        if self.cfg.engine.pretrain.steps:
            progress.note(f"pretraining the policy on random play ({self.cfg.engine.pretrain.steps} steps)")
        # in a worker thread: run here, the build (corpus play, pretraining: minutes) held the
        # event loop, and the first Ctrl-C (asyncio.run cancels the main task) took effect
        # only at the next await, after it. A thread cannot be cancelled: told to stop, the
        # build ends at its next check (a pretraining step, a poll of the corpus child, whose
        # processes it kills), and this waits for that, so nothing outlives the job. Nothing
        # else runs yet, so the thread shares nothing with the loop but the progress display.
        stop = threading.Event()
        build = asyncio.ensure_future(
            asyncio.to_thread(
                build_policy,
                self.cfg,
                on_pretrain_step=progress.pretrain_step,
                stop=stop,
                bundles=images.bundles,
            )
        )
        try:
            bundle = await asyncio.shield(build)
        except asyncio.CancelledError:
            stop.set()
            with contextlib.suppress(Exception):  # StoppedError, or what it failed with meanwhile
                await build
            raise
        self.evaluator.trained_on(bundle.tasks)
        if bundle.pretrained:
            self._pretrained = bundle.pretrained
            p = bundle.pretrained
            progress.note(
                f"pretrained in {p['seconds']:.0f}s: held-out next-token loss "
                f"{p['held_out_loss_before']:.2f} -> {p['held_out_loss_after']:.2f}"
            )
        return bundle

    def _action_ids(self, bundle: PolicyBundle | None) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, env in enumerate(self.cfg.envs):
            if env.actions is None:
                continue
            if bundle is None:
                raise ConfigError([(f"envs[{i}].actions", "constrained actions need the torch engine")])
            out[env.tag] = action_ids(bundle.tok(), env.actions)
        return out

    @contextlib.asynccontextmanager
    async def _fabric(self, registry: Registry, images: JobImages) -> AsyncIterator[tuple[Any, Any]]:
        from envpool.pool import EnvPool
        from envpool.pool_config import fabric_tools
        from fabric.client import Client

        cfg = self.cfg
        async with Client(
            backend=cfg.fabric.backend_config(), registry=registry, config=cfg.fabric.client
        ) as client:
            await self._warm_rewards(client)

            # a tool's own failure is shown to the policy as text; the fabric's fails the step
            tools = fabric_tools(client)
            async with EnvPool(cfg.envpool, images=images.cache, tool_caller=tools) as pool:
                await self._prewarm(pool, images)
                yield client, pool

    async def _prewarm(self, pool: Any, images: JobImages) -> None:
        await prewarm_images(self.cfg, pool, images)

    #: seconds between warm-up tries of a reward whose workers did not start: the local
    #: pool's ``setup_failure_cooldown_s``, before which it starts none again
    warm_retry_s = 5.0

    async def _warm_rewards(self, client: Any) -> None:
        await warm_rewards(self.cfg, client, retry_s=self.warm_retry_s)
