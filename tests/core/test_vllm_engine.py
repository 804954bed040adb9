"""The vllm backend. Everywhere: the module imports without vLLM, a missing vLLM is a clear
error, configs are checked at the edge, and the pure mappings (request -> SamplingParams
keywords, chat -> prompt ids, state -> weight chunks) and the engine's own bookkeeping (delta
accumulation, abort, drain/in-flight suspend, weight loading calls) run against a stand-in
for vLLM's ``AsyncLLM``. Against real vLLM on a CUDA device (``pytest.mark.gpu``, skipped
without one): logprobs, allowed_token_ids, abort and weight loading on a small HF model
(``RL_FABRIC_VLLM_TEST_MODEL``, default Qwen/Qwen2.5-0.5B-Instruct, from the local HF cache;
offline, ``benchmarks/gpu/make_tiny_hf_model.py DIR`` builds a tiny one to point it at)."""

from __future__ import annotations

import asyncio
import enum
import os
import subprocess
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from core.rollout.engines import vllm_
from core.rollout.engines.base import EngineError, GenerateRequest, PromptTooLongError, engine_registry
from core.rollout.engines.vllm_ import (
    LOAD_METHOD,
    VLLMEngine,
    VLLMEngineConfig,
    render_chat,
    sampling_params_kwargs,
    weight_chunks,
)
from core.rollout.replicas import make_engine
from fabric.protocol import Message

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:
    HAVE_VLLM = False

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAVE_VLLM),
    reason="needs a CUDA device and vLLM (pip install 'rl-fabric[vllm]')",
)
GPU_MODEL = os.environ.get("RL_FABRIC_VLLM_TEST_MODEL", "Qwen/Qwen2.5-0.5B-Instruct")


