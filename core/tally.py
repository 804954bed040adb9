"""The job's tally: what it counts while trajectories finish and groups come and go, and the
``train`` row of ``metrics.jsonl`` built from it each step.

    tally = Tally()
    tally.finished(traj)                    # every trajectory the group runner finishes
    tally.cancelled(traj_id)                # every run it cancelled before it ended
    tally.counts["stale_groups"] += 1       # what the job's other callbacks count
    row = tally.train_row(step, version, groups, metrics, wall, wait_s, train_s, publish_s, stream)

``counts`` run over the whole job (finished trajectories by status, disjoint: one whose reward
failed for good counts as ``reward_failed``, not ``ok``; generated tokens, groups
dropped as stale or given up, aborted or masked trajectories that were trained), and so do
``errors`` (``infra_failed`` trajectories by the type of error that ended them),
``finish_reasons`` (finished trajectories by their ``info["finish_reason"]``: ``terminated``,
``max_turns``, ``env_truncated``, ``context_full``) and ``context_full`` (the ``truncated``
ones whose conversation outgrew the model's context, kept under its own key too); the
generation, environment and reward times are means over what finished since the last row.
"""

from __future__ import annotations

import statistics
from collections import Counter, OrderedDict
from typing import Any

from core.buffer import Group
from core.rewards import RewardStream
from core.sample import Sample
from fabric.protocol import Trajectory

#: Finished trajectory ids the double-count check remembers (the newest).
SEEN_WINDOW = 200_000


