import asyncio

import pytest
import torch
from pydantic import ValidationError
from tiny_models import stopless

from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import (
    Completion,
    EngineClosedError,
    EngineError,
    EngineRegistry,
    GenerateRequest,
    PromptTooLongError,
    UnknownEngineError,
    engine_registry,
)
from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig

WORDS = "left right up down you are at row column the lake is frozen hole goal start walk safe".split()


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer(WORDS)


def make_model(tok: WordTokenizer, seed: int = 0, max_len: int = 64) -> TinyLM:
    return TinyLM(
        TinyLMConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, max_len=max_len), seed=seed
    )


def engine(model: TinyLM, tok: WordTokenizer, **cfg) -> TorchEngine:
    return TorchEngine(model, tok, TorchEngineConfig(num_threads=1, **cfg))


def req(prompt: list[int], **kw) -> GenerateRequest:
    return GenerateRequest(prompt_ids=prompt, **kw)


def direct_logprobs(model: TinyLM, c: Completion, temperature: float = 1.0) -> list[float]:
    seq = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(seq)[0] / temperature, -1)
    n = len(c.prompt_ids)
    return [float(logp[n - 1 + j, t]) for j, t in enumerate(c.token_ids)]


async def wait_for(cond) -> None:
    """Until the engine has got that far (its counters move in its own task)."""
    async with asyncio.timeout(5):
        while not cond():  # noqa: ASYNC110 - the engine exposes counters, not events
            await asyncio.sleep(0.001)


async def test_concurrent_requests_share_forward_passes(tok):
    model = stopless(make_model(tok), tok)
    async with engine(model, tok) as eng:
        prompts = [[2, 5, 9 + i % 7] * (1 + i % 3) for i in range(8)]  # lengths 3, 6, 9: padding
        cs = await asyncio.gather(
            *(eng.generate(req(p, max_new_tokens=4, seed=i)) for i, p in enumerate(prompts))
        )
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for c in cs)
    # one prefill for all 8, then 3 decode steps for all 8: 4 passes, not 32
    assert eng.stats == {
        "forward_passes": 4,
        "prefill_rows": 8,
        "prefill_shared": 0,
        "decode_rows": 24,
        "tokens": 32,
    }


async def test_logprobs_match_a_direct_forward(tok):
    model = make_model(tok, seed=1)
    async with engine(model, tok) as eng:
        prompts = [[2, 5, 10, 11, 12], [2, 5, 13], [2, 5, 14, 15, 16, 17, 18, 9]]
        hot = await asyncio.gather(*(eng.generate(req(p, max_new_tokens=6, seed=3)) for p in prompts))
        warm = await eng.generate(req(prompts[0], max_new_tokens=6, temperature=0.7, seed=3))
        greedy = await eng.generate(req(prompts[1], max_new_tokens=6, temperature=0.0))
    for c in hot:
        assert c.logprobs == pytest.approx(direct_logprobs(model, c), abs=1e-4)
    assert warm.logprobs == pytest.approx(direct_logprobs(model, warm, temperature=0.7), abs=1e-4)
    assert greedy.logprobs == pytest.approx(direct_logprobs(model, greedy), abs=1e-4)
    seq = torch.tensor([greedy.prompt_ids + greedy.token_ids])
    with torch.no_grad():
        argmax = model(seq)[0].argmax(-1).tolist()
    n = len(greedy.prompt_ids)
    assert greedy.token_ids == argmax[n - 1 : n - 1 + len(greedy.token_ids)]


async def test_seeded_requests_repeat_and_messages_use_the_chat_template(tok):
    model = make_model(tok)
    msgs = [{"role": "user", "content": "you are at the lake"}]
    async with engine(model, tok) as eng:
        a = await eng.generate(GenerateRequest(messages=msgs, max_new_tokens=5, seed=11))
        b = await eng.generate(GenerateRequest(messages=msgs, max_new_tokens=5, seed=11))
    assert a.prompt_ids == tok.encode_chat(msgs)
    assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)


async def test_stop_token_and_stop_strings(tok):
    model = make_model(tok)
    with torch.no_grad():  # make <|end|> the certain first reply
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.embed.weight[tok.end_id] = 5.0
    async with engine(model, tok) as eng:
        c = await eng.generate(req([2, 5], max_new_tokens=8))
    assert (c.token_ids, c.text, c.finish_reason) == ([tok.end_id], "", "stop")

    model = stopless(make_model(tok), tok)
    async with engine(model, tok) as eng:
        first = await eng.generate(req([2, 5, 9], max_new_tokens=1, temperature=0.0))
        word = tok.decode(first.token_ids)
        c = await eng.generate(req([2, 5, 9], max_new_tokens=8, temperature=0.0, stop=[word]))
    assert c.finish_reason == "stop" and c.token_ids == first.token_ids and c.text == ""


