"""Adaptive entropy control (``core.entropy_control``): the update rule, the steering both
trainers share (``Trainer.step``, exercised with a stub backend: the megatron trainer needs
GPUs), the torch trainer's loss and checkpoints, and the configs' checks."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from core.config_backends import TorchTrainerConfig
from core.config_megatron import MegatronTrainerConfig
from core.config_sections import TrainerConfig
from core.entropy_control import EntropyControl
from core.trainer.base import Trainer, TrainerError, TrainSample
from core.trainer.torch_ import TorchTrainer

# -------------------------------------------------------------------------------- the rule


def test_the_coefficient_rises_below_the_target_and_falls_above_it_in_proportion():
    c = EntropyControl(coef=0.03, target=0.3, coef_lr=0.1, coef_max=0.2)
    assert c.update(0.1) == pytest.approx(0.03 + 0.1 * 0.2)  # 0.2 nats too certain
    assert c.update(0.5) == pytest.approx(0.05 - 0.1 * 0.2)  # 0.2 nats too uncertain
    assert c.update(0.3) == pytest.approx(0.03)  # on target: left alone


def test_the_coefficient_stays_within_zero_and_its_bound():
    c = EntropyControl(coef=0.03, target=0.3, coef_lr=1.0, coef_max=0.1)
    assert c.update(1.3) == 0.0  # no bonus while the policy explores enough; never a penalty
    assert c.update(1.3) == 0.0
    assert c.update(0.0) == 0.1  # 0.3 wanted, capped
    assert c.update(0.0) == 0.1


def test_a_floor_keeps_the_bonus_on_above_the_target():
    c = EntropyControl(coef=0.03, target=0.3, coef_lr=1.0, coef_max=0.1, coef_min=0.01)
    assert c.update(0.69) == 0.01  # undecided between two moves: the other two stay alive
    assert c.update(0.28) == pytest.approx(0.03)
    c.load({"entropy_coef": 0.0})  # a checkpoint of a run without the floor
    assert c.coef == 0.01


def test_without_a_target_or_a_measured_entropy_the_coefficient_stays():
    fixed = EntropyControl(coef=0.03)
    assert fixed.update(0.0) == 0.03 and fixed.update(5.0) == 0.03
    steered = EntropyControl(coef=0.03, target=0.3)
    for nothing in (None, math.nan, math.inf):  # a step with every sample masked reports none
        assert steered.update(nothing) == 0.03


def test_a_checkpoint_keeps_a_steered_coefficient_not_a_fixed_one():
    steered = EntropyControl(coef=0.0, target=0.3, coef_max=0.1)
    steered.load({"entropy_coef": 0.07})
    assert steered.coef == 0.07
    steered.load({"entropy_coef": 0.5})  # a resume that lowered entropy_coef_max
    assert steered.coef == 0.1
    steered.load({})  # written without a target: the starting coefficient stands
    assert steered.coef == 0.1
    fixed = EntropyControl(coef=0.03)  # a target removed on resume: the config's coefficient
    fixed.load({"entropy_coef": 0.07})
    assert fixed.coef == 0.03


# -------------------------------------------------------------------- the shared steering


class Stub(Trainer):
    """A backend that reports the entropies it is given and records the coefficients it
    trained with (what ``MegatronTrainer._update`` reads, as ``TorchTrainer._update`` does)."""

    name = "stub"

    def __init__(self, entropies: list[float | None], control: EntropyControl) -> None:
        super().__init__(entropy=control)
        self.entropies = list(entropies)
        self.used: list[float] = []

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def _step(self, batch: Sequence[TrainSample], advantages: list[float]) -> dict[str, float]:
        self.used.append(self.entropy_coef)
        entropy = self.entropies.pop(0)
        return {} if entropy is None else {"entropy": entropy}

    def _training_state(self) -> dict[str, Any]:
        return {}

    def _load_training_state(self, state: Mapping[str, Any]) -> None:
        """No weights to load: the base class restores the version and the coefficient."""


BATCH = [
    TrainSample(
        prompt_ids=[1], completion_ids=[2], old_logprobs=[0.0], advantage=1.0, group_id="g", policy_version=0
    )
]


def test_each_step_trains_with_the_coefficient_the_last_ones_entropy_steered():
    t = Stub([0.1, 0.1, None, 0.5], EntropyControl(coef=0.0, target=0.3, coef_lr=0.1, coef_max=0.1))
    logged = [t.step(BATCH)["entropy_coef"] for _ in range(4)]
    want = [0.0, 0.02, 0.04, 0.04]  # up twice by 0.1 * 0.2; a step without entropy changes nothing
    assert t.used == pytest.approx(want) and logged == pytest.approx(want)
    assert t.entropy_coef == pytest.approx(0.02)  # 0.2 nats above: down by 0.02, for step 5


def test_a_fixed_coefficient_is_logged_too():
    t = Stub([0.0], EntropyControl(coef=0.03))
    assert t.step(BATCH)["entropy_coef"] == 0.03 and t.entropy_coef == 0.03


def test_the_training_state_carries_the_steered_coefficient_to_the_resumed_trainer():
    a = Stub([0.0, 0.0], EntropyControl(coef=0.0, target=0.3, coef_lr=0.1, coef_max=0.1))
    a.step(BATCH)
    a.step(BATCH)
    b = Stub([0.0], EntropyControl(coef=0.0, target=0.3, coef_lr=0.1, coef_max=0.1))
    b.load_training_state(a.training_state())
    assert b.entropy_coef == pytest.approx(0.06)
    b.step(BATCH)
    assert b.used == pytest.approx([0.06])


def test_a_target_added_on_resume_starts_from_its_own_entropy_coef():
    # a run with a fixed 0.01, resumed with --allow-change trainer (a target, entropy_coef 0.05):
    # the checkpoint holds no steered coefficient, so the resumed run starts from the config's
    a = Stub([0.0], EntropyControl(coef=0.01))
    a.step(BATCH)
    b = Stub([], EntropyControl(coef=0.05, target=0.3, coef_max=0.1))
    b.load_training_state(a.training_state())
    assert b.entropy_coef == 0.05


# ------------------------------------------------------------------- the torch trainer


class Uniform(torch.nn.Module):
    """Logits from a table by the last input token (a bigram), so the loss is known by hand."""

    def __init__(self, vocab: int = 4) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab, max_len=8)
        self.table = torch.nn.Parameter(torch.zeros(vocab, vocab))

    def forward(self, ids: torch.Tensor, attn: torch.Tensor | None = None) -> torch.Tensor:
        return self.table[ids]


def _on_policy(m: Uniform) -> TrainSample:
    with torch.no_grad():
        logp = torch.log_softmax(m.table[3], -1)[0].item()
    return TrainSample(
        prompt_ids=[3], completion_ids=[0], old_logprobs=[logp], advantage=0.0, group_id="g", policy_version=0
    )


def test_the_torch_trainers_bonus_uses_the_steered_coefficient():
    # on-policy with advantage 0: the loss is the bonus alone, -coef * entropy
    m = Uniform()
    cfg = TorchTrainerConfig(
        lr=1e-2, entropy_coef=0.0, entropy_target=0.5, entropy_coef_lr=0.1, entropy_coef_max=1.0
    )
    t = TorchTrainer(m, cfg)  # type: ignore[arg-type]
    first = t.step([_on_policy(m)])
    assert first["entropy"] == pytest.approx(math.log(4)) and first["loss"] == pytest.approx(0.0)
    assert first["entropy_coef"] == 0.0 and t.entropy_coef == 0.0  # above the target: stays at 0
    t.entropy.target = 1.5  # a target above the entropy now: the coefficient rises, the bonus trains
    second = t.step([_on_policy(m)])
    assert second["entropy_coef"] == 0.0 and t.entropy_coef == pytest.approx(0.1 * (1.5 - second["entropy"]))
    third = t.step([_on_policy(m)])
    assert third["entropy_coef"] > 0 and third["loss"] == pytest.approx(
        -third["entropy_coef"] * third["entropy"]
    )


def test_a_torch_trainer_resumed_from_a_checkpoint_goes_on_with_its_coefficient():
    cfg = TorchTrainerConfig(
        lr=1e-2, entropy_coef=0.0, entropy_target=1.3, entropy_coef_lr=0.1, entropy_coef_max=1.0
    )
    a = TorchTrainer(Uniform(), cfg)  # type: ignore[arg-type]
    a.step([_on_policy(a.model)])  # type: ignore[arg-type]
    a.entropy.coef = 0.07
    b = TorchTrainer(Uniform(), cfg)  # type: ignore[arg-type]
    b.load_training_state(a.training_state())
    assert b.entropy_coef == 0.07


def test_the_job_steers_and_a_resumed_job_goes_on_from_the_checkpoints_coefficient(tmp_path):
    # the trainer actor as the job builds it from trainer.*, and its checkpoint file
    from core.policy.build import PolicyBundle
    from core.policy.tiny_lm import TinyLM, TinyLMConfig
    from core.policy.tokenizer import WordTokenizer
    from core.trainer.actor import TrainerActor

    tok = WordTokenizer("left right up down".split())
    m = TinyLM(TinyLMConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=16), seed=0)
    bundle = PolicyBundle(tokenizer=tok.to_dict(), model_config=m.config.model_dump(), state=m.state_dict())
    cfg = TrainerConfig(
        lr=1e-2, entropy_target=0.3, entropy_coef=0.02, entropy_coef_lr=0.1, entropy_coef_max=0.5
    )

    def actor() -> TrainerActor:
        return TrainerActor(cfg, bundle, total_steps=4, temperature=1.0, seed=0)

    first = actor()
    right = tok.token_to_id("right")
    batch = [
        TrainSample(
            prompt_ids=[1, 2],
            completion_ids=[right],
            old_logprobs=[-1.0],
            advantage=1.0,
            group_id="g",
            policy_version=0,
        )
    ]
    metrics, _ = first.step(batch)
    # an untrained policy is near uniform (ln 13 = 2.56 nats): far above the target, the bonus goes off
    assert metrics["entropy_coef"] == 0.02 and metrics["entropy"] > 2.0
    assert first.trainer.entropy_coef == 0.0
    first.trainer.entropy.coef = 0.123  # as if steered up since
    first.save(str(tmp_path / "trainer.pt"))
    resumed = actor()
    resumed.load(str(tmp_path / "trainer.pt"))
    assert resumed.trainer.entropy_coef == 0.123
    assert resumed.step(batch)[0]["entropy_coef"] == 0.123


def _restricted(allowed: list[int]) -> TrainSample:
    logp = -math.log(len(allowed))  # the uniform table, renormalised over the allowed ids
    return TrainSample(
        prompt_ids=[3],
        completion_ids=[0],
        old_logprobs=[logp],
        advantage=0.0,
        group_id="g",
        policy_version=0,
        allowed_token_ids=allowed,
    )


def test_a_mix_of_action_counts_caps_the_mean_entropy_at_the_mean_of_their_logs(caplog):
    # a 2-action and a 4-action turn: the mean entropy of the batch is at most
    # (ln 2 + ln 4) / 2 = 1.04, reached by the uniform policy; a target of 1.2 is below ln 4,
    # the widest's ceiling, which was all that was checked, and the coefficient only rose
    cfg = TorchTrainerConfig(lr=1e-2, entropy_target=1.2, entropy_coef_lr=0.1, entropy_coef_max=1.0)
    t = TorchTrainer(Uniform(), cfg)  # type: ignore[arg-type]
    batch = [_restricted([0, 1]), _restricted([0, 1, 2, 3])]
    with caplog.at_level("WARNING", logger="core.trainer.base"):
        first = t.step(batch)
        second = t.step(batch)
    ceiling = (math.log(2) + math.log(4)) / 2
    assert first["entropy"] == pytest.approx(ceiling, rel=1e-5)  # the uniform policy is at it
    assert first["entropy_max"] == pytest.approx(ceiling) and second["entropy_max"] == pytest.approx(ceiling)
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "entropy_target 1.2 nats is not below 1.04" in warning and "entropy_coef_max" in warning
    # per sample, not per token, under seq_mean_token_mean: a 3-token 2-action turn counts once
    seq = TorchTrainer(Uniform(), cfg.model_copy(update={"loss_agg": "seq_mean_token_mean"}))  # type: ignore[arg-type]
    long = _restricted([0, 1]).model_copy(
        update={"completion_ids": [0, 0, 0], "old_logprobs": [-math.log(2)] * 3}
    )
    assert seq.step([long, _restricted([0, 1, 2, 3])])["entropy_max"] == pytest.approx(ceiling)
    tok = TorchTrainer(Uniform(), cfg)  # type: ignore[arg-type]
    got = tok.step([long, _restricted([0, 1, 2, 3])])["entropy_max"]
    assert got == pytest.approx((3 * math.log(2) + math.log(4)) / 4)


def test_a_reachable_target_in_a_mix_says_nothing(caplog):
    cfg = TorchTrainerConfig(lr=1e-2, entropy_target=0.9, entropy_coef_lr=0.1, entropy_coef_max=1.0)
    t = TorchTrainer(Uniform(), cfg)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="core.trainer.base"):
        t.step([_restricted([0, 1]), _restricted([0, 1, 2, 3])])
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    # unrestricted tokens choose among the whole vocabulary (4 here)
    assert t.step([_on_policy(t.model)])["entropy_max"] == pytest.approx(math.log(4))  # type: ignore[arg-type]


def test_a_target_no_token_of_the_model_can_reach_is_refused():
    with pytest.raises(TrainerError, match=r"not below ln\(4\) = 1.39"):
        TorchTrainer(Uniform(), TorchTrainerConfig(entropy_target=1.4))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("model", [TrainerConfig, TorchTrainerConfig])
@pytest.mark.parametrize(
    ("over", "key", "text"),
    [
        ({"entropy_target": -0.1}, "entropy_target", "greater than 0"),
        ({"entropy_target": 0}, "entropy_target", "greater than 0"),
        ({"entropy_target": math.nan}, "entropy_target", "finite"),
        ({"entropy_target": math.inf}, "entropy_target", "finite"),
        ({"entropy_target": 0.3, "entropy_coef_lr": 0}, "entropy_coef_lr", "greater than 0"),
        ({"entropy_target": 0.3, "entropy_coef_max": math.nan}, "entropy_coef_max", "finite"),
        ({"entropy_target": 0.3, "entropy_coef": 0.2}, "entropy_coef_max", "below entropy_coef 0.2"),
        ({"entropy_target": 0.3, "entropy_coef_min": 0.02}, "entropy_coef_min", "above entropy_coef 0"),
        (
            {"entropy_target": 0.3, "entropy_coef_min": -0.01},
            "entropy_coef_min",
            "greater than or equal to 0",
        ),
    ],
)
def test_bad_entropy_settings_name_their_key(model, over, key, text):
    with pytest.raises(ValidationError) as e:
        model(**over)
    [err] = e.value.errors()
    assert err["loc"] == (key,) and text in err["msg"]


def test_a_fixed_coefficient_needs_no_bound():
    assert TrainerConfig(entropy_coef=0.5).entropy_coef_max == 0.1  # the bound is the target's


def test_the_megatron_config_checks_a_target_against_the_shape_it_is_given():
    shape = {
        "num_layers": 1,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "vocab_size": 8,
        "max_sequence_length": 8,
    }
    with pytest.raises(ValidationError, match=r"not below ln\(8\) = 2.08"):
        MegatronTrainerConfig(model=shape, entropy_target=2.1)
    with pytest.raises(ValidationError, match=r"below entropy_coef 0\.5"):
        MegatronTrainerConfig(model=shape, entropy_target=1.0, entropy_coef=0.5)
    cfg = MegatronTrainerConfig(
        model=shape,
        entropy_target=1.0,
        entropy_coef=0.1,
        entropy_coef_lr=0.2,
        entropy_coef_min=0.05,
        entropy_coef_max=0.3,
    )
    want = EntropyControl(coef=0.1, target=1.0, coef_lr=0.2, coef_max=0.3, coef_min=0.05)
    assert EntropyControl.from_config(cfg) == want
