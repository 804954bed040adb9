"""A Hugging Face decoder (Llama / Qwen2 / Mistral family) as a megatron-core ``GPTModel``:
the architecture read from the checkpoint's ``config.json``, and the weights mapped both
ways, so the megatron trainer can start from the model the rollout engine serves and publish
weights under the names the engine loads (vLLM's ``load_weights`` takes Hugging Face names).

    arch = HFArch.from_dir("models/qwen2.5-0.5b")
    mstate = hf_to_megatron(read_hf_state("models/qwen2.5-0.5b"), arch)   # trainer side
    hstate = megatron_to_hf(mstate, arch)                                   # what it publishes

The mapping, per layer (megatron-core's local layer spec, tensor parallel size 1):

* ``q_proj``, ``k_proj``, ``v_proj`` -> ``linear_qkv``, interleaved by key/value group: for
  each group its query heads, then its key head, then its value head (megatron's
  ``SelfAttention`` splits the fused projection that way); the biases likewise (Qwen2);
* ``gate_proj``, ``up_proj`` -> ``linear_fc1`` (gate first: megatron's gated unit applies the
  activation to the first half);
* ``o_proj`` -> ``linear_proj``, ``down_proj`` -> ``linear_fc2``, the two RMSNorms ->
  ``input_layernorm`` / ``pre_mlp_layernorm``, ``model.norm`` -> ``decoder.final_layernorm``;
  ``lm_head`` -> ``output_layer`` unless the embeddings are tied.

Pure tensor code: it runs (and is tested) without megatron-core or a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from core.trainer.base import TrainerError

#: ``model_type`` values whose decoder this mapping covers (same layer layout).
SUPPORTED = ("llama", "qwen2", "mistral")


class HFArch(BaseModel):
    """What the megatron model needs from a Hugging Face ``config.json``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: str
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    ffn_hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    max_sequence_length: int = Field(ge=2)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    qkv_bias: bool
    tie_word_embeddings: bool
    config: dict[str, Any] = Field(default_factory=dict, repr=False)
    """The ``config.json`` as read (kept for checkpoints)."""

    @model_validator(mode="after")
    def _groups_divide(self) -> HFArch:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        return self

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_key_value_heads

    def transformer_config_args(self) -> dict[str, Any]:
        """megatron-core ``TransformerConfig`` fields for this architecture: RMSNorm, SwiGLU
        without biases (q/k/v biases for Qwen2), grouped-query attention."""
        return {
            "num_query_groups": self.num_key_value_heads,
            "kv_channels": self.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.rms_norm_eps,
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu,
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
        }

    def gpt_model_args(self) -> dict[str, Any]:
        """``GPTModel`` arguments: RoPE with this base, embeddings tied or not."""
        return {
            "share_embeddings_and_output_weights": self.tie_word_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": int(self.rope_theta),
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, source: str = "config.json") -> HFArch:
        """Read a Hugging Face ``config.json`` (as a dict); what it cannot map is a
        ``TrainerError`` naming the field."""
        c = dict(config)
        kind = c.get("model_type")
        if kind not in SUPPORTED:
            raise TrainerError(
                f"{source}: model_type {kind!r} is not supported by the megatron trainer "
                f"(supported: {', '.join(SUPPORTED)})"
            )
        theta = _rope_theta(c, source)
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise TrainerError(f"{source}: hidden_act {act!r} is not supported (SwiGLU, silu, only)")
        if c.get("mlp_bias"):
            raise TrainerError(f"{source}: mlp_bias is not supported")
        window = c.get("sliding_window")
        # Qwen2 says whether its window is on (use_sliding_window); Mistral's is on whenever
        # it is set, and one at least as long as the positions changes nothing
        positions = c.get("max_position_embeddings", (window or 0) + 1)
        if window and c.get("use_sliding_window", True) and window < positions:
            raise TrainerError(
                f"{source}: sliding-window attention ({window} tokens) is not supported: the trainer "
                "would attend to the whole sequence where the engine attends to the window"
            )
        if kind != "qwen2" and c.get("attention_bias"):
            # Llama's attention_bias puts a bias on o_proj too, which megatron adds only
            # together with biases on every linear layer
            raise TrainerError(f"{source}: attention_bias is not supported for {kind} (it biases o_proj too)")
        missing = [
            k
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "intermediate_size",
                "vocab_size",
            )
            if k not in c
        ]
        if missing:
            raise TrainerError(f"{source}: missing {', '.join(missing)}")
        heads = int(c["num_attention_heads"])
        try:
            return cls(
                model_type=kind,
                num_layers=int(c["num_hidden_layers"]),
                hidden_size=int(c["hidden_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
                ffn_hidden_size=int(c["intermediate_size"]),
                vocab_size=int(c["vocab_size"]),
                max_sequence_length=int(c.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                qkv_bias=kind == "qwen2",  # Qwen2 has biases on q, k and v, and nowhere else
                tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
                config=c,
            )
        except ValueError as e:
            raise TrainerError(f"{source}: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> HFArch:
        p = Path(path) / "config.json"
        try:
            config = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise TrainerError(f"cannot read a Hugging Face config at {p}: {e}") from e
        return cls.from_config(config, source=str(p))


def _rope_theta(c: Mapping[str, Any], source: str) -> float:
    """RoPE's base, from ``rope_parameters`` (transformers 5) or the older top-level
    ``rope_theta`` / ``rope_scaling``; any scaled RoPE (yarn, llama3, linear, ...) is refused."""
    theta = c.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        rp = c.get(key)
        if not rp:
            continue
        if not isinstance(rp, Mapping):
            raise TrainerError(f"{source}: {key} {rp!r} is not a mapping")
        kind = rp.get("rope_type", rp.get("type", "default"))
        if kind != "default":
            raise TrainerError(f"{source}: {key} of rope_type {kind!r} is not supported (plain RoPE only)")
        theta = rp.get("rope_theta", theta)
    return float(theta if theta is not None else 10000.0)


def read_hf_state(path: str | Path) -> dict[str, Tensor]:
    """The weights of a Hugging Face checkpoint directory: ``model.safetensors``, its sharded
    form (``model.safetensors.index.json``), or ``pytorch_model.bin``."""
    d = Path(path)
    index = d / "model.safetensors.index.json"
    if index.exists() or (d / "model.safetensors").exists():
        try:
            from safetensors.torch import load_file
        except ImportError as e:  # shipped with transformers, which a GPU image has
            raise TrainerError(f"reading {d} needs the safetensors package ({e})") from e
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.exists()
            else ["model.safetensors"]
        )
        state: dict[str, Tensor] = {}
        for f in files:
            state.update(load_file(str(d / f)))
        return state
    if (d / "pytorch_model.bin").exists():
        return dict(torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True))
    raise TrainerError(f"{d} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def hf_to_megatron(state: Mapping[str, Tensor], arch: HFArch) -> dict[str, Tensor]:
    """Hugging Face names and layouts -> megatron-core ``GPTModel`` (local spec, TP 1)."""
    need = _hf_names(arch)
    missing = [k for k in need if k not in state]
    if missing:
        raise TrainerError(f"the Hugging Face weights lack {missing[:5]} ({len(missing)} missing)")
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"]}
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"], arch
        )
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                state[a + "q_proj.bias"], state[a + "k_proj.bias"], state[a + "v_proj.bias"], arch
            )
        out[m + "self_attention.linear_proj.weight"] = state[a + "o_proj.weight"]
        out[m + "input_layernorm.weight"] = state[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = state[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [state[h + "mlp.gate_proj.weight"], state[h + "mlp.up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = state[h + "mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = state["model.norm.weight"]
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    return out


def megatron_to_hf(state: Mapping[str, Tensor], arch: HFArch) -> dict[str, Tensor]:
    """The inverse of ``hf_to_megatron``: the names and layouts an engine loading a Hugging
    Face checkpoint expects (``lm_head`` left out when tied, as ``save_pretrained`` does)."""
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(arch.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        q, k, v = _split_qkv(state[m + "self_attention.linear_qkv.weight"], arch)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        if arch.qkv_bias:
            q, k, v = _split_qkv(state[m + "self_attention.linear_qkv.bias"], arch)
            out[a + "q_proj.bias"], out[a + "k_proj.bias"], out[a + "v_proj.bias"] = q, k, v
        out[a + "o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        out[h + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = state["output_layer.weight"]
    return out


def _hf_names(arch: HFArch) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(arch.num_layers):
        h = f"model.layers.{i}."
        names += [h + f"self_attn.{p}_proj.weight" for p in "qkvo"]
        if arch.qkv_bias:
            names += [h + f"self_attn.{p}_proj.bias" for p in "qkv"]
        names += [h + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [h + "input_layernorm.weight", h + "post_attention_layernorm.weight"]
    return names


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: HFArch) -> Tensor:
    """``[heads*d, ...]``, ``[groups*d, ...]`` x 2 -> ``[groups * (group + 2) * d, ...]``."""
    g, d, rest = arch.num_key_value_heads, arch.head_dim, q.shape[1:]
    want = {"q": arch.num_attention_heads * d, "k": g * d, "v": g * d}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[0] != want[name]:
            raise TrainerError(f"{name}_proj has {t.shape[0]} rows, the config implies {want[name]}")
    fused = torch.cat(
        [q.reshape(g, arch.group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return fused.reshape(g * (arch.group + 2) * d, *rest)


def _split_qkv(fused: Tensor, arch: HFArch) -> tuple[Tensor, Tensor, Tensor]:
    g, d, rest = arch.num_key_value_heads, arch.head_dim, fused.shape[1:]
    per = fused.reshape(g, (arch.group + 2) * d, *rest)
    q, k, v = per.split([arch.group * d, d, d], dim=1)
    return (
        q.reshape(g * arch.group * d, *rest).contiguous(),
        k.reshape(g * d, *rest).contiguous(),
        v.reshape(g * d, *rest).contiguous(),
    )
