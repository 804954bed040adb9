import asyncio

import pytest
import torch

from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig
from core.trainer.base import (
    TrainerError,
    TrainerRegistry,
    TrainSample,
    UnknownTrainerError,
    trainer_registry,
)
from core.trainer.torch_ import TorchTrainer, TorchTrainerConfig

TOK = WordTokenizer("left right up down walk the lake".split())


def model(seed: int = 0) -> TinyLM:
    return TinyLM(
        TinyLMConfig(vocab_size=TOK.vocab_size, d_model=32, n_layers=2, n_heads=4, max_len=32), seed=seed
    )


def logprobs_of(m: TinyLM, prompt: list[int], completion: list[int]) -> list[float]:
    with torch.no_grad():
        logp = torch.log_softmax(m(torch.tensor([prompt + completion]))[0], -1)
    return [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]


def sample(m: TinyLM, prompt: list[int], completion: list[int], advantage: float, **kw) -> TrainSample:
    return TrainSample(
        prompt_ids=prompt,
        completion_ids=completion,
        old_logprobs=logprobs_of(m, prompt, completion),
        advantage=advantage,
        group_id="g",
        policy_version=0,
        **kw,
    )


def on_policy(c: Completion) -> TrainSample:
    """A completion as the engine gave it, rewarded: its logprobs are the old ones."""
    return TrainSample(
        prompt_ids=c.prompt_ids,
        completion_ids=c.token_ids,
        old_logprobs=c.logprobs,
        advantage=1.0,
        group_id="g",
        policy_version=0,
        allowed_token_ids=c.allowed_token_ids,
    )


def test_a_step_lowers_the_surrogate_loss():
    torch.manual_seed(0)
    m = model()
    right, left, walk = TOK.token_to_id("right"), TOK.token_to_id("left"), TOK.token_to_id("walk")
    batch = [
        sample(m, [2, walk], [right, TOK.end_id], 1.0),
        sample(m, [2, walk, walk], [left, TOK.end_id], -1.0),
        sample(m, [2], [right], 0.5),
    ]
    trainer = TorchTrainer(m, TorchTrainerConfig(lr=2e-3))
    first = trainer.step(batch)
    second = trainer.step(batch)  # same batch, same old logprobs: the surrogate went down
    assert second["loss"] < first["loss"]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["clip_frac"] == 0.0
    assert first["tokens"] == 5 and first["updates"] == 1 and first["grad_norm"] > 0
    assert trainer.version == 2


def test_reward_for_right_raises_its_probability_within_50_steps():
    """The whole loop as the job runs it: engine samples, trainer steps, engine loads."""
    right = TOK.token_to_id("right")
    walk = [2, TOK.role_ids["user"], TOK.token_to_id("walk"), TOK.end_id, TOK.role_ids["assistant"]]
    m = model(seed=1)
    trainer = TorchTrainer(m, TorchTrainerConfig(lr=3e-2, seed=0))

    def p_right() -> float:
        with torch.no_grad():
            return float(torch.softmax(trainer.model(torch.tensor([walk]))[0, -1], -1)[right])

    async def run() -> list[float]:
        curve = [p_right()]
        async with TorchEngine(m, TOK, TorchEngineConfig(num_threads=1, seed=0)) as eng:
            for step in range(50):
                cs = await asyncio.gather(
                    *(eng.generate(GenerateRequest(prompt_ids=walk, max_new_tokens=1)) for _ in range(16))
                )
                batch = [
                    TrainSample(
                        prompt_ids=c.prompt_ids,
                        completion_ids=c.token_ids,
                        old_logprobs=c.logprobs,
                        reward=float(c.token_ids == [right]),
                        group_id=str(step),
                        policy_version=c.policy_version,
                    )
                    for c in cs
                ]
                trainer.step(batch)
                update = trainer.publish()
                await eng.suspend()
                await eng.load_weights(update.state, update.version)
                await eng.resume()
                curve.append(p_right())
                assert all(c.policy_version == step for c in cs)
        return curve

    curve = asyncio.run(run())
    assert curve[0] < 0.15
    assert curve[-1] > 0.8, curve


