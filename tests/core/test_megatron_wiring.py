"""The megatron trainer's calls into megatron-core, on the CPU: stand-ins with the shapes of
megatron-core 0.19.2's own functions (read from its wheel) record what the trainer passes.
What the calls then compute needs a GPU (``test_megatron_trainer.py``, ``pytest.mark.gpu``)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from core.trainer import megatron_
from core.trainer.base import Trainer, TrainerError
from core.trainer.hf_gpt import HFArch
from core.trainer.megatron_ import MegatronTrainerConfig

QWEN2 = HFArch(
    model_type="qwen2",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    ffn_hidden_size=128,
    vocab_size=32,
    max_sequence_length=64,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    qkv_bias=True,
    tie_word_embeddings=False,
)


def _module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: Any) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], child, mod)
    return mod


class _Recorder:
    """A megatron class stand-in: keeps its keyword arguments; ``cuda()`` returns itself."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw

    def cuda(self, device: int) -> _Recorder:
        return self


def _fake_megatron(monkeypatch: pytest.MonkeyPatch, specs: dict[str, Any], **state: Any) -> dict[str, Any]:
    """``megatron.core`` as ``_build_gpt`` and ``_init_distributed`` import it; ``specs`` the
    functions of ``megatron.core.models.gpt.gpt_layer_specs``. Returns the calls made."""
    calls: dict[str, Any] = {}

    def initialize_model_parallel(**kw: Any) -> None:
        calls["initialize_model_parallel"] = kw

    _module(monkeypatch, "megatron")
    _module(monkeypatch, "megatron.core")
    _module(
        monkeypatch,
        "megatron.core.parallel_state",
        is_pipeline_first_stage=lambda: True,
        is_pipeline_last_stage=lambda: True,
        model_parallel_is_initialized=lambda: state.get("initialized", False),
        initialize_model_parallel=initialize_model_parallel,
    )
    _module(monkeypatch, "megatron.core.models")
    _module(monkeypatch, "megatron.core.models.gpt", GPTModel=_Recorder)
    _module(monkeypatch, "megatron.core.models.gpt.gpt_layer_specs", **specs)
    _module(monkeypatch, "megatron.core.transformer")
    _module(monkeypatch, "megatron.core.transformer.transformer_config", TransformerConfig=_Recorder)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return calls


# -- the local layer spec's norm ------------------------------------------------------------


def _spec_019(calls: dict[str, Any]) -> dict[str, Any]:
    """megatron-core 0.19.2: ``get_gpt_layer_local_spec(*args, **kwargs)`` hands everything to
    ``get_gpt_layer_local_submodules``, whose signature names ``normalization``."""

    def get_gpt_layer_local_submodules(
        num_experts: int | None = None, qk_layernorm: bool = False, normalization: str | None = None
    ) -> str:
        return "submodules"

    def get_gpt_layer_local_spec(*args: Any, **kwargs: Any) -> str:
        calls["spec"] = kwargs
        get_gpt_layer_local_submodules(*args, **kwargs)  # raises on a keyword it does not take
        return "spec"

    return {
        "get_gpt_layer_local_spec": get_gpt_layer_local_spec,
        "get_gpt_layer_local_submodules": get_gpt_layer_local_submodules,
    }


def test_an_hf_model_asks_megatron_019s_local_spec_for_rmsnorm(monkeypatch):
    # Without normalization="RMSNorm" the local spec's norm is apex's FusedLayerNorm wherever
    # apex is installed (NVIDIA's PyTorch images), which asserts on config.normalization ==
    # "RMSNorm"; only where apex is absent does WrappedTorchNorm read the config instead
    seen: dict[str, Any] = {}
    _fake_megatron(monkeypatch, _spec_019(seen))
    model = megatron_._build_gpt(QWEN2, MegatronTrainerConfig(hf_model="/nonexistent"))
    assert seen["spec"] == {"normalization": "RMSNorm"}
    assert model.kw["transformer_layer_spec"] == "spec"
    assert model.kw["config"].kw["normalization"] == "RMSNorm"


