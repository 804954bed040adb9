"""An RL training loop on top of the rollout simulator: rollouts, rewards, training, sync.

A step is a rollout (``Simulator`` on that step's trajectories), a reward for every kept
trajectory, a training pass over them and a weight sync. What this module adds to the
one-step simulator is what happens around and between rollouts:

* **failures**: each attempt of a trajectory fails with probability ``failure_prob`` at a
  uniformly random point of its generation and is re-run from scratch. The failed attempt's
  turns are put in front of the trajectory (the engine really spends that time), then
  ``restart_ms`` to notice the failure and restart its environment. (The re-run keeps the
  failed attempt's context in the simulator's history; with the prefix cache that costs
  little prefill, and decode time does not depend on context length here);
* **redundant rollouts**: a group of ``group_size`` launches ``redundancy`` more; the first
  ``group_size`` to finish are kept, the rest aborted (``Simulator(keep_per_group=...)``);
* **rewards** (``core.sim.reward``): dedicated reward workers that get the whole batch when
  the rollout ends, or a Reward-as-a-Service pool fed as each trajectory finishes;
* **trainer and weight sync**: training takes ``train_ms_per_token`` per trained token
  (prompt and generation of the kept trajectories), then ``sync_ms`` to publish weights;
* **asynchronous bound**: rollout ``k`` needs policy version ``k - bound`` (version ``v`` is
  published once training of step ``v - 1`` is synced) and the engines to be done with
  rollout ``k - 1``. ``bound = 0`` is the synchronous loop; ``bound >= 1`` overlaps rollout
  ``k`` with the reward and training of earlier steps, with staleness at most ``bound``.

Rollouts do not depend on when they start, so ``simulate_rollouts`` runs them once and
``run_timeline`` lays them out for any bound or reward stage (the benchmark sweeps bounds
without re-simulating). Rollouts are step-granular: the engines start rollout ``k + 1``
only after the last kept trajectory of rollout ``k`` (no partial rollouts across steps),
and engines pick up new weights between rollouts without pausing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from core.sim.reward import RewardPool, RewardStage
from core.sim.simulator import Simulator
from core.sim.workload import TrajSpec, Turn, preset

#: ``(step, per_group) -> trajectories`` with exactly ``per_group`` per group.
StepWorkload = Callable[[int, int], list[TrajSpec]]


def preset_steps(name: str, groups: int, *, seed: int = 0) -> StepWorkload:
    """Each step's ``groups`` groups drawn from ``preset(name)``, one seed per (step, group).

    Nested on purpose: a group's first ``k`` trajectories are the same whatever ``per_group``
    is, so a run with redundancy launches the same trajectories as one without, plus extras.
    """

    def make(step: int, per_group: int) -> list[TrajSpec]:
        out: list[TrajSpec] = []
        for g in range(groups):
            w = preset(name, per_group, seed=seed * 1_000_003 + step * 10_007 + g, group_size=per_group)
            out += [replace(t, id=f"s{step}g{g}t{i}", group=g) for i, t in enumerate(w.trajectories)]
        return out

    return make


@dataclass(frozen=True)
class RolloutPlan:
    """What shapes the rollouts themselves (and so must be simulated again when changed)."""

    steps: int = 4
    group_size: int = 8
    redundancy: int = 0
    failure_prob: float = 0.0
    restart_ms: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {self.group_size}")
        if self.redundancy < 0:
            raise ValueError(f"redundancy must be >= 0 (extra trajectories per group), got {self.redundancy}")
        if not 0.0 <= self.failure_prob < 1.0:
            raise ValueError(f"failure_prob must be in [0, 1) (1 never finishes), got {self.failure_prob}")
        if self.restart_ms < 0:
            raise ValueError(f"restart_ms must be >= 0, got {self.restart_ms}")


@dataclass(frozen=True)
class Timeline:
    """What lays finished rollouts out in time: async bound, rewards, trainer, weight sync."""

    bound: int = 0
    reward: RewardStage = field(default_factory=RewardStage)
    train_ms_per_token: float = 0.0
    sync_ms: float = 0.0
    seed: int = 0
    """Seeds the reward service times (the same per trajectory whatever the reward stage)."""

    def __post_init__(self) -> None:
        if self.bound < 0:
            raise ValueError(f"bound must be >= 0 (0: synchronous), got {self.bound}")
        if self.train_ms_per_token < 0 or self.sync_ms < 0:
            raise ValueError("train_ms_per_token and sync_ms must be >= 0")


@dataclass
class StepRollout:
    """One simulated rollout, in ms from its own start."""

    step: int
    duration_ms: float
    finish_ms: dict[str, float]
    """Kept trajectories only."""
    trained_tokens: int
    launched: int
    aborted: int
    failures: int
    lost_tokens: int
    """Tokens generated by attempts that failed."""
    engine_busy_ms: float
    """Summed over workers (utilisation x workers x duration)."""


@dataclass
class StepRecord:
    step: int
    version: int
    """The newest policy version published when the rollout started."""
    rollout_start_ms: float
    rollout_end_ms: float
    reward_end_ms: float
    train_start_ms: float
    train_end_ms: float
    synced_ms: float

    @property
    def staleness(self) -> int:
        return self.step - self.version

    @property
    def rollout_reward_ms(self) -> float:
        """Rollout start to the step's last reward: what RaaS shortens."""
        return self.reward_end_ms - self.rollout_start_ms


