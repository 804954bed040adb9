"""What the LLMProxy test modules share: a tiny real engine (a one-layer TinyLM), request
helpers, and ``Fake``, a scripted ``Replica`` that fails on cue (importable: pytest puts
``tests/core`` on ``sys.path``)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig
from core.rollout.llm_proxy import (
    LocalReplica,
    Replica,
    ReplicaLost,
)

WORDS = "left right up down you are at row column the lake is frozen hole goal start".split()
_ids = itertools.count()


def tiny(tok: WordTokenizer, seed: int = 0) -> TinyLM:
    return TinyLM(
        TinyLMConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=64), seed=seed
    )


def engine(model: TinyLM, tok: WordTokenizer) -> TorchEngine:
    return TorchEngine(model, tok, TorchEngineConfig(num_threads=1, batch_wait_ms=0.0))


def req(**kw: Any) -> GenerateRequest:
    kw.setdefault("prompt_ids", [2, 5, 9])
    kw.setdefault("max_new_tokens", 2)
    kw.setdefault("request_id", f"r{next(_ids)}")
    return GenerateRequest(**kw)


async def until(cond, within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110 - polling counters the code under test moves
            await asyncio.sleep(0.001)


class Recording(LocalReplica):
    """A real engine replica that remembers which trajectories it served."""

    def __init__(self, engine: TorchEngine, name: str):
        super().__init__(engine, name)
        self.served: list[str] = []

    async def generate(self, request: GenerateRequest) -> Completion:
        self.served.append(request.metadata.get("traj", "?"))
        return await super().generate(request)


def completion(request: GenerateRequest, version: int, text: str = "ok") -> Completion:
    return Completion(
        request_id=request.request_id,
        text=text,
        prompt_ids=list(request.prompt_ids or []),
        token_ids=[7],
        logprobs=[-0.5],
        policy_version=version,
        finish_reason="stop",
        metadata=request.metadata,
    )


class Fake(Replica):
    """A scripted replica: ``fail`` lists what the next generate calls raise (None:
    succeed); the first ``ping_down`` pings and ``swap_down`` swaps raise ``ReplicaLost``
    (the process is restarting); ``gate`` holds generate (of the ``only`` request ids)
    until it is set or the request is aborted."""

    def __init__(
        self,
        name: str,
        *,
        fail: list[BaseException | None] | None = None,
        ping_down: float = 0,
        swap_down: float = 0,
        gate: asyncio.Event | None = None,
        only: set[str] | None = None,
    ):
        self.name = name
        self.version = 0
        self.fail = list(fail or [])
        self.ping_down = ping_down
        self.swap_down = swap_down
        self.gate = gate
        self.only = only  # request ids the gate holds (None: all)
        self.generated: list[str] = []  # request ids, in call order
        self.swaps: list[tuple[int, Any]] = []
        self.pings = 0
        self.aborted: list[str] = []
        self._waiting: dict[str, asyncio.Future[None]] = {}

    async def generate(self, request: GenerateRequest) -> Completion:
        self.generated.append(request.request_id)
        if self.gate is not None and (self.only is None or request.request_id in self.only):
            fut = asyncio.get_running_loop().create_future()
            self._waiting[request.request_id] = fut
            gate = asyncio.ensure_future(self.gate.wait())
            try:
                await asyncio.wait([fut, gate], return_when=asyncio.FIRST_COMPLETED)
            finally:
                gate.cancel()
                self._waiting.pop(request.request_id, None)
            if fut.done():
                c = completion(request, self.version, text="")
                return c.model_copy(update={"finish_reason": "abort", "token_ids": [], "logprobs": []})
        else:
            await asyncio.sleep(0)
        err = self.fail.pop(0) if self.fail else None
        if err is not None:
            raise err
        return completion(request, self.version, text=self.name)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        fut = self._waiting.get(request_id)
        if fut is None or fut.done():
            return False
        fut.set_result(None)
        return True

    async def swap(self, version: int, state: Any) -> None:
        await asyncio.sleep(0)
        if self.swap_down > 0:
            self.swap_down -= 1
            raise ReplicaLost("crashed while loading")
        self.swaps.append((version, state))
        self.version = version

    async def ping(self) -> int:
        self.pings += 1
        await asyncio.sleep(0)
        if self.ping_down > 0:
            self.ping_down -= 1
            raise ReplicaLost("restarting")
        return self.version


class SlowPing(Fake):
    """A replica whose pings wait until ``back`` is set (its restart takes a while)."""

    def __init__(self, name: str, **kw: Any):
        super().__init__(name, **kw)
        self.back = asyncio.Event()

    async def ping(self) -> int:
        self.pings += 1
        await self.back.wait()
        return self.version