class Tally:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()  # accounting of finished trajectories (and more)
        self._times: dict[str, list[float]] = {"gen_s": [], "env_s": []}
        # the trajectories finished lately, for the double-count check: a window, not every
        # id of the run (a long job finishes millions)
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._reward_mark = (0.0, 0)  # the reward stream's (total ms, scored) at the last row
        self.last_error = ""  # the last trajectory error seen
        # infra_failed trajectories by the error that ended them (EnvLogicError:KeyError,
        # SessionLost, TrajectoryTimeout, ...): summary.json's trajectories.errors. Without it
        # an environment that raised on some seeds showed only as an infra_failed count
        self.errors: Counter[str] = Counter()
        # finished trajectories by how they ended (info["finish_reason"]): summary.json's
        # trajectories.finish_reasons. Without it an episode cut at max_turns was a plain
        # truncated count, not told apart from the environment's own step limit
        self.finish_reasons: Counter[str] = Counter()

    def finished(self, traj: Trajectory) -> None:
        if traj.id in self._seen:  # cannot happen by construction; counted if it does
            self.counts["double_count"] += 1
        self._seen[traj.id] = None
        if len(self._seen) > SEEN_WINDOW:
            self._seen.popitem(last=False)
        self.counts[traj.status] += 1
        if traj.status == "infra_failed":
            self.last_error = str(traj.info.get("error", ""))
            self.errors[str(traj.info.get("error_type") or "unknown")] += 1
        self.counts["tokens"] += sum(
            len((m.model_extra or {}).get("token_ids", [])) for m in traj.messages if m.role == "assistant"
        )
        reason = traj.info.get("finish_reason")
        if reason:  # aborted and infra_failed trajectories have none
            self.finish_reasons[str(reason)] += 1
        if reason == "context_full":
            # a part of ``truncated``, counted apart: a run whose episodes keep outgrowing the
            # context wants a larger one (or a shorter prompt.history)
            self.counts["context_full"] += 1
        if traj.status in ("ok", "truncated"):
            for k in ("gen_s", "env_s"):
                self._times[k].append(float(traj.info.get(k, 0.0)))

    def trajectories(self) -> dict[str, Any]:
        """summary.json's (and failure.json's) ``trajectories``: the counts, the errors and
        the finish reasons."""
        return {**self.counts, "errors": dict(self.errors), "finish_reasons": dict(self.finish_reasons)}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the tally: the job-long counts (copies)."""
        return {
            "counts": dict(self.counts),
            "errors": dict(self.errors),
            "finish_reasons": dict(self.finish_reasons),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        """The counts of a checkpoint's ``state()``; ``errors`` and ``finish_reasons`` are
        absent in an earlier release's."""
        self.counts.update(saved["counts"])
        self.errors.update(saved.get("errors", {}))
        self.finish_reasons.update(saved.get("finish_reasons", {}))

    def cancelled(self, traj_id: str) -> None:
        """A run cancelled before it ended (aborted inside an environment step): counted
        ``aborted``, as one the proxy stopped at its LLM turn. Only those were, so
        ``finished.aborted`` and summary.json's ``trajectories.aborted`` missed most aborts of
        an environment with slow steps, and disagreed with ``groups.aborted``."""
        self.counts["aborted"] += 1

    def reward_failed(self, sample: Sample) -> None:
        """A sample whose reward failed for good (masked; the group re-runs that member):
        moved from its trajectory's ``ok`` / ``truncated`` to ``reward_failed``, so that the
        finished counts are disjoint and add up to the trajectories finished."""
        self.counts["reward_failed"] += 1
        if sample.traj.status in ("ok", "truncated") and self.counts[sample.traj.status] > 0:
            self.counts[sample.traj.status] -= 1
        # the reason is on the sample, not on its trajectory (which finished ``ok``): without
        # it a run whose reward always raised stopped with "the last trajectory error: none
        # recorded", the one error a user needed to see
        self.last_error = f"reward_failed, rewards.{sample.tag}: {sample.error}"

    def train_row(
        self,
        step: int,
        version: int,
        groups: list[Group],
        metrics: dict[str, float],
        wall: float,
        wait_s: float,
        train_s: float,
        publish_s: float,
        stream: RewardStream,
    ) -> dict[str, Any]:
        samples = [s for g in groups for s in g.samples]
        envr = [s.traj.env_reward for s in samples if s.traj.env_reward is not None]
        w, times = self.counts, self._times
        rm = stream.metrics()
        total_ms, scored = rm["reward_ms"]["total"], rm["scored"]
        d_ms, d_n = total_ms - self._reward_mark[0], scored - self._reward_mark[1]
        self._reward_mark = (total_ms, scored)
        row = {
            "kind": "train",
            "step": step,
            "version": version,
            "wall_s": round(wall, 2),
            "reward_mean": statistics.fmean(s.score for s in samples),
            "success": sum(1 for r in envr if r > 0) / len(envr) if envr else 0.0,
            "trajectories": len(samples),
            "turns_mean": statistics.fmean(len(s.traj.info.get("turn_rewards", [])) for s in samples),
            "staleness_mean": statistics.fmean(version - 1 - s.version for s in samples),
            "loss": metrics.get("loss"),
            "entropy": metrics.get("entropy"),
            "entropy_coef": metrics.get("entropy_coef"),
            # with entropy_target: the most mean entropy the step's tokens could have
            "entropy_max": metrics.get("entropy_max"),
            "lr": metrics.get("lr"),
            # the drift gauges: approx_kl between the engine's logprobs and the trainer's at the
            # first update is ~0 when the engines serve the weights the trainer published
            **{
                k: metrics.get(k)
                for k in ("approx_kl", "clip_frac", "dual_clip_frac", "ratio_mean", "grad_norm")
            },
            # turns the trainer masked for a non-finite engine logprob (it logs a warning)
            "nonfinite_logprob_samples": metrics.get("nonfinite_logprob_samples"),
            "finished": {k: w[k] for k in ("ok", "truncated", "aborted", "infra_failed", "reward_failed")},
            "stale_groups": w["stale_groups"],
            "given_up_groups": w["given_up_groups"],
            "time": {
                "wait_s": round(wait_s, 3),
                "train_s": round(train_s, 3),
                "publish_s": round(publish_s, 3),
                "gen_s": round(statistics.fmean(times["gen_s"]), 3) if times["gen_s"] else 0.0,
                "env_s": round(statistics.fmean(times["env_s"]), 3) if times["env_s"] else 0.0,
                "reward_s": round(d_ms / d_n / 1000, 3) if d_n else 0.0,
            },
        }
        for k in ("gen_s", "env_s"):
            times[k].clear()
        return row
