"""``VLLMEngine``: the policy served in-process by vLLM's asynchronous engine, for the GPU path.

    engine = VLLMEngine(model="Qwen/Qwen2.5-0.5B-Instruct", gpu_memory_utilization=0.5)
    async with engine:
        c = await engine.generate(GenerateRequest(messages=[...], allowed_token_ids=[...]))

vLLM and its CUDA stack are imported lazily (this module imports without them); a missing
install is an ``EngineError`` naming ``pip install 'rl-fabric[vllm]'``. Written against the V1
engine of vLLM 0.10.2-0.11 (``vllm.v1.engine.async_llm.AsyncLLM``; older releases expose the
same methods as ``vllm.AsyncLLMEngine``, used as a fallback); weight loading and generation
run on an H100 with vLLM 0.24.0. Each call below was also read against the sources of 0.24.0
and 0.33.0 (the newest read: the pin has no upper bound; never run on a GPU): same names,
signatures and meaning. The vLLM API it relies on:

* ``AsyncLLM.from_engine_args(AsyncEngineArgs(model=..., seed=..., logprobs_mode=...,
  worker_extension_cls=..., **engine_args))``; ``shutdown()`` on close;
* ``generate({"prompt_token_ids": ids}, SamplingParams(...), request_id)``, an async stream of
  ``RequestOutput`` deltas (``output_kind=DELTA``): continuous batching is vLLM's own;
* ``abort(request_id)``;
* ``collective_rpc("rl_fabric_load_weights", args=(payload,))``: ``WeightSyncExtension`` below
  is mixed into every worker (``worker_extension_cls``) and calls
  ``worker.model_runner.model.load_weights(weights=[(name, tensor), ...])``, vLLM's own
  checkpoint loader, which shards each full tensor for tensor parallelism. Names are the
  Hugging Face checkpoint's (what ``model.state_dict()`` of the HF model gives); tensors go
  to the workers as CPU tensors, ``weight_chunk_mb`` per call, each chunk ``torch.save``d to
  bytes (``pack_weights``): vLLM's msgpack IPC decodes a utility call's arguments untyped, so
  a bare tensor would reach the worker as a list;
* ``reset_prefix_cache()`` after new weights, so no prompt reuses a KV cache computed under
  the old ones.

Logprobs: ``SamplingParams(logprobs=0)`` returns the sampled token's logprob, and the engine
runs with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2) so it is of the distribution
sampled from: after ``allowed_token_ids`` and temperature, as the base contract says. vLLM's
default (``raw_logprobs``) is the model's raw distribution, wrong for a restricted or
tempered policy.

Chat prompts are rendered with the Hugging Face tokenizer's chat template (to text, then
encoded without extra special tokens, as vLLM's chat entry point does) and sent as token ids,
so the completion's ``prompt_ids`` are exactly what the model read.

Weight updates (``suspend`` / ``load_weights`` / ``resume``), two modes:

* default (drain): ``suspend`` holds new requests at the gate and returns once every turn in
  vLLM has finished; the weights then change under no running request, so each turn is
  entirely under one version. A long turn delays the update.
* ``inflight_weight_updates=True``: ``suspend`` returns at once; vLLM runs each chunk's load
  between two engine steps, and turns in flight continue under the new weights (their KV
  cache was computed under the old ones). A completion's ``policy_version`` is then the
  version its turn started under (the oldest that produced a token), so staleness is never
  understated; its later tokens' logprobs are under the newer weights. With more than one
  chunk (``weight_chunk_mb``, 512 MB: a 0.5B model in fp32 is ~4 chunks, a 7B one ~56),
  vLLM takes engine steps between the chunks, so tokens in between come from a model part
  old, part new (not checked on a GPU; found by review). Where that matters, keep the
  default drain mode, or raise ``weight_chunk_mb`` above the model's size (one chunk).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from core.rollout.engines.base import (
    Completion,
    Engine,
    EngineDeadError,
    EngineError,
    FinishReason,
    GenerateRequest,
    PromptTooLongError,
    options_error,
)
from fabric.protocol import Message

INSTALL_HINT = "pip install 'rl-fabric[vllm]' on a CUDA machine"
#: The worker method ``load_weights`` calls through ``collective_rpc``.
LOAD_METHOD = "rl_fabric_load_weights"
_EXTENSION = f"{__name__}.WeightSyncExtension"  # vLLM resolves "module.Class"

#: Engine args the engine sets itself, and why a job may not.
_RESERVED_ENGINE_ARGS = {
    "model": "give it as the engine's model (engine.model in a job config)",
    "seed": "give it as the engine's seed",
    "tokenizer": "give it as the engine's tokenizer",
    "trust_remote_code": "give it as the engine's trust_remote_code",
    "logprobs_mode": "the engine needs processed_logprobs: logprobs of the distribution sampled from",
    "worker_extension_cls": "the engine installs its own, to load weights",
}


class VLLMEngineConfig(BaseModel):
    """The model and how vLLM serves it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["vllm"] = "vllm"
    model: str = Field(min_length=1)
    """Hugging Face model id or local path."""
    tokenizer: str | None = None
    """Tokenizer (and chat template) id or path; ``None``: the model's."""
    trust_remote_code: bool = False
    seed: int = 0
    """vLLM's seed: requests without their own ``seed`` sample from its seeded stream."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Passed to ``vllm.AsyncEngineArgs`` as they are (``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len``, ``dtype``, ``enable_prefix_caching``...)."""
    inflight_weight_updates: bool = False
    """Load new weights between engine steps without draining the turns in flight (see the
    module docstring); ``False`` waits for them. vLLM cannot reset its prefix cache while
    requests run, so with this on, turn prefix caching off (``enable_prefix_caching=False``)
    or new prompts may reuse KV computed under old weights
    (``stats["prefix_cache_resets_failed"]`` counts the times)."""
    weight_chunk_mb: float = Field(512.0, gt=0)
    """Weights sent to the workers per ``collective_rpc`` call (bounds the IPC message)."""

    @field_validator("engine_args")
    @classmethod
    def _not_ours(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = [f"{k} ({why})" for k, why in _RESERVED_ENGINE_ARGS.items() if k in v]
        if bad:
            raise ValueError(f"may not set {'; '.join(bad)}")
        return v


class WeightSyncExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``), so ``collective_rpc`` can hand
    each worker a chunk of the new weights. Runs in the worker process, where ``self`` is the
    worker (``model_runner`` is its attribute)."""

    def rl_fabric_load_weights(self, payload: bytes) -> int:
        weights = unpack_weights(payload)
        # vLLM's loader maps HF names onto its fused/sharded parameters and copies in place
        self.model_runner.model.load_weights(weights=weights)  # type: ignore[attr-defined]
        return len(weights)


# ----------------------------------------------------------------------------- pure helpers


def sampling_params_kwargs(request: GenerateRequest, *, room: int | None = None) -> dict[str, Any]:
    """``vllm.SamplingParams`` keywords for ``request`` (the engine adds ``output_kind``).

    ``room`` is how many tokens the context has left after the prompt: ``max_tokens`` never
    asks for more. Top-p/top-k stay vLLM's defaults (off): the policy samples from its whole
    distribution, as the trainer assumes. ``logprobs=0`` returns the sampled token's only."""
    max_tokens = request.max_new_tokens if room is None else min(request.max_new_tokens, room)
    return {
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": request.temperature,
        "stop": list(request.stop) or None,
        "seed": request.seed,
        "logprobs": 0,
        "allowed_token_ids": list(request.allowed_token_ids) if request.allowed_token_ids else None,
    }


