"""The veRL adapter's implementation; ``fabric/integrations/verl.py`` is the file veRL loads.

veRL loads its custom reward function from a *file path*, as a module of another name. Were
the functions defined in that file, they would belong to a module nobody can import by
name, and pickling one (veRL's remote reward manager sends it to a Ray actor) would copy
it by value, with this module's pools, threads and locks: it fails. Defined here, they are
``fabric.integrations._verl``'s, pickled by reference and rebuilt by import on the other
side; and the file loaded by path shares this module's pools with any other import.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fabric.backends.base import Backend
from fabric.integrations.base import RewardAdapter, Sample, Score, SyncBridge, build_trajectory
from fabric.integrations.config import IntegrationConfig, plain
from fabric.integrations.errors import BadBatchError
from fabric.registry import Registry

#: Keyword arguments veRL itself may add to a call (a reward model's router, the sandbox
#: fusion settings of its default scorer): not ours, and not a typo in reward_kwargs.
VERL_EXTRAS = frozenset(
    {
        "reward_router_address",
        "reward_model_tokenizer",
        "sandbox_fusion_url",
        "concurrent_semaphore",
        "memory_limit_mb",
    }
)

#: Sources a veRL sample gives: these names, and every key of ``extra_info``.
_ALIASES = {"ground_truth": "ground_truth"}


class VerlReward:
    """One fabric function behind veRL's ``compute_score`` conventions (usable directly:
    ``compute_score = VerlReward("math_answer").compute_score`` in your own reward file)."""

    def __init__(
        self,
        config: IntegrationConfig | str,
        *,
        registry: Registry | None = None,
        backend_instance: Backend | None = None,
        **options: Any,
    ):
        if isinstance(config, str):
            config = IntegrationConfig.parse({"function": config, **options})
        self.config = config
        self.adapter = RewardAdapter(config, registry=registry, aliases=_ALIASES, backend=backend_instance)
        self._bridge = SyncBridge(self.adapter, name=f"fabric-verl-{config.function}")

    def sample(self, data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any) -> Sample:
        if not isinstance(solution_str, str):
            raise BadBatchError(
                f"solution_str must be the decoded response text, not {type(solution_str).__name__}"
            )
        extra = plain(extra_info) if extra_info is not None else {}
        if not isinstance(extra, Mapping):
            raise BadBatchError(f"extra_info must be a mapping, not {type(extra_info).__name__}")
        gt = plain(ground_truth)
        sources = {**extra, "data_source": plain(data_source), "ground_truth": gt, "extra_info": extra}
        task: dict[str, Any] = {"data_source": sources["data_source"]}
        if isinstance(gt, str):
            task["ground_truth"] = gt
        return Sample(build_trajectory(solution_str, task=task, what="solution_str"), sources)

    def result(self, score: Score) -> dict[str, float]:
        assert score.value is not None  # failures raised in check() unless failure_score is set
        out = {"score": score.value, **self.adapter.report(score)}
        if self.config.failure_score is not None:
            out["fabric_failed"] = 1.0 if score.failed else 0.0
        return out

    def compute_score(
        self, data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None
    ) -> dict[str, float]:
        scores = self._bridge.run([self.sample(data_source, solution_str, ground_truth, extra_info)])
        self.adapter.check(scores, none_ok=False)
        return self.result(scores[0])

    async def compute_score_async(
        self, data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None
    ) -> dict[str, float]:
        scores = await self._bridge.arun([self.sample(data_source, solution_str, ground_truth, extra_info)])
        self.adapter.check(scores, none_ok=False)
        return self.result(scores[0])

    def compute_score_batch(
        self,
        data_sources: Sequence[Any],
        solution_strs: Sequence[Any],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Any] | None = None,
    ) -> list[dict[str, float]]:
        strs = _batch_list("solution_strs", solution_strs)
        if strs is None:
            raise BadBatchError("solution_strs must be a list of the decoded responses, not None")
        n = len(strs)
        # a list left out (None) is none for every sample: callers of this convention pass
        # data_sources=None or extra_infos=None when they have none
        given = {
            "data_sources": _batch_list("data_sources", data_sources),
            "ground_truths": _batch_list("ground_truths", ground_truths),
            "extra_infos": _batch_list("extra_infos", extra_infos),
        }
        lists = {k: [None] * n if v is None else v for k, v in given.items()}
        bad = {k: len(v) for k, v in lists.items() if len(v) != n}
        if bad:
            raise BadBatchError(f"{n} solution_strs but " + ", ".join(f"{v} {k}" for k, v in bad.items()))
        samples = [
            self.sample(ds, s, gt, ex)
            for ds, s, gt, ex in zip(
                lists["data_sources"], strs, lists["ground_truths"], lists["extra_infos"], strict=True
            )
        ]
        scores = self._bridge.run(samples)
        self.adapter.check(scores, none_ok=False)
        return [self.result(s) for s in scores]

    def close(self) -> None:
        self._bridge.close()


def _batch_list(name: str, values: Any) -> list[Any] | None:
    """One of the batch convention's lists (a list, a tuple, a numpy array) as a list; None
    stays None. A string or a mapping is one value where a list of them goes: refused, where
    it was read as one sample per character (or key)."""
    if values is None:
        return None
    if isinstance(values, str | bytes | Mapping) or not isinstance(values, Iterable):
        raise BadBatchError(f"{name} must be a list, one value per sample, not {type(values).__name__}")
    return list(values)


# ----------------------------------------------------------------------------- module level
# veRL loads a function by file path and name, and passes its settings with every call: one
# VerlReward per distinct settings, made on first use and kept for the process's life

_REWARDS: dict[str, VerlReward] = {}
_LOCK = threading.Lock()


def _new_lock_in_child() -> None:
    # held by another thread of the parent at the fork (building the first reward), it would
    # never be released in the child: its first call would wait forever
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)


def reward_for(kwargs: Mapping[str, Any]) -> VerlReward:
    """The ``VerlReward`` for these reward_kwargs (plus ``FABRIC_*``), made once per process."""
    given = {k: v for k, v in kwargs.items() if k not in VERL_EXTRAS}
    key = json.dumps(plain(given), sort_keys=True, default=str)
    reward = _REWARDS.get(key)
    if reward is None:
        with _LOCK:
            reward = _REWARDS.get(key)
            if reward is None:
                reward = _REWARDS[key] = VerlReward(IntegrationConfig.parse(given))
    return reward


def compute_score(
    data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> dict[str, float]:
    """veRL's per-sample ``compute_score``; ``kwargs`` are the reward_kwargs (see the module doc)."""
    return reward_for(kwargs).compute_score(data_source, solution_str, ground_truth, extra_info)


async def compute_score_async(
    data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None, **kwargs: Any
) -> dict[str, float]:
    """``compute_score`` for veRL's reward loop to await: its samples' calls overlap."""
    return await reward_for(kwargs).compute_score_async(data_source, solution_str, ground_truth, extra_info)


def compute_score_batch(
    data_sources: Sequence[Any],
    solution_strs: Sequence[Any],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[dict[str, float]]:
    """veRL's ``batch`` reward manager convention: lists in, one dict per sample out."""
    return reward_for(kwargs).compute_score_batch(data_sources, solution_strs, ground_truths, extra_infos)


def close_all() -> None:
    """Close every reward made here (each also closes at exit)."""
    with _LOCK:
        rewards = list(_REWARDS.values())
        _REWARDS.clear()
    for r in rewards:
        r.close()


__all__ = [
    "VerlReward",
    "close_all",
    "compute_score",
    "compute_score_async",
    "compute_score_batch",
    "reward_for",
]
