"""The megatron backend: config and missing-runtime errors run everywhere; training needs a
CUDA device and megatron-core (``pytest.mark.gpu``) and is skipped without them."""

import math
import subprocess
import sys
import types

import pytest
import torch

from core.trainer.base import TrainerError, TrainSample, trainer_registry
from core.trainer.megatron_ import GPTShape, MegatronTrainer, MegatronTrainerConfig

try:
    import megatron.core  # noqa: F401

    HAVE_MCORE = True
except ImportError:
    HAVE_MCORE = False

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_MCORE),
    reason="needs a CUDA device and megatron-core (pip install -e .[megatron])",
)

SHAPE = GPTShape(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    vocab_size=16,
    max_sequence_length=32,
)
PROMPT = [1, 2, 3]
GOOD, BAD = 5, 6


def config(**kw) -> MegatronTrainerConfig:
    return MegatronTrainerConfig(model=SHAPE, **kw)


# -- everywhere ---------------------------------------------------------------------------


def test_config_validation():
    assert config().lr == 1e-5 and config().tensor_parallel_size == 1
    assert SHAPE.ffn == 128 and SHAPE.model_copy(update={"ffn_hidden_size": None}).ffn == 256
    with pytest.raises(ValueError, match="exactly one of model"):
        MegatronTrainerConfig()
    with pytest.raises(ValueError, match="exactly one of model"):
        MegatronTrainerConfig(model=SHAPE, checkpoint="x.pt")
    with pytest.raises(ValueError, match="hidden_size=66 is not divisible by num_attention_heads=4"):
        GPTShape(num_layers=1, hidden_size=66, num_attention_heads=4, vocab_size=8, max_sequence_length=8)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        config(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="vocab_size=16 is not divisible by tensor_parallel_size=32"):
        MegatronTrainerConfig(
            model=SHAPE.model_copy(
                update={"num_attention_heads": 32, "hidden_size": 64, "ffn_hidden_size": 64}
            ),
            tensor_parallel_size=32,
        )
    with pytest.raises(ValueError, match="num_layers=2 is not divisible by pipeline_parallel_size=4"):
        config(pipeline_parallel_size=4)
    assert config(tensor_parallel_size=2, pipeline_parallel_size=2).pipeline_parallel_size == 2
    for bad in ({"lr": 0}, {"clip_low": 1.0}, {"micro_batch_size": 0}, {"grad_clip": -1.0}, {"bogus": 1}):
        with pytest.raises(ValueError):
            config(**bad)
    # the job passes backend options as a dict
    assert MegatronTrainerConfig.model_validate({"model": SHAPE.model_dump(), "lr": 1e-4}).lr == 1e-4


def test_missing_megatron_core_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron -> ImportError
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(TrainerError, match=r"install the megatron extra \(pip install -e \.\[megatron\]\)"):
        MegatronTrainer(config())
    with pytest.raises(TrainerError, match="megatron-core"):
        trainer_registry.create("megatron", config={"model": SHAPE.model_dump()})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a CUDA device")
def test_no_cuda_device_is_a_clear_error(monkeypatch):
    # megatron-core "installed" (a stand-in package), no GPU: the second check speaks
    pkg = types.ModuleType("megatron")
    core = types.ModuleType("megatron.core")
    pkg.core = core  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "megatron", pkg)
    monkeypatch.setitem(sys.modules, "megatron.core", core)
    with pytest.raises(TrainerError, match="no CUDA device"):
        MegatronTrainer(config())


@pytest.mark.parametrize(
    ("env", "torchrun"),
    [
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}, True),
        ({"WORLD_SIZE": "2", "MASTER_ADDR": "h", "RANK": "1", "LOCAL_RANK": "1"}, True),
        # what a Kubeflow PyTorchJob or a SLURM script exports pod-wide: a trainer actor Ray
        # starts there is alone, and waited for ranks that never came
        ({"WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "23456"}, False),
        ({"WORLD_SIZE": "8", "MASTER_ADDR": "h", "RANK": "0"}, False),
        ({}, False),
    ],
)
def test_only_a_launchers_process_joins_its_world(env, torchrun):
    from core.trainer.megatron_ import launched_by_torchrun

    assert launched_by_torchrun(env) is torchrun


def test_registered_and_imports_without_megatron():
    assert trainer_registry.get("megatron") is MegatronTrainer
    code = "import sys, core.trainer.megatron_; assert 'megatron' not in sys.modules, 'eager import'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- on a GPU -----------------------------------------------------------------------------


def sample(t: MegatronTrainer, completion: list[int], advantage: float, prompt=PROMPT, **kw) -> TrainSample:
    allowed = kw.get("allowed_token_ids")
    return TrainSample(
        prompt_ids=prompt,
        completion_ids=completion,
        old_logprobs=t.logprobs(prompt, completion, allowed),
        advantage=advantage,
        group_id="g",
        policy_version=t.version,
        **kw,
    )


def prob(t: MegatronTrainer, token: int) -> float:
    return math.exp(t.logprobs(PROMPT, [token])[0])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("bf16", [False, True])