def test_masked_tokens_do_not_train():
    right, left = TOK.token_to_id("right"), TOK.token_to_id("left")
    m = model()
    a = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2))
    b = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2))
    # b's sample has an extra token with a huge advantage-bearing ratio, masked out
    a.step([sample(m, [2, 5], [right], 1.0)])
    extra = sample(m, [2, 5], [right, left], 1.0, mask=[1, 0])
    b.step([extra.model_copy(update={"old_logprobs": [extra.old_logprobs[0], -50.0]})])
    for (k, pa), pb in zip(a.state().items(), b.state().values(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6), k
    nothing = a.step([sample(m, [2, 5], [right], 1.0, mask=[0])])
    assert nothing["skipped"] == 1.0 and nothing["tokens"] == 0


def test_mini_batches_epochs_and_kl():
    m = model()
    right = TOK.token_to_id("right")
    batch = [sample(m, [2, 5 + i % 3], [right, TOK.end_id], float(i % 2) - 0.5) for i in range(4)]
    t = TorchTrainer(m, TorchTrainerConfig(lr=1e-2, mini_batch_size=2, epochs=2, kl_coef=0.1))
    first = t.step(batch)
    assert first["updates"] == 4
    assert first["kl"] >= 0.0
    assert first["approx_kl"] > 0.0  # later mini-batches are off-policy
    for _ in range(3):
        metrics = t.step(batch)
    assert metrics["kl"] > 0.0  # drifted away from the frozen initial policy
    assert t.reference is not None and not any(p.requires_grad for p in t.reference.parameters())


def test_clipping_caps_off_policy_updates():
    m = model()
    right = TOK.token_to_id("right")
    s = sample(m, [2, 5], [right], 1.0)
    stale = s.model_copy(update={"old_logprobs": [s.old_logprobs[0] - 1.0]})  # ratio e > 1.2
    metrics = TorchTrainer(m, TorchTrainerConfig(lr=1e-2)).step([stale])
    assert metrics["clip_frac"] == 1.0 and metrics["grad_norm"] == 0.0


def test_restricted_sampling_is_trained_under_the_same_restriction():
    right, left = TOK.token_to_id("right"), TOK.token_to_id("left")
    allowed = [right, left]
    m = model()

    async def gen():
        async with TorchEngine(m, TOK, TorchEngineConfig(num_threads=1)) as eng:
            return await asyncio.gather(
                *(
                    eng.generate(
                        GenerateRequest(
                            prompt_ids=[2, 5], max_new_tokens=1, allowed_token_ids=allowed, seed=i
                        )
                    )
                    for i in range(8)
                )
            )

    cs = asyncio.run(gen())
    assert {t for c in cs for t in c.token_ids} <= set(allowed)
    with torch.no_grad():
        logits = m(torch.tensor([[2, 5]]))[0, -1]
    restricted = torch.log_softmax(logits[allowed], -1)
    for c in cs:
        assert c.logprobs[0] == pytest.approx(float(restricted[allowed.index(c.token_ids[0])]), abs=1e-5)
    metrics = TorchTrainer(m, TorchTrainerConfig(lr=1e-3)).step([on_policy(c) for c in cs])
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the same distribution
    assert metrics["entropy"] <= float(torch.log(torch.tensor(2.0))) + 1e-5


def test_greedy_rollouts_train_at_the_temperature_their_logprobs_were_taken():
    # engine.temperature 0: the engine reports untempered logprobs, and the trainer the job
    # makes recomputes them at T=1 too (it once used 1e-3: ratio 9, every token clipped)
    from core.config import TrainerConfig
    from core.config_backends import backend_config

    m = model()

    async def gen():
        async with TorchEngine(m, TOK, TorchEngineConfig(num_threads=1)) as eng:
            return await eng.generate(GenerateRequest(prompt_ids=[2, 5], max_new_tokens=3, temperature=0.0))

    c = asyncio.run(gen())
    options = backend_config(TrainerConfig(lr=1e-3), temperature=0.0, seed=0)
    assert options["temperature"] == 1.0
    metrics = TorchTrainer(m, TorchTrainerConfig(**options)).step([on_policy(c)])
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["clip_frac"] == 0.0


def test_published_weights_are_a_versioned_copy():
    m = model()
    t = TorchTrainer(m, TorchTrainerConfig(lr=1e-2))
    t.step([sample(m, [2, 5], [TOK.token_to_id("up")], 1.0)])
    update = t.publish()
    assert update.version == 1
    before = update.state["embed.weight"].clone()
    t.step([sample(m, [2, 5], [TOK.token_to_id("up")], 1.0)])
    assert torch.equal(update.state["embed.weight"], before)
    assert not update.state["embed.weight"].requires_grad


def test_bad_batches_are_clear_errors():
    m = model()
    t = TorchTrainer(m)
    with pytest.raises(TrainerError, match="non-empty"):
        t.step([])
    too_long = TrainSample(
        prompt_ids=[2] * 30,
        completion_ids=[5] * 5,
        old_logprobs=[0.0] * 5,
        advantage=1.0,
        group_id="g",
        policy_version=0,
    )
    with pytest.raises(TrainerError, match="exceeds the model's max_len=32"):
        t.step([too_long])


def test_registry():
    assert trainer_registry.get("torch") is TorchTrainer
    reg = TrainerRegistry()
    with pytest.raises(UnknownTrainerError, match="unknown trainer 'megatron'; known trainers: \\(none\\)"):
        reg.get("megatron")
    reg.register("torch", "core.trainer.torch_:TorchTrainer")
    assert isinstance(reg.create("torch", model=model()), TorchTrainer)
    reg.register("megatron", "core.trainer.megatron_:MegatronTrainer")
    assert reg.get("megatron").__name__ == "MegatronTrainer"  # importable without megatron-core
    reg.register("broken", "core.trainer.no_such_module:Trainer")
    with pytest.raises(TrainerError, match="cannot load trainer 'broken'"):
        reg.get("broken")
