"""``env_return``: the environment's own return for the episode, as the reward.

For environments that score themselves (FrozenLake's 1.0 on the goal, math-tools' 1.0 for a
correct answer), the env manager records the sum of the step rewards in
``Trajectory.env_reward``; this function hands it to the reward stream so such an
environment is rewarded through the same path, weights and masking as any other reward.

A trajectory without ``env_reward`` is an error, not a zero: the reward stream then masks it
(``reward_failed``) instead of training on a made-up score.
"""

from __future__ import annotations

import math

import fabric
from fabric.protocol import Trajectory

_EXAMPLE_TRAJ = {
    "messages": [
        {"role": "user", "content": "FrozenLake 2x2: walk from S to G. Reply with one action."},
        {"role": "assistant", "content": "right", "policy_version": 0},
        {"role": "user", "content": "You moved right."},
        {"role": "assistant", "content": "down", "policy_version": 0},
        {"role": "user", "content": "You reached the goal! Episode over."},
    ],
    "task": {"env_id": "frozenlake-v1", "seed": 7},
    "env_reward": 1.0,
}


@fabric.reward(
    warm=1,
    timeout_s=5,
    max_batch=64,
    examples=(
        {"traj": _EXAMPLE_TRAJ},
        {"traj": {**_EXAMPLE_TRAJ, "env_reward": 0.0, "status": "truncated"}},
    ),
)
def env_return(traj: Trajectory) -> float:
    """The episode return the environment gave (``Trajectory.env_reward``)."""
    if traj.env_reward is None:
        raise ValueError(
            f"trajectory {traj.id} has no env_reward; the env manager must record the episode return"
        )
    if not math.isfinite(traj.env_reward):
        raise ValueError(f"trajectory {traj.id} has a non-finite env_reward {traj.env_reward}")
    return float(traj.env_reward)
