"""What the ``llm_judge`` test modules (``test_judge_*.py``) share: an injected clock and
sleep, a ``FakeOpenAI`` server per test and a maker of judges closed after it (each module
binds the two as its ``srv`` and ``make_judge`` fixtures), and a trajectory builder."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from fabric.protocol import Message, Trajectory
from functions.fakes import FakeOpenAI
from functions.rewards.judge import Judge
from functions.rewards.judge_config import JudgeConfig

ENTRY = "functions.rewards.judge:llm_judge"


class FakeTime:
    """An injected clock and sleep: sleeping records the wait and moves the clock."""

    def __init__(self, advance: bool = True):
        self.now = 1000.0
        self.advance = advance
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if self.advance:
            self.now += seconds
        await asyncio.sleep(0)


def fake_openai() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as s:
        yield s


async def judge_maker() -> AsyncIterator[Callable[..., Judge]]:
    """Judges for a server (with an injected clock/sleep if given), closed after the test."""
    made: list[Judge] = []

    def make(srv: FakeOpenAI, t: FakeTime | None = None, **cfg: Any) -> Judge:
        cfg.setdefault("backoff_s", 0.01)
        config = JudgeConfig(model=srv.model, base_url=srv.base_url, api_key=srv.api_key, **cfg)
        judge = Judge(config) if t is None else Judge(config, clock=t.clock, sleep=t.sleep)
        made.append(judge)
        return judge

    yield make
    for judge in made:
        await judge.aclose()


def traj(question: str, answer: str, **task: Any) -> Trajectory:
    msgs = [Message(role="user", content=question), Message(role="assistant", content=answer)]
    return Trajectory(messages=msgs, task=task)
