"""``trainer.minibatch_size`` and a trainer backend with its own step: the actor splits a
batch by setting the backend's ``config.mini_batch_size``; a backend with no ``config`` (one
that overrides ``_step``, as the base allows) had the setting ignored without a word, every
batch one update. It is refused when the actor starts, naming what to implement."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from pydantic import BaseModel

import core.trainer.actor as actor_mod
from core.config import TrainerConfig
from core.trainer.actor import TrainerActor
from core.trainer.base import Trainer, TrainerError, TrainSample

BATCH = [
    TrainSample(
        prompt_ids=[1],
        completion_ids=[2],
        old_logprobs=[0.0],
        advantage=1.0,
        group_id="g",
        trajectory_id=f"t{i}",
        policy_version=0,
    )
    for i in range(4)
]


class Plain(Trainer):
    """A backend with its own kind of step and no ``config`` (as the base allows)."""

    name = "plain"

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def _step(self, batch: Sequence[TrainSample], advantages: list[float]) -> dict[str, float]:
        return {"loss": 0.0}


class Settings(BaseModel):
    mini_batch_size: int | None = None
    epochs: int = 1


class Configured(Plain):
    """Such a backend that splits its step by a ``config`` of its own."""

    name = "configured"

    def __init__(self) -> None:
        super().__init__()
        self.config = Settings()
        self.sizes: list[int | None] = []

    def _step(self, batch: Sequence[TrainSample], advantages: list[float]) -> dict[str, float]:
        self.sizes.append(self.config.mini_batch_size)
        return {}


def _actor(monkeypatch: pytest.MonkeyPatch, trainer: Trainer, **cfg: int) -> TrainerActor:
    monkeypatch.setattr(actor_mod, "make_trainer", lambda *a, **k: trainer)
    return TrainerActor(TrainerConfig(**cfg), None, total_steps=3, temperature=1.0, seed=0)


def test_minibatch_size_for_a_backend_without_a_config_is_refused_at_start(monkeypatch):
    with pytest.raises(TrainerError, match=r"minibatch_size=2.*'plain' trainer.*`config`.*mini_batch_size"):
        _actor(monkeypatch, Plain(), minibatch_size=2)
    whole = _actor(monkeypatch, Plain())  # unset: nothing is asked of it
    assert whole.step(BATCH)[0]["version"] == 1


def test_a_backend_with_a_config_gets_the_per_update_size(monkeypatch):
    t = Configured()
    _actor(monkeypatch, t, minibatch_size=2).step(BATCH)
    assert t.sizes == [2]  # 2 of the 4 trajectories, one sample each
