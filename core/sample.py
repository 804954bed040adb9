"""``Sample``: a finished trajectory plus what the core job knows about it (its group, the
policy version it started under, its reward), as it moves from the reward stream into the
sample buffer and on to the trainer.

Where the bookkeeping lives on a ``Trajectory`` (the env managers write it):

* ``traj.task["tag"]``: the environment-mix entry (selects the reward components);
* ``traj.task["group_id"]``: the GRPO group (same task, ``group_size`` rollouts);
* ``traj.info["start_version"]``: the policy version when the trajectory started (falls back
  to the version of its first assistant turn).

``RewardStream.submit`` also takes each of them as a keyword, which wins over the trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fabric.protocol import RewardResult, Trajectory

TAG_KEY = "tag"
GROUP_KEY = "group_id"
VERSION_KEY = "start_version"

SampleStatus = Literal["ok", "infra_failed", "reward_failed", "aborted"]
"""``ok``: trainable (scored). Every other status is *masked*: never scored as zero, never
sent to the trainer, only counted."""


@dataclass(slots=True)
class Sample:
    traj: Trajectory
    tag: str
    group_id: str
    version: int
    """Policy version the trajectory started under (what the asynchronous bound judges)."""
    reward: RewardResult | None = None
    status: SampleStatus = "ok"
    error: str | None = None
    """Why a masked sample was masked."""

    @property
    def id(self) -> str:
        return self.traj.id

    @property
    def masked(self) -> bool:
        return self.status != "ok"

    @property
    def score(self) -> float:
        if self.reward is None:
            raise ValueError(f"trajectory {self.id} has no reward (status {self.status})")
        return self.reward.score

    @classmethod
    def of(
        cls,
        traj: Trajectory,
        *,
        tag: str | None = None,
        group_id: str | None = None,
        version: int | None = None,
        reward: RewardResult | None = None,
    ) -> Sample:
        """A sample of ``traj``: masked ``infra_failed``/``aborted`` when the trajectory is,
        else ``ok`` (and unscored until ``reward`` is set). ``ValueError`` when the
        bookkeeping is missing: that is a bug of the caller, not data."""
        tag = tag if tag is not None else traj.task.get(TAG_KEY)
        group_id = group_id if group_id is not None else traj.task.get(GROUP_KEY)
        if version is None:
            version = traj.info.get(VERSION_KEY)
            if version is None:
                versions = traj.policy_versions()
                version = versions[0] if versions else None
        missing = [
            what
            for what, v in (
                (f"task[{TAG_KEY!r}]", tag),
                (f"task[{GROUP_KEY!r}]", group_id),
                (f"info[{VERSION_KEY!r}]", version),
            )
            if v is None
        ]
        if missing:
            raise ValueError(f"trajectory {traj.id} lacks {', '.join(missing)} (pass them as keywords)")
        assert tag is not None and group_id is not None and version is not None
        status: SampleStatus = "ok"
        if traj.status == "infra_failed":
            status = "infra_failed"
        elif traj.status == "aborted":
            status = "aborted"
        return cls(
            traj=traj,
            tag=str(tag),
            group_id=str(group_id),
            version=int(version),
            reward=reward,
            status=status,
        )
