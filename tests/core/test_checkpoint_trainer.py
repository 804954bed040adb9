"""Checkpoints of the trainers' training state: a resumed trainer goes on exactly as the
uninterrupted one (weights, Adam's moments, the KL anchor, its own hyperparameters), a state
that does not fit is refused by name, the trainer actor's whole-file saves, its learning-rate
schedule on a resume, and its snapshots written beside training.

The checkpoint directory and the job's resume are in ``test_checkpoint``."""

from __future__ import annotations

import os

import pytest
import torch
from test_torch_trainer import TOK, model, sample

from core.trainer.actor import TrainerActor
from core.trainer.base import TrainerError
from core.trainer.torch_ import TorchTrainer, TorchTrainerConfig


def _trainer(kl: float = 0.1) -> TorchTrainer:
    torch.manual_seed(0)
    return TorchTrainer(model(), TorchTrainerConfig(lr=1e-2, kl_coef=kl, mini_batch_size=1, seed=3))


def _batch(t: TorchTrainer) -> list:
    right, left = TOK.token_to_id("right"), TOK.token_to_id("left")
    return [sample(t.model, [1, 2], [right], 1.0), sample(t.model, [1, 2], [left], -1.0)]


def test_a_resumed_trainer_goes_on_exactly_as_the_uninterrupted_one(tmp_path):
    a = _trainer()
    for _ in range(3):
        a.step(_batch(a))
    state = a.training_state()
    torch.save(state, tmp_path / "t.pt")
    b = _trainer()  # fresh: initial weights, no optimizer moments, shuffle at its seed
    b.load_training_state(torch.load(tmp_path / "t.pt", weights_only=False))
    assert b.version == 3
    for _ in range(2):  # the same batches: Adam's moments, the shuffle and the KL anchor matter
        batch = _batch(a)
        ma, mb = a.step(batch), b.step(batch)
        assert ma["kl"] == pytest.approx(mb["kl"], abs=0) and ma["kl"] > 0
    for (k, va), vb in zip(a.state().items(), b.state().values(), strict=True):
        assert torch.equal(va, vb), k
    # without the optimizer's moments the next update differs: the check above can fail
    c = _trainer()
    c.model.load_state_dict(state["model"])
    c.step(_batch(c))
    assert not all(torch.equal(x, y) for x, y in zip(c.state().values(), b.state().values(), strict=True))


def test_a_checkpoint_that_does_not_fit_the_trainer_is_refused_by_name():
    state = _trainer().training_state()
    with pytest.raises(TrainerError, match="checkpoint is of the 'megatron' trainer, not 'torch'"):
        _trainer().load_training_state({**state, "trainer": "megatron"})
    wide = TorchTrainer(
        model().__class__(model().config.model_copy(update={"d_model": 64}), seed=0), TorchTrainerConfig()
    )
    with pytest.raises(TrainerError, match="does not fit this trainer's model"):
        _trainer(kl=0.0).load_training_state(wide.training_state())


def test_a_kl_weight_added_on_resume_anchors_at_the_initial_policy():
    # a checkpoint written with kl_coef 0 has no reference; the resuming trainer's own is the
    # initial policy it was built from, which is what the anchor must be
    a = _trainer(kl=0.0)
    a.step(_batch(a))
    b = _trainer(kl=0.1)
    initial = {k: v.clone() for k, v in b.reference.state_dict().items()}
    b.load_training_state(a.training_state())
    assert all(torch.equal(initial[k], v) for k, v in b.reference.state_dict().items())
    assert not all(torch.equal(initial[k], v) for k, v in b.model.state_dict().items())
    assert b.step(_batch(b))["kl"] > 0


def test_a_resumed_trainer_trains_with_its_own_hyperparameters_not_the_saved_ones():
    # the optimizer's saved groups hold the lr and weight decay they were written with; a
    # resume that changed them (--allow-change trainer.lr) must not train on with the old
    a = _trainer()
    a.step(_batch(a))
    torch.manual_seed(0)
    changed = TorchTrainerConfig(
        lr=2e-3, kl_coef=0.1, mini_batch_size=1, seed=3, weight_decay=0.5, betas=(0.8, 0.9)
    )
    b = TorchTrainer(model(), changed)
    b.load_training_state(a.training_state())
    group = b.optimizer.param_groups[0]
    assert (b.lr, group["weight_decay"], tuple(group["betas"])) == (2e-3, 0.5, (0.8, 0.9))
    moments = zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True)
    assert all(torch.equal(x["exp_avg"], y["exp_avg"]) for x, y in moments)  # these came along
    assert a.lr == 1e-2 and b.step(_batch(b))["lr"] == 2e-3


def test_the_trainer_actor_saves_whole_files_and_restores_the_schedule(tmp_path):
    from core.config import TrainerConfig
    from core.policy.build import PolicyBundle

    m = model()
    bundle = PolicyBundle(tokenizer=TOK.to_dict(), model_config=m.config.model_dump(), state=m.state_dict())
    cfg = TrainerConfig(lr=1e-2, lr_end=1e-3)
    actor = TrainerActor(cfg, bundle, total_steps=4, temperature=1.0, seed=0)
    actor.step(_batch(actor.trainer))
    path = str(tmp_path / "trainer.pt")
    actor.save(path)
    assert os.listdir(tmp_path) == ["trainer.pt"]  # no .part left
    again = TrainerActor(cfg, bundle, total_steps=4, temperature=1.0, seed=0)
    assert again.load(path) == 1 and again.steps == 1
    actor.step(_batch(actor.trainer))
    again.step(_batch(again.trainer))
    assert again.trainer.lr == actor.trainer.lr == pytest.approx(1e-2 + (1e-3 - 1e-2) / 3)
    assert all(
        torch.equal(x, y) for x, y in zip(actor.weights().values(), again.weights().values(), strict=True)
    )


