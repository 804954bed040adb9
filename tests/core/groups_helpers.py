"""The fakes the GroupRunner tests share: a scripted env manager, a proxy that records its
aborts and releases, and a harness that wires them to a runner.

The env manager's ``run`` follows a script (a short sleep, then a status), so every race
is decided by the script's timings, a few milliseconds apart."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from core.config import JobConfig
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.env_manager import Task, TurnBarrier
from core.rollout.groups import GroupRunner, GroupState
from core.sample import Sample
from fabric.protocol import Trajectory

Plan = tuple[float, str]  # (seconds, status); status "raise" makes run raise


def job(group_size: int = 3, redundancy: int = 0, max_reruns: int = 3) -> JobConfig:
    return JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat"}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": group_size,
            "redundancy": redundancy,
            "rollout": {"max_reruns": max_reruns},
        },
        check_references=False,
    )


class FakeManager:
    """``run`` plays the next plan of the script (launch order), or ``default`` when the
    script is used up; records each launch, and which runs were cancelled."""

    def __init__(self, script: list[Plan] | None = None, default: Plan = (0.001, "ok")):
        self.script = list(script or [])
        self.default = default
        self.launched: list[tuple[Task, str, int, TurnBarrier | None]] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []

    async def run(
        self, task: Task, *, version: int, traj_id: str | None = None, barrier: TurnBarrier | None = None
    ) -> Trajectory:
        assert traj_id is not None
        self.launched.append((task, traj_id, version, barrier))
        delay, status = self.script.pop(0) if self.script else self.default
        try:
            await asyncio.sleep(delay)
        except asyncio.CancelledError:
            self.cancelled.append(traj_id)
            raise
        finally:
            if barrier is not None:
                await barrier.leave()
        if status == "raise":
            raise RuntimeError("a bug in the manager")
        self.finished.append(traj_id)
        info: dict[str, Any] = {"start_version": version}
        if status == "infra_failed":
            info["error"] = "EnvLogicError: KeyError: 'oops'"
        return Trajectory(
            id=traj_id,
            status=status,  # type: ignore[arg-type]
            task={"tag": task.env.tag, "group_id": task.group_id},
            info=info,
        )

    def ids(self) -> list[str]:
        return [tid for _, tid, _, _ in self.launched]


class FakeProxy:
    def __init__(self, abort_s: float = 0.0) -> None:
        self.abort_s = abort_s  # an abort's round trip (a Ray call to a busy proxy actor)
        self.aborted: list[str] = []
        self.released: list[str] = []

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        raise AssertionError("the runner never generates: its manager does")

    async def abort(self, traj_id: str) -> int:
        self.aborted.append(traj_id)
        await asyncio.sleep(self.abort_s)
        return 1

    async def release(self, traj_id: str) -> None:
        self.released.append(traj_id)


class Harness:
    def __init__(self, cfg: JobConfig, manager: FakeManager, *, abort_s: float = 0.0):
        self.cfg = cfg
        self.manager = manager
        self.proxy = FakeProxy(abort_s)
        self.submitted: list[Trajectory] = []
        self.finished: list[Trajectory] = []
        self.cancelled: list[str] = []
        self.given_up: list[GroupState] = []
        self.runner = GroupRunner(
            cfg,
            manager,  # type: ignore[arg-type]
            self.proxy,
            submit=self.submitted.append,
            on_finished=self.finished.append,
            on_given_up=self.given_up.append,
            on_cancelled=self.cancelled.append,
        )

    def start(self, seed: int = 7, version: int = 2, **kw: Any) -> GroupState:
        return self.runner.start(self.cfg.envs[0], seed, version, **kw)

    async def settle(self, within: float = 5.0) -> None:
        """Until nothing runs and every abort is through."""
        async with asyncio.timeout(within):
            while self.runner.running() or self.runner._aborting:  # noqa: ASYNC110 - no event for "idle"
                await asyncio.sleep(0.002)
        await asyncio.sleep(0)

    def submitted_ids(self) -> list[str]:
        return [t.id for t in self.submitted]

    def by_status(self) -> Counter[str]:
        return Counter(t.status for t in self.submitted)


def sample_of(traj: Trajectory, gid: str) -> Sample:
    return Sample(traj=traj, tag="lat", group_id=gid, version=0, status="reward_failed")