async def test_abort_in_flight_returns_what_was_generated(tok):
    model = stopless(make_model(tok), tok)
    async with engine(model, tok) as eng:
        task = asyncio.create_task(eng.generate(req([2, 5, 9], max_new_tokens=50, request_id="long")))
        other = asyncio.create_task(eng.generate(req([2, 5, 10], max_new_tokens=5)))
        await wait_for(lambda: eng.stats["tokens"] >= 6)
        assert await eng.abort("long") is True
        c = await task
        assert c.finish_reason == "abort" and 1 <= len(c.token_ids) < 50
        assert len(c.logprobs) == len(c.token_ids)
        assert (await other).finish_reason == "length"  # the batch goes on without it
        assert await eng.abort("long") is False  # finished: idempotent
        assert await eng.abort("never-sent") is False
        assert eng.num_inflight == 0


async def test_abort_while_waiting_at_the_suspended_gate(tok):
    model = make_model(tok)
    async with engine(model, tok) as eng:
        await eng.suspend()
        task = asyncio.create_task(eng.generate(req([2, 5], request_id="queued")))
        await asyncio.sleep(0.02)
        assert await eng.abort("queued")
        c = await task
        assert (c.finish_reason, c.token_ids) == ("abort", [])
        await eng.resume()


async def test_suspend_blocks_new_and_running_work_until_resume(tok):
    model = stopless(make_model(tok), tok)
    async with engine(model, tok) as eng:
        running = asyncio.create_task(eng.generate(req([2, 5, 9], max_new_tokens=30)))
        await wait_for(lambda: eng.stats["tokens"] >= 2)
        await eng.suspend()
        assert eng.suspended
        frozen = eng.stats["tokens"]
        new = asyncio.create_task(eng.generate(req([2, 5, 10], max_new_tokens=3)))
        await asyncio.sleep(0.05)
        assert not running.done() and not new.done()
        assert eng.stats["tokens"] == frozen  # no step ran while suspended
        await eng.resume()
        assert len((await running).token_ids) == 30
        assert len((await new).token_ids) == 3


async def test_version_stamping_and_load_weights_change_outputs(tok):
    model = make_model(tok, seed=0)
    other = make_model(tok, seed=1)
    async with engine(model, tok, seed=0) as eng:
        assert eng.version == 0
        before = await eng.generate(req([2, 5, 9, 10], max_new_tokens=4, temperature=0.0))
        await eng.suspend()
        await eng.load_weights(other.state_dict(), version=7)
        await eng.resume()
        assert eng.version == 7
        after = await eng.generate(req([2, 5, 9, 10], max_new_tokens=4, temperature=0.0))
        with pytest.raises(EngineError, match="older"):
            await eng.load_weights(model.state_dict(), version=3)
        with pytest.raises(EngineError, match="do not fit"):
            await eng.load_weights({"embed.weight": torch.zeros(3, 3)}, version=8)
    assert (before.policy_version, after.policy_version) == (0, 7)
    assert before.logprobs != pytest.approx(after.logprobs, abs=1e-3)
    assert after.logprobs == pytest.approx(direct_logprobs(other, after), abs=1e-4)


async def test_new_weights_mid_turn_reread_the_prefix(tok):
    old = stopless(make_model(tok, seed=0), tok)
    new = stopless(make_model(tok, seed=1), tok)
    async with engine(old, tok) as eng:
        task = asyncio.create_task(eng.generate(req([2, 5, 9], max_new_tokens=12, request_id="r")))
        await wait_for(lambda: eng.stats["tokens"] >= 3)
        await eng.suspend()
        n_old = len(eng._by_id["r"].out)
        await eng.load_weights(new.state_dict(), version=1)
        await eng.resume()
        c = await task
    assert c.policy_version == 0  # the oldest version that produced a token
    assert 3 <= n_old < 12
    # each token's logprob is under the weights that sampled it
    assert c.logprobs[:n_old] == pytest.approx(direct_logprobs(old, c)[:n_old], abs=1e-4)
    assert c.logprobs[n_old:] == pytest.approx(direct_logprobs(new, c)[n_old:], abs=1e-4)


async def test_engine_owns_a_copy_of_the_weights(tok):
    model = make_model(tok)
    async with engine(model, tok) as eng:
        a = await eng.generate(req([2, 5], max_new_tokens=3, seed=1))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the trainer stepping its model must not leak into rollouts
        b = await eng.generate(req([2, 5], max_new_tokens=3, seed=1))
    assert a.logprobs == b.logprobs


