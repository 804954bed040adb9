"""The torch backends' own settings, torch-free: what ``engine.kwargs`` and ``trainer.kwargs``
may hold for them, checked by ``JobConfig`` before anything starts.

    TinyLMConfig        a new ``tiny-lm``'s shape      engine.kwargs: d_model, n_layers, ...
    TorchEngineConfig   the torch engine's serving     engine.kwargs: max_batch_size, ...
    TorchTrainerConfig  GRPO on the CPU                the trainer's settings + trainer.kwargs

They are the models the policy, the engine replicas and the trainer actor build from (their
modules re-export them); kept here, where importing them needs no torch, so the job config
can refuse a misspelt or out-of-range key naming it, instead of the key being dropped (an
``engine.kwargs`` key nobody reads) or the trainer actor dying in Ray after the policy was
built and pretrained. The megatron trainer's config (``core.config_megatron``) is checked the
same way by ``trainer_problems``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.config_messages import hint, validation_problems
from core.entropy_control import entropy_coef_max_fits, entropy_coef_min_fits

if TYPE_CHECKING:
    from core.config_sections import EngineConfig, TrainerConfig

LossAgg = Literal["token_mean", "seq_mean_token_mean"]


class TinyLMConfig(BaseModel):
    """Shape of a ``TinyLM``."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    vocab_size: int = Field(ge=2)
    d_model: int = Field(64, ge=8)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    d_ff: int | None = Field(None, ge=1)
    """Width of the MLP; ``None`` means ``4 * d_model``."""
    max_len: int = Field(256, ge=2)
    """Longest sequence (prompt + completion) the model takes."""
    rope_base: float = Field(10000.0, gt=1.0)
    init_std: float = Field(0.02, gt=0.0)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyLMConfig:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be even (rotary embeddings rotate pairs)")
        return self

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model


