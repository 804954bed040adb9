import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig
from core.trainer.base import (
    NonFiniteGradient,
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


class Bigram(torch.nn.Module):
    """A policy whose logits at a position are the table row of the token there: every
    logprob, ratio and gradient of a step can be worked out by hand."""

    def __init__(self, probs: list[list[float]], temperature: float):
        super().__init__()
        # logits / T = log p: the trainer's tempered softmax gives back the rows
        self.table = torch.nn.Parameter(temperature * torch.tensor(probs).log())
        self.config = SimpleNamespace(max_len=8, vocab_size=len(probs))

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.table[ids]


P = [
    [0.5, 0.25, 0.125, 0.125],  # after token 0
    [0.25, 0.5, 0.125, 0.125],  # after token 1
    [0.125, 0.125, 0.5, 0.25],  # after token 2
    [0.125, 0.5, 0.25, 0.125],  # after token 3
]


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_a_step_by_hand_alignment_padding_masking_clipping_and_aggregation(agg):
    ln = math.log
    # A: [3, 0 | 1, 2], advantage +1, padded by one (B is longer)
    #   token 1 after 0: p .25, old .25 -> r 1, -1;  token 2 after 1: p .125, old 1/16 -> r 2,
    #   clipped to 1.2 (no gradient)
    a = TrainSample(
        prompt_ids=[3, 0],
        completion_ids=[1, 2],
        old_logprobs=[ln(0.25), ln(1 / 16)],
        advantage=1.0,
        group_id="g",
        policy_version=0,
    )
    # B: [2 | 3, 0, 1, 2], advantage -1, last token masked (its old logprob is junk)
    #   3 after 2: p .25, old .5 -> r .5, clipped: -min(-.5, -.8) = .8;  0 after 3: p .125,
    #   r 1 -> 1;  1 after 0: p .25, r 1 -> 1
    b = TrainSample(
        prompt_ids=[2],
        completion_ids=[3, 0, 1, 2],
        old_logprobs=[ln(0.5), ln(0.125), ln(0.25), 0.0],
        mask=[1, 1, 1, 0],
        advantage=-1.0,
        group_id="g",
        policy_version=0,
    )
    m = Bigram(P, temperature=2.0)
    cfg = TorchTrainerConfig(lr=1e-3, temperature=2.0, grad_clip=None, loss_agg=agg)
    metrics = TorchTrainer(m, cfg).step([a, b])  # type: ignore[arg-type]
    if agg == "token_mean":  # every trained token weighs 1/5
        loss, w_a, w_b = (-1 - 1.2 + 0.8 + 1 + 1) / 5, 1 / 5, 1 / 5
    else:  # each sample's mean, then the mean of the two: A's tokens 1/4, B's 1/6
        loss, w_a, w_b = ((-1 - 1.2) / 2 + (0.8 + 1 + 1) / 3) / 2, 1 / 4, 1 / 6
    assert metrics["loss"] == pytest.approx(loss, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1 + 2 + 0.5 + 1 + 1) / 5)
    assert metrics["approx_kl"] == pytest.approx(((2 - 1 - ln(2)) + (0.5 - 1 + ln(2))) / 5)
    assert metrics["entropy"] == pytest.approx(1.75 * ln(2))  # every row's entropy at T=2
    # d(-A r)/d row = -A r (onehot(target) - p) / T for the unclipped tokens only: A's token 1
    # and B's token 1 (both after 0), B's token 0 (after 3). Rows 1 and 2 score only clipped,
    # masked, prompt or padded positions: no gradient
    e = torch.eye(4)
    p = torch.tensor(P)
    want = torch.zeros(4, 4)
    want[0] = -(e[1] - p[0]) / 2 * w_a + (e[1] - p[0]) / 2 * w_b
    want[3] = (e[0] - p[3]) / 2 * w_b
    assert m.table.grad is not None
    assert torch.allclose(m.table.grad, want, atol=1e-6), m.table.grad
    assert metrics["grad_norm"] == pytest.approx(float(want.norm()), rel=1e-5)


