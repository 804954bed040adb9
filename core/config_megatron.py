"""The megatron trainer's settings, torch-free: ``GPTShape`` and ``MegatronTrainerConfig``.

They live apart from ``core.trainer.megatron_`` (which imports torch) so that the job config
can check ``trainer.kwargs`` for ``trainer.backend: megatron`` when it is loaded, naming a
misspelt or out-of-range key, instead of the trainer actor dying in Ray on a GPU machine
after the engine started. ``core.trainer.megatron_`` re-exports both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from core.config_backends import LossAgg
from core.config_sections import UserPath
from core.entropy_control import entropy_coef_max_fits, entropy_coef_min_fits, entropy_target_problem

if TYPE_CHECKING:
    from core.trainer.hf_gpt import HFArch


class GPTShape(BaseModel):
    """The ``GPTModel``'s shape (learned absolute positions, LayerNorm, GeLU MLP)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    ffn_hidden_size: int | None = Field(None, ge=1)
    """``None`` = ``4 * hidden_size`` (megatron's default)."""
    vocab_size: int = Field(ge=1)
    """The tokenizer's vocabulary (megatron-core does not pad it)."""
    max_sequence_length: int = Field(ge=2)
    """Longest ``prompt + completion`` the model takes (size of the position table)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> GPTShape:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        return self

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size


class MegatronTrainerConfig(BaseModel):
    """The model (a shape or a checkpoint), parallelism and GRPO hyper-parameters."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["megatron"] = "megatron"
    model: GPTShape | None = None
    """Build a freshly initialised model of this shape (seeded by ``seed``)."""
    checkpoint: UserPath | None = None
    """Or load one written by ``MegatronTrainer.save_checkpoint`` (shape, weights, version): the
    path given to it; at tp x pp > 1 each rank reads its own shard's file beside it, which needs
    the tp x pp it was saved with."""
    hf_model: UserPath | None = None
    """Or start from a Hugging Face checkpoint directory (Llama, Qwen2 or Mistral family:
    RMSNorm, SwiGLU, RoPE, grouped-query attention): its ``config.json`` and weights. The
    trainer's ``state()`` then uses Hugging Face names, which an engine serving the same
    checkpoint (vLLM) loads as they are."""
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    bf16: bool = False
    """Run the forward under bf16 autocast; the weights (and ``state()``) stay fp32."""
    lr: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = Field(1.0, gt=0.0)
    """Max global grad norm; ``None`` = no clipping (the norm is still reported)."""
    mini_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer update; ``None`` = the whole batch in one update."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Samples per forward/backward (gradients accumulate over a mini-batch); ``None`` = the
    whole mini-batch at once. Memory, not maths: the update is the same."""
    epochs: int = Field(1, ge=1)
    clip_low: float = Field(0.2, gt=0.0, lt=1.0)
    clip_high: float | None = Field(None, gt=0.0)
    """Upper ratio clip; ``None`` = ``clip_low`` (symmetric)."""
    clip_ratio_c: float | None = Field(3.0, gt=1.0, allow_inf_nan=False)
    """Dual clip: where the advantage is negative a token's loss is at most ``-A * clip_ratio_c``
    (``core.trainer.grpo.policy_loss``); None: off."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL to a frozen copy of the initial policy (0: no copy is kept)."""
    entropy_coef: float = Field(0.0, ge=0.0)
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
    seed: int = 0
    """Seeds the weights' initialisation and the mini-batch shuffling."""

    @model_validator(mode="after")
    def _consistent(self) -> MegatronTrainerConfig:
        if sum(x is not None for x in (self.model, self.checkpoint, self.hf_model)) != 1:
            raise ValueError("give exactly one of model (a shape), checkpoint or hf_model")
        if self.model is not None:
            check_parallel_shape(self.model, self.tensor_parallel_size, self.pipeline_parallel_size)
            problem = entropy_target_problem(self.entropy_target, self.model.vocab_size, "a token")
            if problem:
                raise ValueError(problem)
        if self.hf_model is not None and self.tensor_parallel_size > 1:
            # the name mapping fuses whole q/k/v projections; a rank's shard is a slice of it
            raise ValueError("hf_model needs tensor_parallel_size=1 (the weight mapping is unsharded)")
        return self


def check_parallel_shape(shape: GPTShape | HFArch, tp: int, pp: int) -> None:
    """What megatron-core would assert, as a readable ``ValueError`` (``shape``: a
    ``GPTShape`` or a Hugging Face ``HFArch``, which also has key/value heads)."""
    sizes = [
        ("num_attention_heads", shape.num_attention_heads),
        ("ffn_hidden_size", shape.ffn),
        ("vocab_size", shape.vocab_size),
    ]
    kv_heads = getattr(shape, "num_key_value_heads", None)  # HFArch lives with torch: not imported
    if kv_heads is not None:
        sizes.append(("num_key_value_heads", kv_heads))
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"{name}={value} is not divisible by tensor_parallel_size={tp}")
    if shape.num_layers % pp:
        raise ValueError(f"num_layers={shape.num_layers} is not divisible by pipeline_parallel_size={pp}")
