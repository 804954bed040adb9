"""The step sequence both backends share (``Trainer._step``): a backend that implements only
``_update`` gets the mini-batches, the epochs, the shuffle and the metrics the torch and the
megatron trainer report. The megatron trainer runs only on a GPU; this is its step's CPU check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import BaseModel

from core.trainer.base import Trainer, TrainerError, TrainSample


class Settings(BaseModel):
    mini_batch_size: int | None = None
    epochs: int = 1


class Recorder(Trainer):
    """A backend with an optimizer over one parameter and an ``_update`` that records the
    mini-batches it is given."""

    name = "recorder"

    def __init__(self, settings: Settings, *, lr: float = 0.5, seed: int = 0) -> None:
        super().__init__()
        self.config = settings
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.optimizer = torch.optim.SGD([self.weight], lr=lr)
        self._shuffle = torch.Generator().manual_seed(seed)
        self.seen: list[list[int]] = []

    def state(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.detach().clone()}

    def _update(self, samples: list[TrainSample], advantages: list[float]) -> dict[str, float] | None:
        self.seen.append([s.completion_ids[0] for s in samples])
        if not any(any(s.token_mask) for s in samples):
            return None
        return {"loss": float(len(samples)), "adv": sum(advantages)}


def batch(n: int, **kw: Any) -> list[TrainSample]:
    return [
        TrainSample(
            prompt_ids=[1],
            completion_ids=[i],
            old_logprobs=[0.0],
            advantage=float(i),
            group_id="g",
            policy_version=0,
            **kw,
        )
        for i in range(n)
    ]


def test_the_shared_step_runs_the_backends_updates_in_shuffled_mini_batches():
    t = Recorder(Settings(mini_batch_size=2, epochs=2))
    m = t.step(batch(5))
    assert len(t.seen) == 6  # 3 mini-batches (2, 2, 1) per epoch, 2 epochs
    for epoch in (t.seen[:3], t.seen[3:]):
        assert sorted(i for mb in epoch for i in mb) == [0, 1, 2, 3, 4]
        assert [len(mb) for mb in epoch] == [2, 2, 1]
    assert t.seen[:3] != [[0, 1], [2, 3], [4]] or t.seen[3:] != [[0, 1], [2, 3], [4]]  # shuffled
    assert m["updates"] == 6 and m["tokens"] == 5 and m["lr"] == 0.5
    assert m["loss"] == pytest.approx((2 + 2 + 1) * 2 / 6)
    assert m["version"] == 1 and m["samples"] == 5


def test_the_shared_step_is_seeded_and_reports_the_rate_set():
    a, b = Recorder(Settings(mini_batch_size=1), seed=3), Recorder(Settings(mini_batch_size=1), seed=3)
    a.step(batch(4))
    b.step(batch(4))
    assert a.seen == b.seen
    a.set_lr(0.25)
    assert a.lr == 0.25 and a.step(batch(4))["lr"] == 0.25
    with pytest.raises(ValueError, match="must be positive"):
        a.set_lr(0.0)


def test_a_whole_batch_is_one_update_and_a_masked_batch_none():
    t = Recorder(Settings())
    assert t.step(batch(3))["updates"] == 1 and [len(mb) for mb in t.seen] == [3]
    skipped = t.step(batch(3, mask=[0]))
    assert skipped["skipped"] == 1.0 and skipped["tokens"] == 0 and "lr" not in skipped
    assert len(t.seen) == 1  # no update was asked for


def test_a_backend_without_update_or_step_says_so():
    class Bare(Trainer):
        name = "bare"

        def state(self) -> dict[str, torch.Tensor]:
            return {}

    t = Bare()
    t.config = Settings()
    t._shuffle = torch.Generator()
    with pytest.raises(NotImplementedError, match="'bare' trainer implements neither _step nor _update"):
        t.step(batch(1))
    with pytest.raises(TrainerError, match="non-empty batch"):
        t.step([])


def test_a_sample_the_model_cannot_take_fails_the_step_before_any_update():
    # it failed in its own mini-batch: the updates of those before it were applied (the
    # weights moved, the version did not), and the error did not say so
    from test_torch_trainer import TOK, model, sample

    from core.trainer.torch_ import TorchTrainer, TorchTrainerConfig

    t = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2, mini_batch_size=1, seed=3))
    right = TOK.token_to_id("right")
    good = [sample(t.model, [1, 2], [right], 1.0) for _ in range(4)]  # seed 3: the long one is 4th
    too_long = good[0].model_copy(
        update={"prompt_ids": [2] * 30, "completion_ids": [right] * 5, "old_logprobs": [0.0] * 5}
    )
    before = t.state()
    with pytest.raises(TrainerError, match="exceeds the model's max_len=32"):
        t.step([*good, too_long])
    assert all(torch.equal(before[k], v) for k, v in t.state().items())
    assert t.version == 0 and not t.optimizer.state  # no update, no moments


def test_the_shared_step_checks_every_sample_before_the_first_update():
    class Picky(Recorder):
        def _check_samples(self, batch: list[TrainSample]) -> None:
            if any(s.completion_ids[0] == 3 for s in batch):
                raise TrainerError("no 3s")

    t = Picky(Settings(mini_batch_size=1))
    with pytest.raises(TrainerError, match="no 3s"):
        t.step(batch(5))
    assert t.seen == [] and t.version == 0
    assert t.step(batch(3))["updates"] == 3
    assert t.step(batch(5, mask=[0]))["skipped"] == 1.0  # nothing trains: no update to protect


def test_an_id_outside_the_torch_models_vocabulary_is_a_clear_error_before_any_update():
    # it was an IndexError from the embedding (or from the restriction's table) in its own
    # mini-batch, after the updates of those before it
    from test_torch_trainer import TOK, model, sample

    from core.trainer.torch_ import TorchTrainer, TorchTrainerConfig

    t = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2, mini_batch_size=1, seed=3))
    right = TOK.token_to_id("right")
    good = [sample(t.model, [1, 2], [right], 1.0) for _ in range(4)]
    vocab = TOK.vocab_size
    before = t.state()
    for bad in (
        {"completion_ids": [vocab]},
        {"prompt_ids": [1, -1]},
        {"allowed_token_ids": [right, vocab + 3]},
    ):
        with pytest.raises(TrainerError, match=f"outside the model's vocab_size={vocab}"):
            t.step([*good, good[0].model_copy(update=bad)])
    assert all(torch.equal(before[k], v) for k, v in t.state().items()) and t.version == 0


def test_reward_mean_counts_each_trajectory_once():
    # a trajectory cut into three turn samples weighed three times in it (as batch_advantages
    # says: trajectories, not samples, are the members)
    turns = [
        s.model_copy(update={"advantage": None, "reward": r, "trajectory_id": t})
        for s, r, t in zip(batch(5), [1.0, 1.0, 1.0, 0.0, 0.5], ["a", "a", "a", "b", None], strict=True)
    ]
    m = Recorder(Settings()).step(turns)
    assert m["reward_mean"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    assert m["samples"] == 5