def render_chat(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """The prompt ids of a chat: the template rendered to text with the generation prompt,
    then encoded without adding special tokens (the template already has its own)."""
    chat = [m.model_dump(exclude_none=True, exclude={"policy_version"}) for m in messages]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def weight_chunks(state: Mapping[str, Any], max_bytes: int) -> list[list[tuple[str, Any]]]:
    """``state`` as lists of ``(name, contiguous CPU tensor)`` of at most ``max_bytes`` each
    (a tensor larger than that goes alone)."""
    import torch

    chunks: list[list[tuple[str, Any]]] = []
    chunk: list[tuple[str, Any]] = []
    size = 0
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise EngineError(f"weight {name!r} is a {type(value).__name__}, not a torch.Tensor")
        t = value.detach().to("cpu").contiguous()  # vLLM's IPC carries CPU tensors only
        n = t.numel() * t.element_size()
        if chunk and size + n > max_bytes:
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append((name, t))
        size += n
    if chunk:
        chunks.append(chunk)
    return chunks


def pack_weights(chunk: Sequence[tuple[str, Any]]) -> bytes:
    """A chunk of ``(name, CPU tensor)`` as ``torch.save`` bytes, what ``collective_rpc`` carries.

    vLLM's msgpack IPC encodes a tensor as ``(dtype, shape, buffer)`` and decodes a utility
    call's arguments untyped, so a tensor inside them reaches the worker as a list, not a
    tensor (vLLM 0.24: ``'list' object has no attribute 'shape'`` in the loader); bytes
    arrive as they left. Views into a larger storage are cloned so only their own bytes go."""
    import io

    import torch

    items = [(n, t if t.untyped_storage().nbytes() == t.nbytes else t.clone()) for n, t in chunk]
    buf = io.BytesIO()
    torch.save(items, buf)
    return buf.getvalue()


def unpack_weights(payload: bytes) -> list[tuple[str, Any]]:
    """``pack_weights``'s inverse (tensors and names only: ``weights_only``)."""
    import io

    import torch

    return [(n, t) for n, t in torch.load(io.BytesIO(payload), weights_only=True)]


def _finish_reason(reason: Any) -> FinishReason:
    if reason in ("stop", "length", "abort"):
        return cast(FinishReason, reason)
    raise EngineError(f"vLLM ended the request with finish_reason={reason!r}")


# ----------------------------------------------------------------------------- the engine


@dataclass
class _Turn:
    """What a request has generated so far (vLLM sends deltas)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def add(self, out: Any) -> None:
        self.text += out.text
        new = list(out.token_ids)
        if not new:  # a delta with text only (a final flush)
            return
        lps = out.logprobs
        if lps is None or len(lps) != len(new):
            raise EngineError(
                f"vLLM returned {len(new)} tokens with {0 if lps is None else len(lps)} logprobs"
            )
        self.token_ids += new
        self.logprobs += [float(lp[t].logprob) for t, lp in zip(new, lps, strict=True)]


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(
        self,
        config: VLLMEngineConfig | None = None,
        *,
        version: int = 0,
        llm: Any = None,
        tokenizer: Any = None,
        **options: Any,
    ):
        """Give a config, or its fields as keywords; keywords that are not config fields are
        vLLM engine args (``make_engine`` passes ``engine.model`` and ``engine.kwargs`` so).

        ``llm`` serves an ``AsyncLLM`` built elsewhere (the caller keeps it: closing the
        engine does not shut it down); ``tokenizer`` replaces the Hugging Face one."""
        super().__init__(version=version)
        if config is not None and options:
            raise EngineError(f"give a VLLMEngineConfig or its fields, not both (got {sorted(options)})")
        self.config = config if config is not None else _config_from(options)
        _require_vllm()  # fail at construction (in the replica actor), not at the first turn
        self._llm: Any = llm
        self._owns_llm = llm is None
        self.tokenizer: Any = tokenizer
        self._params_cls: Any = None
        self._delta: Any = None
        self._max_len: int | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._busy = 0  # requests inside vLLM
        self._idle = asyncio.Event()
        self._idle.set()
        self.stats = {
            "requests": 0,
            "aborts": 0,
            "tokens": 0,
            "weight_loads": 0,
            "prefix_cache_resets_failed": 0,
        }

    # -- hooks
    async def _start(self) -> None:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        self._params_cls, self._delta = SamplingParams, RequestOutputKind.DELTA
        cfg = self.config
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(
                _hf_tokenizer, cfg.tokenizer or cfg.model, cfg.trust_remote_code
            )
        if self._llm is None:
            # on the event loop, not a thread: the client's zmq asyncio sockets belong to it
            self._llm = _build_llm(cfg)
            self._owns_llm = True  # (a restart builds one even where the caller gave one)
        model_config = getattr(self._llm, "model_config", None)
        self._max_len = getattr(model_config, "max_model_len", None)

    async def _close(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None and self._owns_llm:
            llm.shutdown()

    async def _pause(self) -> None:
        if not self.config.inflight_weight_updates:
            await self._idle.wait()

    async def _abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is None:
            return
        task.cancel()  # vLLM's stream aborts its request when its consumer is cancelled...
        if self._llm is not None:
            with contextlib.suppress(Exception):  # ...and an explicit abort is idempotent
                await self._llm.abort(request_id)

    async def _load_weights(self, state: Mapping[str, Any], version: int) -> None:
        await self.start()  # weights may come before the first turn
        llm = self._llm
        if llm is None:
            raise EngineError("the vllm engine is still starting (or closed): load weights after start()")
        chunks = weight_chunks(state, int(self.config.weight_chunk_mb * 2**20))
        try:
            for chunk in chunks:
                await llm.collective_rpc(LOAD_METHOD, args=(pack_weights(chunk),))
        except Exception as e:
            if _engine_died(e):
                raise _dead(e) from e
            raise EngineError(
                f"vLLM could not load the weights ({type(e).__name__}: {e}); the state's names must be "
                "the Hugging Face checkpoint's and its shapes the served model's"
            ) from e
        self.stats["weight_loads"] += 1
        if await llm.reset_prefix_cache() is False:  # older vLLM returns None: it did reset
            self.stats["prefix_cache_resets_failed"] += 1  # blocks still in use (in-flight mode)

    async def _generate(self, request: GenerateRequest) -> Completion:
        if request.messages is not None:
            prompt = render_chat(self.tokenizer, request.messages)
        else:
            prompt = list(request.prompt_ids or [])
        room = None
        if self._max_len is not None:
            room = self._max_len - len(prompt)
            if room < 1:
                raise PromptTooLongError(
                    f"prompt is {len(prompt)} tokens; the model's context is {self._max_len} "
                    "(no room to generate)"
                )
        params = self._params_cls(**sampling_params_kwargs(request, room=room), output_kind=self._delta)
        version, turn, rid = self._version, _Turn(), request.request_id
        task = asyncio.create_task(self._stream(rid, prompt, params, turn), name=f"vllm-{rid}")
        self._tasks[rid] = task
        self._busy += 1
        self._idle.clear()
        self.stats["requests"] += 1
        try:
            await asyncio.wait({task})  # unlike await, an abort's cancel does not reach us
        except asyncio.CancelledError:  # our caller gave up: so does vLLM
            task.cancel()
            raise
        finally:
            self._tasks.pop(rid, None)
            self._busy -= 1
            if self._busy == 0:
                self._idle.set()
        if task.cancelled():
            self.stats["aborts"] += 1
            reason: FinishReason = "abort"
        else:
            if (e := task.exception()) is not None:
                raise _translate(e) from e
            reason = turn.finish_reason or "abort"
        self.stats["tokens"] += len(turn.token_ids)
        return Completion(
            request_id=rid,
            text=turn.text,
            prompt_ids=prompt,
            token_ids=turn.token_ids,
            logprobs=turn.logprobs,
            policy_version=version,
            finish_reason=reason,
            allowed_token_ids=request.allowed_token_ids,
            metadata=request.metadata,
        )

    async def _stream(self, rid: str, prompt: list[int], params: Any, turn: _Turn) -> None:
        # closed here: a delta this turn refuses ends vLLM's request (its generator aborts it on
        # GeneratorExit) before the turn returns, not when the garbage collector gets to it
        stream = self._llm.generate({"prompt_token_ids": prompt}, params, rid)
        async with contextlib.aclosing(stream):
            async for out in stream:
                delta = out.outputs[0]
                turn.add(delta)
                if out.finished:
                    turn.finish_reason = _finish_reason(delta.finish_reason)


def _translate(e: BaseException) -> EngineError:
    if isinstance(e, EngineError):
        return e
    cause = e.__cause__ or e  # EngineGenerateError carries the real error as its cause
    if _engine_died(e):
        return _dead(e)
    if isinstance(cause, (ValueError, *_vllm_classes(_CLIENT_ERRORS))):
        return EngineError(f"vLLM rejected the request: {cause}")
    return EngineError(f"vLLM generation failed: {type(cause).__name__}: {cause}")


#: vLLM's errors for an engine that cannot serve any more: ``module``, ``class`` (V1's engine
#: core process died; the V0 engine's background loop).
_DEAD_ERRORS = (
    ("vllm.v1.engine.exceptions", "EngineDeadError"),
    ("vllm.engine.async_llm_engine", "AsyncEngineDeadError"),
)


#: vLLM's errors for a request it refuses: in 0.33 ``VLLMValidationError`` is one, no longer
#: a ``ValueError`` (as in 0.24), and ``AsyncLLM.generate`` re-raises it unwrapped.
_CLIENT_ERRORS = (("vllm.exceptions", "VLLMClientError"),)


def _vllm_classes(names: Sequence[tuple[str, str]]) -> tuple[type[BaseException], ...]:
    """The exception classes ``(module, class)`` this vLLM has."""
    found: list[type[BaseException]] = []
    for module, name in names:
        try:  # lazily: the module imports without vLLM, and a vLLM release may lack any
            cls = getattr(importlib.import_module(module), name)
        except Exception:  # not in this vLLM
            continue
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def _engine_died(e: BaseException) -> bool:
    """Whether ``e`` (or its cause) is vLLM's word that its engine is dead: every later
    call fails the same way, so the replica must be restarted, not the turn retried."""
    dead = _vllm_classes(_DEAD_ERRORS)
    return any(isinstance(x, dead) for x in (e, e.__cause__) if x is not None)


def _dead(e: BaseException) -> EngineDeadError:
    return EngineDeadError(f"the vLLM engine died ({type(e).__name__}: {e}); the replica must be restarted")


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise EngineError(f"the vllm engine needs vLLM: {INSTALL_HINT} ({e})") from e


def _hf_tokenizer(name: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


def _build_llm(cfg: VLLMEngineConfig) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ModuleNotFoundError as e:
        # only a vLLM without the V1 module falls back; a dependency the V1 engine lacks
        # (vLLM imports many) must surface as itself, not as a second, misleading traceback
        if e.name not in ("vllm.v1", "vllm.v1.engine", "vllm.v1.engine.async_llm"):
            raise
        from vllm import AsyncLLMEngine as AsyncLLM
    try:
        args = AsyncEngineArgs(
            model=cfg.model,
            tokenizer=cfg.tokenizer,
            trust_remote_code=cfg.trust_remote_code,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=_EXTENSION,
            **cfg.engine_args,
        )
    except TypeError as e:  # an unknown engine arg, or a vLLM without logprobs_mode (< 0.10.2)
        raise EngineError(f"bad vLLM engine args ({e}); the vllm engine needs vllm >= 0.10.2") from e
    return AsyncLLM.from_engine_args(args)


def _config_from(options: dict[str, Any]) -> VLLMEngineConfig:
    fields = set(VLLMEngineConfig.model_fields)
    known = {k: v for k, v in options.items() if k in fields}
    extra = {k: v for k, v in options.items() if k not in fields}
    if extra:
        known["engine_args"] = {**known.get("engine_args", {}), **extra}
    try:
        return VLLMEngineConfig(**known)
    except ValidationError as e:
        raise options_error("vllm", e) from None
