"""The learning rate of a trainer backend and the job's schedule over it: a backend that
overrides ``_step`` and sets no optimizer (the base's contract allows one) is told what to
implement when a rate is asked of it, the trainer actor says so before the job starts, a
backend with its own ``lr`` and ``set_lr`` follows the schedule, and the schedule's ends
(``lr`` at the first step, ``lr_end`` at the last; one step: ``lr``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

import core.trainer.actor as actor_mod
from core.config import TrainerConfig
from core.trainer.actor import TrainerActor
from core.trainer.base import Trainer, TrainerError, TrainSample

BATCH = [
    TrainSample(
        prompt_ids=[1], completion_ids=[2], old_logprobs=[0.0], advantage=1.0, group_id="g", policy_version=0
    )
]


class Plain(Trainer):
    """A backend with its own kind of step and no ``optimizer`` (as the base allows)."""

    name = "plain"

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def _step(self, batch: Sequence[TrainSample], advantages: list[float]) -> dict[str, float]:
        return {"loss": 0.0}


class OwnRate(Plain):
    """Such a backend that takes a rate all the same: it implements ``lr`` and ``set_lr``."""

    name = "own-rate"

    def __init__(self) -> None:
        super().__init__()
        self.rate = 1.0
        self.used: list[float] = []

    @property
    def lr(self) -> float:
        return self.rate

    def set_lr(self, lr: float) -> None:
        self.rate = lr

    def _step(self, batch: Sequence[TrainSample], advantages: list[float]) -> dict[str, float]:
        self.used.append(self.rate)
        return {}


def _actor(monkeypatch: pytest.MonkeyPatch, trainer: Trainer, total_steps: int, **cfg: float) -> TrainerActor:
    monkeypatch.setattr(actor_mod, "make_trainer", lambda *a, **k: trainer)
    return TrainerActor(TrainerConfig(**cfg), None, total_steps=total_steps, temperature=1.0, seed=0)


def test_a_backend_without_an_optimizer_says_what_to_implement_for_a_rate():
    # the base's lr and set_lr read self.optimizer: such a backend failed with
    # "'Plain' object has no attribute 'optimizer'", which named neither it nor the remedy
    t = Plain()
    with pytest.raises(TrainerError, match=r"'plain' trainer has no optimizer.*`lr` and `set_lr`"):
        t.set_lr(1e-3)
    with pytest.raises(TrainerError, match="'plain' trainer has no optimizer"):
        _ = t.lr
    assert t.step(BATCH)["version"] == 1  # its own step needs no rate


def test_the_actor_refuses_an_lr_schedule_for_a_backend_without_a_rate_at_start(monkeypatch):
    # its hasattr(trainer, "set_lr") was always true (the base defines it): the first step,
    # after the engines and the first rollouts, failed with the AttributeError
    with pytest.raises(TrainerError, match="'plain' trainer has no optimizer"):
        _actor(monkeypatch, Plain(), 3, lr=1e-2, lr_end=1e-3)
    constant = _actor(monkeypatch, Plain(), 3, lr=1e-2)  # no schedule: no rate is asked of it
    assert constant.step(BATCH)[0]["version"] == 1


def test_a_backend_with_its_own_rate_follows_the_schedule(monkeypatch):
    t = OwnRate()
    actor = _actor(monkeypatch, t, 3, lr=1e-2, lr_end=1e-3)
    for _ in range(4):  # one past the schedule: lr_end
        actor.step(BATCH)
    assert t.used == pytest.approx([1e-2, 5.5e-3, 1e-3, 1e-3])


@pytest.mark.parametrize(("steps", "want"), [(1, [1e-2]), (2, [1e-2, 1e-3])])
def test_the_schedule_starts_at_lr_and_ends_at_lr_end_a_single_step_at_lr(monkeypatch, steps, want):
    # a one-step run has no step to decay over: it trains at lr, the rate the config names
    # for training (the schedule's first step), as a longer run's first step does
    t = OwnRate()
    actor = _actor(monkeypatch, t, steps, lr=1e-2, lr_end=1e-3)
    for _ in range(steps):
        actor.step(BATCH)
    assert t.used == pytest.approx(want)


def test_set_lr_refuses_a_rate_that_is_not_positive_and_finite():
    # "must be positive" let inf through (not inf > 0 is False): the next update made every
    # weight it moved infinite or NaN. The job's config refuses it (allow_inf_nan=False)
    t = Plain()
    t.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=0.1)
    for bad in (math.inf, math.nan, 0.0, -1.0):
        with pytest.raises(ValueError, match="must be positive and finite"):
            t.set_lr(bad)
    assert t.lr == 0.1
    t.set_lr(0.05)
    assert t.lr == 0.05


@pytest.mark.parametrize(
    "field", ["lr", "weight_decay", "grad_clip", "kl_coef", "entropy_coef", "temperature"]
)
def test_a_backend_config_built_by_hand_refuses_an_infinite_value(field):
    # the job config refuses inf field by field; a config built by hand (the trainer API
    # used directly) took lr=inf, and the first update made every weight inf or NaN
    from pydantic import ValidationError

    from core.config_backends import TorchTrainerConfig
    from core.config_megatron import MegatronTrainerConfig

    for cls in (TorchTrainerConfig, MegatronTrainerConfig):
        if field not in cls.model_fields:
            continue
        with pytest.raises(ValidationError, match="finite"):
            cls(**{field: float("inf")})
