"""Trajectories for the simulator: turns of generation, each followed by a tool or env call.

Presets follow the shapes agentic RL workloads have: ``coding`` (many turns, test runs as
tool calls, a long tail of trajectories that keep failing tests), ``search`` (a few turns
of short generations and slow tool calls), ``math`` (one or two long generations). Every
preset is seeded. ``env_latency_normal`` gives ROLLART's environment latency N(mu, sigma).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from core.sched.base import Outcome


@dataclass(frozen=True)
class Turn:
    gen_tokens: int
    tool_ms: float = 0.0
    """The tool or environment call after this turn's generation (0: none, the episode ends)."""
    outcome: Outcome = "ok"
    tool_tokens: int = 64
    """The tool's output, added to the context for the next turn."""

    def __post_init__(self) -> None:
        # a negative or nan length or latency runs the simulator's clock backwards (or makes
        # every time nan) without an error: refused here, where the workload is built (nan
        # passed a "< 0" check; an infinite length never completes)
        if not all(0 <= n < math.inf for n in (self.gen_tokens, self.tool_tokens)):
            raise ValueError(f"a turn's gen_tokens and tool_tokens must be finite and >= 0, got {self}")
        if not 0.0 <= self.tool_ms < math.inf:
            raise ValueError(f"a turn's tool_ms must be finite and >= 0, got {self.tool_ms}")


@dataclass(frozen=True)
class TrajSpec:
    id: str
    prompt_tokens: int
    turns: tuple[Turn, ...]
    group: int = 0

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"trajectory {self.id!r} has no turns")
        if not 0 <= self.prompt_tokens < math.inf:
            raise ValueError(
                f"trajectory {self.id!r}: prompt_tokens must be finite and >= 0, got {self.prompt_tokens}"
            )

    @property
    def total_tokens(self) -> int:
        return sum(t.gen_tokens for t in self.turns)


@dataclass
class Workload:
    trajectories: list[TrajSpec]
    name: str = "custom"
    meta: dict[str, float] = field(default_factory=dict)


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def env_latency_normal(mu_ms: float, sigma_ms: float) -> Callable[[random.Random], float]:
    return lambda rng: max(rng.gauss(mu_ms, sigma_ms), 0.0)


def uniform_turns(
    n: int,
    turns: int,
    gen_tokens: int,
    env_latency: Callable[[random.Random], float],
    *,
    prompt_tokens: int = 512,
    group_size: int = 8,
    gen_jitter: float = 0.25,
    seed: int = 0,
) -> Workload:
    """``n`` trajectories of ``turns`` turns each: the ROLLART environment-latency setup."""
    rng = random.Random(seed)
    trajs = []
    for i in range(n):
        ts = []
        for k in range(turns):
            gen = int(_clip(rng.gauss(gen_tokens, gen_tokens * gen_jitter), 1, 4 * gen_tokens))
            ts.append(Turn(gen, env_latency(rng) if k < turns - 1 else 0.0))
        trajs.append(TrajSpec(f"t{i}", prompt_tokens, tuple(ts), group=i // group_size))
    return Workload(trajs, "uniform")


def preset(name: str, n: int, *, seed: int = 0, group_size: int = 8, submit_turn: bool = False) -> Workload:
    """A named workload of ``n`` trajectories.

    ``submit_turn`` (``coding`` only): the turn whose tests pass is a test run like the
    others (``run_tests``, outcome ``success``, its tool latency), and a short ``submit``
    turn ends the episode, as in ``code-repair-v1``. The next turn then sees the success,
    which is what C-MLFQ's main rule reacts to; without it the passing turn is the last and
    no turn sees its outcome. Off by default: the other coding figures were measured
    without it. The same seed gives the same trajectories either way, but for those two turns.
    """
    # checked up front: per trajectory, preset("nope", 0) returned an empty "nope" workload
    if name not in ("coding", "search", "math"):
        raise ValueError(f"unknown workload preset {name!r}; known: coding, search, math")
    if n < 0 or group_size < 1:
        raise ValueError(f"n must be >= 0 (trajectories) and group_size >= 1, got {n}, {group_size}")
    if submit_turn and name != "coding":
        raise ValueError(f"submit_turn is for the coding preset, not {name!r}")
    rng = random.Random(seed)
    # the submit turns' own draws: the main stream, and so every other turn, stays the same
    extra = random.Random(f"{seed}/submit")
    trajs = []
    for i in range(n):
        if name == "coding":
            # turns until the tests pass: geometric, so a few trajectories go on for long. A
            # hidden difficulty makes a task's turns alike (hard tasks write more and fail
            # more), which is what lets a predictor learn from the first turns
            difficulty = rng.random()
            p_pass = 0.55 - 0.45 * difficulty
            turns: list[Turn] = []
            while True:
                gen = int(_clip(rng.lognormvariate(5.6 + 1.0 * difficulty, 0.6), 16, 8192))
                passed = rng.random() < p_pass or len(turns) >= 15
                if passed and submit_turn:
                    test_ms = _clip(extra.lognormvariate(7.5, 0.7), 50, 60_000)
                    turns.append(Turn(gen, test_ms, "success"))
                    # "submit": a few tokens, then the episode ends (its test run is the reward's)
                    turns.append(Turn(int(_clip(extra.lognormvariate(3.5, 0.4), 8, 128)), 0.0, "success"))
                    break
                if passed:
                    turns.append(Turn(gen, 0.0, "success"))
                    break
                outcome: Outcome = "tool_error" if rng.random() < 0.2 else "test_failure"
                turns.append(Turn(gen, _clip(rng.lognormvariate(7.5, 0.7), 50, 60_000), outcome))
            prompt = int(_clip(rng.lognormvariate(6.5 + 0.5 * difficulty, 0.3), 64, 8192))
        elif name == "search":
            k = rng.randint(2, 6)
            turns = [
                Turn(
                    int(_clip(rng.lognormvariate(5.0, 0.6), 8, 2048)),
                    rng.uniform(300, 3000) if j < k - 1 else 0.0,
                )
                for j in range(k)
            ]
            prompt = 768
        else:  # math (the name was checked above)
            k = 1 if rng.random() < 0.7 else 2
            turns = [
                Turn(int(_clip(rng.lognormvariate(7.0, 1.0), 32, 32_768)), 200.0 if j < k - 1 else 0.0)
                for j in range(k)
            ]
            prompt = 256
        trajs.append(TrajSpec(f"t{i}", prompt, tuple(turns), group=i // group_size))
    return Workload(trajs, name)
