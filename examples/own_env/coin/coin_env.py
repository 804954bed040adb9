# coin/coin_env.py
"""A user's environment: call the side a coin landed on (the observation says which)."""

import random

import envpool


class Coin(envpool.Env):
    example_actions = ("heads", "tails")  # what the tokenizer's random play replies

    def reset(self, *, seed=None, options=None):
        self.side = random.Random(seed).choice(["heads", "tails"])  # same seed, same episode
        return f"The coin landed {self.side} up. Call it: heads or tails.", {}

    def step(self, action: str) -> envpool.StepResult:
        won = action.strip() == self.side
        text = "Right, you win." if won else "Wrong, you lose."
        return envpool.StepResult(obs=envpool.Observation(text=text), reward=float(won), terminated=True)


envpool.register("coin-v0", entry_point="coin_env:Coin", max_episode_steps=1)
