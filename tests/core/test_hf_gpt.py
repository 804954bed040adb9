"""The Hugging Face <-> megatron-core weight mapping (``core/trainer/hf_gpt.py``): config
reading and its errors, the round trip, the fused-QKV layout head by head as megatron's
attention splits it, and the checkpoint readers. Pure tensors: no GPU, no megatron-core (the
numerical check against a Hugging Face model runs in test_megatron_trainer.py on a GPU)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from core.trainer.base import TrainerError
from core.trainer.hf_gpt import HFArch, _hf_names, hf_to_megatron, megatron_to_hf, read_hf_state
from core.trainer.megatron_ import MegatronTrainerConfig

QWEN2 = {
    "model_type": "qwen2",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "vocab_size": 50,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}
LLAMA = {**QWEN2, "model_type": "llama", "num_key_value_heads": 4, "tie_word_embeddings": False}


def random_state(arch: HFArch, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight the architecture has, at its Hugging Face shape, with distinct values."""
    g = torch.Generator().manual_seed(seed)
    d, h, f = arch.head_dim, arch.hidden_size, arch.ffn_hidden_size
    shapes = {
        "q_proj.weight": (arch.num_attention_heads * d, h),
        "k_proj.weight": (arch.num_key_value_heads * d, h),
        "v_proj.weight": (arch.num_key_value_heads * d, h),
        "q_proj.bias": (arch.num_attention_heads * d,),
        "k_proj.bias": (arch.num_key_value_heads * d,),
        "v_proj.bias": (arch.num_key_value_heads * d,),
        "o_proj.weight": (h, arch.num_attention_heads * d),
        "gate_proj.weight": (f, h),
        "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
        "layernorm.weight": (h,),
        "embed_tokens.weight": (arch.vocab_size, h),
        "lm_head.weight": (arch.vocab_size, h),
        "norm.weight": (h,),
    }
    out = {}
    for name in _hf_names(arch):
        shape = next(v for k, v in shapes.items() if name.endswith(k))
        out[name] = torch.randn(*shape, generator=g)
    return out


def test_the_config_is_read_with_its_defaults():
    a = HFArch.from_config(QWEN2)
    assert (a.num_layers, a.head_dim, a.group, a.ffn, a.max_sequence_length) == (2, 8, 2, 48, 64)
    assert a.qkv_bias and a.tie_word_embeddings and a.rope_theta == 1e6  # Qwen2: biases on q, k, v
    b = HFArch.from_config({k: v for k, v in LLAMA.items() if k != "num_key_value_heads"})
    assert b.num_key_value_heads == 4 and not b.qkv_bias and not b.tie_word_embeddings
    assert HFArch.from_config({**LLAMA, "head_dim": 16}).head_dim == 16


def test_rope_base_is_read_where_each_transformers_version_writes_it():
    # transformers 5 writes rope_parameters; older versions a top-level rope_theta
    bare = {k: v for k, v in QWEN2.items() if k != "rope_theta"}
    assert HFArch.from_config(bare).rope_theta == 10000.0
    v5 = {**bare, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert HFArch.from_config(v5).rope_theta == 500000.0
    assert HFArch.from_config({**QWEN2, "rope_scaling": None}).rope_theta == 1e6
    assert (
        HFArch.from_config({**bare, "rope_scaling": {"type": "default", "rope_theta": 2.0}}).rope_theta == 2.0
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "gpt2"},
            "model_type 'gpt2' is not supported by the megatron trainer (supported: llama",
        ),
        (
            {"rope_scaling": {"type": "yarn", "factor": 4}},
            "rope_scaling of rope_type 'yarn' is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "rope_parameters of rope_type 'llama3'",
        ),
        ({"model_type": "llama", "attention_bias": True}, "attention_bias is not supported for llama"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"mlp_bias": True}, "mlp_bias is not supported"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not divisible by num_key_value_heads=3"),
        ({"intermediate_size": None}, "intermediate_size"),
        # Mistral-7B-v0.1's window is on without use_sliding_window (a Qwen2-only field)
        (
            {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768},
            "sliding-window attention (4096 tokens) is not supported",
        ),
        ({"sliding_window": 16, "use_sliding_window": True}, "sliding-window attention (16 tokens)"),
    ],
)
def test_configs_it_cannot_map_are_refused_by_field(change, message):
    config = {k: v for k, v in {**QWEN2, **change}.items() if v is not None}
    with pytest.raises(TrainerError, match=re.escape(message)):
        HFArch.from_config(config, source="m/config.json")


def test_a_sliding_window_that_is_off_or_covers_every_position_is_no_window():
    assert HFArch.from_config({**QWEN2, "sliding_window": 16, "use_sliding_window": False})
    mistral = {**QWEN2, "model_type": "mistral", "sliding_window": 32768, "max_position_embeddings": 32768}
    assert HFArch.from_config(mistral).max_sequence_length == 32768


