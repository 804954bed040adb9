"""A job's checkpoints: one started every ``checkpoint.every`` steps (the step loop waits
only while the trainer copies its state), written while training goes on and committed once
it is on disk; and a resumed run put back where its checkpoint left off (the policy the
earlier run built, the trainer's state, the job's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

from core._job_state import JobState
from core.checkpoint import REMEDY, TRAINER_FILE
from core.errors import ConfigError
from core.policy.build import PolicyBundle
from core.report import JobProgress, RunDir


class JobCheckpoints(JobState):
    """Checkpoints written, and read back on resume (see the module docstring)."""

    def _checkpoint_figures(self) -> dict[str, Any]:
        return {
            "written": len(self._checkpoint_s),
            "seconds": round(sum(self._checkpoint_s), 2),
            "blocked_s": round(sum(self._checkpoint_blocked_s), 2),
        }

    def _resumed_policy(self) -> PolicyBundle:
        """The torch engine's policy as the earlier run built it (tokenizer, initial weights):
        never pretrained again; the trained weights come from the checkpoint."""
        assert self._resume_from is not None
        saved = self._resume_from[1]
        self._pretrained = saved.get("pretrained") or {}
        return PolicyBundle.load(Path(self.cfg.run_dir) / "policy-init")

    def _open_run_dir(self, progress: JobProgress) -> RunDir:
        """The run directory, opened for this run at the first call: an earlier run's outputs
        this one writes again removed, a resumed run's rows after its checkpoint dropped, the
        config written."""
        if self.run_dir is not None:
            return self.run_dir
        resume = self._resume_from
        try:
            run_dir = self.run_dir = RunDir(
                Path(self.cfg.run_dir), resume_step=resume[1]["step"] if resume else None
            )
        except OSError as e:  # changed since the check at the start
            raise ConfigError(
                [("run_dir", f"cannot use {str(self.cfg.run_dir)!r}: {e.strerror or e}")]
            ) from None
        run_dir.write_config(self.cfg.to_yaml())
        progress.note(f"run directory: {run_dir.path}")
        return run_dir

    async def _restore(self, path: Path, saved: dict[str, Any], progress: JobProgress) -> None:
        """The trainer back to the checkpoint, its weights on every engine replica before the
        first rollout, and the job's own state (step, random state, counts, tasks seen). The
        run directory is opened once the checkpoint has loaded: one refused (a config error)
        leaves what the earlier run left there as it was, as a refusal before the start does."""
        from ray.exceptions import RayTaskError

        try:
            version = await self._from_trainer(
                self.trainer_handle.load.remote(str(path / TRAINER_FILE)), "load of the checkpoint"
            )
        except RayTaskError as e:  # wraps what the trainer's load raised (a truncated or foreign file)
            # only that condemns the file: a trainer that died or hung while it loaded (the OOM
            # killer, a lost node) is a failure of the run, whose remedy is not to drop the
            # checkpoint
            cause = getattr(e, "cause", None) or e
            raise ConfigError(
                [
                    (
                        "run_dir",
                        f"cannot load {str(path / TRAINER_FILE)!r} "
                        f"({type(cause).__name__}: {cause}); {REMEDY}",
                    )
                ]
            ) from None
        run_dir = self._open_run_dir(progress)
        weights = [self.trainer_handle.weights.remote()]
        await self.proxy.call(self.proxy_handle.update_weights.remote(version, weights))
        self.version = version
        self.step = int(saved["step"])
        # the trained groups count against the launch budget, as they did in the earlier run:
        # without them the launcher started step x batch_size groups at once, all to go stale
        self._groups_live = self.version * self.cfg.batch_size
        self._wall_before = float(saved.get("train_wall_s", 0.0))
        v, state, gauss = saved["rng"]
        self.rng.setstate((v, tuple(state), gauss))
        self.tally.restore(saved)
        self.evaluator.restore(saved)
        self.evaluator.rows.extend(run_dir.evals)
        progress.note(f"resumed from {path} (step {self.step}, policy version {version})")
        schedule = await self._from_trainer(self.trainer_handle.schedule_note.remote(), "schedule note")
        if schedule:  # resumed with other steps: what became of the learning-rate schedule
            progress.note(schedule)
        for key, what in self._changes:
            progress.note(f"changed on resume (--allow-change): {key} {what}")

    async def _save_checkpoint(self, step: int) -> None:
        """Start the checkpoint of ``step``: the step loop waits only while the trainer copies
        its state; the copy goes to disk in the trainer's thread while training goes on,
        and the checkpoint is committed (named ``latest``) once it is there. One at a time:
        an earlier one still being written is finished first."""
        await self._checkpoint_done()
        t = time.perf_counter()
        part = self.checkpoints.prepare(step)
        path = str(part / TRAINER_FILE)
        await self._from_trainer(self.trainer_handle.snapshot.remote(path), f"checkpoint copy of step {step}")
        v, state, gauss = self.rng.getstate()
        job_state = {  # the job's side as of this step (copies: the loop goes on)
            "step": step,
            "version": self.version,
            "config": self.cfg.to_yaml(),
            "rng": [v, list(state), gauss],
            **self.tally.state(),  # counts, errors, finish_reasons
            **self.evaluator.state(),  # trained_tasks (bounded), eval_tasks
            "pretrained": self._pretrained,
            "train_wall_s": round(time.perf_counter() - self._t0, 3),
        }
        self._checkpoint_blocked_s.append(time.perf_counter() - t)
        self._checkpoint_task = asyncio.create_task(self._commit_checkpoint(part, step, path, job_state, t))

    async def _commit_checkpoint(
        self, part: Path, step: int, path: str, job_state: dict[str, Any], t: float
    ) -> None:
        written = self.trainer_handle.written.options(concurrency_group="io").remote(path)
        await self._from_trainer(written, f"checkpoint write of step {step}")
        self.checkpoints.commit(part, step, job_state)
        self._checkpoint_s.append(time.perf_counter() - t)

    def _raise_failed_checkpoint(self) -> None:
        """Raise the error of a checkpoint whose write failed already (a full disk, the
        trainer's file refused): looked at every step, since otherwise it was found only by
        the next checkpoint (``checkpoint.every`` steps on, all trained with no checkpoint
        taken) or at the end of the run. The run stops as on any failure."""
        task = self._checkpoint_task
        if task is None or not task.done() or task.cancelled() or task.exception() is None:
            return
        self._checkpoint_task = None
        task.result()

    async def _checkpoint_done(self, *, cancel: bool = False) -> None:
        """The checkpoint being written, committed (its error raised), or with ``cancel``
        dropped (Ctrl-C: the previous one stays the latest)."""
        task, self._checkpoint_task = self._checkpoint_task, None
        if task is None:
            return
        if cancel:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            return
        await task