def test_the_kl_penalty_and_the_entropy_bonus_by_hand():
    ln = math.log
    # one token, 0 after 3: p .125 under the policy, .25 under the reference; on-policy, A = 0
    s = TrainSample(
        prompt_ids=[3],
        completion_ids=[0],
        old_logprobs=[ln(0.125)],
        advantage=0.0,
        group_id="g",
        policy_version=0,
    )
    ref_probs = [row[:] for row in P]
    ref_probs[3] = [0.25, 0.25, 0.25, 0.25]
    m = Bigram(P, temperature=2.0)
    cfg = TorchTrainerConfig(lr=1e-3, temperature=2.0, grad_clip=None, kl_coef=0.5, entropy_coef=0.1)
    metrics = TorchTrainer(m, cfg, reference=Bigram(ref_probs, temperature=2.0)).step([s])  # type: ignore[arg-type]
    # k3 with d = ref - logp = ln 2: e^d - d - 1 = 1 - ln 2; the row's entropy is 1.75 ln 2
    kl, ent = 1 - ln(2), 1.75 * ln(2)
    assert metrics["kl"] == pytest.approx(kl) and metrics["entropy"] == pytest.approx(ent)
    assert metrics["loss"] == pytest.approx(0.5 * kl - 0.1 * ent)  # a penalty, and a bonus
    # the KL's gradient: (1 - e^d) dlogp = -(onehot(0) - p) / T, weighted by kl_coef; the
    # entropy's: -(p * (log p + H)) / T per logit, and the bonus subtracts it
    e0, p3 = torch.eye(4)[0], torch.tensor(P[3])
    grad_h = -(p3 * (p3.log() + ent)) / 2
    want = 0.5 * -(e0 - p3) / 2 - 0.1 * grad_h
    assert m.table.grad is not None
    assert torch.allclose(m.table.grad[3], want, atol=1e-6), m.table.grad[3]
    assert m.table.grad[:3].abs().max().item() == 0.0


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


@pytest.mark.parametrize(("ids", "updates"), [([None] * 4, 4), (["a", "a", "b", "b"], 2)])
def test_the_actors_minibatch_size_counts_a_sample_without_trajectory_id_as_its_own(ids, updates):
    # trainer.minibatch_size counts trajectories; a sample with no trajectory_id is its own
    # (TrainSample, batch_advantages), but all of them once counted as one trajectory, so
    # the whole batch went in a single update whatever minibatch_size said
    from core.config import TrainerConfig
    from core.policy.build import PolicyBundle
    from core.trainer.actor import TrainerActor

    m = model()
    bundle = PolicyBundle(tokenizer=TOK.to_dict(), model_config=m.config.model_dump(), state=m.state_dict())
    actor = TrainerActor(TrainerConfig(minibatch_size=1), bundle, total_steps=1, temperature=1.0, seed=0)
    right = TOK.token_to_id("right")
    batch = [
        sample(m, [2, 5 + i], [right], float(i % 2) - 0.5).model_copy(update={"trajectory_id": t})
        for i, t in enumerate(ids)
    ]
    metrics, _ = actor.step(batch)
    assert metrics["updates"] == updates


def test_clipping_caps_off_policy_updates():
    m = model()
    right = TOK.token_to_id("right")
    s = sample(m, [2, 5], [right], 1.0)
    stale = s.model_copy(update={"old_logprobs": [s.old_logprobs[0] - 1.0]})  # ratio e > 1.2
    metrics = TorchTrainer(m, TorchTrainerConfig(lr=1e-2)).step([stale])
    assert metrics["clip_frac"] == 1.0 and metrics["grad_norm"] == 0.0