@pytest.mark.parametrize("config", [QWEN2, LLAMA], ids=["qwen2-gqa-tied-bias", "llama-mha-untied"])
def test_the_round_trip_gives_back_every_tensor(config):
    arch = HFArch.from_config(config)
    hf = random_state(arch)
    meg = hf_to_megatron(hf, arch)
    assert ("output_layer.weight" in meg) is not arch.tie_word_embeddings
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in meg) is arch.qkv_bias
    back = megatron_to_hf(meg, arch)
    assert set(back) == set(hf)
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_the_fused_qkv_is_grouped_as_megatrons_attention_splits_it():
    # megatron: fused.view(groups, (q_per_group + 2) * d, hidden), split into q heads, k, v
    arch = HFArch.from_config(QWEN2)
    hf = random_state(arch)
    meg = hf_to_megatron(hf, arch)
    d, per = arch.head_dim, (arch.group + 2) * arch.head_dim
    fused = meg["decoder.layers.1.self_attention.linear_qkv.weight"]
    bias = meg["decoder.layers.1.self_attention.linear_qkv.bias"]
    assert fused.shape == (arch.num_key_value_heads * per, arch.hidden_size)
    a = "model.layers.1.self_attn."
    for head in range(arch.num_attention_heads):  # query head h reads key/value head h // group
        grp, j = divmod(head, arch.group)
        rows = slice(grp * per + j * d, grp * per + (j + 1) * d)
        assert torch.equal(fused[rows], hf[a + "q_proj.weight"][head * d : (head + 1) * d])
        assert torch.equal(bias[rows], hf[a + "q_proj.bias"][head * d : (head + 1) * d])
    for grp in range(arch.num_key_value_heads):
        k_rows = slice(grp * per + arch.group * d, grp * per + (arch.group + 1) * d)
        v_rows = slice(grp * per + (arch.group + 1) * d, (grp + 1) * per)
        assert torch.equal(fused[k_rows], hf[a + "k_proj.weight"][grp * d : (grp + 1) * d])
        assert torch.equal(fused[v_rows], hf[a + "v_proj.weight"][grp * d : (grp + 1) * d])
    # the gated unit: megatron applies the activation to the first half of fc1
    fc1 = meg["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: arch.ffn], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[arch.ffn :], hf["model.layers.1.mlp.up_proj.weight"])


def test_missing_or_misshapen_weights_are_named():
    arch = HFArch.from_config(QWEN2)
    hf = random_state(arch)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(TrainerError, match=r"lack \['model.layers.1.mlp.up_proj.weight'\]"):
        hf_to_megatron(hf, arch)
    hf = random_state(arch)
    hf["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, arch.hidden_size)
    with pytest.raises(TrainerError, match="k_proj has 8 rows, the config implies 16"):
        hf_to_megatron(hf, arch)


def test_checkpoint_directories_are_read(tmp_path: Path):
    from safetensors.torch import save_file

    arch = HFArch.from_config(QWEN2)
    hf = random_state(arch)
    (tmp_path / "config.json").write_text(json.dumps(QWEN2))
    assert HFArch.from_dir(tmp_path) == arch
    single = tmp_path / "single"
    single.mkdir()
    save_file(hf, str(single / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(hf)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for f, part in halves.items():
        save_file({k: hf[k] for k in part}, str(sharded / f))
    index = {"weight_map": {k: f for f, part in halves.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    binary = tmp_path / "bin"
    binary.mkdir()
    torch.save(hf, binary / "pytorch_model.bin")
    for d in (single, sharded, binary):
        got = read_hf_state(d)
        assert set(got) == set(hf) and all(torch.equal(got[k], hf[k]) for k in hf), d
    with pytest.raises(TrainerError, match=r"holds no model\.safetensors"):
        read_hf_state(tmp_path)  # a config, no weights
    with pytest.raises(TrainerError, match="cannot read a Hugging Face config"):
        HFArch.from_dir(single)


def test_the_trainer_config_takes_exactly_one_model_source(tmp_path: Path):
    assert MegatronTrainerConfig(hf_model=tmp_path).hf_model == tmp_path
    with pytest.raises(ValueError, match="exactly one of model"):
        MegatronTrainerConfig(hf_model=tmp_path, checkpoint=tmp_path / "x.pt")
    with pytest.raises(ValueError, match="hf_model needs tensor_parallel_size=1"):
        MegatronTrainerConfig(hf_model=tmp_path, tensor_parallel_size=2)


def test_the_megatron_arguments_follow_the_architecture():
    q, lm = HFArch.from_config(QWEN2), HFArch.from_config(LLAMA)
    assert (
        q.transformer_config_args()["num_query_groups"] == 2 and q.transformer_config_args()["add_qkv_bias"]
    )
    assert q.gpt_model_args() == {
        "share_embeddings_and_output_weights": True,
        "position_embedding_type": "rope",
        "rotary_base": 1000000,
    }
    assert not lm.transformer_config_args()["add_qkv_bias"]
    assert not lm.gpt_model_args()["share_embeddings_and_output_weights"]
