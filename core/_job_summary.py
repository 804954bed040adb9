"""What a job's run leaves on record: ``summary.json`` of a run that finished,
``failure.json`` of one that stopped on an error, and the counts that the ``RolloutError``
of a rollout that cannot go on names.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from core._job_checkpoints import JobCheckpoints
from core.buffer import SampleBuffer
from core.evaluation import best_success
from core.report import RunDir
from core.rewards import RewardStream
from core.rollout.groups import GroupRunner

log = logging.getLogger(__name__)


class JobSummary(JobCheckpoints):
    """The summary and the failure of a run (see the module docstring)."""

    def _summary(
        self,
        run_dir: RunDir,
        train_wall: float,
        first: dict[str, Any] | None,
        final: dict[str, Any] | None,
        buffer: SampleBuffer,
        stream: RewardStream,
        runner: GroupRunner,
    ) -> dict[str, Any]:
        rows = run_dir.rows
        return {
            "config": str(self.cfg.run_dir / "config.yaml"),
            "mode": self.cfg.rollout.mode,
            "steps": len(rows),
            "train_wall_s": round(train_wall, 1),
            "step_s_mean": round(train_wall / max(len(rows), 1), 3),
            "untrained_success": first["success"] if first else None,
            "final_success": final["success"] if final else None,
            "best_eval_success": best_success(self.evals),
            "final_train_reward": rows[-1]["reward_mean"] if rows else None,
            "final_success_sampled": final["success_sampled"] if final else None,
            "final_success_unseen": final["success_unseen"] if final else None,
            "final_unseen_episodes": final["episodes_unseen"] if final else None,
            "evals": [
                # versions: the weights that played it (None in a row an earlier release wrote)
                {
                    k: e.get(k)
                    for k in (
                        "step",
                        "success",
                        "success_sampled",
                        "success_unseen",
                        "episodes_unseen",
                        "versions",
                    )
                }
                for e in self.evals
            ],
            "trajectories": self.tally.trajectories(),
            "aborted_trained": self.tally.counts["aborted_trained"],
            "masked_trained": self.tally.counts["masked_trained"],
            "nonfinite_logprob_trained": self.tally.counts["nonfinite_logprob_trained"],
            "buffer": {k: v for k, v in buffer.metrics().items() if k not in ("trainer_wait_s",)},
            "rewards": stream.metrics(),
            "groups": dict(runner.metrics),
            "run_dir": str(run_dir.path),
            **({"pretrain": self._pretrained} if self._pretrained else {}),
            **({"resumed_from_step": self._resume_from[1]["step"]} if self._resume_from else {}),
            **({"changed_on_resume": dict(self._changes)} if self._changes else {}),
            **({"checkpoints": self._checkpoint_figures()} if self._checkpoint_s else {}),
        }

    def _failure(
        self,
        error: BaseException,
        t_start: float,
        run_dir: RunDir,
        buffer: SampleBuffer | None,
        stream: RewardStream | None,
        runner: GroupRunner | None,
    ) -> dict[str, Any]:
        """``failure.json``: why the run stopped, and the counts a summary would have had
        (of the parts that exist: a resume that fails to load its checkpoint stops before
        the rollout starts)."""
        out: dict[str, Any] = {
            "error": f"{type(error).__name__}: {error}",
            "steps": len(run_dir.rows),  # trained, as in summary.json
            "wall_s": round(time.perf_counter() - t_start, 1),
            "trajectories": self.tally.trajectories(),
        }
        if buffer is not None:
            out["buffer"] = {k: v for k, v in buffer.metrics().items() if k not in ("trainer_wait_s",)}
        if stream is not None:
            out["rewards"] = stream.metrics()
        if runner is not None:
            out["groups"] = dict(runner.metrics)
        out["run_dir"] = str(run_dir.path)
        return out

    def _write_failure(
        self,
        error: BaseException,
        t_start: float,
        run_dir: RunDir,
        buffer: SampleBuffer | None = None,
        stream: RewardStream | None = None,
        runner: GroupRunner | None = None,
    ) -> None:
        """``failure.json`` of a run that stops on ``error`` (which the caller raises on)."""
        try:
            run_dir.fail(self._failure(error, t_start, run_dir, buffer, stream, runner))
        except Exception as write_error:  # the run's own error is the one to see
            log.warning("the failed run's record (failure.json, plots) is not complete: %s", write_error)

    def _failure_counts(self) -> str:
        """What failed so far, for the ``RolloutError``: a reward that fails on every
        trajectory and an environment that does look alike in the groups given up."""
        counts = self.tally.counts
        out = f"so far {counts['infra_failed']} infra_failed, {counts['reward_failed']} reward_failed"
        failures = self.stream.metrics()["failures"] if self.stream is not None else {}
        if failures:
            by_function = ", ".join(f"{k} {n}" for k, n in failures.items())
            out += f" (reward failures by function: {by_function})"
        return out
