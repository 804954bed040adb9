"""The job config's ``trainer`` section, and ``ConfigModel``, the base of every section's
model (``core.config_sections`` holds the others and re-exports these).

A module of its own, importing pydantic alone: the trainer actor, a new process at every
job's start, unpickles its ``TrainerConfig``, and the other sections' module imports
envpool's image tiers (httpx), the pool's and the fabric client's configs: 0.35 s of CPU
there for models it never reads.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from core.entropy_control import entropy_coef_max_fits, entropy_coef_min_fits

TRAINERS = ("torch", "megatron")


def one_of(what: str, known: tuple[str, ...]) -> BeforeValidator:
    """A check that names the bad value and the known ones (pydantic's literal error says
    only "Input should be ...")."""

    def check(v: Any) -> Any:
        if isinstance(v, str) and v not in known:
            raise ValueError(f"unknown {what} {v!r}; known: {', '.join(known)}")
        return v

    return BeforeValidator(check)


class ConfigModel(BaseModel):
    """The base of every config model: an unknown key is an error, a field's docstring is its
    description."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class TrainerConfig(ConfigModel):
    """GRPO hyper-parameters and the training backend."""

    backend: Annotated[Literal["torch", "megatron"], one_of("trainer", TRAINERS)] = "torch"
    lr: float = Field(1e-5, gt=0, allow_inf_nan=False)
    clip_eps: float = Field(0.2, gt=0, allow_inf_nan=False)
    """PPO-style clipping of the probability ratio."""
    kl_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of the KL penalty to the reference policy (0: no reference model is kept)."""
    epochs: int = Field(1, ge=1)
    """Passes over each batch."""
    minibatch_size: int | None = Field(None, ge=1)
    """Trajectories per optimiser step (None: the whole batch)."""
    clip_eps_high: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Upper ratio clip (DAPO's clip-higher); None: ``clip_eps``."""
    clip_ratio_c: float | None = Field(3.0, gt=1, allow_inf_nan=False)
    """Dual clip (veRL's ``clip_ratio_c``, same default): where the advantage is negative a
    token's loss is at most ``-A * clip_ratio_c``. The ratio clip leaves that side unbounded,
    and a stale sample (``alpha > 0``) can carry a large ratio whose gradient then dominates
    the update; None: off."""
    max_grad_norm: float | None = Field(1.0, gt=0, allow_inf_nan=False)
    entropy_coef: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Bonus on the policy's entropy (keeps a small policy exploring); with ``entropy_target``
    the coefficient of the first step."""
    entropy_target: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Adaptive entropy control (``core.entropy_control``): the mean entropy of the trained
    tokens, in nats, toward which the coefficient is steered after every step (raised while
    the entropy is below it, lowered toward 0 above it); None: ``entropy_coef`` stays fixed.
    Below ``ln`` of the choices a token has (the vocabulary, or ``envs[].actions``)."""
    entropy_coef_lr: float = Field(0.05, gt=0, allow_inf_nan=False)
    """With ``entropy_target``: the coefficient's change per step per nat of the gap."""
    entropy_coef_min: float = Field(0.0, ge=0, allow_inf_nan=False, validate_default=True)
    """With ``entropy_target``: the least the coefficient is lowered to (a floor that keeps
    rarely chosen actions alive while the mean entropy is above the target)."""
    entropy_coef_max: float = Field(0.1, gt=0, allow_inf_nan=False, validate_default=True)
    """With ``entropy_target``: the most the coefficient is raised to."""
    lr_end: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Decay the learning rate linearly to this over the job's steps: ``lr`` at the first step,
    this at the last (a one-step job, which has no step to decay over, trains at ``lr``);
    None: constant."""
    scale_advantages: bool = True
    """Divide by the group's reward std (GRPO); False keeps the centred reward (Dr. GRPO)."""
    step_adv: float = Field(0.0, ge=0, allow_inf_nan=False)
    """Weight of GiGPO's step-level advantage (turns taken in the same state of the same task,
    compared by discounted return), added to the episode's group advantage; 0: plain GRPO."""
    gamma: float = Field(0.95, gt=0, le=1, allow_inf_nan=False)
    """Discount of the step-level returns."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Backend-specific options: for ``torch`` ``TorchTrainerConfig`` fields
    (``weight_decay``, ``loss_agg``, ...) and ``num_threads``, checked with the config, as is
    the config the job's settings make for it; passed through to ``megatron`` (parallelism,
    ``hf_model``, ...)."""
    num_gpus: float | None = Field(None, ge=0, allow_inf_nan=False)
    """GPUs the trainer actor reserves from Ray; ``None``: 1 for ``megatron``, 0 for ``torch``."""
    call_timeout_s: float = Field(3600.0, gt=0, allow_inf_nan=False)
    """How long the job waits for one call of the trainer actor (a step, a checkpoint's copy
    or its write to disk, a resume's load) before it stops with ``TrainerTimeout``: a trainer
    stuck in a step (a hung collective, a deadlocked data loader) held the job for ever.
    Keep it above the slowest step (a large model's first step compiles kernels)."""

    entropy_floor = field_validator("entropy_coef_min")(entropy_coef_min_fits)
    entropy_bound = field_validator("entropy_coef_max")(entropy_coef_max_fits)

    @property
    def gpus(self) -> float:
        if self.num_gpus is not None:
            return self.num_gpus
        return 1.0 if self.backend == "megatron" else 0.0