def test_positive_advantage_raises_its_token_probability(bf16):
    t = MegatronTrainer(config(lr=1e-2, bf16=bf16, seed=1))
    p_good, p_bad = prob(t, GOOD), prob(t, BAD)
    keys = None
    for step in range(5):
        batch = [sample(t, [GOOD], 1.0), sample(t, [BAD], -1.0), sample(t, [GOOD, BAD, 7], 0.5)]
        metrics = t.step(batch)
        assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        assert metrics["version"] == step + 1 == t.version
        if step == 0:  # old logprobs are the trainer's own: on-policy
            assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-2 if bf16 else 1e-5)
            assert metrics["clip_frac"] == 0.0
        state = t.state()
        assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in state.values())
        assert not any(v.requires_grad for v in state.values())
        keys = keys or list(state)
        assert list(state) == keys
    assert prob(t, GOOD) > p_good + 0.05, (p_good, prob(t, GOOD))
    assert prob(t, BAD) < p_bad
    update = t.publish()
    assert update.version == 5 and list(update.state) == keys


@pytest.mark.gpu
@needs_gpu
def test_metrics_match_the_torch_backend():
    from core.policy.tiny_lm import TinyLM, TinyLMConfig
    from core.trainer.torch_ import TorchTrainer

    tiny = TinyLM(TinyLMConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=4, max_len=32), seed=0)
    ref = TorchTrainer(tiny).step(
        [
            TrainSample(
                prompt_ids=PROMPT,
                completion_ids=[GOOD],
                old_logprobs=[-2.0],
                advantage=1.0,
                group_id="g",
                policy_version=0,
            )
        ]
    )
    t = MegatronTrainer(config())
    got = t.step([sample(t, [GOOD], 1.0)])
    assert set(got) == set(ref)
    masked = t.step([sample(t, [GOOD], 1.0, mask=[0])])
    assert masked["skipped"] == 1.0 and masked["tokens"] == 0


@pytest.mark.gpu
@needs_gpu
def test_same_seed_same_weights_and_micro_batches_change_nothing():
    a = MegatronTrainer(config(lr=1e-2, seed=3))
    b = MegatronTrainer(config(lr=1e-2, seed=3, micro_batch_size=1))
    for (k, va), vb in zip(a.state().items(), b.state().values(), strict=True):
        assert torch.equal(va, vb), k
    batch = [sample(a, [GOOD, 7], 1.0), sample(a, [BAD], -1.0, prompt=[1, 2]), sample(a, [GOOD], 0.3)]
    ma, mb = a.step(batch), b.step(batch)
    assert ma["loss"] == pytest.approx(mb["loss"], abs=1e-5)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-4)
    for (k, va), vb in zip(a.state().items(), b.state().values(), strict=True):
        assert torch.allclose(va, vb, atol=1e-4), k


@pytest.mark.gpu
@needs_gpu
def test_restriction_masking_kl_and_mini_batches():
    t = MegatronTrainer(config(lr=1e-2, kl_coef=0.1, mini_batch_size=2, epochs=2))
    allowed = [GOOD, BAD]
    restricted = [
        sample(t, [GOOD], 1.0, allowed_token_ids=allowed),
        sample(t, [BAD], -1.0, allowed_token_ids=allowed),
    ]
    # restricted logprobs are of the renormalised distribution: the two probabilities sum to 1
    assert math.exp(restricted[0].old_logprobs[0]) + math.exp(restricted[1].old_logprobs[0]) == pytest.approx(
        1.0
    )
    first = t.step(restricted)
    assert first["updates"] == 2 and first["entropy"] <= math.log(2) + 1e-5
    assert first["kl"] >= 0.0
    for _ in range(3):
        metrics = t.step([sample(t, [GOOD], 1.0), sample(t, [BAD], -1.0)] * 2)
    assert metrics["updates"] == 4 and metrics["kl"] > 0.0  # drifted from the frozen start
    assert t.reference is not None and not any(p.requires_grad for p in t.reference.parameters())


@pytest.mark.gpu
@needs_gpu
def test_a_resumed_trainer_goes_on_as_the_uninterrupted_one(tmp_path):
    # what `fabric run --resume` restores: weights, AdamW moments, KL anchor, shuffle, version
    def fresh() -> MegatronTrainer:
        return MegatronTrainer(config(lr=1e-2, seed=3, kl_coef=0.1, mini_batch_size=1))

    def batch(t: MegatronTrainer) -> list[TrainSample]:
        return [sample(t, [GOOD], 1.0), sample(t, [BAD], -1.0), sample(t, [GOOD, 7], 0.5)]

    a = fresh()
    for _ in range(2):
        a.step(batch(a))
    torch.save(a.training_state(), tmp_path / "t.pt")
    b = fresh()
    b.load_training_state(torch.load(tmp_path / "t.pt", map_location="cpu", weights_only=False))
    assert b.version == 2
    for _ in range(2):
        same = batch(a)
        ma, mb = a.step(same), b.step(same)
        assert ma["kl"] > 0 and ma["kl"] == pytest.approx(mb["kl"], rel=1e-4, abs=1e-7)
    for (k, va), vb in zip(a.state().items(), b.state().values(), strict=True):
        assert torch.allclose(va, vb, atol=1e-5), k