def test_the_dual_clip_caps_a_stale_sample_with_a_negative_advantage():
    # ratio e^2 = 7.4 with A = -1: the ratio clip took this unclipped branch (loss 7.4, full
    # gradient); the dual clip at c = 3 caps its loss at 3, with no gradient
    m = model()
    right = TOK.token_to_id("right")
    s = sample(m, [2, 5], [right], -1.0)
    stale = s.model_copy(update={"old_logprobs": [s.old_logprobs[0] - 2.0]})
    capped = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2)).step([stale])
    assert capped["dual_clip_frac"] == 1.0 and capped["grad_norm"] == 0.0
    assert capped["pg_loss"] == pytest.approx(3.0)
    free = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2, clip_ratio_c=None)).step([stale])
    assert free["dual_clip_frac"] == 0.0 and free["grad_norm"] > 0
    assert free["pg_loss"] == pytest.approx(math.exp(2.0), rel=1e-4)


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_a_sample_with_a_non_finite_engine_logprob_is_masked_counted_and_warned_of(bad, caplog):
    # a NaN behaviour logprob made the ratio NaN: the clamp passes no gradient through it, so
    # the update went on and reported a NaN loss (and ratio_mean, approx_kl) without a word
    right, left = TOK.token_to_id("right"), TOK.token_to_id("left")
    m = model()
    good = sample(m, [2, 5], [right, TOK.end_id], 1.0, trajectory_id="a")
    broken = sample(m, [2, 6], [left, TOK.end_id], -1.0, trajectory_id="b")
    broken = broken.model_copy(update={"old_logprobs": [broken.old_logprobs[0], bad]})
    trainer = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2))
    with caplog.at_level("WARNING", logger="core.trainer.base"):
        metrics = trainer.step([good, broken])
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["nonfinite_logprob_samples"] == 1.0 and metrics["tokens"] == 2.0
    assert "1 of 2 samples" in caplog.text and "trajectory 'b'" in caplog.text
    # the broken sample's turn does not train at all (its other logprobs are not to be trusted
    # either): the update is the good sample's alone
    alone = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2))
    again = alone.step([good, broken.model_copy(update={"mask": [0, 0], "old_logprobs": [0.0, 0.0]})])
    assert again["nonfinite_logprob_samples"] == 0.0 and again["loss"] == pytest.approx(metrics["loss"])
    pairs = zip(trainer.state().values(), alone.state().values(), strict=True)
    assert all(torch.equal(x, y) for x, y in pairs)


def test_a_non_finite_logprob_where_the_mask_is_0_is_not_counted():
    right = TOK.token_to_id("right")
    m = model()
    s = sample(m, [2, 5], [right, TOK.end_id], 1.0)
    s = s.model_copy(update={"old_logprobs": [s.old_logprobs[0], math.nan], "mask": [1, 0]})
    metrics = TorchTrainer(m, TorchTrainerConfig(lr=1e-2)).step([s])
    assert metrics["nonfinite_logprob_samples"] == 0.0 and math.isfinite(metrics["loss"])


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


def test_samples_that_feed_the_model_the_same_tokens_are_run_through_it_once():
    # GRPO's group members share a prompt (and with a short history window, turns taken in the
    # same state do too): the model runs each distinct input once, and the step, its loss and
    # its gradient are those of the whole batch run row by row
    m, ref = model(), model()
    right, left = TOK.token_to_id("right"), TOK.token_to_id("left")
    prompts = [[2, 5], [2, 5], [3, 6, 7], [2, 5], [3, 6, 7], [4, 6]]
    replies = [[right], [left], [right], [right, TOK.end_id], [left], [right]]
    batch = [
        sample(m, p, r, advantage=float(i % 3) - 1.0, allowed_token_ids=[right, left] if i < 3 else None)
        for i, (p, r) in enumerate(zip(prompts, replies, strict=True))
    ]
    cfg = TorchTrainerConfig(lr=1e-2, entropy_coef=0.03, kl_coef=0.1, grad_clip=None)
    trainer = TorchTrainer(m, cfg)
    rows: list[int] = []
    for net in (m, trainer.reference):
        assert net is not None
        net.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
    metrics = trainer.step(batch)
    # inputs (prompt + all but the last reply token): [2 5], [3 6 7], [2 5 right], [4 6]; the
    # policy's and the KL reference's forward
    assert rows == [4, 4]

    # the same loss and gradient, every row run through the model: the trainer's update
    # written out
    from core.trainer.grpo import aggregate, kl_k3, policy_loss
    from core.trainer.lean_logprobs import logprobs_and_entropy
    from core.trainer.torch_ import _pack, _restriction

    frozen = model()
    frozen.requires_grad_(False)
    ids, attn, targets, mask, old = _pack(batch, ref.config.max_len)
    restrict = _restriction(batch, ref.config.vocab_size)
    adv = torch.tensor([s.advantage for s in batch])
    logp, ent_tok = logprobs_and_entropy(ref(ids, attn), targets, cfg.temperature, restrict)
    pg, _ = policy_loss(
        logp,
        old,
        adv,
        mask,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        clip_ratio_c=cfg.clip_ratio_c,
        agg=cfg.loss_agg,
    )
    ent = aggregate(ent_tok, mask, cfg.loss_agg)
    with torch.no_grad():
        ref_logp, _ = logprobs_and_entropy(frozen(ids, attn), targets, cfg.temperature, restrict)
    kl = aggregate(kl_k3(logp, ref_logp, mask), mask, cfg.loss_agg)
    loss = pg - cfg.entropy_coef * ent + cfg.kl_coef * kl
    loss.backward()
    assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert metrics["kl"] == pytest.approx(kl.item(), rel=1e-5, abs=1e-9)
    # the gradients (Adam's first update is about lr * sign(grad): a gradient within rounding
    # of 0 moves its weight by lr either way, so the weights are no test of the gradient)
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), (name, (p.grad - q.grad).abs().max())