def test_the_spec_is_asked_only_for_what_this_megatron_takes(monkeypatch):
    seen: dict[str, Any] = {}

    def old_spec(num_experts: int | None = None, normalization: str | None = None) -> str:
        seen["old"] = normalization  # 0.10-0.13: the keyword is the spec's own
        return "spec"

    _fake_megatron(monkeypatch, {"get_gpt_layer_local_spec": old_spec})
    megatron_._build_gpt(QWEN2, MegatronTrainerConfig(hf_model="/nonexistent"))
    assert seen["old"] == "RMSNorm"

    def older_spec(num_experts: int | None = None) -> str:  # no RMSNorm choice at all
        return "spec"

    _fake_megatron(monkeypatch, {"get_gpt_layer_local_spec": older_spec})
    megatron_._build_gpt(QWEN2, MegatronTrainerConfig(hf_model="/nonexistent"))

    # a GPTShape model keeps megatron's default LayerNorm: nothing is asked
    _fake_megatron(monkeypatch, _spec_019(seen))
    shape = megatron_.GPTShape(
        num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=8, max_sequence_length=8
    )
    megatron_._build_gpt(shape, MegatronTrainerConfig(model=shape))
    assert seen["spec"] == {}


# -- the parallel world -----------------------------------------------------------------------


def test_a_data_parallel_world_is_refused(monkeypatch):
    # initialize_model_parallel makes world / (tp * pp) data-parallel replicas, but the trainer
    # has no gradient all-reduce over them (no megatron DDP, no finalize_model_grads): each
    # replica would step on its own gradients and their weights drift apart unseen
    calls = _fake_megatron(monkeypatch, {})
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    with pytest.raises(TrainerError, match=r"world size 4 is 2 data-parallel replicas of tp x pp = 2 x 1"):
        megatron_._init_distributed(2, 1)
    with pytest.raises(TrainerError, match="not divisible"):
        megatron_._init_distributed(3, 1)
    assert "initialize_model_parallel" not in calls
    megatron_._init_distributed(2, 2)  # world = tp * pp: one replica
    assert calls["initialize_model_parallel"]["tensor_model_parallel_size"] == 2


# -- checkpoints at tensor parallel > 1 --------------------------------------------------------

SMALL = megatron_.GPTShape(
    num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=8, max_sequence_length=8
)


def _rank(monkeypatch: pytest.MonkeyPatch, tp_rank: int) -> megatron_.MegatronTrainer:
    """A tp = 2 trainer's rank ``tp_rank`` as ``save_checkpoint`` and the training state see it:
    ``parallel_state`` names the rank, the model is a stand-in whose weights are the rank."""
    _module(monkeypatch, "megatron")
    _module(monkeypatch, "megatron.core")
    _module(
        monkeypatch,
        "megatron.core.parallel_state",
        get_tensor_model_parallel_rank=lambda: tp_rank,
        get_pipeline_model_parallel_rank=lambda: 0,
    )
    t = object.__new__(megatron_.MegatronTrainer)
    Trainer.__init__(t, version=3)
    t.config = MegatronTrainerConfig(model=SMALL, tensor_parallel_size=2)
    t.shape = SMALL
    t.model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(t.model.weight, float(tp_rank))
    t.optimizer = torch.optim.AdamW(t.model.parameters())
    t.reference = None
    t._shuffle = torch.Generator()
    return t


def test_each_tensor_parallel_rank_saves_its_own_shard(monkeypatch, tmp_path):
    # under one name the ranks overwrote each other: the last one's shard was the checkpoint
    path = tmp_path / "policy.pt"
    files = [_rank(monkeypatch, r).save_checkpoint(path) for r in range(2)]
    assert [f.name for f in files] == ["policy.tp0-of-2.pp0-of-1.pt", "policy.tp1-of-2.pp0-of-1.pt"]
    assert not path.exists()
    for r, f in enumerate(files):
        ckpt = torch.load(f, map_location="cpu", weights_only=True)
        assert (ckpt["tensor_parallel_size"], ckpt["tensor_parallel_rank"], ckpt["version"]) == (2, r, 3)
        assert torch.all(ckpt["state"]["weight"] == r)


def test_a_training_state_is_resumed_only_by_the_rank_that_wrote_it(monkeypatch):
    state = _rank(monkeypatch, 0).training_state()
    assert (state["tensor_parallel_size"], state["tensor_parallel_rank"]) == (2, 0)
    with pytest.raises(
        TrainerError, match="the training state holds the shard of tensor rank 0, pipeline rank 0"
    ):
        _rank(monkeypatch, 1).load_training_state(state)
    own = _rank(monkeypatch, 0)
    own.load_training_state({**state, "version": 4})
    assert own.version == 4