# -- stand-ins for vLLM --------------------------------------------------------------------


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm`` and ``vllm.sampling_params`` as the engine imports them (only those names)."""

    class RequestOutputKind(enum.Enum):
        CUMULATIVE = 0
        DELTA = 1
        FINAL_ONLY = 2

    class SamplingParams:
        def __init__(self, **kw: Any):
            self.__dict__.update(kw)

    pkg = types.ModuleType("vllm")
    sp = types.ModuleType("vllm.sampling_params")
    sp.RequestOutputKind = RequestOutputKind  # type: ignore[attr-defined]
    sp.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    pkg.sampling_params = sp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", pkg)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    return SimpleNamespace(RequestOutputKind=RequestOutputKind)


class FakeLLM:
    """An ``AsyncLLM`` stand-in: streams one delta per token (ids 10, 11, ... or cycling
    through ``allowed_token_ids``), logprob ``-0.25 * position``; ends with ``length``, or
    ``stop`` at the third token when the request has stop strings."""

    def __init__(self, *, max_model_len: int = 64, token_delay: float = 0.0):
        self.model_config = SimpleNamespace(max_model_len=max_model_len)
        self.token_delay = token_delay
        self.params: dict[str, Any] = {}
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.rpcs: list[tuple[str, tuple[Any, ...]]] = []
        self.running_at_rpc: list[int] = []
        self.resets = 0
        self.shutdowns = 0
        self.running = 0
        self.fail: Exception | None = None

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str):
        self.params[request_id] = params
        self.prompts[request_id] = list(prompt["prompt_token_ids"])
        if self.fail is not None:
            raise self.fail
        self.running += 1
        try:
            for i in range(params.max_tokens):
                await asyncio.sleep(self.token_delay)
                allowed = params.allowed_token_ids
                tok = allowed[i % len(allowed)] if allowed else 10 + i
                reason = (
                    "stop" if params.stop and i == 2 else "length" if i == params.max_tokens - 1 else None
                )
                delta = SimpleNamespace(
                    text=f"w{tok} ",
                    token_ids=[tok],
                    logprobs=[{tok: SimpleNamespace(logprob=-0.25 * (i + 1))}],
                    finish_reason=reason,
                )
                yield SimpleNamespace(finished=reason is not None, outputs=[delta])
                if reason is not None:
                    return
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None):
        self.rpcs.append((method, args))
        self.running_at_rpc.append(self.running)
        if self.fail is not None:
            raise self.fail
        return [len(vllm_.unpack_weights(args[0]))]

    async def reset_prefix_cache(self) -> bool:
        self.resets += 1
        return True

    def shutdown(self) -> None:
        self.shutdowns += 1


class FakeTokenizer:
    def apply_chat_template(self, chat: list[dict[str, Any]], *, tokenize: bool, add_generation_prompt: bool):
        assert tokenize is False and add_generation_prompt is True
        assert all("policy_version" not in m for m in chat)
        return "".join(f"<{m['role']}>{m['content']}" for m in chat) + "<assistant>"

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        assert add_special_tokens is False
        return [ord(c) % 50 for c in text]


def engine(llm: FakeLLM, **options: Any) -> VLLMEngine:
    return VLLMEngine(model="fake/model", llm=llm, tokenizer=FakeTokenizer(), **options)


def chat(text: str = "hi", **kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=[Message(role="user", content=text)], **kw)


# -- everywhere: import, config, pure mappings ----------------------------------------------


def test_registered_and_imports_without_vllm():
    assert "vllm" in engine_registry and engine_registry.get("vllm") is VLLMEngine
    code = (
        "import sys, core.rollout.engines.vllm_\n"
        "assert 'vllm' not in sys.modules and 'transformers' not in sys.modules, 'eager import'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_vllm_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(EngineError, match=r"needs vLLM: pip install 'rl-fabric\[vllm\]'"):
        VLLMEngine(model="Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(EngineError, match=r"pip install 'rl-fabric\[vllm\]'"):
        make_engine("vllm", None, {"gpu_memory_utilization": 0.5}, seed=0, model="m")


def test_config_at_the_edge(fake_vllm):
    e = VLLMEngine(model="m", gpu_memory_utilization=0.5, max_model_len=2048, inflight_weight_updates=True)
    assert e.config.inflight_weight_updates and e.config.model == "m"
    assert e.config.engine_args == {"gpu_memory_utilization": 0.5, "max_model_len": 2048}
    e = VLLMEngine(model="m", engine_args={"dtype": "bfloat16"}, enforce_eager=True)
    assert e.config.engine_args == {"dtype": "bfloat16", "enforce_eager": True}
    with pytest.raises(
        EngineError, match=r"engine_args: may not set logprobs_mode \(the engine needs processed_logprobs"
    ):
        VLLMEngine(model="m", logprobs_mode="raw_logprobs")
    with pytest.raises(EngineError, match="may not set worker_extension_cls"):
        VLLMEngine(model="m", engine_args={"worker_extension_cls": "x.Y"})
    with pytest.raises(EngineError, match="weight_chunk_mb: Input should be greater than 0"):
        VLLMEngine(model="m", weight_chunk_mb=0)
    with pytest.raises(EngineError, match="model: Field required"):
        VLLMEngine()
    with pytest.raises(EngineError, match="not both"):
        VLLMEngine(VLLMEngineConfig(model="m"), max_model_len=8)
    # config errors need no vLLM: they come first
    assert VLLMEngineConfig(model="m").engine_args == {}


def test_request_to_sampling_params():
    req = GenerateRequest(
        prompt_ids=[1, 2], max_new_tokens=32, temperature=0.7, stop=["\n\n"], seed=5, allowed_token_ids=[3, 4]
    )
    assert sampling_params_kwargs(req) == {
        "n": 1,
        "max_tokens": 32,
        "temperature": 0.7,
        "stop": ["\n\n"],
        "seed": 5,
        "logprobs": 0,
        "allowed_token_ids": [3, 4],
    }
    assert sampling_params_kwargs(req, room=10)["max_tokens"] == 10  # never past the context
    plain = sampling_params_kwargs(GenerateRequest(prompt_ids=[1], temperature=0.0))
    assert plain["stop"] is None and plain["seed"] is None and plain["allowed_token_ids"] is None
    assert plain["temperature"] == 0.0 and plain["max_tokens"] == 64


def test_render_chat_drops_our_stamp():
    msgs = [Message(role="user", content="ab"), Message(role="assistant", content="c", policy_version=4)]
    assert render_chat(FakeTokenizer(), msgs) == [ord(c) % 50 for c in "<user>ab<assistant>c<assistant>"]


def test_weight_chunks():
    state = {
        "a": torch.zeros(4),
        "b": torch.zeros(4, dtype=torch.float16),
        "c": torch.zeros(16),
        "d": torch.zeros(1),
    }
    chunks = weight_chunks(state, max_bytes=24)
    assert [[n for n, _ in c] for c in chunks] == [["a", "b"], ["c"], ["d"]]  # c (64 B) goes alone
    assert all(t.device.type == "cpu" and t.is_contiguous() for c in chunks for _, t in c)
    assert weight_chunks({"t": torch.ones(2, 3).t()}, 1 << 20)[0][0][1].is_contiguous()
    with pytest.raises(EngineError, match=r"'x' is a list, not a torch\.Tensor"):
        weight_chunks({"x": [1.0]}, 100)


# -- the engine against a stand-in AsyncLLM -------------------------------------------------


async def test_generate_accumulates_deltas(fake_vllm):
    llm = FakeLLM()
    async with engine(llm) as e:
        c = await e.generate(chat("hello", max_new_tokens=4, metadata={"t": 1}))
        s = await e.generate(chat(stop=["w12"], max_new_tokens=10))
    assert c.prompt_ids == render_chat(FakeTokenizer(), [Message(role="user", content="hello")])
    assert llm.prompts[c.request_id] == c.prompt_ids
    assert c.token_ids == [10, 11, 12, 13] and c.logprobs == [-0.25, -0.5, -0.75, -1.0]
    assert (c.text, c.finish_reason, c.policy_version, c.metadata) == (
        "w10 w11 w12 w13 ",
        "length",
        0,
        {"t": 1},
    )
    params = llm.params[c.request_id]
    assert params.output_kind is fake_vllm.RequestOutputKind.DELTA and params.logprobs == 0
    assert s.finish_reason == "stop" and s.token_ids == [10, 11, 12]
    assert e.stats["requests"] == 2 and e.stats["tokens"] == 7


async def test_context_limits_and_allowed_ids(fake_vllm):
    llm = FakeLLM(max_model_len=64)
    async with engine(llm) as e:
        c = await e.generate(GenerateRequest(prompt_ids=list(range(60)), max_new_tokens=10))
        assert len(c.token_ids) == 4 and llm.params[c.request_id].max_tokens == 4
        with pytest.raises(PromptTooLongError, match="prompt is 64 tokens; the model's context is 64"):
            await e.generate(GenerateRequest(prompt_ids=list(range(64))))
        r = await e.generate(chat(allowed_token_ids=[7, 9], max_new_tokens=3))
        assert r.token_ids == [7, 9, 7] and r.allowed_token_ids == [7, 9]
        assert llm.params[r.request_id].allowed_token_ids == [7, 9]


async def test_abort_returns_what_was_generated(fake_vllm):
    llm = FakeLLM(token_delay=0.01)
    async with engine(llm) as e:
        req = chat(max_new_tokens=500)
        task = asyncio.create_task(e.generate(req))
        await asyncio.sleep(0.1)
        assert await e.abort(req.request_id)
        c = await task
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 500
        assert len(c.logprobs) == len(c.token_ids) and c.text.startswith("w10 ")
        assert llm.aborted == [req.request_id] and llm.cancelled == [req.request_id]
        assert not await e.abort(req.request_id) and e.stats["aborts"] == 1
        assert (await e.generate(chat(max_new_tokens=2))).finish_reason == "length"  # still serving


async def test_drain_suspend_then_load_weights(fake_vllm):
    llm = FakeLLM(token_delay=0.01)
    async with engine(llm, weight_chunk_mb=12 / 2**20) as e:  # 12 bytes: three float32 a chunk
        first = asyncio.create_task(e.generate(chat(max_new_tokens=15)))
        await asyncio.sleep(0.03)
        suspending = asyncio.create_task(e.suspend())
        await asyncio.sleep(0.03)
        assert not suspending.done()  # the turn in vLLM runs to its end first
        later = asyncio.create_task(e.generate(chat(max_new_tokens=2)))
        await suspending
        assert first.done() and not later.done() and llm.running == 0
        state = {"w": torch.ones(3), "v": torch.arange(6, dtype=torch.float32)}
        await e.load_weights(state, version=1)
        await e.resume()
        assert (await first).policy_version == 0 and (await later).policy_version == 1
    assert [m for m, _ in llm.rpcs] == [LOAD_METHOD, LOAD_METHOD]
    (w,), (v,) = (vllm_.unpack_weights(args[0]) for _, args in llm.rpcs)
    assert w[0] == "w" and torch.equal(w[1], torch.ones(3)) and v[0] == "v"
    assert llm.running_at_rpc == [0, 0] and llm.resets == 1 and e.stats["weight_loads"] == 1


async def test_inflight_weight_updates_do_not_wait(fake_vllm):
    llm = FakeLLM(token_delay=0.01)
    async with engine(llm, inflight_weight_updates=True) as e:
        turn = asyncio.create_task(e.generate(chat(max_new_tokens=20)))
        await asyncio.sleep(0.03)
        await asyncio.wait_for(e.suspend(), 0.05)  # returns at once
        await e.load_weights({"w": torch.ones(1)}, version=1)
        await e.resume()
        assert llm.running_at_rpc == [1]  # loaded while the turn ran
        c = await turn
        assert c.policy_version == 0 and c.finish_reason == "length"  # the version it started under


async def test_vllm_errors_become_engine_errors(fake_vllm):
    llm = FakeLLM()
    async with engine(llm) as e:
        llm.fail = ValueError("token id 999999 is out of vocabulary")
        with pytest.raises(EngineError, match="vLLM rejected the request: token id 999999"):
            await e.generate(chat())
        llm.fail = RuntimeError("size mismatch for lm_head.weight")
        with pytest.raises(EngineError, match=r"could not load the weights.*size mismatch.*Hugging Face"):
            await e.load_weights({"lm_head.weight": torch.zeros(2)}, version=1)
        assert e.version == 0 and e.num_inflight == 0


async def test_a_request_vllm_033_refuses_is_a_rejection(fake_vllm, monkeypatch):
    # vLLM 0.33's VLLMValidationError is a VLLMClientError, no longer a ValueError, and
    # AsyncLLM.generate re-raises it as it is (vllm/exceptions.py, v1/engine/async_llm.py)
    exceptions = types.ModuleType("vllm.exceptions")

    class VLLMClientError(Exception):
        pass

    class VLLMValidationError(VLLMClientError):
        pass

    exceptions.VLLMClientError = VLLMClientError  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.exceptions", exceptions)
    llm = FakeLLM()
    llm.fail = VLLMValidationError("allowed_token_ids contains out-of-vocab token id!")
    async with engine(llm) as e:
        with pytest.raises(EngineError, match="vLLM rejected the request: allowed_token_ids contains"):
            await e.generate(chat(allowed_token_ids=[7]))


class MalformedLLM(FakeLLM):
    """Streams a delta with two tokens and one logprob, then would go on; its cleanup awaits,
    as ``AsyncLLM.generate``'s does (``await self.abort(...)`` on ``GeneratorExit``)."""

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str):
        try:
            logprobs = [{10: SimpleNamespace(logprob=-1.0)}]
            delta = SimpleNamespace(text="a", token_ids=[10, 11], logprobs=logprobs, finish_reason=None)
            yield SimpleNamespace(finished=False, outputs=[delta])
            await asyncio.sleep(60)
        except GeneratorExit:
            await asyncio.sleep(0)  # vLLM's abort goes to its engine core first
            await self.abort(request_id)
            raise


