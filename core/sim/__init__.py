"""Discrete-event simulator of rollout steps (``simulator``), its engine model (``engine``)
and workloads (``workload``). It runs the same ``core.sched`` policies as the real path.
``pipeline`` and ``reward`` simulate the RL loop around the rollout (asynchrony, failures,
reward workers); ``trace`` replays a real run's trace and ``calibrate`` measures a real
engine's profile."""

from core.sim.engine import EngineProfile, Worker
from core.sim.simulator import SimResult, Simulator, no_prediction, oracle
from core.sim.workload import TrajSpec, Turn, Workload, env_latency_normal, preset, uniform_turns

__all__ = [
    "EngineProfile",
    "SimResult",
    "Simulator",
    "TrajSpec",
    "Turn",
    "Worker",
    "Workload",
    "env_latency_normal",
    "no_prediction",
    "oracle",
    "preset",
    "uniform_turns",
]