@pytest.mark.parametrize(
    ("resumed_steps", "lrs"), [(3, [5.5e-3, 1e-3]), (8, [8.2e-3, 6.4e-3, 4.6e-3, 2.8e-3, 1e-3, 1e-3, 1e-3])]
)
def test_a_resume_that_lowers_steps_reaches_lr_end_at_the_new_last_step(tmp_path, resumed_steps, lrs):
    # written at step 1 of a 6-step schedule (1e-2 -> 1e-3 by 1.8e-3 a step). Resumed with
    # steps: 3, it kept the saved 6 and ended at 6.4e-3, never near lr_end; it now follows the
    # new length and says so. A longer run keeps the saved length and goes on at lr_end
    from core.config import TrainerConfig
    from core.policy.build import PolicyBundle

    m = model()
    bundle = PolicyBundle(tokenizer=TOK.to_dict(), model_config=m.config.model_dump(), state=m.state_dict())
    cfg = TrainerConfig(lr=1e-2, lr_end=1e-3)
    actor = TrainerActor(cfg, bundle, total_steps=6, temperature=1.0, seed=0)
    actor.step(_batch(actor.trainer))
    path = str(tmp_path / "trainer.pt")
    actor.save(path)
    again = TrainerActor(cfg, bundle, total_steps=resumed_steps, temperature=1.0, seed=0)
    again.load(path)
    note = again.schedule_note()
    assert note is not None
    if resumed_steps < 6:
        assert "follows the new steps: 3 (was 6)" in note and "lr_end 0.001 at step 3" in note
        assert "0.0055 at step 2 (0.0082 on the saved schedule)" in note
    else:
        assert "keeps its 6 steps" in note and "steps 7 to 8 train at lr_end 0.001" in note
    got = []
    for _ in range(resumed_steps - 1):
        got.append(again.step(_batch(again.trainer))[0]["lr"])
    assert got == pytest.approx(lrs)


def test_a_resume_with_the_same_steps_says_nothing_of_the_schedule(tmp_path):
    actor = _actor()
    actor.step(_batch(actor.trainer))
    path = str(tmp_path / "trainer.pt")
    actor.save(path)
    again = _actor()
    again.load(path)
    assert again.schedule_note() is None


def _actor(lr: float = 1e-2) -> TrainerActor:
    from core.config import TrainerConfig
    from core.policy.build import PolicyBundle

    torch.manual_seed(0)
    m = model()
    bundle = PolicyBundle(tokenizer=TOK.to_dict(), model_config=m.config.model_dump(), state=m.state_dict())
    return TrainerActor(TrainerConfig(lr=lr), bundle, total_steps=4, temperature=1.0, seed=0)


def test_a_snapshot_is_written_while_training_goes_on_and_holds_its_own_step(tmp_path, monkeypatch):
    import threading

    import core.trainer.actor as actor_mod

    gate, writing = threading.Event(), threading.Event()
    real = actor_mod._write_file

    def slow_disk(data, path):
        writing.set()
        assert gate.wait(10)
        real(data, path)

    monkeypatch.setattr(actor_mod, "_write_file", slow_disk)
    actor = _actor()
    actor.step(_batch(actor.trainer))
    weights = {k: v.clone() for k, v in actor.trainer.model.state_dict().items()}
    moments = [v["exp_avg"].clone() for v in actor.trainer.optimizer.state.values()]
    path = str(tmp_path / "trainer.pt")
    actor.snapshot(path)
    assert writing.wait(10)
    actor.step(_batch(actor.trainer))  # the disk has not taken it yet: training goes on
    assert not os.path.exists(path)
    with pytest.raises(TrainerError, match="being written already"):
        actor.snapshot(path)
    gate.set()
    actor.written(path)
    saved = torch.load(path, weights_only=False)
    assert saved["steps"] == 1 and saved["state"]["version"] == 1
    # the step taken meanwhile is not in it: weights and Adam's moments (updated in place by
    # that step) are the snapshot's
    assert all(torch.equal(saved["state"]["model"][k], v) for k, v in weights.items())
    saved_moments = [v["exp_avg"] for v in saved["state"]["optimizer"]["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(saved_moments, moments, strict=True))
    now = [v["exp_avg"] for v in actor.trainer.optimizer.state.values()]
    assert not all(torch.equal(a, b) for a, b in zip(saved_moments, now, strict=True))
    with pytest.raises(TrainerError, match="no snapshot of"):
        actor.written(path)  # waited for once


def test_a_snapshot_that_cannot_be_written_says_why_when_waited_for(tmp_path):
    actor = _actor()
    path = str(tmp_path / "gone" / "trainer.pt")  # no such directory
    actor.snapshot(path)
    with pytest.raises(FileNotFoundError):
        actor.written(path)
    assert not os.listdir(tmp_path)