async def test_a_turn_that_fails_mid_stream_ends_its_vllm_request_first(fake_vllm):
    # left to the garbage collector, vLLM's generator is closed (and its request aborted) in a
    # task of its own, after the turn has returned: a drain could load weights while it runs
    llm = MalformedLLM()
    async with engine(llm) as e:
        req = chat()
        with pytest.raises(EngineError, match="vLLM returned 2 tokens with 1 logprobs"):
            await e.generate(req)
        assert llm.aborted == [req.request_id]


async def test_an_owned_engine_is_built_on_start_and_shut_down(fake_vllm, monkeypatch):
    built: list[VLLMEngineConfig] = []
    llm = FakeLLM()

    def build(cfg: VLLMEngineConfig) -> FakeLLM:
        built.append(cfg)
        return llm

    monkeypatch.setattr(vllm_, "_build_llm", build)
    monkeypatch.setattr(vllm_, "_hf_tokenizer", lambda name, trust: FakeTokenizer())
    e = make_engine("vllm", None, {"max_model_len": 64}, seed=0, model="fake/model")
    assert isinstance(e, VLLMEngine) and built == []  # nothing heavy before start
    async with e:
        assert (await e.generate(chat(max_new_tokens=1))).token_ids == [10]
    assert built[0].engine_args == {"max_model_len": 64} and llm.shutdowns == 1
    shared = FakeLLM()
    async with engine(shared):
        pass  # only entering and leaving are under test
    assert shared.shutdowns == 0  # a caller's AsyncLLM stays the caller's


