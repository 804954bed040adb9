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
from envpool.testing import EnvConformanceError, check_env


def __getattr__(name: str) -> object:
    # the pool (tenacity, asyncio machinery) is not needed inside a container
    if name in ("EnvPool", "EnvSession", "PoolConfig", "SessionLost"):
        from envpool import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'envpool' has no attribute {name!r}")


__all__ = [
    "Env",
    "EnvConformanceError",
    "EnvPool",
    "EnvPoolError",
    "EnvRegistry",
    "EnvSession",
    "EnvSpec",
    "Observation",
    "PoolConfig",
    "SessionLost",
    "StepResult",
    "check_env",
    "default_registry",
    "make",
    "register",
]
