"""The groups a job starts and the callbacks that close them: a launcher that keeps groups
starting within the launch budget (``async`` mode), the reward stream's samples into the
buffer, groups the buffer aborts or the runner gives up, and the rollout's fatal error once
too many in a row are given up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

from core._job_summary import JobSummary
from core.config import EnvConfig
from core.errors import DiskFullError, ProxyDiedError, RolloutError
from core.evaluation import EVAL_SEED_BASE
from core.rollout.env_manager import TurnBarrier
from core.rollout.groups import GroupRunner
from core.sample import Sample

T = TypeVar("T")


class JobGroups(JobSummary):
    """Groups launched and closed (see the module docstring)."""

    async def _unless_fatal(self, aw: Awaitable[T]) -> T:
        """``aw``'s result, or the rollout's fatal error if that comes first."""
        assert self._fatal is not None
        task: asyncio.Future[Any] = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({task, self._fatal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # cancelled (Ctrl-C, SIGTERM) or stopped by the fatal error: ``wait`` leaves its
            # tasks running, and the batch's wait stayed a waiter of the buffer past the job
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if task.cancelled() and self._fatal.done():
            self._fatal.result()  # raises RolloutError
        return task.result()

    # ------------------------------------------------------------------ launching
    async def _launch_loop(self, runner: GroupRunner) -> None:
        """Keep groups starting: at most ``alpha`` versions ahead of the trainer (groups that
        would only go stale are never started) and ``max_groups_in_flight`` at a time."""
        cfg = self.cfg
        cap = cfg.rollout.max_groups_in_flight or cfg.batch_size * (cfg.alpha + 1)
        # until the job stops on a fatal error: groups started then fail at once, and the
        # step loop may notice only after a trainer step (minutes)
        while not self._failing():
            runner.changed.clear()
            budget = (self.version + cfg.alpha + 1) * cfg.batch_size
            while self._groups_live < budget and runner.rolling_groups() < cap and not self._failing():
                self._start_group(runner)
            await runner.changed.wait()

    def _failing(self) -> bool:
        """The job has its fatal error (a ``RolloutError``, a dead proxy): it is stopping."""
        return self._fatal is not None and self._fatal.done()

    def _start_group(self, runner: GroupRunner, barrier: TurnBarrier | None = None) -> None:
        """Start a group, unless the job is failing: the step loop or the shutdown meets the
        fatal error next, and a group started now (sync mode's replacement of one given up,
        a step's groups) only opened environment sessions for the shutdown to cancel."""
        if self._failing():
            return
        env = self._draw_env()
        seed = self.rng.randrange(EVAL_SEED_BASE)
        g = runner.start(env, seed, self.version, barrier=barrier)
        assert self.buffer is not None
        self.buffer.open_group(g.id, self.version)
        self._groups_live += 1

    def _draw_env(self) -> EnvConfig:
        envs = self.cfg.envs
        return envs[0] if len(envs) == 1 else self.rng.choices(envs, weights=[e.weight for e in envs])[0]

    # ------------------------------------------------------------------ callbacks
    def _deliver(self, sample: Sample) -> None:
        """The reward stream's output: into the buffer; a failed reward re-runs a member."""
        assert self.buffer is not None and self.runner is not None
        self.buffer.put(sample)
        if sample.status == "reward_failed":
            self.tally.reward_failed(sample)
            self.runner.reward_failed(sample)

    def _on_abort(self, gid: str, reason: str) -> None:
        assert self.runner is not None
        if reason == "complete":
            self._give_up_streak = 0
        if reason == "stale":
            self._groups_live -= 1
            self.tally.counts["stale_groups"] += 1
        self.runner.abort_group(gid, reason)  # type: ignore[arg-type]

    def _proxy_failed(self, error: ProxyDiedError | DiskFullError) -> None:
        """The proxy actor died (``RemoteProxy.on_died``), or the disk under a file it writes
        is full (``on_disk_full``): the job stops on it."""
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(error)

    def _given_up(self, g: Any) -> None:
        if self.buffer is not None:
            # closed in the buffer too, or its bound drops it later as stale and _on_abort
            # counts it out of the launch budget (and into stale_groups) a second time
            self.buffer.drop(g.id)
        self._groups_live -= 1
        self.tally.counts["given_up_groups"] += 1
        self._give_up_streak += 1
        limit = max(8, 2 * self.cfg.batch_size)
        if self._give_up_streak >= limit and self._fatal is not None and not self._failing():
            # the group's own error first: what gave it up, whatever kind (a run that raised,
            # a proxy actor's error on every turn, only it records); the tally's is the run's
            # last infra_failed or reward_failed trajectory, which may be hours old
            last = g.last_error or self.tally.last_error or "none recorded"
            self._fatal.set_exception(
                RolloutError(
                    f"{self._give_up_streak} groups in a row were given up (each after "
                    f"{self.cfg.rollout.max_reruns} re-runs) and none completed; the last "
                    f"trajectory error: {last}; "
                    f"{self._failure_counts()}"
                )
            )
            return
        if self.cfg.rollout.mode == "sync" and self.runner is not None:
            # the step waits for batch_size groups: replace it, in the step's lockstep (its
            # barrier), or the replacement ran on its own outside the batch-level baseline
            self._start_group(self.runner, g.barrier)
