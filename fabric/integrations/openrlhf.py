"""rl-fabric rewards for OpenRLHF's remote reward (``--reward.remote_url``, formerly
``--remote_rm_url``), in both of its forms (checked in OpenRLHF 0.11.2,
``openrlhf/utils/agent.py``, ``SingleTurnAgentExecutor``):

* **a Python file**: a URL ending in ``.py`` is loaded and its ``reward_func(queries, prompts,
  labels)`` called on a thread, with lists (one sample per call in 0.11.2). ``queries`` are
  the decoded prompt+response with special tokens, ``prompts`` the prompt text, ``labels``
  the dataset's ``--data.label_key`` values. It returns ``{"rewards": ..., "scores": ...,
  "extra_logs": {...}}``. Point it at this file with ``FABRIC_FUNCTION`` set (and the other
  ``FABRIC_*`` variables; Ray actors need them in the runtime env), or write your own file
  with ``reward_func = OpenRLHFReward("math_answer", ...)``. Earlier releases (0.8) run
  ``reward_func`` as a Ray task, which pickles it: it goes by reference (see ``_openrlhf``).
* **HTTP**: any other URL gets ``POST {"query": [...], "prompts": [...], "labels": [...]}``
  and reads the same dict from the JSON answer; errors are retried 5 times, 1 s apart.
  ``fabric integrate openrlhf-serve --function math_answer`` serves that (``serve``).

OpenRLHF has no "no reward" value: an exception in the reward function is logged at INFO
and the sample's reward stays ``None``, which the trainer later trips over. So a failed
call raises ``RewardCallError`` (logged here as a WARNING first), or, with
``failure_score``, scores that. ``label`` reaches ``ground_truth`` by default; a label that
is a JSON object gives its keys as sources too (``args={"tests": "label.tests"}``).
"""

# the definitions live in _openrlhf (why: its docstring); this file only names them
from fabric.integrations._openrlhf import (
    DEFAULT_MAX_BODY_BYTES,
    EOS_MARKERS,
    OpenRLHFReward,
    RewardServer,
    reward_func,
    serve,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "EOS_MARKERS",
    "OpenRLHFReward",
    "RewardServer",
    "reward_func",
    "serve",
]