async def test_cancelled_caller_leaves_nothing_behind(tok):
    model = stopless(make_model(tok), tok)
    async with engine(model, tok) as eng:
        task = asyncio.create_task(eng.generate(req([2, 5], max_new_tokens=40)))
        await wait_for(lambda: eng.stats["tokens"] >= 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert eng.num_inflight == 0 and not eng._by_id and not eng._active
        c = await eng.generate(req([2, 5], max_new_tokens=2))
        assert len(c.token_ids) == 2


async def test_close_aborts_in_flight_and_refuses_new_work(tok):
    model = stopless(make_model(tok), tok)
    eng = engine(model, tok)
    await eng.start()
    task = asyncio.create_task(eng.generate(req([2, 5], max_new_tokens=50)))
    await wait_for(lambda: eng.stats["tokens"] >= 1)
    await eng.aclose()
    assert (await task).finish_reason == "abort"
    with pytest.raises(EngineClosedError):
        await eng.generate(req([2, 5]))


async def test_bad_requests_are_clear_errors(tok):
    model = make_model(tok, max_len=16)
    async with engine(model, tok) as eng:
        with pytest.raises(PromptTooLongError, match="16"):
            await eng.generate(req([2] * 16))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await eng.generate(req([2, 999]))
        long = await eng.generate(req([2] * 14, max_new_tokens=10))
        assert len(long.token_ids) <= 2  # the context ends the turn before max_new_tokens
    with pytest.raises(ValidationError, match="exactly one of messages or prompt_ids"):
        GenerateRequest(prompt_ids=[1], messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest()
    with pytest.raises(ValueError, match="vocab_size"):
        TorchEngine(make_model(WordTokenizer(WORDS[:3])), tok)


async def test_duplicate_request_ids_are_refused(tok):
    model = stopless(make_model(tok), tok)
    async with engine(model, tok) as eng:
        task = asyncio.create_task(eng.generate(req([2, 5], max_new_tokens=30, request_id="same")))
        await wait_for(lambda: eng.num_inflight == 1)
        with pytest.raises(EngineError, match="already in flight"):
            await eng.generate(req([2, 5], request_id="same"))
        await eng.abort("same")
        await task


def test_registry(tok):
    assert "torch" in engine_registry and engine_registry.get("torch") is TorchEngine
    reg = EngineRegistry()
    reg.register("torch", "core.rollout.engines.torch_:TorchEngine")
    eng = reg.create("torch", model=make_model(tok), tokenizer=tok)
    assert isinstance(eng, TorchEngine) and eng.name == "torch"
    with pytest.raises(UnknownEngineError, match="unknown engine 'vllm'; known engines: torch"):
        reg.get("vllm")
    reg.register("broken", "core.rollout.engines.nope:Engine")
    with pytest.raises(EngineError, match="cannot load engine 'broken'"):
        reg.get("broken")
    with pytest.raises(EngineError, match="already registered"):
        reg.register("torch", "somewhere:Else")


async def test_requests_with_the_same_prompt_share_one_prefill_row(tok):
    # a group's members ask for their first turn together with the same prompt: the prefill
    # runs that prompt once, and each member samples from it with its own generator
    model = make_model(tok, seed=1)
    rows: list[int] = []
    async with engine(model, tok) as eng:
        # (the engine runs forward_cached, which module hooks do not see; the embedding they do)
        eng.model.embed.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[0]))
        prompts = [[2, 5, 10], [2, 5, 10], [2, 5, 13, 14], [2, 5, 10], [2, 5, 13, 14], [3]]
        cs = await asyncio.gather(
            *(eng.generate(req(p, max_new_tokens=3, seed=i)) for i, p in enumerate(prompts))
        )
    assert rows[0] == 3  # the prefill: three distinct prompts
    assert eng.stats["prefill_rows"] == 6 and eng.stats["prefill_shared"] == 3
    for c, p in zip(cs, prompts, strict=True):
        assert c.prompt_ids == p and c.token_ids
        assert c.logprobs == pytest.approx(direct_logprobs(model, c), abs=1e-4)
    # each drew its tokens with its own generator: what it would have drawn alone
    for i in (0, 2, 5):
        assert cs[i].token_ids == (await _alone(model, tok, prompts[i], seed=i)).token_ids


async def _alone(model: TinyLM, tok: WordTokenizer, prompt: list[int], *, seed: int) -> Completion:
    async with engine(model, tok) as eng:
        return await eng.generate(req(prompt, max_new_tokens=3, seed=seed))
