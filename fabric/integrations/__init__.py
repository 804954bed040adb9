"""rl-fabric rewards as drop-in reward functions of existing trainers (Reward-as-a-Service).

One module per framework, each matching its calling convention without importing it:

* ``fabric.integrations.trl``: ``trl_reward("math_answer")`` for ``GRPOTrainer(reward_funcs=...)``
  (and ``trl_async_reward``);
* ``fabric.integrations.verl``: ``compute_score`` / ``compute_score_async`` /
  ``compute_score_batch`` for ``custom_reward_function`` (settings in ``reward_kwargs``);
* ``fabric.integrations.openrlhf``: ``reward_func`` for ``--reward.remote_url file.py``, and
  an HTTP server for ``--reward.remote_url http://...`` (``fabric integrate openrlhf-serve``).

The calls run in the fabric's warm local pools (``backend="local"``) or a shared
``fabric serve`` / AWS Lambda (``endpoint_url=...``). A failed call never reads as a reward
of 0: see docs/integrations.md.
"""

from fabric.integrations.base import RewardAdapter, Sample, Score, SyncBridge, build_trajectory
from fabric.integrations.config import IntegrationConfig
from fabric.integrations.errors import (
    BadBatchError,
    BatchDeadlineError,
    IntegrationError,
    MissingArgumentError,
    RefusedArgumentsError,
    RewardCallError,
    RewardClosedError,
    UnexpectedArgumentError,
)

__all__ = [
    "BadBatchError",
    "BatchDeadlineError",
    "IntegrationConfig",
    "IntegrationError",
    "MissingArgumentError",
    "RefusedArgumentsError",
    "RewardAdapter",
    "RewardCallError",
    "RewardClosedError",
    "Sample",
    "Score",
    "SyncBridge",
    "UnexpectedArgumentError",
    "build_trajectory",
]