def test_only_the_positions_that_can_score_a_reply_token_are_scored(monkeypatch):
    # a long prompt and a one-token reply: the columns before the shortest prompt's last
    # token hold no trained token, so the softmax and entropy skip them (the loss is the same:
    # test_samples_that_feed_the_model_the_same_tokens_are_run_through_it_once)
    import core.trainer.torch_ as torch_trainer

    widths: list[int] = []
    real = torch_trainer.logprobs_and_entropy

    def spy(logits, *args, **kw):
        widths.append(logits.shape[1])
        return real(logits, *args, **kw)

    monkeypatch.setattr(torch_trainer, "logprobs_and_entropy", spy)
    m = model()
    right = TOK.token_to_id("right")
    batch = [sample(m, [2, 5, 3, 4, 6, 7, 8], [right], 1.0), sample(m, [2, 5, 3, 4, 6], [right, right], -1.0)]
    TorchTrainer(m, TorchTrainerConfig(lr=1e-2)).step(batch)
    # inputs of 7 and 6 tokens (width 7); the first trained position is the shorter prompt's
    # last (column 4): columns 4-6
    assert widths == [3]


def test_a_non_finite_gradient_after_other_mini_batches_says_their_updates_were_applied():
    # "update skipped" alone read as a step that changed nothing, but the step's earlier
    # mini-batches had moved the weights (and Adam's moments) with the version unchanged
    m = model()
    t = TorchTrainer(m, TorchTrainerConfig(lr=1e-2, mini_batch_size=1, scale_advantages=False))
    batch = [sample(m, [1, 2], [3], a) for a in (1.0, -1.0, 0.5)]
    real = t._update
    calls = 0

    def second_fails(samples, advantages):
        nonlocal calls
        calls += 1
        if calls == 2:
            for p in m.parameters():  # what a NaN loss leaves: the norm check then refuses it
                p.grad = torch.full_like(p, math.nan)
            raise NonFiniteGradient("non-finite gradient norm (nan); update skipped")
        return real(samples, advantages)

    before = {k: v.clone() for k, v in m.state_dict().items()}
    t._update = second_fails  # type: ignore[method-assign]
    with pytest.raises(NonFiniteGradient, match="1 earlier mini-batch update") as e:
        t.step(batch)
    assert isinstance(e.value, TrainerError) and "do not publish" in str(e.value)
    assert t.version == 0
    assert any(not torch.equal(before[k], v) for k, v in m.state_dict().items())  # as it says

    # the first update's failure is that update's alone: nothing was applied
    t2 = TorchTrainer(model(), TorchTrainerConfig(lr=1e-2, mini_batch_size=1))
    t2._update = lambda s, a: (_ for _ in ()).throw(
        NonFiniteGradient("non-finite gradient norm (inf); update skipped")
    )  # type: ignore[method-assign]
    with pytest.raises(NonFiniteGradient) as e2:
        t2.step(batch)
    assert "earlier" not in str(e2.value)


def test_minibatch_updates_averages_the_updates_made_and_counts_them():
    from core.trainer.base import minibatch_updates

    m = model()
    batch = [sample(m, [1, 2], [3], a) for a in (1.0, -1.0, 0.5, 0.0, 2.0)]
    seen: list[int] = []

    def update(samples, advantages):
        seen.append(len(samples))
        return None if len(samples) == 1 else {"loss": float(len(samples))}

    out = minibatch_updates(
        update, batch, [1.0] * 5, size=2, epochs=2, shuffle=torch.Generator().manual_seed(0)
    )
    assert seen == [2, 2, 1, 2, 2, 1]  # the last mini-batch of each pass is the remainder
    assert out == {"loss": 2.0, "tokens": 5.0, "updates": 4.0}
