"""``latency-v0``: an environment whose steps take time, for rollout benchmarks and faults.

Every step sleeps a duration drawn from N(``mu_s``, ``sigma_s``) (truncated at 0), as a
real environment's tool call, compile or simulator tick would; with probability
``slow_prob`` an episode is *slow* (every step ``slow_factor`` times longer) and with
``fail_prob`` it *fails* (its process exits mid-episode, as a crashed container does). The
episode lasts ``turns`` steps and returns 1.0 (any action is valid: the policy is not what
is measured).

``tail="task"`` (the default) draws everything from the reset seed: the task is slow or
fatal, so every rollout of it (a group's members, a replay) behaves the same. ``"rollout"``
draws from fresh entropy at each reset: a straggling or crashing *machine*, which another
rollout of the same task, or a replay in a fresh container, escapes.
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from envpool.api import Env, Observation, StepResult


class LatencyEnv(Env):
    example_actions = ("go", "wait")

    def __init__(
        self,
        mu_s: float = 0.05,
        sigma_s: float = 0.0,
        turns: int = 4,
        slow_prob: float = 0.0,
        slow_factor: float = 10.0,
        fail_prob: float = 0.0,
        tail: str = "task",
    ):
        if mu_s < 0 or sigma_s < 0 or turns < 1 or slow_factor < 1:
            raise ValueError("need mu_s >= 0, sigma_s >= 0, turns >= 1, slow_factor >= 1")
        if not (0 <= slow_prob <= 1 and 0 <= fail_prob <= 1):
            raise ValueError("slow_prob and fail_prob are probabilities")
        if tail not in ("task", "rollout"):
            raise ValueError(f"tail is 'task' or 'rollout', got {tail!r}")
        self.tail = tail
        self.mu_s, self.sigma_s, self.turns = mu_s, sigma_s, turns
        self.slow_prob, self.slow_factor, self.fail_prob = slow_prob, slow_factor, fail_prob
        self._rng = random.Random()
        self.t = 0
        self.slow = self.fail = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self._rng = random.Random(seed if self.tail == "task" else None)  # None: fresh entropy
        self.t = 0
        self.slow = self._rng.random() < self.slow_prob
        self.fail = self._rng.random() < self.fail_prob
        return Observation(text=f"step 0 of {self.turns}: say go"), {"slow": self.slow, "fail": self.fail}

    def step(self, action: str) -> StepResult:
        delay = max(0.0, self._rng.gauss(self.mu_s, self.sigma_s)) * (self.slow_factor if self.slow else 1.0)
        time.sleep(delay)
        self.t += 1
        if self.fail and self.t == max(1, self.turns // 2):
            os._exit(17)  # the container dies mid-episode
        done = self.t >= self.turns
        return StepResult(
            obs=Observation(text=f"step {self.t} of {self.turns}: say go"),
            reward=1.0 if done else 0.0,
            terminated=done,
            info={"delay_s": round(delay, 4)},
        )
