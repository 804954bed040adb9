"""envpool: stateful environments in session-affine container pools.

import envpool
envpool.register("my-env-v0", entry_point="my_pkg.envs:MyEnv", max_episode_steps=50)
env = envpool.make("my-env-v0")                      # in-process, for tests

async with envpool.EnvPool() as pool:                 # containers, for training
    async with pool.session("my-env-v0") as s:
        obs, info = await s.reset(seed=7)
        res = await s.step("right")
"""

from envpool.api import (
    Env,
    EnvRegistry,
    EnvSpec,
    Observation,
    StepResult,
    default_registry,
    make,
    register,
)
from envpool.errors import EnvPoolError

__all__ = [
    "Env",
    "EnvPoolError",
    "EnvRegistry",
    "EnvSpec",
    "Observation",
    "StepResult",
    "default_registry",
    "make",
    "register",
]