class TorchEngineConfig(BaseModel):
    """Serving knobs of the torch engine (the model's shape is the model's config)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["torch"] = "torch"
    max_batch_size: int = Field(64, ge=1)
    """Sequences per forward pass; more wait in the queue."""
    batch_wait_ms: float = Field(2.0, ge=0.0)
    """An idle engine waits this long after a request arrives, to batch its companions."""
    num_threads: int | None = Field(None, ge=1)
    """torch intra-op threads for this process (``torch.set_num_threads``); ``None`` leaves
    the process setting alone (torch defaults to the physical cores)."""
    seed: int = 0
    """Seeds the stream that seeds requests sent without their own ``seed``."""


class TorchTrainerConfig(BaseModel):
    """GRPO hyper-parameters for the torch backend."""

    # no inf in any field (gt/ge let it through): built by hand, lr=inf made every weight
    # inf or NaN at the first update; the job config refuses it field by field
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["torch"] = "torch"
    lr: float = Field(1e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = Field(1.0, gt=0.0)
    """Max global grad norm; ``None`` = no clipping (the norm is still reported)."""
    mini_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer update; ``None`` = the whole batch in one update."""
    epochs: int = Field(1, ge=1)
    """Passes over the batch per ``step``."""
    clip_low: float = Field(0.2, gt=0.0, lt=1.0)
    clip_high: float | None = Field(None, gt=0.0)
    """Upper ratio clip; ``None`` = ``clip_low`` (symmetric)."""
    clip_ratio_c: float | None = Field(3.0, gt=1.0, allow_inf_nan=False)
    """Dual clip: where the advantage is negative a token's loss is at most ``-A * clip_ratio_c``
    (``core.trainer.grpo.policy_loss``); None: off."""
    kl_coef: float = Field(0.0, ge=0.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    """Bonus on the policy's entropy at the trained tokens: keeps a small policy exploring
    (without it a group whose rollouts all agree teaches nothing, and they soon all do)."""
    entropy_target: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    """Steer ``entropy_coef`` toward this mean token entropy, in nats (``core.entropy_control``);
    None: the coefficient stays fixed."""
    entropy_coef_lr: float = Field(0.05, gt=0.0, allow_inf_nan=False)
    entropy_coef_min: float = Field(0.0, ge=0.0, allow_inf_nan=False, validate_default=True)
    entropy_coef_max: float = Field(0.1, gt=0.0, allow_inf_nan=False, validate_default=True)
    entropy_floor = field_validator("entropy_coef_min")(entropy_coef_min_fits)
    entropy_bound = field_validator("entropy_coef_max")(entropy_coef_max_fits)
    loss_agg: LossAgg = "token_mean"
    temperature: float = Field(1.0, gt=0.0)
    """The rollout temperature: logprobs are of ``logits / T``, as the engine's are."""
    adv_eps: float = Field(1e-6, gt=0.0)
    scale_advantages: bool = True
    """Divide by the group std (GRPO); False keeps the centred reward (Dr. GRPO)."""
    seed: int = 0
    """Seeds the mini-batch shuffling."""


#: ``engine.kwargs`` keys that shape a new ``TinyLM`` (its vocabulary comes from the tokenizer).
MODEL_KEYS: tuple[str, ...] = tuple(k for k in TinyLMConfig.model_fields if k != "vocab_size")
#: ``engine.kwargs`` keys of the torch engine's serving config (its seed is the job's).
TORCH_ENGINE_KEYS: tuple[str, ...] = tuple(
    k for k in TorchEngineConfig.model_fields if k not in ("type", "seed")
)
#: ``trainer.kwargs`` the torch trainer takes besides its config's fields (the trainer actor's
#: ``torch.set_num_threads``).
TORCH_TRAINER_EXTRA_KEYS = ("num_threads",)

#: The job's GRPO settings under the field names the backends share (torch, megatron):
#: backend field -> ``trainer`` key.
SHARED_TRAINER_FIELDS = {
    "lr": "lr",
    "clip_low": "clip_eps",
    "clip_high": "clip_eps_high",
    "clip_ratio_c": "clip_ratio_c",
    "kl_coef": "kl_coef",
    "epochs": "epochs",
    "grad_clip": "max_grad_norm",
    "entropy_coef": "entropy_coef",
    "entropy_target": "entropy_target",
    "entropy_coef_lr": "entropy_coef_lr",
    "entropy_coef_min": "entropy_coef_min",
    "entropy_coef_max": "entropy_coef_max",
    "scale_advantages": "scale_advantages",
}


def backend_config(cfg: TrainerConfig, *, temperature: float, seed: int) -> dict[str, Any]:
    """The job's GRPO settings in the field names the backends share (torch, megatron),
    then ``trainer.kwargs`` on top (backend-only options: model shape, parallelism)."""
    return {
        **{field: getattr(cfg, key) for field, key in SHARED_TRAINER_FIELDS.items()},
        # a greedy rollout's logprobs are the untempered ones (GenerateRequest.temperature):
        # the trainer recomputes them at T=1 too (at 1e-3 the first, exactly on-policy
        # update read a ratio of 9 with every token clipped: no gradient at all)
        "temperature": temperature if temperature > 0 else 1.0,
        "seed": seed,
        **cfg.kwargs,
    }


def torch_engine_problems(engine: EngineConfig) -> list[tuple[str, str]]:
    """``engine.kwargs`` of the torch engine: every key known (a misspelt one was dropped
    without a word), every value in range."""
    if engine.backend != "torch":
        return []
    allowed = [*MODEL_KEYS, *TORCH_ENGINE_KEYS]
    problems = _unknown("engine.kwargs", engine.kwargs, allowed, "the torch engine")
    shape = {k: v for k, v in engine.kwargs.items() if k in MODEL_KEYS}
    serving = {k: v for k, v in engine.kwargs.items() if k in TORCH_ENGINE_KEYS}
    # the vocabulary is the tokenizer's, known once the corpus is played: any size checks the rest
    problems += _invalid(
        "engine.kwargs", TinyLMConfig, {"vocab_size": 2, **shape}, "not a valid tiny-lm shape"
    )
    problems += _invalid("engine.kwargs", TorchEngineConfig, serving, "the torch engine")
    return problems


def trainer_problems(trainer: TrainerConfig, *, temperature: float, seed: int) -> list[tuple[str, str]]:
    """The trainer's config as the trainer actor will build it, checked now: a bad
    ``trainer.kwargs`` key or value (or a job setting the backend bounds more tightly, such as
    ``clip_eps`` below 1) named under the key it came from. Both backends: the torch trainer,
    and the megatron trainer, whose actor would otherwise die in Ray on a GPU machine."""
    model: type[BaseModel]
    extra: tuple[str, ...] = ()
    if trainer.backend == "torch":
        model, extra, what = TorchTrainerConfig, TORCH_TRAINER_EXTRA_KEYS, "the torch trainer"
    elif trainer.backend == "megatron":
        from core.config_megatron import MegatronTrainerConfig  # it reads this module's LossAgg

        model, what = MegatronTrainerConfig, "the megatron trainer"
    else:
        return []
    allowed = [k for k in model.model_fields if k != "type"] + list(extra)
    problems = _unknown("trainer.kwargs", trainer.kwargs, allowed, what)
    problems += _set_by_the_job(trainer.kwargs)
    options = {
        k: v for k, v in backend_config(trainer, temperature=temperature, seed=seed).items() if k in allowed
    }
    threads = options.pop("num_threads", None)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        problems.append(("trainer.kwargs.num_threads", f"must be a whole number >= 1 (got {threads!r})"))
    origin = {field: f"trainer.{key}" for field, key in SHARED_TRAINER_FIELDS.items()}
    origin |= {"temperature": "engine.temperature", "seed": "seed"}
    origin |= {k: f"trainer.kwargs.{k}" for k in trainer.kwargs}
    try:
        model.model_validate(options)
    except ValidationError as e:
        for key, msg in validation_problems(e, model):
            field = key.split(".", 1)[0].split("[", 1)[0]
            where = origin.get(field, "trainer.kwargs")
            problems.append((where + key[len(field) :] if field else where, f"{what}: {msg}"))
    return problems


def _set_by_the_job(kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    """``trainer.kwargs`` keys the job sets itself, or that do nothing in a job: a backend
    field took them silently (``scale_advantages: false`` under kwargs still trained on
    std-normalised advantages, which the job computes in ``build_batch`` from
    ``trainer.scale_advantages``; ``clip_low`` there overrode ``trainer.clip_eps``)."""
    owner = {field: f"trainer.{key}" for field, key in SHARED_TRAINER_FIELDS.items()}
    owner |= {"temperature": "engine.temperature", "seed": "seed"}
    problems = [
        (f"trainer.kwargs.{key}", f"set by the job from {owner[key]}: set it there")
        for key in kwargs
        if key in owner
    ]
    if "adv_eps" in kwargs:
        problems.append(
            (
                "trainer.kwargs.adv_eps",
                "has no effect in a job: the job computes the advantages (build_batch, "
                "eps 1e-6; trainer.scale_advantages: false for centred rewards only)",
            )
        )
    return problems


def _unknown(prefix: str, kwargs: dict[str, Any], allowed: list[str], what: str) -> list[tuple[str, str]]:
    return [
        (f"{prefix}.{key}", f"not a key of {what}{hint(key, allowed)}; its keys: {', '.join(allowed)}")
        for key in kwargs
        if key not in allowed
    ]


def _invalid(prefix: str, model: type[BaseModel], data: dict[str, Any], what: str) -> list[tuple[str, str]]:
    try:
        model.model_validate(data)
    except ValidationError as e:
        return [
            (f"{prefix}.{key}" if key else prefix, f"{what}: {msg}")
            for key, msg in validation_problems(e, model)
        ]
    return []
