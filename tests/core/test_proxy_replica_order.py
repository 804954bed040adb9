"""The engine replica actor's side of the proxy's aborts: an abort that reaches the actor
before the turn it was meant for (no Ray here: the actor is a plain object, and the order
Ray may deliver its calls in is modelled by calling them in that order)."""

from __future__ import annotations

import asyncio
from typing import Any

from core.policy.build import PolicyBundle
from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout import replicas
from core.rollout.engines.base import Completion, GenerateRequest
from core.rollout.llm_proxy import LLMProxy, Replica, ReplicaLost, swap_weights
from core.rollout.replicas import EngineReplicaActor

WORDS = "left right up down you are at row column the lake is frozen hole goal start".split()


def actor() -> EngineReplicaActor:
    tok = WordTokenizer(WORDS)
    m = TinyLM(TinyLMConfig(vocab_size=tok.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=64), seed=0)
    bundle = PolicyBundle(tokenizer=tok.to_dict(), model_config=m.config.model_dump(), state=m.state_dict())
    kwargs: dict[str, Any] = {"num_threads": 1, "batch_wait_ms": 0.0}
    return EngineReplicaActor("torch", bundle, kwargs, seed=0, name="r", model="tiny-lm")


def req(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt_ids=[2, 5, 9], max_new_tokens=4)


async def test_a_turn_whose_abort_reached_the_replica_first_is_not_run():
    # the proxy's turn waits in the coalescing window (1 ms) before it is sent to the
    # replica actor, while its abort (a full group, a timeout, a release) goes at once, and
    # Ray runs an async actor's calls in any order: the engine found no such request, and
    # the turn then ran to its end for nobody, holding a batch slot
    a = actor()
    try:
        assert await a.abort("t/0") is False  # nothing to stop yet
        answers = [x async for batch in a.generate_many([req("t/0"), req("u/0")]) for x in batch]
        by_id = {x.request_id: x.value for x in answers}
        late = by_id["t/0"]
        assert (late.finish_reason, late.token_ids, late.request_id) == ("abort", [], "t/0")
        assert by_id["u/0"].finish_reason in ("stop", "length")  # the others run
        assert a.engine.stats["tokens"] == len(by_id["u/0"].token_ids)  # t/0 made none
        assert (await a.generate(req("t/1"))).finish_reason in ("stop", "length")
    finally:
        await a.engine.aclose()


class ActorReplica(Replica):
    """The proxy's handle on an in-process ``EngineReplicaActor`` whose first ``lost``
    turns are lost (its process died, and Ray restarted it: they never reached it)."""

    def __init__(self, a: EngineReplicaActor, lost: int = 0, hold: asyncio.Event | None = None):
        self.a, self.name, self.lost, self.hold = a, "r", lost, hold
        self.sent: list[str] = []  # request ids, in call order

    async def generate(self, request: GenerateRequest) -> Completion:
        self.sent.append(request.request_id)
        if self.hold is not None:
            await self.hold.wait()  # (in flight: the node is cut off, say)
        if self.lost:
            self.lost -= 1
            raise ReplicaLost("the actor died")
        return await self.a.generate(request)

    async def abort(self, request_id: str) -> bool:
        return await self.a.abort(request_id)

    async def swap(self, version: int, state: Any) -> None:
        await swap_weights(self.a.engine, version, state)

    async def ping(self) -> int:
        return self.a.engine.version


async def test_a_turn_rerun_after_its_replica_came_back_is_not_taken_for_an_aborted_one():
    # after a recovery the proxy aborts the lost turn's first run on the replica (it may go
    # on there); the replica did not know it, and the rerun went under the same id, which
    # the replica now takes for a turn its abort overtook: the turn ended aborted, for no one
    a = actor()
    try:
        proxy = LLMProxy({"default": [ActorReplica(a, lost=1)]})
        c = await asyncio.wait_for(proxy.generate("t", "x", req("t/0")), 10)
        assert c.finish_reason in ("stop", "length") and c.request_id == "t/0"
        assert proxy.metrics["turns_rerun"] == 1
        await proxy.aclose()
    finally:
        await a.engine.aclose()


async def test_a_turn_moved_off_a_dropped_replica_never_comes_back_under_an_id_it_aborted():
    # a replica dropped with a turn in flight rejoins once it answers, and first aborts that
    # turn's id, which its actor, not knowing it (the run ended, or never reached it),
    # remembers (up to OVERTAKEN_WINDOW ids). The turn had moved on under the same id: lost
    # again, it came back to the rejoined replica under that id and was answered aborted
    hold = asyncio.Event()
    a, b = actor(), actor()
    first, other = ActorReplica(a, hold=hold), ActorReplica(b, hold=hold)
    first.name, other.name = "first", "other"
    proxy = LLMProxy({"default": [first, other]}, rejoin_first_s=0.01, rejoin_max_s=0.02)
    try:
        turn = asyncio.create_task(proxy.generate("t", "x", req("t/0")))
        await asyncio.wait_for(_until(lambda: first.sent == ["t/0"]), 5)
        proxy._drop(first, "its recovery gave up", rejoin=True)  # (the moment a recovery drops it)
        await asyncio.wait_for(_until(lambda: len(other.sent) == 1), 5)
        first.hold = None
        await asyncio.wait_for(_until(lambda: proxy.metrics["replicas_rejoined"] == 1), 5)
        proxy._drop(other, "gone for good", rejoin=False)  # the turn is lost again
        c = await asyncio.wait_for(turn, 10)
        assert (c.finish_reason, c.request_id) in {("stop", "t/0"), ("length", "t/0")}
        assert "t/0" not in first.sent[1:]  # the id its rejoin aborted is never sent to it again
        await proxy.aclose()
    finally:
        await a.engine.aclose()
        await b.engine.aclose()


async def test_the_ids_an_abort_found_nowhere_are_bounded_and_each_answers_aborted_once(monkeypatch):
    # the actor remembers the ids an abort found nowhere, the newest OVERTAKEN_WINDOW: an old
    # one forgotten runs (for nobody: the proxy never sends an id again once it aborted it),
    # and one met once is forgotten, so its memory neither grows for the job's life nor
    # answers a later turn aborted
    monkeypatch.setattr(replicas, "OVERTAKEN_WINDOW", 2)
    a = actor()
    try:
        for rid in ("t/0", "t/1", "t/2"):
            assert await a.abort(rid) is False
        assert list(a._overtaken) == ["t/1", "t/2"]
        assert (await a.generate(req("t/0"))).finish_reason in ("stop", "length")  # forgotten
        assert (await a.generate(req("t/2"))).finish_reason == "abort"
        assert list(a._overtaken) == ["t/1"]
        assert (await a.generate(req("t/2#rerun1"))).finish_reason in ("stop", "length")
    finally:
        await a.engine.aclose()


async def _until(cond: Any) -> None:
    while not cond():  # noqa: ASYNC110 - polling state the code under test moves
        await asyncio.sleep(0.001)
