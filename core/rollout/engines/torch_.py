"""``TorchEngine``: the CPU default, a ``TinyLM`` served with continuous batching.

One scheduler task owns the model. Each tick it takes every active sequence (up to
``max_batch_size``), runs at most two batched forward passes in a worker thread (torch
releases the GIL, so the event loop keeps taking requests and stepping environments):

* prefill: sequences without a KV cache (just admitted, or whose cache new weights made
  stale) read their whole prefix, left-padded, and sample their first token;
* decode: sequences with a cache feed their last token only.

A sequence leaves the batch the moment it finishes, and a new one joins at the next tick:
concurrent ``generate`` calls share forward passes without waiting for each other's turns
to end. An idle engine waits ``batch_wait_ms`` after the first arrival so that requests
sent together (one per episode of a group) start in the same prefill.

New weights invalidate every cache: the sequences in flight re-read their prefix under the
new weights, so each token's logprob is exactly under the weights that sampled it (the
ratio the trainer computes is then the true importance ratio).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core.config_backends import TorchEngineConfig as TorchEngineConfig  # torch-free, for the job config
from core.policy.tiny_lm import KV, TinyLM
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import (
    Completion,
    Engine,
    EngineDeadError,
    EngineError,
    FinishReason,
    GenerateRequest,
    PromptTooLongError,
)


@dataclass(eq=False)
class _Seq:
    request: GenerateRequest
    prompt: list[int]
    future: asyncio.Future[Completion]
    generator: torch.Generator
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kv: list[KV] | None = field(default=None, repr=False)
    """Per layer ``(k, v)``, each ``[heads, tokens, head_dim]``: every token but the last
    sampled one (which the next decode step feeds)."""
    first_version: int | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


@dataclass
class _Sampled:
    seq: _Seq
    token: int
    logprob: float
    kv: list[KV]


class TorchEngine(Engine):
    name = "torch"

    def __init__(
        self,
        model: TinyLM,
        tokenizer: WordTokenizer,
        config: TorchEngineConfig | None = None,
        *,
        version: int = 0,
    ) -> None:
        super().__init__(version=version)
        if tokenizer.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{model.config.vocab_size}"
            )
        self.config = config or TorchEngineConfig()
        self.tokenizer = tokenizer
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        # the engine owns its copy: a trainer stepping the caller's model must not change
        # what the engine samples from until load_weights says so
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self._spare: TinyLM | None = None
        self._rng = torch.Generator().manual_seed(self.config.seed)
        self._waiting: deque[_Seq] = deque()
        self._active: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._epoch = 0  # bumped by load_weights: caches computed before are stale
        self._task: asyncio.Task[None] | None = None
        self.stats = {
            "forward_passes": 0,
            "prefill_rows": 0,
            "prefill_shared": 0,
            "decode_rows": 0,
            "tokens": 0,
        }

    # -- hooks
    async def _start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="torch-engine-scheduler")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        """The scheduler task ended without ``_close`` (a bug outside a forward pass, which
        fails its step's requests only): nothing would ever answer a request again, so its
        requests waited for good. The engine is dead: they fail now, and so do later ones."""
        if task.cancelled() or task is not self._task:
            return
        exc = task.exception()
        dead = EngineDeadError(f"the torch engine's batching loop died: {exc!r}")
        self._mark_dead(dead)
        for seq in [*self._waiting, *self._active]:
            if not seq.future.done():
                seq.future.set_exception(EngineDeadError(str(dead)))
            self._remove(seq)
        self._idle.set()  # no step runs any more: a suspend must not wait for one

    async def _close(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # (a loop that died was looked at by _loop_ended: awaited, it would raise again)
        for seq in [*self._waiting, *self._active]:
            self._finish(seq, "abort")

    async def _pause(self) -> None:
        await self._idle.wait()

    async def _generate(self, request: GenerateRequest) -> Completion:
        if request.messages is not None:
            prompt = self.tokenizer.encode_chat(request.messages)
        else:
            prompt = list(request.prompt_ids or [])
        for what, ids in (("prompt ids", prompt), ("allowed_token_ids", request.allowed_token_ids or [])):
            bad = [i for i in ids if not 0 <= i < self.tokenizer.vocab_size]
            if bad:
                raise ValueError(
                    f"{what} {bad[:5]} are outside the vocabulary (size {self.tokenizer.vocab_size})"
                )
        max_len = self.model.config.max_len
        if len(prompt) >= max_len:
            raise PromptTooLongError(
                f"prompt is {len(prompt)} tokens; the model's context is {max_len} (no room to generate)"
            )
        seed = (
            request.seed if request.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        )
        seq = _Seq(
            request=request,
            prompt=prompt,
            future=asyncio.get_running_loop().create_future(),
            generator=torch.Generator().manual_seed(seed),
        )
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._wake.set()
        try:
            return await seq.future
        finally:  # finished, aborted, or the caller was cancelled: never leave it queued
            self._remove(seq)

    async def _abort(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    async def _load_weights(self, state: Mapping[str, Any], version: int) -> None:
        # a step in flight reads self.model; load into the spare copy and swap between steps
        await self._idle.wait()
        spare = self._spare if self._spare is not None else copy.deepcopy(self.model)
        try:
            spare.load_state_dict(dict(state))
        except RuntimeError as e:
            raise EngineError(f"weights do not fit the engine's model: {e}") from None
        self._spare, self.model = self.model, spare
        self._epoch += 1
        for seq in self._active:
            seq.kv = None

    # -- scheduler
    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._active:
                self._wake.clear()
                await self._wake.wait()
                if self.config.batch_wait_ms > 0:
                    await asyncio.sleep(self.config.batch_wait_ms / 1000)
            await self._running.wait()  # suspended: hold every sequence where it is
            while self._waiting and len(self._active) < self.config.max_batch_size:
                self._active.append(self._waiting.popleft())
            if not self._active:
                continue
            prefill = [s for s in self._active if s.kv is None]
            decode = [s for s in self._active if s.kv is not None]
            model, version, epoch = self.model, self._version, self._epoch
            self._idle.clear()
            try:
                sampled = await asyncio.to_thread(self._compute, model, prefill, decode)
            except Exception as e:  # a broken step fails its requests, not the engine
                for seq in prefill + decode:
                    if not seq.future.done():
                        seq.future.set_exception(EngineError(f"forward pass failed: {e!r}"))
                    self._remove(seq)
                continue
            finally:
                self._idle.set()
            for s in sampled:
                self._advance(s, version, fresh_cache=epoch == self._epoch)
            del sampled  # an idle engine keeps no finished sequence (nor its cache) alive

    def _advance(self, s: _Sampled, version: int, *, fresh_cache: bool) -> None:
        seq = s.seq
        if seq.future.done():  # aborted or cancelled while the step ran
            return
        seq.out.append(s.token)
        seq.logprobs.append(s.logprob)
        seq.kv = s.kv if fresh_cache else None
        if seq.first_version is None:
            seq.first_version = version
        self.stats["tokens"] += 1
        req = seq.request
        if s.token in self.tokenizer.stop_ids:
            self._finish(seq, "stop")
        elif req.stop and _find_stop(self.tokenizer.decode(seq.out), req.stop) is not None:
            self._finish(seq, "stop")
        elif len(seq.out) >= req.max_new_tokens or len(seq.tokens) >= self.model.config.max_len:
            self._finish(seq, "length")

    def _finish(self, seq: _Seq, reason: FinishReason) -> None:
        if not seq.future.done():
            seq.future.set_result(self._completion(seq, reason))
        self._remove(seq)

    def _remove(self, seq: _Seq) -> None:
        if self._by_id.get(seq.request.request_id) is seq:
            del self._by_id[seq.request.request_id]
        # membership first: a failed remove() would format the sequence (and its cache)
        if seq in self._waiting:
            self._waiting.remove(seq)
        if seq in self._active:
            self._active.remove(seq)

    def _completion(self, seq: _Seq, reason: FinishReason) -> Completion:
        ids = seq.out
        if reason == "stop" and ids and ids[-1] in self.tokenizer.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids)
        cut = _find_stop(text, seq.request.stop)
        if cut is not None:
            text = text[:cut]
        return Completion(
            request_id=seq.request.request_id,
            text=text,
            prompt_ids=seq.prompt,
            token_ids=list(seq.out),
            logprobs=list(seq.logprobs),
            policy_version=seq.first_version if seq.first_version is not None else self._version,
            finish_reason=reason,
            allowed_token_ids=seq.request.allowed_token_ids,
            metadata=seq.request.metadata,
        )

    # -- compute (worker thread: touches no scheduler state, only its arguments)
    def _compute(self, model: TinyLM, prefill: list[_Seq], decode: list[_Seq]) -> list[_Sampled]:
        out: list[_Sampled] = []
        with torch.inference_mode():
            if prefill:
                out += self._prefill(model, prefill)
            if decode:
                out += self._decode(model, decode)
        return out

    def _prefill(self, model: TinyLM, seqs: list[_Seq]) -> list[_Sampled]:
        # each distinct prefix is run once: a group's members ask for their first turn
        # together with the same prompt (and with a short history window, turns taken in the
        # same state repeat one too). Equal prefixes give equal logits and caches; each
        # sequence still samples with its own generator
        first: dict[tuple[int, ...], int] = {}
        rows: list[list[int]] = []
        of: list[int] = []  # per sequence, its row
        for s in seqs:
            key = tuple(s.tokens)
            if key not in first:
                first[key] = len(rows)
                rows.append(s.tokens)
            of.append(first[key])
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):  # left padding: every row's last token is in the last column
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = True
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        logits, kv = model.forward_cached(ids, attention_mask=mask, position_ids=pos)
        self._count(prefill=len(seqs), shared=len(seqs) - len(rows))
        caches = [
            [(k[i, :, width - len(r) :], v[i, :, width - len(r) :]) for k, v in kv]
            for i, r in enumerate(rows)
        ]
        # (a cache is only read later: decode concatenates into new tensors, so sharing is safe)
        return self._sample(seqs, logits[of, -1], [caches[i] for i in of])

    def _decode(self, model: TinyLM, seqs: list[_Seq]) -> list[_Sampled]:
        caches = [s.kv for s in seqs if s.kv is not None]
        lengths = [c[0][0].shape[1] for c in caches]
        width = max(lengths)
        # left-pad every row's cache to the longest: the fed tokens then share one column
        past: list[KV] = [
            (
                torch.stack(
                    [F.pad(c[layer][0], (0, 0, width - n, 0)) for c, n in zip(caches, lengths, strict=True)]
                ),
                torch.stack(
                    [F.pad(c[layer][1], (0, 0, width - n, 0)) for c, n in zip(caches, lengths, strict=True)]
                ),
            )
            for layer in range(len(caches[0]))
        ]
        past_mask = torch.arange(width)[None, :] >= (width - torch.tensor(lengths))[:, None]
        ids = torch.tensor([[s.out[-1]] for s in seqs])
        pos = torch.tensor(lengths)[:, None]  # the fed token's position = tokens before it
        logits, new = model.forward_cached(
            ids,
            attention_mask=torch.ones_like(ids, dtype=torch.bool),
            position_ids=pos,
            past=past,
            past_mask=past_mask,
        )
        self._count(decode=len(seqs))
        grown = [
            [
                (torch.cat([c[layer][0], nk[i]], dim=1), torch.cat([c[layer][1], nv[i]], dim=1))
                for layer, (nk, nv) in enumerate(new)
            ]
            for i, c in enumerate(caches)
        ]
        return self._sample(seqs, logits[:, -1], grown)

    def _sample(self, seqs: list[_Seq], logits: Tensor, caches: list[list[KV]]) -> list[_Sampled]:
        temps = torch.tensor([s.request.temperature or 1.0 for s in seqs])[:, None]
        logits = logits.float() / temps
        for i, s in enumerate(seqs):
            if s.request.allowed_token_ids is not None:
                keep = torch.tensor(s.request.allowed_token_ids)
                row = torch.full_like(logits[i], float("-inf"))
                row[keep] = logits[i, keep]
                logits[i] = row
        logp = torch.log_softmax(logits, dim=-1)
        out = []
        for i, s in enumerate(seqs):
            if s.request.temperature == 0.0:
                tok = int(logp[i].argmax())
            else:
                tok = int(torch.multinomial(logp[i].exp(), 1, generator=s.generator))
            out.append(_Sampled(s, tok, float(logp[i, tok]), caches[i]))
        return out

    def _count(self, *, prefill: int = 0, shared: int = 0, decode: int = 0) -> None:
        # plain int updates from the worker thread; only this thread writes them mid-step
        self.stats["forward_passes"] += 1
        self.stats["prefill_rows"] += prefill
        self.stats["prefill_shared"] += shared  # of those, rows another's prefix computed
        self.stats["decode_rows"] += decode


def _find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