@dataclass
class PipelineResult:
    steps: list[StepRecord]
    rollouts: list[StepRollout]
    makespan_ms: float
    """Until the last step's weights are synced."""
    reward_utilisation: float
    engine_utilisation: float
    """Engine busy time over ``workers x makespan``: the engines' idle share between rollouts."""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Kept trajectories trained per second."""
        if not self.makespan_ms:
            return 0.0
        return sum(len(r.finish_ms) for r in self.rollouts) / (self.makespan_ms / 1000.0)

    @property
    def mean_rollout_reward_ms(self) -> float:
        if not self.steps:
            return 0.0
        return sum(s.rollout_reward_ms for s in self.steps) / len(self.steps)


def with_failures(
    spec: TrajSpec, rng: random.Random, p: float, restart_ms: float
) -> tuple[TrajSpec, int, int]:
    """``spec`` with its failed attempts in front: ``(spec', failures, lost_tokens)``.

    Attempts fail independently with probability ``p`` (geometric retries); a failed attempt
    runs its turns up to a uniformly random token, then ``restart_ms`` before the re-run.
    """
    turns: list[Turn] = []
    failures = lost = 0
    total = spec.total_tokens
    while total > 0 and rng.random() < p:
        cut = max(1, int(rng.random() * total))
        done = 0
        for t in spec.turns:
            if done + t.gen_tokens >= cut:
                turns.append(Turn(cut - done, restart_ms, "tool_error"))
                break
            turns.append(t)
            done += t.gen_tokens
        failures += 1
        lost += cut
    if not failures:
        return spec, 0, 0
    return replace(spec, turns=(*turns, *spec.turns)), failures, lost


def simulate_rollouts(workload: StepWorkload, plan: RolloutPlan, **sim_options: Any) -> list[StepRollout]:
    """Every step's rollout, each from time 0; ``sim_options`` go to ``Simulator``."""
    workers = int(sim_options.get("workers", 1))
    per_group = plan.group_size + plan.redundancy
    out = []
    for step in range(plan.steps):
        trajs = workload(step, per_group)
        sizes: dict[int, int] = {}
        for t in trajs:
            sizes[t.group] = sizes.get(t.group, 0) + 1
        if any(n != per_group for n in sizes.values()):
            raise ValueError(f"step {step}: every group needs {per_group} trajectories, got sizes {sizes}")
        originals = {t.id: t for t in trajs}
        rng = random.Random(f"{plan.seed}:{step}:failures")
        failed = [with_failures(t, rng, plan.failure_prob, plan.restart_ms) for t in trajs]
        keep = plan.group_size if plan.redundancy else None
        res = Simulator([f[0] for f in failed], keep_per_group=keep, **sim_options).run()
        kept = res.finish_ms
        out.append(
            StepRollout(
                step=step,
                duration_ms=res.makespan_ms,
                finish_ms=kept,
                trained_tokens=sum(originals[t].prompt_tokens + originals[t].total_tokens for t in kept),
                launched=len(trajs),
                aborted=len(res.meta.get("aborted", ())),
                failures=sum(f[1] for f in failed),
                lost_tokens=sum(f[2] for f in failed),
                engine_busy_ms=res.utilisation * workers * res.makespan_ms,
            )
        )
    return out


def run_timeline(rollouts: list[StepRollout], timeline: Timeline, *, workers: int = 1) -> PipelineResult:
    """Lay the rollouts out in time under ``timeline``; ``workers`` is the engine count."""
    pool = RewardPool(timeline.reward)
    records: list[StepRecord] = []
    rollout_end = 0.0
    for r in rollouts:
        k = r.step
        need = k - timeline.bound - 1  # the step whose synced weights rollout k must wait for
        start = max(rollout_end, records[need].synced_ms if need >= 0 else 0.0)
        version = sum(1 for s in records if s.synced_ms <= start)
        rollout_end = start + r.duration_ms
        rng = random.Random(f"{timeline.seed}:{k}:reward")
        service = {t: timeline.reward.service_ms(rng) for t in sorted(r.finish_ms)}
        order = sorted(r.finish_ms, key=lambda t: (r.finish_ms[t], t))
        # RaaS: each reward starts as its trajectory streams out; dedicated: the batch goes to
        # the reward workers once the rollout is over (in finish order)
        raas = timeline.reward.mode == "raas"
        jobs = [(start + r.finish_ms[t] if raas else rollout_end, service[t]) for t in order]
        reward_end = max(pool.serve(jobs), rollout_end)
        train_start = max(reward_end, records[-1].synced_ms if records else 0.0)
        train_end = train_start + timeline.train_ms_per_token * r.trained_tokens
        records.append(
            StepRecord(
                k,
                version,
                start,
                rollout_end,
                reward_end,
                train_start,
                train_end,
                train_end + timeline.sync_ms,
            )
        )
    makespan = records[-1].synced_ms if records else 0.0
    busy = sum(r.engine_busy_ms for r in rollouts)
    return PipelineResult(
        steps=records,
        rollouts=rollouts,
        makespan_ms=makespan,
        reward_utilisation=pool.utilisation(makespan),
        engine_utilisation=busy / (workers * makespan) if makespan else 0.0,
        meta={"reward_busy_ms": pool.busy_ms, "reward_held_ms": pool.held_ms(makespan)},
    )


def simulate(
    workload: StepWorkload, plan: RolloutPlan, timeline: Timeline, **sim_options: Any
) -> PipelineResult:
    """``simulate_rollouts`` then ``run_timeline``: the whole training loop."""
    rollouts = simulate_rollouts(workload, plan, **sim_options)
    return run_timeline(rollouts, timeline, workers=int(sim_options.get("workers", 1)))
