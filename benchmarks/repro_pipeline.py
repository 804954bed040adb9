"""ROLLART's training-loop results reproduced in the pipeline simulator (``core.sim.pipeline``).

Three experiments, each against its baseline on the same seeded workload:

* redundant rollouts: launch ``r`` extra trajectories per group and keep the first finishers;
* asynchronous bound 1..6: rollout of step ``k`` overlaps the reward and training of earlier
  steps, with policy staleness at most ``bound``;
* Reward-as-a-Service vs dedicated reward GPUs.

The workload is coding-like (``preset("coding")``'s shape) but grouped as GRPO groups are: a
group's trajectories share one task, so its prompt and hidden difficulty, and differ only by
sampling. Drawing every trajectory's difficulty independently would overstate how much a
group's first finishers gain over its slowest member.

    .venv/bin/python benchmarks/repro_pipeline.py        # one JSON object: {"rows": [...]}
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from core.sim import EngineProfile, TrajSpec, Turn
from core.sim.pipeline import (
    RolloutPlan,
    StepRollout,
    StepWorkload,
    Timeline,
    run_timeline,
    simulate_rollouts,
)
from core.sim.reward import RewardStage, lognormal_ms

#: 4 engines whose KV cache holds 32 sequences each: 128 slots for 128 trajectories a step.
ENGINES: dict[str, Any] = {"workers": 4, "profile": EngineProfile(max_batch=32), "scheduler": "fcfs"}
GROUPS, GROUP_SIZE = 16, 8


def row(name: str, ours: float, published: str, note: str = "") -> dict[str, object]:
    return {"experiment": name, "ours": round(ours, 3), "published": published, "note": note}


def coding_groups(groups: int, *, seed: int = 0) -> StepWorkload:
    """Coding trajectories (the shape of ``preset("coding")``) in groups sharing a task.

    Nested like ``pipeline.preset_steps``: a group's first ``k`` trajectories do not depend
    on how many are drawn, so runs with and without redundancy share them.
    """

    def make(step: int, per_group: int) -> list[TrajSpec]:
        out = []
        for g in range(groups):
            task = random.Random(f"{seed}:{step}:{g}")
            difficulty = task.random()
            prompt = int(min(max(task.lognormvariate(6.5 + 0.5 * difficulty, 0.3), 64), 8192))
            p_pass = 0.55 - 0.45 * difficulty
            for i in range(per_group):
                rng = random.Random(f"{seed}:{step}:{g}:{i}")
                turns: list[Turn] = []
                while True:
                    gen = int(min(max(rng.lognormvariate(5.6 + difficulty, 0.6), 16), 8192))
                    if rng.random() < p_pass or len(turns) >= 15:
                        turns.append(Turn(gen, 0.0, "success"))
                        break
                    tool = min(max(rng.lognormvariate(7.5, 0.7), 50), 60_000)
                    turns.append(Turn(gen, tool, "tool_error" if rng.random() < 0.2 else "test_failure"))
                out.append(TrajSpec(f"s{step}g{g}t{i}", prompt, tuple(turns), group=g))
        return out

    return make


def _mean_rollout_ms(rollouts: list[StepRollout]) -> float:
    return sum(r.duration_ms for r in rollouts) / len(rollouts)


def redundant_rollouts() -> list[dict[str, object]]:
    workload = coding_groups(GROUPS, seed=1)
    runs = {
        r: _mean_rollout_ms(
            simulate_rollouts(workload, RolloutPlan(steps=6, group_size=GROUP_SIZE, redundancy=r), **ENGINES)
        )
        for r in (0, 1, 2, 4, 8)
    }
    practical = (1, 2, 4)  # at most half a group more: keeping the fastest half of 2G biases training
    best = min(practical, key=lambda r: runs[r])
    per_r = ", ".join(f"r={r}: {runs[0] / runs[r]:.2f}x" for r in runs if r)
    return [
        row(
            f"redundant rollouts: group of {GROUP_SIZE} + r, first {GROUP_SIZE} kept (coding, "
            f"{GROUPS} groups, 4 engines x 32 slots)",
            runs[0] / runs[best],
            "ROLLART: up to 1.62x rollout speedup",
            f"mean rollout time of 6 steps, r=0 / best r in {practical} (r={best}, "
            f"{(GROUP_SIZE + best) / GROUP_SIZE:.2f}x the trajectories launched); {per_r}. A group "
            "shares a task but its samples differ in turns (tests pass at a random turn), so the "
            "slowest of G+r are cut off. r=8 goes past the published figure because the fastest "
            "half of 16 samples drops nearly the whole tail, a sample bias a real job would not "
            "accept; extra trajectories also queue once the 128 slots are full",
        )
    ]


def async_bound() -> list[dict[str, object]]:
    rollouts = simulate_rollouts(
        coding_groups(GROUPS, seed=2), RolloutPlan(steps=24, group_size=GROUP_SIZE), **ENGINES
    )
    # a trainer sized for the async pipeline: reward + training + sync take about as long as
    # a mean rollout, as a job that splits its GPUs between the two stages would arrange
    tokens = sum(r.trained_tokens for r in rollouts) / len(rollouts)
    reward = RewardStage("dedicated", 8, lognormal_ms(1500.0, 0.5))
    train_ms_per_token = 0.75 * _mean_rollout_ms(rollouts) / tokens
    results = {
        b: run_timeline(rollouts, Timeline(b, reward, train_ms_per_token, 10_000.0), workers=4)
        for b in range(7)
    }
    sync = results[0].throughput
    out = []
    for b in range(1, 7):
        res = results[b]
        out.append(
            row(
                f"asynchronous bound {b} vs synchronous (coding, 24 steps of {GROUPS * GROUP_SIZE} "
                "trajectories)",
                res.throughput / sync,
                "ROLLART: throughput grows with the bound and saturates",
                "trajectories trained per second, trainer sized so reward + training + sync take "
                f"about one mean rollout; max staleness {max(s.staleness for s in res.steps)}, "
                f"engine utilisation {results[0].engine_utilisation:.0%} -> {res.engine_utilisation:.0%}. "
                "Rollouts are step-granular (step k+1 starts after step k's last trajectory), so the "
                "bound only absorbs step-to-step variation between the rollout stage and reward + "
                "training. The tail of one rollout is not overlapped with the next (no partial "
                "rollouts), so gains that come from filling a tail's idle slots are not counted",
            )
        )
    return out


def reward_as_a_service() -> list[dict[str, object]]:
    rollouts = simulate_rollouts(
        coding_groups(GROUPS, seed=3), RolloutPlan(steps=6, group_size=GROUP_SIZE), **ENGINES
    )
    tokens = sum(r.trained_tokens for r in rollouts) / len(rollouts)
    train_ms_per_token = 0.3 * _mean_rollout_ms(rollouts) / tokens
    judge = lognormal_ms(4000.0, 0.5)  # an LLM judge reading a coding trajectory, per GPU
    res = {
        mode: run_timeline(
            rollouts,
            Timeline(
                0,
                RewardStage(mode, 8, judge, cold_start_ms=2000.0, keep_alive_ms=5000.0),
                train_ms_per_token,
                10_000.0,
            ),
            workers=4,
        )
        for mode in ("dedicated", "raas")
    }
    ded, raas = res["dedicated"], res["raas"]
    setup = (
        "8 dedicated reward GPUs vs a RaaS pool of at most 8 instances (2 s cold start, 5 s "
        "keep-alive), LLM-judge reward ~4 s per trajectory, synchronous loop"
    )
    return [
        row(
            "Reward-as-a-Service vs dedicated reward GPUs: reward GPU utilisation",
            raas.reward_utilisation / ded.reward_utilisation,
            "ROLLART: 6% -> 88%",
            f"{ded.reward_utilisation:.0%} -> {raas.reward_utilisation:.0%} ({setup}). Dedicated GPUs "
            "are held through rollout and training; RaaS instances only while serving (plus cold "
            "start and keep-alive). The dedicated figure is the reward work's share of the step, "
            "so it is higher than 6% wherever the judge is a bigger part of the step",
        ),
        row(
            "Reward-as-a-Service vs dedicated reward GPUs: rollout + reward time per step",
            ded.mean_rollout_reward_ms / raas.mean_rollout_reward_ms,
            "ROLLART: 158 s -> 77 s (2.05x)",
            f"{ded.mean_rollout_reward_ms / 1000:.0f} s -> {raas.mean_rollout_reward_ms / 1000:.0f} s "
            "with the same reward capacity: RaaS hides the reward behind the rollout's long tail, "
            "so the gain is bounded by (rollout + reward phase) / rollout; a 2x gain needs a "
            "dedicated reward phase as long as the rollout, which this setup does not have",
        ),
    ]


def main() -> None:
    t0 = time.perf_counter()
    rows = [*redundant_rollouts(), *async_bound(), *reward_as_a_service()]
    print(json.dumps({"rows": rows, "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