@pytest.mark.gpu
@needs_gpu
def test_checkpoint_round_trip_and_bad_samples(tmp_path):
    t = MegatronTrainer(config(lr=1e-2))
    t.step([sample(t, [GOOD], 1.0)])
    path = tmp_path / "policy.pt"
    assert t.save_checkpoint(path) == path  # one GPU: the one file, under the name given
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert (saved["tensor_parallel_size"], saved["pipeline_parallel_size"]) == (1, 1)
    assert (saved["tensor_parallel_rank"], saved["pipeline_parallel_rank"]) == (0, 0)
    back = MegatronTrainer(MegatronTrainerConfig(checkpoint=path))
    assert back.version == 1 and back.shape == SHAPE
    for (k, va), vb in zip(t.state().items(), back.state().values(), strict=True):
        assert torch.equal(va, vb), k
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainerError, match="cannot read megatron checkpoint"):
        MegatronTrainer(MegatronTrainerConfig(checkpoint=tmp_path / "junk.pt"))
    with pytest.raises(TrainerError, match="exceeds the model's max_sequence_length=32"):
        t.step(
            [
                TrainSample(
                    prompt_ids=[1] * 30,
                    completion_ids=[2] * 5,
                    old_logprobs=[0.0] * 5,
                    advantage=1.0,
                    group_id="g",
                    policy_version=0,
                )
            ]
        )
    with pytest.raises(TrainerError, match="outside the model's vocab_size=16"):
        t.step(
            [
                TrainSample(
                    prompt_ids=[1],
                    completion_ids=[99],
                    old_logprobs=[0.0],
                    advantage=1.0,
                    group_id="g",
                    policy_version=0,
                )
            ]
        )
    with pytest.raises(TrainerError, match="world size 1 is not divisible by tensor x pipeline parallel = 2"):
        MegatronTrainer(config(tensor_parallel_size=2))


# -- a Hugging Face checkpoint (hf_model): the model vLLM serves, trained by megatron ---------

HF_KINDS = {
    # grouped-query attention, q/k/v biases, tied embeddings (Qwen2.5's small models)
    "qwen2": {"num_key_value_heads": 2, "tie_word_embeddings": True},
    # multi-head attention, no biases, a separate lm_head
    "llama": {"num_key_value_heads": 4, "tie_word_embeddings": False},
}


def tiny_hf_model(kind: str, path):
    """A random two-layer model of that family saved with ``save_pretrained``; every weight
    (norms and biases too) perturbed, so a misplaced tensor cannot hide behind a 1 or a 0."""
    import transformers

    cls = {"qwen2": "Qwen2", "llama": "Llama"}[kind]
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        rope_theta=10000.0 if kind == "llama" else 1000000.0,
        rms_norm_eps=1e-6,
        **HF_KINDS[kind],
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls}ForCausalLM")(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(path)
    return model.cuda().eval()


def hf_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt + completion], device="cuda")
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", list(HF_KINDS))
def test_an_hf_model_trains_and_publishes_weights_the_hf_model_loads(kind, tmp_path):
    pytest.importorskip("transformers")
    hf = tiny_hf_model(kind, tmp_path / kind)
    t = MegatronTrainer(MegatronTrainerConfig(hf_model=tmp_path / kind, lr=1e-2, seed=1))
    prompt, completion = [3, 17, 42, 5, 9], [11, 60, 2, 33]
    # the same function as the Hugging Face model: RoPE, RMSNorm, SwiGLU, GQA mapped right
    assert t.logprobs(prompt, completion) == pytest.approx(hf_logprobs(hf, prompt, completion), abs=1e-4)
    # published under Hugging Face names, equal to what was loaded
    names = {
        k for k in hf.state_dict() if not (HF_KINDS[kind]["tie_word_embeddings"] and k == "lm_head.weight")
    }
    before = t.state()
    assert set(before) == names
    for k, v in hf.state_dict().items():
        if k in before:
            assert torch.equal(before[k], v.cpu()), k
    for _ in range(3):
        t.step([sample(t, [GOOD], 1.0, prompt=prompt), sample(t, [BAD], -1.0, prompt=prompt)])
    after = t.state()
    assert any(not torch.equal(after[k], before[k]) for k in names)
    # an engine that loads the published weights samples from the trainer's policy
    result = hf.load_state_dict({k: v.cuda() for k, v in after.items()}, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    assert t.logprobs(prompt, completion) == pytest.approx(hf_logprobs(hf, prompt, completion), abs=1e-4)
    # and a checkpoint keeps the architecture and the version
    t.save_checkpoint(tmp_path / "ckpt.pt")
    back = MegatronTrainer(MegatronTrainerConfig(checkpoint=tmp_path / "ckpt.pt"))
    assert back.version == 3 and set(back.state()) == names
    assert back.logprobs(prompt, completion) == pytest.approx(t.logprobs(prompt, completion), abs=1e-6)
