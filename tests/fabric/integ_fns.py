"""Reward functions the integration tests call through real worker processes (importable)."""

from __future__ import annotations

import asyncio

from fabric.protocol import RewardResult, Trajectory
from fabric.registry import Registry

REG = Registry()


@REG.reward(warm=0, timeout_s=10)
def contains(traj: Trajectory, *, answer: str) -> RewardResult:
    """1.0 when the last assistant turn contains ``answer``; components say what was seen."""
    text = traj.final_text()
    hit = float(answer in text)
    return RewardResult(score=hit, components={"hit": hit, "turns": float(len(traj.messages))})


@REG.reward(warm=0, retry={"max_attempts": 1})
def explode(traj: Trajectory, *, ground_truth: str) -> float:
    if "boom" in traj.final_text():
        raise ValueError(f"cannot score this (ground truth {ground_truth})")
    return 1.0


@REG.reward(warm=0)
def length(completion: str) -> float:
    """The completion as text (the parameter is ``str``): its length, to check the order."""
    return float(len(completion))


@REG.reward(warm=0, timeout_s=10)
async def slow_length(traj: Trajectory, *, delay_s: float = 0.3) -> float:
    await asyncio.sleep(delay_s)
    return float(len(traj.final_text()))


@REG.reward(warm=0)
def with_tests(traj: Trajectory, *, tests: list[str], language: str = "python") -> RewardResult:
    """Passes the tests that appear in the answer (a stand-in for code_verify's shape)."""
    text = traj.final_text()
    passed = sum(t in text for t in tests)
    return RewardResult(
        score=passed / len(tests), components={"passed": float(passed)}, info={"lang": language}
    )


@REG.reward(warm=0)
def graded_if_given(traj: Trajectory, *, ground_truth: str = "") -> float:
    """1.0 without a ground truth (nothing to check); else whether the answer contains it.
    Its default is not None: a null sent for it is refused."""
    return float(ground_truth in traj.final_text())


@REG.reward(warm=0)
def not_a_reward(traj: Trajectory) -> str:
    return "high"


@REG.reward(warm=0)
def huge(traj: Trajectory) -> float | RewardResult:
    """An int past float's range, as a score or as a component, for the samples that ask."""
    text = traj.final_text()
    if text == "big":
        return 10**400  # type: ignore[return-value]
    if text == "big component":
        return RewardResult(score=1.0, components={"n": 10**400})  # type: ignore[dict-item]
    return 1.0


#: What became of each ``waits`` call (inproc: this process): "done" or "cancelled".
OUTCOMES: dict[str, str] = {}


@REG.reward(warm=0, timeout_s=30, retry={"max_attempts": 1})
async def waits(traj: Trajectory, *, label: str, delay_s: float = 5.0) -> float:
    try:
        await asyncio.sleep(delay_s)
    except asyncio.CancelledError:
        OUTCOMES[label] = "cancelled"
        raise
    OUTCOMES[label] = "done"
    return 1.0
