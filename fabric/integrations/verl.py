"""rl-fabric rewards as veRL's custom reward function.

veRL loads ``custom_reward_function.name`` from the file ``custom_reward_function.path`` and
calls it with ``custom_reward_function.reward_kwargs`` merged into every call
(``verl.trainer.ppo.reward.get_custom_reward_fn``, checked in veRL 0.9.1)::

    reward:
      custom_reward_function:
        path: /path/to/site-packages/fabric/integrations/verl.py   # or a file importing it
        name: compute_score              # or compute_score_async (awaited by the reward loop)
        reward_kwargs:
          function: math_answer          # any IntegrationConfig field
          backend: local                 # or endpoint_url: http://rm-host:9000 (a fabric serve)

The same fields may come from ``FABRIC_*`` environment variables (``FABRIC_FUNCTION``, ...);
reward_kwargs win. veRL's convention:

* ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``: one
  sample (the reward loop's ``naive`` manager; it runs a synchronous one on a thread pool and
  awaits an ``async def`` one, so ``compute_score_async`` overlaps the samples it is given).
  It returns a float or a dict with ``"score"``; the dict's other keys are logged, and every
  sample must carry the keys of the first (they are stacked into arrays by key), so the dict
  here always has the same keys: ``score``, the function's components, and ``fabric_failed``
  when ``failure_score`` is set.
* ``compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs)``:
  the ``batch`` reward manager (``verl.workers.reward_manager.batch``), a list back.

A failed call raises ``RewardCallError`` unless ``failure_score`` is set: veRL has no "no
reward" value (a ``None`` or NaN reward would reach the advantages), and its naive manager
only turns its own ``TimeoutError`` into 0.0.
"""

# the definitions live in _verl (why: its docstring); this file only names them
from fabric.integrations._verl import (
    VERL_EXTRAS,
    VerlReward,
    close_all,
    compute_score,
    compute_score_async,
    compute_score_batch,
    reward_for,
)

__all__ = [
    "VERL_EXTRAS",
    "VerlReward",
    "close_all",
    "compute_score",
    "compute_score_async",
    "compute_score_batch",
    "reward_for",
]