def _fake_vllm_tree(monkeypatch, async_llm: types.ModuleType | None) -> types.ModuleType:
    """``vllm`` with ``engine.arg_utils`` and, unless None, ``v1.engine.async_llm``."""
    pkg = types.ModuleType("vllm")
    args = types.ModuleType("vllm.engine.arg_utils")
    args.AsyncEngineArgs = lambda **kw: kw  # type: ignore[attr-defined]

    class OldEngine:
        @staticmethod
        def from_engine_args(a: Any) -> str:
            return "old engine"

    pkg.AsyncLLMEngine = OldEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", pkg)
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", args)
    for name in ("vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm"):
        monkeypatch.setitem(sys.modules, name, None if async_llm is None else types.ModuleType(name))
    if async_llm is not None:
        monkeypatch.setitem(sys.modules, "vllm.v1.engine.async_llm", async_llm)
    return pkg


def test_only_a_vllm_without_the_v1_engine_falls_back_to_the_old_one(monkeypatch):
    cfg = VLLMEngineConfig(model="m")
    _fake_vllm_tree(monkeypatch, async_llm=None)  # import vllm.v1... -> ModuleNotFoundError
    assert vllm_._build_llm(cfg) == "old engine"

    class Broken(types.ModuleType):
        def __getattr__(self, name: str) -> Any:  # the V1 module is there, a dependency is not
            raise ModuleNotFoundError("No module named 'llguidance'", name="llguidance")

    _fake_vllm_tree(monkeypatch, async_llm=Broken("vllm.v1.engine.async_llm"))
    with pytest.raises(ModuleNotFoundError, match="llguidance"):
        vllm_._build_llm(cfg)


