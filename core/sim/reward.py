"""Reward workers for the training-loop simulator: dedicated GPUs or Reward-as-a-Service.

A reward (an LLM judge, a test run) takes a sampled service time on one worker. The two
stages differ in when work arrives and what is paid for:

* ``dedicated``: ``workers`` reward GPUs reserved for the whole job. The batch arrives when
  the rollout ends, so they sit idle through rollout and training; utilisation is their
  busy time over ``workers x makespan``.
* ``raas``: a shared serverless pool. Each reward is a request sent as its trajectory
  finishes; an instance is started on demand (``cold_start_ms``) up to ``workers`` at once,
  serves requests FCFS and is released after ``keep_alive_ms`` idle. The job holds an
  instance from its start to its release, so utilisation is busy time over held time.

Requests are served first come, first served, each on the earliest free instance: with
identical instances that is exact FCFS multi-server queueing. Steps call ``serve`` in order
and their arrivals never go back in time, so one pool serves the whole run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

ServiceTime = Callable[[random.Random], float]


def fixed_ms(ms: float) -> ServiceTime:
    """Every reward takes ``ms``."""
    return lambda rng: ms


def lognormal_ms(median_ms: float, sigma: float) -> ServiceTime:
    """Rewards whose time varies with the trajectory's length (a judge reads all of it)."""
    return lambda rng: rng.lognormvariate(0.0, sigma) * median_ms


@dataclass(frozen=True)
class RewardStage:
    mode: Literal["dedicated", "raas"] = "dedicated"
    workers: int = 1
    """Dedicated GPUs, or the most RaaS instances the job may hold at once."""
    service_ms: ServiceTime = field(default=fixed_ms(0.0))
    cold_start_ms: float = 0.0
    keep_alive_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("dedicated", "raas"):
            raise ValueError(f"reward mode must be 'dedicated' or 'raas', got {self.mode!r}")
        if self.workers < 1:
            raise ValueError(f"reward workers must be at least 1, got {self.workers}")
        if self.cold_start_ms < 0 or self.keep_alive_ms < 0:
            raise ValueError("cold_start_ms and keep_alive_ms must be >= 0")


@dataclass
class _Instance:
    born_ms: float
    free_ms: float


class RewardPool:
    """Serves reward requests for a whole run and accounts busy and held time."""

    def __init__(self, stage: RewardStage) -> None:
        self.stage = stage
        self.busy_ms = 0.0
        self._released_ms = 0.0
        """RaaS: held time of instances already released."""
        # dedicated workers are there from the start; RaaS instances come on demand
        self._live = [_Instance(0.0, 0.0) for _ in range(stage.workers)] if stage.mode == "dedicated" else []

    def serve(self, jobs: list[tuple[float, float]]) -> float:
        """Serve ``(arrival_ms, service_ms)`` jobs in arrival order, equal arrivals in the
        order given (a batch handed over at once: in its trajectories' finish order); returns
        the last end."""
        last = 0.0
        # by arrival only: sorting the tuples ran equal arrivals shortest first, not FCFS
        for arrival, service in sorted(jobs, key=lambda job: job[0]):
            # a user's service-time function: a negative time ended a reward before it began,
            # nan made the busy time and the utilisation nan, silently
            if not 0 <= service < math.inf:
                raise ValueError(f"a reward's service time must be finite and >= 0 ms, got {service}")
            inst, start = self._instance_for(arrival)
            inst.free_ms = start + service
            self.busy_ms += service
            last = max(last, inst.free_ms)
        return last

    def _instance_for(self, arrival: float) -> tuple[_Instance, float]:
        if self.stage.mode == "dedicated":
            inst = min(self._live, key=lambda i: i.free_ms)
            return inst, max(arrival, inst.free_ms)
        keep = self.stage.keep_alive_ms
        for inst in [i for i in self._live if i.free_ms + keep < arrival]:  # idle too long
            self._released_ms += inst.free_ms + keep - inst.born_ms
            self._live.remove(inst)
        idle = [i for i in self._live if i.free_ms <= arrival]
        if idle:  # the most recently used, so the others can be released
            return max(idle, key=lambda i: i.free_ms), arrival
        if len(self._live) < self.stage.workers:
            inst = _Instance(arrival, arrival)
            self._live.append(inst)
            return inst, arrival + self.stage.cold_start_ms
        inst = min(self._live, key=lambda i: i.free_ms)
        return inst, inst.free_ms

    def held_ms(self, makespan_ms: float) -> float:
        """GPU time the job held reward workers for."""
        if self.stage.mode == "dedicated":
            return self.stage.workers * makespan_ms
        return self._released_ms + sum(i.free_ms + self.stage.keep_alive_ms - i.born_ms for i in self._live)

    def utilisation(self, makespan_ms: float) -> float:
        held = self.held_ms(makespan_ms)
        return self.busy_ms / held if held else 0.0
