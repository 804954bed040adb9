"""``echo-v0``: the smallest environment, for measuring the pool and the protocol.

Each step echoes the action; ``done`` ends the episode."""

from __future__ import annotations

from typing import Any

from envpool.api import Env, Observation, StepResult


class EchoEnv(Env):
    example_actions = ("hello", "done")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict]:
        self.steps = 0
        return Observation(text=f"echo ready (seed={seed})"), {"seed": seed}

    def step(self, action: str) -> StepResult:
        self.steps += 1
        done = action == "done"
        return StepResult(obs=Observation(text=action), terminated=done, info={"steps": self.steps})