# -- on a GPU with vLLM ---------------------------------------------------------------------


def _gpu_engine(**options: Any) -> VLLMEngine:
    options.setdefault("gpu_memory_utilization", 0.3)
    options.setdefault("max_model_len", 1024)
    options.setdefault("enforce_eager", True)
    return VLLMEngine(model=GPU_MODEL, **options)


def _reference_logprobs(
    model: Any, prompt: list[int], tokens: list[int], temperature: float, allowed: list[int] | None
):
    """Log-probabilities of ``tokens`` after ``prompt`` under the HF model, restricted and
    tempered as the engine's contract says (greedy: untempered)."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logits = logits / (temperature or 1.0)
    if allowed is not None:
        mask = torch.full_like(logits, float("-inf"))
        mask[:, allowed] = 0
        logits = logits + mask
    logp = torch.log_softmax(logits, -1)
    return [float(logp[i, t]) for i, t in enumerate(tokens)]


@pytest.mark.gpu
@needs_gpu
async def test_gpu_logprobs_allowed_ids_and_abort():
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(GPU_MODEL, dtype=torch.float32).cuda().eval()
    async with _gpu_engine() as e:
        greedy = await e.generate(chat("Count from 1 to 20.", temperature=0.0, max_new_tokens=24))
        assert greedy.finish_reason in ("stop", "length") and greedy.text and len(greedy.token_ids) > 4
        want = _reference_logprobs(ref, greedy.prompt_ids, greedy.token_ids, 0.0, None)
        assert greedy.logprobs == pytest.approx(want, abs=0.05)

        allowed = e.tokenizer.encode(" left right up down", add_special_tokens=False)
        r = await e.generate(
            chat("Move:", temperature=0.8, max_new_tokens=6, allowed_token_ids=allowed, seed=1)
        )
        assert set(r.token_ids) <= set(allowed)
        want = _reference_logprobs(ref, r.prompt_ids, r.token_ids, 0.8, allowed)
        assert r.logprobs == pytest.approx(want, abs=0.05)  # renormalised over the allowed ids

        req = chat("Write a long story about a frozen lake.", max_new_tokens=900)
        task = asyncio.create_task(e.generate(req))
        await asyncio.sleep(0.5)
        assert await e.abort(req.request_id)
        c = await asyncio.wait_for(task, 10)
        assert c.finish_reason == "abort" and len(c.token_ids) < 900 and len(c.logprobs) == len(c.token_ids)


@pytest.mark.gpu
@needs_gpu
async def test_gpu_weights_load_between_versions():
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(GPU_MODEL, dtype=torch.bfloat16).state_dict()
    broken = {k: (torch.zeros_like(v) if "mlp.down_proj" in k else v) for k, v in state.items()}
    req = dict(temperature=0.0, max_new_tokens=16)
    async with _gpu_engine() as e:
        before = await e.generate(chat("The capital of France is", **req))
        long = asyncio.create_task(e.generate(chat("Tell me about Paris.", max_new_tokens=200)))
        await asyncio.sleep(0.2)
        await e.suspend()  # drains: the long turn ends under version 0
        assert long.done() and (await long).policy_version == 0
        await e.load_weights(broken, version=1)
        await e.resume()
        changed = await e.generate(chat("The capital of France is", **req))
        assert changed.policy_version == 1 and changed.token_ids != before.token_ids
        await e.suspend()
        await e.load_weights(state, version=2)
        await e.resume()
        again = await e.generate(chat("The capital of France is", **req))
        assert again.policy_version == 2 and again.token_ids == before.token_ids
