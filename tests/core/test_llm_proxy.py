"""LLMProxy routing, aborts, weights and replica recovery; the Coalescer transport.

The happy path runs real ``TorchEngine`` replicas (a one-layer TinyLM); failures use fake
``Replica`` subclasses that fail on cue. No Ray: the proxy is a plain object here."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
from typing import Any

import pytest
import torch
from tiny_models import stopless

from core.config import JobConfig
from core.config_sections import EngineConfig
from core.errors import ConfigError
from core.policy.tiny_lm import TinyLM, TinyLMConfig
from core.policy.tokenizer import WordTokenizer
from core.rollout.coalesce import Answer, Coalescer, answer_all
from core.rollout.engines.base import Completion, EngineError, GenerateRequest
from core.rollout.engines.torch_ import TorchEngine, TorchEngineConfig
from core.rollout.llm_proxy import (
    LLMProxy,
    LocalReplica,
    NoReplicaError,
    Replica,
    ReplicaGone,
    ReplicaLost,
    proxy_options,
    swap_weights,
)
from fabric.protocol import Trajectory
from fabric.registry import Registry

WORDS = "left right up down you are at row column the lake is frozen hole goal start".split()
_ids = itertools.count()


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer(WORDS)


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


# ----------------------------------------------------------------------------- routing


async def test_a_trajectory_sticks_to_the_replica_of_its_first_turn(tok):
    async with engine(tiny(tok), tok) as e1, engine(tiny(tok), tok) as e2:
        a, b = Recording(e1, "a"), Recording(e2, "b")
        proxy = LLMProxy({"default": [a, b]})
        # first turns together: t1 loads "a", so t2 starts on "b"
        first = await asyncio.gather(
            *(proxy.generate(t, "lake", req(metadata={"traj": t})) for t in ("t1", "t2"))
        )
        assert all(c.token_ids for c in first)
        for _ in range(2):  # later turns one at a time: both replicas idle, yet each sticks
            for traj in ("t2", "t1"):
                c = await proxy.generate(traj, "lake", req(metadata={"traj": traj}))
                assert c.finish_reason in ("stop", "length") and c.token_ids
        assert a.served == ["t1"] * 3 and b.served == ["t2"] * 3
        assert proxy.metrics["affinity_hits"] == 4  # turns 2 and 3 of both trajectories
        assert proxy.metrics["turns"] == 6
        assert proxy.stats()["trajectories"] == 2


async def test_a_new_trajectory_goes_to_the_least_loaded_replica():
    gate = asyncio.Event()
    r0, r1 = Fake("r0", gate=gate), Fake("r1", gate=gate)
    proxy = LLMProxy({"default": [r0, r1]})
    t_a = asyncio.create_task(proxy.generate("a", "x", req(request_id="a0")))
    await until(lambda: r0.generated == ["a0"])  # a tie: the first replica
    t_b = asyncio.create_task(proxy.generate("b", "x", req(request_id="b0")))
    await until(lambda: r1.generated == ["b0"])  # r0 has one in flight, r1 none
    t_a2 = asyncio.create_task(proxy.generate("a", "x", req(request_id="a1")))
    await until(lambda: r0.generated == ["a0", "a1"])  # sticky (both have one in flight)
    t_c = asyncio.create_task(proxy.generate("c", "x", req(request_id="c0")))
    await until(lambda: r1.generated == ["b0", "c0"])  # r0 has 2 in flight, r1 1
    gate.set()
    done = await asyncio.gather(t_a, t_b, t_a2, t_c)
    assert [c.text for c in done] == ["r0", "r1", "r0", "r1"]
    # all idle again: a new trajectory takes the first of the tied replicas
    c = await proxy.generate("d", "x", req(request_id="d0"))
    assert c.text == "r0"


async def test_tags_run_on_their_hardware_group_and_unknown_tags_on_the_default():
    d, h = Fake("d"), Fake("h")
    proxy = LLMProxy({"default": [d], "H800": [h]}, affinity={"frozenlake": "H800"})
    assert proxy.group_of("frozenlake") == "H800" and proxy.group_of("math") == "default"
    assert (await proxy.generate("t1", "frozenlake", req())).text == "h"
    assert (await proxy.generate("t2", "math", req())).text == "d"
    assert (await proxy.generate("t3", "never-named", req())).text == "d"
    # stickiness holds within the tag's group only: the tag decides the group every turn
    assert (await proxy.generate("t1", "frozenlake", req())).text == "h"
    assert (await proxy.generate("t1", "math", req())).text == "d"

    # "default" in the affinity map moves every other tag too
    proxy = LLMProxy({"H20": [d], "H800": [h]}, affinity={"frozenlake": "H800", "default": "H20"})
    assert (await proxy.generate("u1", "math", req())).text == "d"
    assert (await proxy.generate("u2", "frozenlake", req())).text == "h"
    # no "default" group and no default affinity: the first group
    proxy = LLMProxy({"H800": [h], "H20": [d]})
    assert proxy.group_of("anything") == "H800"


def test_construction_refuses_no_replicas_and_unknown_groups():
    with pytest.raises(ValueError, match="at least one replica"):
        LLMProxy({})
    with pytest.raises(ValueError, match="at least one replica"):
        LLMProxy({"default": []})
    with pytest.raises(ValueError, match=r"groups without replicas: \['H800'\]"):
        LLMProxy({"default": [Fake("d")]}, affinity={"frozenlake": "H800"})


async def test_construction_refuses_a_replica_listed_twice():
    # a replica in two groups (or twice in one) was swapped twice by each weight update,
    # counted twice in num_replicas, and its drop took it out of both; groups are hardware
    # kinds, so one replica belongs to one
    r, other = Fake("r"), Fake("other")
    with pytest.raises(ValueError, match=r"replica r is listed twice \(groups 'default' and 'H800'\)"):
        LLMProxy({"default": [r], "H800": [other, r]})
    with pytest.raises(ValueError, match=r"replica r is listed twice \(groups 'default' and 'default'\)"):
        LLMProxy({"default": [r, r]})
    proxy = LLMProxy({"default": [r], "H800": [other]})
    await proxy.update_weights(1, ["W1"])
    assert r.swaps == [(1, "W1")] and proxy.num_replicas == 2


async def test_release_forgets_the_trajectory():
    hold = asyncio.Event()
    r0, r1 = Fake("r0", gate=hold, only={"c0"}), Fake("r1")
    proxy = LLMProxy({"default": [r0, r1]})
    assert (await proxy.generate("a", "x", req())).text == "r0"  # a tie: the first
    other = asyncio.create_task(proxy.generate("c", "x", req(request_id="c0")))
    await until(lambda: r0.generated[-1:] == ["c0"])  # r0 now has a turn in flight
    assert (await proxy.generate("a", "x", req())).text == "r0"  # sticky, though r0 is busier
    assert proxy.stats()["trajectories"] == 2
    await proxy.release("a")
    assert proxy.stats()["trajectories"] == 1  # only "c" is still known
    assert (await proxy.generate("a", "x", req())).text == "r1"  # routed afresh: least loaded
    hold.set()
    assert (await other).text == "r0"


async def test_release_aborts_a_turn_its_trajectory_left_running():
    # the caller of a turn went away (its trajectory timed out): under Ray the proxy's side
    # of the call runs on, holding the replica's batch slot; after release nothing knows its
    # request id, so release stops it
    r = Fake("r", gate=asyncio.Event(), only={"t/0"})
    proxy = LLMProxy({"default": [r]})
    turn = asyncio.ensure_future(proxy.generate("t", "x", req(request_id="t/0")))
    await until(lambda: r.generated == ["t/0"])
    await proxy.release("t")
    assert r.aborted == ["t/0"] and (await turn).finish_reason == "abort"
    assert proxy.metrics["aborts"] == 1 and proxy.stats()["trajectories"] == 0
    # the trajectory id is free again; a trajectory that ended cleanly aborts nothing
    assert (await proxy.generate("t", "x", req())).text == "r"
    await proxy.release("t")
    assert r.aborted == ["t/0"]


async def test_an_abort_after_the_release_is_not_kept():
    # a group fills while a member is finishing: the member's release reaches the proxy
    # before the runner's abort. The abort stops nothing and is not kept for the rest of the
    # job (nothing would release the id again); an id used again is live again
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    assert (await proxy.generate("t", "x", req())).text == "r"
    await proxy.release("t")
    assert await proxy.abort("t") == 0
    assert proxy._aborted == set()
    assert (await proxy.generate("t", "x", req())).text == "r"
    assert await proxy.abort("t") == 0  # now it counts: later turns are aborted until released
    assert (await proxy.generate("t", "x", req())).finish_reason == "abort"
    await proxy.release("t")
    assert proxy._aborted == set()


def turn_of(traj_id: str, n: int) -> GenerateRequest:
    """Turn ``n`` of a trajectory as the env manager sends it (its number in the metadata)."""
    return req(request_id=f"{traj_id}/{n}", metadata={"trajectory_id": traj_id, "turn": n})


def assert_forgotten(proxy: LLMProxy, traj_id: str) -> None:
    """Nothing of the trajectory is left in the proxy (nor its turn scheduler)."""
    assert traj_id not in proxy._sticky and traj_id not in proxy._inflight
    assert traj_id not in proxy._aborted and sum(proxy._load.values()) == 0
    if proxy.scheduler is not None:
        assert traj_id not in proxy.scheduler._trajs
        assert proxy.scheduler.stats()["waiting"] == 0


# what the caller sends once it went away (a timeout: abort, then release; a cancelled
# caller: release), delivered before its last turn: Ray runs an async actor's calls in any
# order (and a coalesced turn waits up to a window before it is sent)
OVERTAKEN = [["release"], ["abort", "release"], ["release", "abort"]]


@pytest.mark.parametrize("seen", [0, 2])  # turns of the trajectory that reached the proxy first
@pytest.mark.parametrize("calls", OVERTAKEN, ids="+".join)
async def test_a_turn_that_reaches_the_proxy_after_its_trajectorys_release_is_not_run(seen, calls):
    # the turn began with "an id used again is live again": it cleared the release's mark
    # and ran to its end for nobody, holding an engine slot, and left its affinity, its
    # scheduler state and its replica's load behind for the rest of the job
    from core.rollout.scheduling import TurnScheduler

    r = Fake("r")
    proxy = LLMProxy({"default": [r]}, scheduler=TurnScheduler("fcfs", slots=1))
    for n in range(seen):
        assert (await proxy.generate("t", "x", turn_of("t", n))).text == "r"
    for call in calls:
        await getattr(proxy, call)("t")
    late = turn_of("t", seen)
    c = await asyncio.wait_for(proxy.generate("t", "x", late), 5)
    assert (c.finish_reason, c.token_ids, c.request_id) == ("abort", [], late.request_id)
    assert r.generated == [f"t/{n}" for n in range(seen)]  # it never reached the engine
    assert_forgotten(proxy, "t")
    assert proxy.metrics["turns_after_release"] == 1


async def test_an_id_used_again_after_its_release_is_live_again():
    # the job never uses a trajectory id twice (uuid4 per trajectory, re-runs included), but
    # a caller that does starts its turns over: not a turn sent before the release
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    for n in range(2):
        await proxy.generate("t", "x", turn_of("t", n))
    await proxy.release("t")
    again = turn_of("t", 0)
    assert (await proxy.generate("t", "x", again)).text == "r" and r.generated[-1] == again.request_id
    await proxy.release("t")
    assert_forgotten(proxy, "t")


async def test_a_turn_whose_number_is_not_a_number_is_still_served():
    # the release's check reads the turn's number for every turn, with or without a turn
    # scheduler: a caller's odd metadata must not fail its turn
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    assert (await proxy.generate("t", "x", req(metadata={"turn": "first"}))).text == "r"


async def test_an_abort_that_reaches_the_proxy_before_its_turn_still_aborts_it():
    # a group filled (or the trajectory timed out) as its member sent a turn; the abort is
    # delivered first. It is kept until the release, so the turn is answered aborted then
    from core.rollout.scheduling import TurnScheduler

    r = Fake("r")
    proxy = LLMProxy({"default": [r]}, scheduler=TurnScheduler("fcfs", slots=1))
    await proxy.generate("t", "x", turn_of("t", 0))
    assert await proxy.abort("t") == 0  # nothing in flight yet
    c = await asyncio.wait_for(proxy.generate("t", "x", turn_of("t", 1)), 5)
    assert c.finish_reason == "abort" and r.generated == ["t/0"]
    await proxy.release("t")
    assert_forgotten(proxy, "t")


# ----------------------------------------------------------------------------- aborts


async def test_abort_stops_the_turn_in_flight_on_a_real_engine(tok):
    async with engine(stopless(tiny(tok), tok), tok) as eng:
        proxy = LLMProxy({"default": [LocalReplica(eng)]})
        long = asyncio.create_task(proxy.generate("t", "x", req(max_new_tokens=50, request_id="long")))
        await until(lambda: eng.stats["tokens"] >= 3)
        assert await proxy.abort("t") == 1
        c = await long
        assert c.finish_reason == "abort" and 1 <= len(c.token_ids) < 50
        assert proxy.metrics["aborts"] == 1
        # until released, every later turn of the trajectory is aborted without generating
        tokens = eng.stats["tokens"]
        again = await proxy.generate("t", "x", req(max_new_tokens=5, prompt_ids=[3, 4]))
        assert again.finish_reason == "abort" and again.token_ids == [] and again.prompt_ids == [3, 4]
        assert eng.stats["tokens"] == tokens
        assert await proxy.abort("t") == 0  # nothing in flight: nothing stopped
        # other trajectories are untouched
        other = await proxy.generate("u", "x", req(max_new_tokens=3))
        assert other.finish_reason == "length" and len(other.token_ids) == 3
        await proxy.release("t")
        after = await proxy.generate("t", "x", req(max_new_tokens=3))
        assert after.finish_reason == "length"
        assert eng.num_inflight == 0


async def test_abort_at_a_suspended_engine_and_unknown_trajectories(tok):
    async with engine(tiny(tok), tok) as eng:
        proxy = LLMProxy({"default": [LocalReplica(eng)]})
        assert await proxy.abort("nobody") == 0
        await proxy.release("nobody")
        await eng.suspend()
        t1 = asyncio.create_task(proxy.generate("a", "x", req(request_id="a0")))
        t2 = asyncio.create_task(proxy.generate("b", "x", req(request_id="b0")))
        await until(lambda: eng.num_inflight == 2)
        assert await proxy.abort("a") == 1
        c = await t1
        assert (c.finish_reason, c.token_ids, c.request_id) == ("abort", [], "a0")
        await eng.resume()
        assert (await t2).finish_reason in ("stop", "length")


async def test_abort_ignores_a_replica_that_is_down():
    class DownOnAbort(Fake):
        async def abort(self, request_id: str) -> bool:
            raise ReplicaLost("the actor is restarting")

    gate = asyncio.Event()
    r = DownOnAbort("r", gate=gate)
    proxy = LLMProxy({"default": [r]})
    turn = asyncio.create_task(proxy.generate("t", "x", req()))
    await until(lambda: len(r.generated) == 1)
    assert await proxy.abort("t") == 0
    gate.set()
    await turn


class Wedged(Fake):
    """A replica whose process is alive but stuck (a hung GPU call holds its event loop):
    its turns never end and neither does an abort sent to it."""

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_an_abort_a_wedged_replica_never_answers_is_given_up_after_abort_timeout_s():
    # the trajectory timeout and a group's redundant aborts end in proxy.abort: one replica
    # that never answers it held the trajectory's end (and the job's shutdown) for ever
    r, ok = Wedged("r", gate=asyncio.Event()), Fake("ok", gate=asyncio.Event())
    proxy = LLMProxy({"default": [r, ok]})
    proxy.abort_timeout_s = 0.2
    hung = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
    other = asyncio.create_task(proxy.generate("u", "x", req(request_id="u/0")))
    await until(lambda: r.generated and ok.generated)
    assert await asyncio.wait_for(proxy.abort("t"), 5) == 0
    assert proxy.metrics["abort_timeouts"] == 1 and r.aborted == ["t/0"]
    await asyncio.wait_for(proxy.release("t"), 5)  # released though its turn could not be stopped
    assert "t" not in proxy._sticky
    assert await asyncio.wait_for(proxy.abort("u"), 5) == 1  # a healthy replica's abort still counts
    assert (await other).finish_reason == "abort"
    hung.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await hung


async def test_an_abort_the_replica_fails_still_lets_the_release_finish():
    # the engine's abort raised (a RayTaskError): the error left proxy.abort, and release,
    # which aborts a turn left running first, stopped half-way, keeping the trajectory's
    # affinity, abort flag and scheduler state for the rest of the job
    class BadAbort(Fake):
        async def abort(self, request_id: str) -> bool:
            self.aborted.append(request_id)
            raise EngineError("the engine is closed")

    r = BadAbort("r", gate=asyncio.Event())
    proxy = LLMProxy({"default": [r]})
    turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
    await until(lambda: r.generated == ["t/0"])
    await proxy.release("t")
    assert r.aborted == ["t/0"] and proxy.metrics["abort_errors"] == 1
    assert "t" not in proxy._sticky and "t" not in proxy._aborted and "t" not in proxy._inflight
    turn.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await turn


class SlowAbort(Fake):
    """Its aborts take a round trip: ``asked`` lists them as they arrive, and each is
    answered once ``answer`` is set."""

    def __init__(self, name: str, **kw: Any):
        super().__init__(name, **kw)
        self.asked: list[str] = []
        self.answer = asyncio.Event()

    async def abort(self, request_id: str) -> bool:
        self.asked.append(request_id)
        await self.answer.wait()
        return await super().abort(request_id)


@pytest.mark.parametrize("first", ["release", "abort"])
async def test_a_release_or_abort_and_an_abort_that_overlap_stop_the_turn_once(first):
    # under Ray a trajectory's release (which aborts the turn it left running) and its abort
    # (a full group, its timeout) run in the actor in any order and overlap: each found the
    # turn in flight and both aborts reached the engine
    r = SlowAbort("r", gate=asyncio.Event())
    proxy = LLMProxy({"default": [r]})
    turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
    await until(lambda: r.generated == ["t/0"])
    one = asyncio.create_task(proxy.release("t") if first == "release" else proxy.abort("t"))
    await until(lambda: r.asked == ["t/0"])  # its abort is on its way to the engine
    two = asyncio.create_task(proxy.abort("t"))
    await until(lambda: two.done() or len(r.asked) == 2)
    r.answer.set()
    await asyncio.wait_for(asyncio.gather(one, two), 5)
    assert r.asked == ["t/0"] and two.result() == 0 and proxy.metrics["aborts"] == 1
    assert (await asyncio.wait_for(turn, 5)).finish_reason == "abort"
    await proxy.release("t")
    assert proxy.stats()["trajectories"] == 0 and proxy._aborted == set()


# ----------------------------------------------------------------------------- weights


async def test_update_weights_reaches_every_replica_and_stamps_completions(tok):
    new = tiny(tok, seed=5)
    state = new.state_dict()
    async with engine(tiny(tok), tok) as e1, engine(tiny(tok), tok) as e2:
        proxy = LLMProxy({"default": [LocalReplica(e1, "a")], "other": [LocalReplica(e2, "b")]})
        before = await proxy.generate("t0", "x", req(temperature=0.0, max_new_tokens=4))
        assert before.policy_version == 0
        await proxy.update_weights(1, [state])  # an [ObjectRef]-style wrapped state
        assert proxy.version == 1 and e1.version == 1 and e2.version == 1
        for eng in (e1, e2):
            for k, v in state.items():
                assert torch.equal(eng.model.state_dict()[k], v)
            assert not eng.suspended  # swap resumes the engine
        proxy.affinity["y"] = "other"
        for traj, tag in (("t1", "x"), ("t2", "y")):
            c = await proxy.generate(traj, tag, req(temperature=0.0, max_new_tokens=4))
            assert c.policy_version == 1
        await proxy.update_weights(2, state)  # a bare state works too
        assert (await proxy.generate("t3", "y", req())).policy_version == 2
        with pytest.raises(EngineError, match="older"):
            await proxy.update_weights(1, [state])
        assert proxy.version == 2 and proxy.metrics["weight_updates"] == 2


async def test_swap_weights_resumes_the_engine_even_when_loading_fails(tok):
    async with engine(tiny(tok), tok) as eng:
        with pytest.raises(EngineError, match="do not fit"):
            await swap_weights(eng, 1, {"nope": torch.zeros(1)})
        assert not eng.suspended and eng.version == 0
        assert (await eng.generate(req())).policy_version == 0


async def test_a_replica_down_during_update_weights_gets_them_when_back():
    up, down = Fake("up"), Fake("down", swap_down=1, ping_down=1)
    proxy = LLMProxy({"default": [up, down]})
    await proxy.update_weights(4, ["STATE"])
    assert proxy.version == 4 and up.swaps == [(4, "STATE")]
    await until(lambda: proxy.metrics["replicas_recovered"] == 1)
    assert down.swaps == [(4, "STATE")] and proxy.metrics["weights_reloaded"] == 1
    assert proxy.num_replicas == 2


class HangingSwap(Fake):
    """Alive, answers pings, but its swaps never return (a wedged load)."""

    async def swap(self, version: int, state: Any) -> None:
        await asyncio.Event().wait()


async def test_a_replica_whose_swap_hangs_does_not_hold_the_weight_update():
    # update_weights gathered every replica's swap with no limit: one stuck replica held it,
    # and with it the job's step loop, for good. Past swap_timeout_s it counts as lost, the
    # update goes on, and its recovery (whose reload hangs too) drops it at recover_timeout_s
    up, stuck = Fake("up"), HangingSwap("stuck")
    proxy = LLMProxy({"default": [up, stuck]}, swap_timeout_s=0.2, recover_timeout_s=0.5)
    async with asyncio.timeout(10):
        await proxy.update_weights(1, ["W1"])
    assert proxy.version == 1 and up.swaps == [(1, "W1")]
    assert proxy.metrics["swap_timeouts"] == 1
    await until(lambda: proxy.metrics["replicas_removed"] == 1)  # the reload is bounded too
    assert proxy.num_replicas == 1 and proxy.metrics["ping_timeouts"] == 1
    c = await proxy.generate("t", "default", req())
    assert c.text == "up" and c.policy_version == 1


class BadSwap(Fake):
    """Its engine fails its next ``bad`` swaps with its own error (a RayTaskError: out of
    memory while loading); ``back``, when given, holds its pings until it is set."""

    def __init__(self, name: str, *, bad: float = 1, back: asyncio.Event | None = None, **kw: Any):
        super().__init__(name, **kw)
        self.bad, self.back = bad, back

    async def swap(self, version: int, state: Any) -> None:
        if self.bad > 0:
            self.bad -= 1
            raise EngineError("CUDA out of memory while loading")
        await super().swap(version, state)

    async def ping(self) -> int:
        if self.back is not None:
            await self.back.wait()
        return await super().ping()


async def test_a_replica_whose_swap_raises_is_recovered_while_the_update_goes_on():
    # one replica's engine failed its swap with its own error: update_weights raised it and
    # failed the job, though the other replica held the new weights
    back = asyncio.Event()
    bad, ok = BadSwap("bad", back=back), Fake("ok")
    proxy = LLMProxy({"default": [bad, ok]}, rejoin_first_s=None)
    try:
        assert (await proxy.generate("t", "x", req())).text == "bad"  # a tie: the first
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        assert proxy.version == 1 and ok.swaps == [(1, "W1")] and proxy.metrics["swap_errors"] == 1
        # routed around until its recovery has loaded the new weights into it
        c = await asyncio.wait_for(proxy.generate("t", "x", req()), 5)
        assert (c.text, c.policy_version) == ("ok", 1) and proxy.metrics["turns_rerouted"] == 1
        back.set()
        await until(lambda: proxy.metrics["replicas_recovered"] == 1)
        assert bad.swaps == [(1, "W1")] and proxy.metrics["weights_reloaded"] == 1
        assert proxy.groups["default"] == [bad, ok]
        c = await proxy.generate("u", "x", req())  # it serves again (a tie: the first)
        assert (c.text, c.policy_version) == ("bad", 1)
    finally:
        await proxy.aclose()


async def test_a_replica_whose_swap_keeps_failing_leaves_its_group():
    bad, ok = BadSwap("bad", bad=float("inf")), Fake("ok")
    proxy = LLMProxy({"default": [bad, ok]}, rejoin_first_s=None)
    try:
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        assert proxy.version == 1 and proxy.metrics["swap_errors"] == 1
        await until(lambda: proxy.metrics["replicas_removed"] == 1)  # its reload failed too
        assert proxy.groups["default"] == [ok] and proxy.metrics["recover_errors"] == 1
    finally:
        await proxy.aclose()


async def test_an_update_no_replica_could_load_fails():
    # weights every engine refuses (a shape that does not fit) are the job's error, not the
    # replicas': they are left as they were, on the weights they hold
    a, b = BadSwap("a", bad=float("inf")), BadSwap("b", bad=float("inf"))
    proxy = LLMProxy({"default": [a, b]})
    with pytest.raises(EngineError, match="CUDA out of memory"):
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
    assert proxy.version == 0 and proxy.metrics["swap_errors"] == 2 and proxy.metrics["weight_updates"] == 0
    assert proxy._recovering == {} and proxy.num_replicas == 2
    assert (await proxy.generate("t", "x", req())).policy_version == 0


async def test_a_recovery_during_an_update_every_replica_refuses_does_not_load_its_weights():
    # the update published its weights as the latest before it swapped: a recovery running
    # meanwhile loaded them into its replica, then the update was refused (every replica it
    # swapped failed) and rolled the latest back, so that replica served weights version 1,
    # which the trainer was told were never published
    r = SlowPing("r", fail=[ReplicaLost("died")])

    class Refuses(Fake):
        async def swap(self, version: int, state: Any) -> None:
            r.back.set()  # r answers its recovery's ping while this swap is under way
            with contextlib.suppress(TimeoutError):  # (the bound is only for the fixed code)
                await asyncio.wait_for(r_loading.wait(), 1.0)
            raise EngineError("the weights do not fit")

    r_loading = asyncio.Event()
    real_swap = r.swap

    async def swap(version: int, state: Any) -> None:
        r_loading.set()
        await real_swap(version, state)

    r.swap = swap  # type: ignore[method-assign]
    a = Refuses("a")
    proxy = LLMProxy({"default": [r, a]}, rejoin_first_s=None)
    try:
        c = await asyncio.wait_for(proxy.generate("t", "x", req(request_id="t/0")), 5)
        assert c.text == "a" and r.pings == 1  # lost on r (a tie: the first); r is recovering
        with pytest.raises(EngineError, match="do not fit"):
            await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        await until(lambda: proxy.metrics["replicas_recovered"] == 1)
        assert r.swaps == [] and r.version == 0 and proxy.version == 0
        assert proxy.groups["default"] == [r, a]
        c = await proxy.generate("u", "x", req())  # a tie: the first
        assert (c.text, c.policy_version) == ("r", 0)
    finally:
        await proxy.aclose()


async def test_a_recovery_during_an_update_loads_its_weights_once_a_replica_took_them():
    # a recovery waits to know whether the update's weights are published; one replica that
    # took them decides it (only an update no replica could load is refused): a replica
    # whose swap hangs must not hold the recovery for swap_timeout_s
    r = SlowPing("r", fail=[ReplicaLost("died")])
    ok, stuck = Fake("ok"), HangingSwap("stuck")
    proxy = LLMProxy({"default": [r, ok, stuck]}, swap_timeout_s=60, rejoin_first_s=None)
    update: asyncio.Task[None] | None = None
    try:
        c = await asyncio.wait_for(proxy.generate("t", "x", req(request_id="t/0")), 5)
        assert c.text == "ok" and r.pings == 1  # lost on r (a tie: the first); r is recovering
        update = asyncio.create_task(proxy.update_weights(1, ["W1"]))
        await until(lambda: ok.swaps == [(1, "W1")])
        r.back.set()
        await until(lambda: proxy.metrics["replicas_recovered"] == 1)
        assert r.swaps == [(1, "W1")] and not update.done()  # still waiting for "stuck"
    finally:
        if update is not None:
            update.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await update
        await proxy.aclose()


async def test_a_replica_that_loaded_the_weights_of_a_refused_update_leaves_its_group():
    # its swap loaded them, but the answer was lost (ReplicaLost); every other replica
    # refused them, so the update failed and published nothing. Its recovery found it
    # answering, at version 1, and put it back: it served weights never published (an
    # engine does not go back to older weights, so it cannot be reloaded either)
    class LoadsThenLost(Fake):
        async def swap(self, version: int, state: Any) -> None:
            await super().swap(version, state)
            raise ReplicaLost("the answer was lost on its way back")

    r, a = LoadsThenLost("r"), BadSwap("a", bad=float("inf"))
    proxy = LLMProxy({"default": [r, a]}, rejoin_first_s=None)
    try:
        with pytest.raises(EngineError, match="CUDA out of memory"):
            await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        await until(lambda: proxy.metrics["replicas_removed"] == 1)
        assert proxy.groups["default"] == [a] and proxy.version == 0
        assert (await proxy.generate("t", "x", req())).policy_version == 0
    finally:
        await proxy.aclose()


async def test_a_replica_dropped_before_its_swap_starts_does_not_hold_the_update():
    # an update lists the healthy replicas, then swaps each: one dropped in between (its
    # recovery gave up on it) was swapped all the same, outside its group, where no drop
    # could end the call any more, and the update waited swap_timeout_s on it
    stuck = HangingSwap("stuck")

    class DropsTheOther(Fake):
        async def swap(self, version: int, state: Any) -> None:
            # its swap starts first: the other's drop lands before that one's swap starts
            proxy._drop(stuck, "not back by the recover timeout", rejoin=False)
            await super().swap(version, state)

    first = DropsTheOther("first")
    proxy = LLMProxy({"default": [first, stuck]}, swap_timeout_s=60)
    try:
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        assert proxy.version == 1 and first.swaps == [(1, "W1")] and proxy.groups["default"] == [first]
        assert proxy.metrics["swap_timeouts"] == 0
    finally:
        await proxy.aclose()


# ----------------------------------------------------------------------------- recovery


async def test_a_lost_replica_is_pinged_reloaded_and_the_turn_rerun_on_it():
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    await proxy.update_weights(2, ["W2"])
    # the process dies mid-turn; Ray restarts it with its initial weights (version 0)
    r.fail = [ReplicaLost("actor died")]
    r.ping_down = 2
    r.version = 0
    c = await proxy.generate("t", "x", req(request_id="turn"))
    assert c.policy_version == 2 and c.text == "r"
    # the same turn, run again on the same replica, under an id of its own (the replica
    # answers an id it was asked to abort as aborted: test_proxy_replica_order)
    assert r.generated == ["turn", "turn#rerun1"] and r.aborted == ["turn"] and c.request_id == "turn"
    assert r.pings == 3 and r.swaps == [(2, "W2"), (2, "W2")]
    m = proxy.metrics
    assert (m["replica_lost"], m["turns_rerun"], m["weights_reloaded"], m["replicas_recovered"]) == (
        1,
        1,
        1,
        1,
    )


async def test_a_replica_back_with_current_weights_is_not_reloaded():
    r = Fake("r", fail=[ReplicaLost("blip")])
    proxy = LLMProxy({"default": [r]})
    await proxy.update_weights(1, ["W1"])
    c = await proxy.generate("t", "x", req())
    assert c.policy_version == 1 and r.swaps == [(1, "W1")]
    assert proxy.metrics["weights_reloaded"] == 0 and proxy.metrics["replicas_recovered"] == 1


async def test_turns_lost_together_reload_the_weights_once():
    gate = asyncio.Event()
    r = Fake("r", gate=gate, fail=[ReplicaLost("died"), ReplicaLost("died")])
    proxy = LLMProxy({"default": [r]})
    await proxy.update_weights(3, ["W3"])
    r.version = 0  # restarted with initial weights
    turns = [asyncio.create_task(proxy.generate(t, "x", req())) for t in ("a", "b")]
    await until(lambda: len(r.generated) == 2)
    gate.set()
    done = await asyncio.gather(*turns)
    assert [c.policy_version for c in done] == [3, 3]
    assert proxy.metrics["replica_lost"] == 2 and proxy.metrics["weights_reloaded"] == 1
    assert r.swaps == [(3, "W3"), (3, "W3")]  # the update, then one reload


async def test_a_replica_restarted_between_turns_does_not_serve_its_initial_weights():
    # the process died while idle (OOM-killed between turns) and Ray restarted it before the
    # next call: that call succeeds, on the initial weights. No ReplicaLost ever reached the
    # proxy, which served version-0 turns after publishing 3 (past any asynchronous bound)
    r = Fake("r")
    proxy = LLMProxy({"default": [r]})
    await proxy.update_weights(3, ["W3"])
    r.version = 0
    c = await proxy.generate("t", "x", req(request_id="turn"))
    assert c.policy_version == 3 and r.generated == ["turn", "turn#rerun1"] and c.request_id == "turn"
    assert r.swaps == [(3, "W3"), (3, "W3")] and proxy.metrics["weights_reloaded"] == 1
    assert proxy.metrics["stale_weights_turns"] == 1 and proxy.metrics["turns_rerun"] == 1


async def test_a_turn_that_straddles_a_weight_update_keeps_its_older_version():
    # dispatched under version 1, finished after 2 was published: honest, not a restart
    gate = asyncio.Event()
    r = Fake("r", gate=gate)
    proxy = LLMProxy({"default": [r]})
    await proxy.update_weights(1, ["W1"])
    turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="turn")))
    await until(lambda: r.generated == ["turn"])
    await proxy.update_weights(2, ["W2"])
    r.version = 1  # as the engine stamps a turn whose tokens began under version 1
    gate.set()
    c = await turn
    assert c.policy_version == 1 and r.generated == ["turn"]
    assert proxy.metrics["stale_weights_turns"] == 0


async def test_a_gone_replica_leaves_its_group_and_the_turn_moves_on():
    gone, ok = Fake("gone", fail=[ReplicaGone("out of restarts")]), Fake("ok")
    proxy = LLMProxy({"default": [gone, ok]})
    c = await proxy.generate("t", "x", req(request_id="turn"))
    assert c.text == "ok" and gone.generated == ["turn"] and ok.generated == ["turn"]
    assert proxy.groups["default"] == [ok] and proxy.num_replicas == 1
    assert gone.pings == 0  # gone for good: not waited for
    assert proxy.metrics["replicas_removed"] == 1
    assert proxy.stats()["replicas"] == {"default": ["ok"]}
    assert (await proxy.generate("t", "x", req())).text == "ok"  # sticks to the survivor


async def test_no_replica_left_is_a_no_replica_error():
    proxy = LLMProxy({"default": [Fake("only", fail=[ReplicaGone("gone")])]})
    with pytest.raises(NoReplicaError, match="no engine replica left"):
        await proxy.generate("t", "x", req())
    assert proxy.num_replicas == 0
    assert issubclass(NoReplicaError, EngineError)  # the env manager records infra_failed
    with pytest.raises(NoReplicaError):
        await proxy.generate("u", "x", req())


async def test_a_replica_that_never_comes_back_is_removed_after_the_recover_timeout():
    never = Fake("never", fail=[ReplicaLost("died")], ping_down=float("inf"))
    proxy = LLMProxy({"default": [never]}, recover_timeout_s=0.2)
    with pytest.raises(NoReplicaError):
        await asyncio.wait_for(proxy.generate("t", "x", req()), 5)
    assert never.pings >= 2 and proxy.metrics["replicas_removed"] == 1


async def test_a_replica_whose_ping_never_answers_is_removed_after_the_recover_timeout():
    # lost mid-turn, then wedged (or on a node cut off): the recovery's ping hangs, and the
    # recover timeout, checked only when a ping failed, never fired. The turn, every turn
    # routed to the replica after it, and the replica's place in its group waited for ever
    class Silent(Fake):
        async def ping(self) -> int:
            self.pings += 1
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    r, ok = Silent("silent", fail=[ReplicaLost("died")]), Fake("ok")
    proxy = LLMProxy({"default": [r, ok]}, recover_timeout_s=0.2)
    c = await asyncio.wait_for(proxy.generate("t", "x", req(request_id="turn")), 5)
    assert c.text == "ok"  # moved on to the survivor (at once: it is healthy)
    await until(lambda: proxy.metrics["replicas_removed"] == 1)
    assert proxy.groups["default"] == [ok] and r.pings == 1
    await proxy.aclose()


async def test_a_turn_rerun_after_a_blip_does_not_meet_its_first_run_still_on_the_engine(tok):
    # Ray's ActorUnavailableError (a RayActorError: ReplicaLost) says the actor could not be
    # reached, not that it died: the first run of the turn goes on in the engine. The rerun,
    # same request id on the same replica, was refused ("already in flight") and the
    # trajectory failed, while the orphan held a batch slot to its end
    class Blip(LocalReplica):
        def __init__(self, engine: TorchEngine):
            super().__init__(engine, "blip")
            self.orphans: list[asyncio.Task[Completion]] = []

        async def generate(self, request: GenerateRequest) -> Completion:
            if not self.orphans:  # sent, then the answer is lost on the way back
                self.orphans.append(asyncio.create_task(self.engine.generate(request)))
                await until(lambda: self.engine.num_inflight == 1)
                raise ReplicaLost("blip: ActorUnavailableError")
            return await super().generate(request)

    async with engine(stopless(tiny(tok), tok), tok) as eng:
        r = Blip(eng)
        proxy = LLMProxy({"default": [r]})
        c = await asyncio.wait_for(proxy.generate("t", "x", req(max_new_tokens=40, request_id="turn")), 20)
        assert c.finish_reason == "length" and len(c.token_ids) == 40
        [orphan] = r.orphans
        assert (await orphan).finish_reason == "abort"  # stopped before the rerun, not run to its end
        assert c.request_id == "turn" and proxy.metrics["turns_rerun"] == 1
        assert eng.num_inflight == 0 and proxy._inflight == {"t": {}}


async def test_a_turn_that_keeps_losing_its_replica_fails_after_max_turn_retries():
    r = Fake("r", fail=[ReplicaLost(f"died {i}") for i in range(10)])
    proxy = LLMProxy({"default": [r]}, max_turn_retries=2)
    with pytest.raises(ReplicaLost, match="died 2"):
        await proxy.generate("t", "x", req())
    assert len(r.generated) == 3 and proxy.metrics["turns_rerun"] == 2


async def test_a_trajectory_aborted_while_its_replica_recovers_gets_abort():
    r = Fake("r", fail=[ReplicaLost("died")], ping_down=float("inf"))
    proxy = LLMProxy({"default": [r]}, recover_timeout_s=0.3)
    turn = asyncio.create_task(proxy.generate("t", "x", req()))
    await until(lambda: r.pings >= 1)
    assert await proxy.abort("t") == 0  # nothing in flight on a replica
    c = await turn  # the replica is given up meanwhile; the turn is aborted, not failed
    assert c.finish_reason == "abort" and len(r.generated) == 1


async def test_recovery_gives_up_on_a_replica_whose_reload_keeps_failing():
    r = Fake("r", fail=[ReplicaLost("died")], swap_down=float("inf"))
    proxy = LLMProxy({"default": [r]}, recover_timeout_s=0.2)
    proxy._latest = (1, "W1")  # weights were published: the recovery must reload them
    try:
        with pytest.raises(NoReplicaError):
            await asyncio.wait_for(proxy.generate("t", "x", req()), 1.0)
    finally:
        for t in proxy._recovering.values():
            t.cancel()
        await asyncio.gather(*proxy._recovering.values(), return_exceptions=True)


class Stuck(Fake):
    """A replica that works until ``wedged`` is set, then hangs in every call made to it
    (a hung GPU call holds its event loop); calls made after ``wedged`` is cleared work
    again (it came back). ``swaps_started`` counts swaps sent, hung ones included."""

    def __init__(self, name: str, **kw: Any):
        super().__init__(name, **kw)
        self.wedged = False
        self.swaps_started = 0

    async def _hang_if_wedged(self) -> None:
        if self.wedged:
            await asyncio.Event().wait()

    async def generate(self, request: GenerateRequest) -> Completion:
        if self.wedged:
            self.generated.append(request.request_id)
            await self._hang_if_wedged()
        return await super().generate(request)

    async def abort(self, request_id: str) -> bool:
        await self._hang_if_wedged()
        return await super().abort(request_id)

    async def swap(self, version: int, state: Any) -> None:
        self.swaps_started += 1
        await self._hang_if_wedged()
        await super().swap(version, state)

    async def ping(self) -> int:
        await self._hang_if_wedged()
        return await super().ping()


async def test_new_turns_go_around_a_replica_while_it_recovers():
    # a replica stuck in its weight swap is recovered in the background, and stayed in its
    # group meanwhile: its trajectories' next turns, and new ones it was the least loaded
    # for, went to it and hung until the trajectory timeout. Each weight update waited
    # swap_timeout_s on it again, too
    stuck, up = Stuck("stuck"), Fake("up")
    proxy = LLMProxy({"default": [stuck, up]}, swap_timeout_s=0.2, recover_timeout_s=60)
    try:
        assert (await proxy.generate("t", "x", req())).text == "stuck"  # a tie: the first
        stuck.wedged = True
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        assert proxy.metrics["swap_timeouts"] == 1
        c = await asyncio.wait_for(proxy.generate("t", "x", req()), 5)  # its replica is stuck
        assert (c.text, c.policy_version) == ("up", 1)
        assert (await asyncio.wait_for(proxy.generate("u", "x", req()), 5)).text == "up"
        assert proxy.metrics["turns_rerouted"] == 1  # "t" left its replica; "u" never had one
        await asyncio.wait_for(proxy.update_weights(2, ["W2"]), 5)  # not held by it again
        assert proxy.metrics["swap_timeouts"] == 1 and stuck.swaps_started == 1
        assert stuck.generated == [stuck.generated[0]]  # nothing was sent to it while stuck
    finally:
        await proxy.aclose()


async def test_a_turn_lost_beside_a_healthy_replica_moves_there_at_once():
    # it waited for its own replica's recovery (up to recover_timeout_s, 120 s) though
    # another replica of its group could run it now: a turn has no side effects
    r = Fake("r", fail=[ReplicaLost("died")], ping_down=float("inf"))
    ok = Fake("ok")
    proxy = LLMProxy({"default": [r, ok]}, recover_timeout_s=60)
    try:
        c = await asyncio.wait_for(proxy.generate("t", "x", req(request_id="t/0")), 5)
        assert c.text == "ok" and c.request_id == "t/0"
        # its first run may go on in r's engine (unreachable is not dead): the rerun has an
        # id of its own, and r is sent nothing while it recovers
        assert r.generated == ["t/0"] and ok.generated == ["t/0#rerun1"]
        assert proxy.metrics["turns_rerun"] == 1 and proxy.metrics["replicas_removed"] == 0
    finally:
        await proxy.aclose()


async def test_turns_in_flight_on_a_replica_dropped_by_its_recovery_move_to_a_healthy_one():
    # dropped at recover_timeout_s, the replica left its group, but the turns running on it
    # (hung with it) waited on until the trajectory timeout
    stuck, up = Stuck("stuck"), Fake("up")
    proxy = LLMProxy({"default": [stuck, up]}, swap_timeout_s=0.2, recover_timeout_s=0.3)
    try:
        stuck.wedged = True
        turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
        await until(lambda: stuck.generated == ["t/0"])
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        c = await asyncio.wait_for(turn, 5)
        assert (c.text, c.request_id, c.policy_version) == ("up", "t/0", 1)
        assert proxy.groups["default"] == [up] and proxy.metrics["replicas_removed"] == 1
        assert proxy.metrics["turns_rerun"] == 1
    finally:
        await proxy.aclose()


async def test_a_turn_waiting_for_a_slot_on_a_replica_that_left_runs_elsewhere():
    # the turn scheduler's line of a dropped replica: the turns that move off it free their
    # slots, and the one let in next must not be sent to the replica that left
    from core.rollout.scheduling import TurnScheduler

    stuck, up = Stuck("stuck"), Fake("up")
    proxy = LLMProxy(
        {"default": [stuck, up]},
        swap_timeout_s=0.2,
        recover_timeout_s=0.3,
        scheduler=TurnScheduler("fcfs", slots=1),
    )
    try:
        for traj in ("t", "u"):  # both stick to "stuck" (one at a time: a tie each)
            assert (await proxy.generate(traj, "x", req(metadata={"turn": 0}))).text == "stuck"
        stuck.wedged = True
        t1 = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/1", metadata={"turn": 1})))
        await until(lambda: "t/1" in stuck.generated)
        u1 = asyncio.create_task(proxy.generate("u", "x", req(request_id="u/1", metadata={"turn": 1})))
        await until(lambda: proxy.scheduler is not None and proxy.scheduler.waiting_of("u") == 1)
        await proxy.update_weights(1, ["W1"])
        done = await asyncio.wait_for(asyncio.gather(t1, u1), 5)
        assert [c.text for c in done] == ["up", "up"] and "u/1" not in stuck.generated
    finally:
        await proxy.aclose()


async def test_a_dropped_replica_rejoins_with_the_current_weights_once_it_answers():
    # past recover_timeout_s a replica left its group for good: a node cut off for three
    # minutes cost the job that replica for the rest of the run
    hold = asyncio.Event()
    stuck, up = Stuck("stuck"), Fake("up", gate=hold, only={"h/0"})
    proxy = LLMProxy(
        {"default": [stuck, up]},
        swap_timeout_s=0.2,
        recover_timeout_s=0.3,
        rejoin_first_s=0.05,
        rejoin_max_s=0.2,
    )
    try:
        stuck.wedged = True
        turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
        await until(lambda: stuck.generated == ["t/0"])
        await proxy.update_weights(1, ["W1"])
        assert (await asyncio.wait_for(turn, 5)).text == "up"
        assert proxy.groups["default"] == [up]
        await proxy.update_weights(2, ["W2"])  # published while it is out
        await until(lambda: proxy.metrics["ping_timeouts"] >= 2)  # a retry found it stuck still
        assert proxy.groups["default"] == [up]
        stuck.wedged = False  # it answers again
        await until(lambda: proxy.metrics["replicas_rejoined"] == 1)
        assert proxy.groups["default"] == [up, stuck]
        assert stuck.version == 2 and stuck.swaps == [(2, "W2")]  # the latest, once
        assert stuck.aborted == ["t/0"]  # what it was running when it left is stopped
        held = asyncio.create_task(proxy.generate("h", "x", req(request_id="h/0")))
        await until(lambda: "h/0" in up.generated)
        assert (await proxy.generate("v", "x", req())).text == "stuck"  # it serves again
        hold.set()
        assert (await held).text == "up"
        assert proxy.num_replicas == 2 and proxy.metrics["replicas_removed"] == 1
    finally:
        await proxy.aclose()


async def test_a_replica_gone_for_good_is_not_tried_again():
    gone, ok = Fake("gone", fail=[ReplicaGone("out of restarts")]), Fake("ok")
    proxy = LLMProxy({"default": [gone, ok]}, rejoin_first_s=0.01)
    try:
        assert (await proxy.generate("t", "x", req())).text == "ok"
        assert proxy._rejoining == {} and gone.pings == 0
    finally:
        await proxy.aclose()


class GoneWhenWedged(Stuck):
    """A ``Stuck`` replica whose pings, once wedged, say it is gone for good."""

    async def ping(self) -> int:
        if self.wedged:
            raise ReplicaGone("out of restarts")
        return await super().ping()


@pytest.mark.parametrize("kind", ["gone", "never rejoined"])
async def test_a_replica_dropped_for_good_leaves_no_request_ids_behind(kind):
    # the request ids running on a dropped replica were kept to abort before its rejoin;
    # for one never tried again (gone, or engine.rejoin_first_s null) they were kept for the
    # job's life, a few strings per lost turn
    stuck = GoneWhenWedged("stuck") if kind == "gone" else Stuck("stuck")
    up = Fake("up")
    proxy = LLMProxy({"default": [stuck, up]}, swap_timeout_s=0.2, recover_timeout_s=0.3, rejoin_first_s=None)
    try:
        for traj in ("t", "u"):  # both stick to "stuck" (one at a time: a tie each)
            assert (await proxy.generate(traj, "x", req(request_id=f"{traj}/0"))).text == "stuck"
        stuck.wedged = True
        turns = [asyncio.create_task(proxy.generate(t, "x", req(request_id=f"{t}/1"))) for t in ("t", "u")]
        await until(lambda: {"t/1", "u/1"} <= set(stuck.generated))
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        assert [c.text for c in await asyncio.wait_for(asyncio.gather(*turns), 5)] == ["up", "up"]
        assert proxy.groups["default"] == [up] and proxy._rejoining == {}
        assert proxy._orphans == {}
    finally:
        await proxy.aclose()


async def test_an_abort_just_after_a_drop_does_not_reach_the_dropped_replica():
    # dropped, a replica's turns in flight wake and clean up at their next step; an abort in
    # between still sent them to the replica that left (a stuck one held the abort up to
    # abort_timeout_s), and its rejoin stopped them a second time
    hold = asyncio.Event()
    r = Fake("r", gate=hold)
    proxy = LLMProxy({"default": [r]}, rejoin_first_s=0.01, rejoin_max_s=0.02)
    try:
        turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
        await until(lambda: r.generated == ["t/0"])
        proxy._drop(r, "its recovery gave up", rejoin=True)  # (the moment a recovery drops it)
        stopped = await proxy.abort("t")
        assert r.aborted == [] and stopped == 0  # its turn ends without it: the rejoin stops the run
        assert (await asyncio.wait_for(turn, 5)).finish_reason == "abort"
        await until(lambda: proxy.metrics["replicas_rejoined"] == 1)
        assert r.aborted == ["t/0"]  # once, before it rejoined
    finally:
        await proxy.aclose()


class SlowPing(Fake):
    """A replica whose pings wait until ``back`` is set (its restart takes a while)."""

    def __init__(self, name: str, **kw: Any):
        super().__init__(name, **kw)
        self.back = asyncio.Event()

    async def ping(self) -> int:
        self.pings += 1
        await self.back.wait()
        return self.version


async def test_a_turn_released_while_its_replica_recovers_is_not_run_again():
    # the caller went away (its trajectory timed out) while the turn waited for its
    # replica's recovery; the release found nothing in flight to abort, and the turn, rerun
    # after the recovery for nobody, took the replica's slot and left its affinity behind
    r = SlowPing("r", fail=[ReplicaLost("died")])
    proxy = LLMProxy({"default": [r]})
    turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
    await until(lambda: r.pings == 1)
    await proxy.release("t")
    r.back.set()
    c = await asyncio.wait_for(turn, 5)
    assert c.finish_reason == "abort" and r.generated == ["t/0"]
    assert "t" not in proxy._sticky and proxy.metrics["turns"] == 0


async def test_weights_published_while_a_recovery_reloads_older_ones_are_loaded_too():
    # update_weights skips a replica being recovered, since its recovery loads the latest:
    # a version published while that reload was loading an older one must be loaded after
    # it, or the replica rejoins its group a version behind (found stale at its next turn)
    class SlowReload(Fake):
        def __init__(self, name: str, **kw: Any):
            super().__init__(name, **kw)
            self.loading, self.go = asyncio.Event(), asyncio.Event()

        async def swap(self, version: int, state: Any) -> None:
            if version == 1:
                self.loading.set()
                await self.go.wait()
            await super().swap(version, state)

    r, ok = SlowReload("r", fail=[ReplicaLost("died")]), Fake("ok")
    proxy = LLMProxy({"default": [r, ok]}, rejoin_first_s=None)
    proxy._latest = (1, "W1")  # weights were published: the recovery must reload them
    try:
        assert (await asyncio.wait_for(proxy.generate("t", "x", req()), 5)).text == "ok"
        await asyncio.wait_for(r.loading.wait(), 5)  # its recovery loads version 1
        await proxy.update_weights(2, ["W2"])  # skips r: it is being recovered
        assert ok.swaps == [(2, "W2")] and r.swaps == []
        r.go.set()
        await until(lambda: proxy.metrics["replicas_recovered"] == 1)
        assert r.swaps == [(1, "W1"), (2, "W2")] and r.version == 2
    finally:
        await proxy.aclose()


async def test_a_replica_whose_reload_raises_leaves_its_group():
    # a reload that fails with the engine's own error (a RayTaskError: out of memory while
    # loading) escaped the recovery: the replica stayed in its group on its old weights,
    # and every turn sent to it was found stale, recovered, failed again
    class BadLoad(Fake):
        async def swap(self, version: int, state: Any) -> None:
            raise EngineError("CUDA out of memory while loading")

    r, ok = BadLoad("r", fail=[ReplicaLost("died")]), Fake("ok")
    proxy = LLMProxy({"default": [r, ok]}, rejoin_first_s=None)
    proxy._latest = (1, "W1")  # weights were published: the recovery must reload them
    try:
        assert (await asyncio.wait_for(proxy.generate("t", "x", req()), 5)).text == "ok"
        await until(lambda: proxy.metrics["replicas_removed"] == 1)
        assert proxy.groups["default"] == [ok] and proxy.metrics["recover_errors"] == 1
    finally:
        await proxy.aclose()


async def test_a_turn_waiting_for_a_slot_on_a_recovering_replica_is_rerouted():
    # new turns already went around a replica being recovered, but one waiting in its
    # turn scheduler's line stayed there until the replica was dropped (recover_timeout_s)
    from core.rollout.scheduling import TurnScheduler

    stuck, up = Stuck("stuck"), Fake("up")
    proxy = LLMProxy(
        {"default": [stuck, up]},
        swap_timeout_s=0.2,
        recover_timeout_s=60,
        scheduler=TurnScheduler("fcfs", slots=1),
    )
    t1: asyncio.Task[Completion] | None = None
    try:
        for traj in ("t", "u"):  # both stick to "stuck" (one at a time: a tie each)
            assert (await proxy.generate(traj, "x", req(metadata={"turn": 0}))).text == "stuck"
        stuck.wedged = True
        t1 = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/1", metadata={"turn": 1})))
        await until(lambda: "t/1" in stuck.generated)
        u1 = asyncio.create_task(proxy.generate("u", "x", req(request_id="u/1", metadata={"turn": 1})))
        await until(lambda: proxy.scheduler is not None and proxy.scheduler.waiting_of("u") == 1)
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)  # its swap hangs: recovered
        c = await asyncio.wait_for(u1, 5)
        assert (c.text, c.policy_version) == ("up", 1) and "u/1" not in stuck.generated
        assert proxy.metrics["turns_rerouted"] == 1 and proxy.metrics["replicas_removed"] == 0
    finally:
        if t1 is not None:
            t1.cancel()
        await proxy.aclose()


async def test_abort_ends_the_wait_of_a_turn_whose_group_is_all_recovering():
    # a turn that lost its replica, and a new one, both wait for the group's only replica
    # to come back; an abort of their trajectory left them waiting up to recover_timeout_s
    r = SlowPing("r", fail=[ReplicaLost("died")])
    proxy = LLMProxy({"default": [r]}, rejoin_first_s=None)
    try:
        lost = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/0")))
        await until(lambda: r.pings == 1)  # lost its replica; waits for the recovery
        new = asyncio.create_task(proxy.generate("u", "x", req(request_id="u/0")))
        gone = asyncio.create_task(proxy.generate("v", "x", req(request_id="v/0")))
        for waiting in (new, gone):
            await until(lambda w=waiting: inspect.getcoroutinestate(w.get_coro()) == inspect.CORO_SUSPENDED)
        for traj, turn in (("t", lost), ("u", new)):
            assert await proxy.abort(traj) == 0  # nothing of it runs on a replica
            c = await asyncio.wait_for(turn, 5)
            assert c.finish_reason == "abort" and c.token_ids == []
        await proxy.release("v")  # its caller went away: nobody waits for the turn any more
        assert (await asyncio.wait_for(gone, 5)).finish_reason == "abort"
        assert r.generated == ["t/0"]
        # the first run of t's turn may go on in the engine: it is stopped once the replica
        # is back, and only then (the abort tried it at once too, at a replica down)
        assert r.aborted == []
        r.back.set()
        await until(lambda: proxy.metrics["replicas_recovered"] == 1 and not proxy._background)
        assert r.aborted == ["t/0"]
        assert r.generated == ["t/0"] and proxy.metrics["turns"] == 0 and proxy.metrics["turns_rerun"] == 0
    finally:
        await proxy.aclose()


# ----------------------------------------------------------------------------- settings


def test_the_rejoin_timings_are_engine_settings_the_proxy_takes():
    # they were module constants: a job could not wait less (a node back in seconds) or more
    cfg = EngineConfig(rejoin_first_s=5, rejoin_max_s=40, recover_timeout_s=9, swap_timeout_s=7)
    proxy = LLMProxy({"default": [Fake("r")]}, **proxy_options(cfg))
    assert (proxy.rejoin_first_s, proxy.rejoin_max_s) == (5, 40)
    assert (proxy.recover_timeout_s, proxy.swap_timeout_s) == (9, 7)
    off = LLMProxy({"default": [Fake("r")]}, **proxy_options(EngineConfig(rejoin_first_s=None)))
    assert off.rejoin_first_s is None  # never tried again
    plain = LLMProxy({"default": [Fake("r")]})  # the proxy's defaults are the config's
    defaults = EngineConfig()
    assert (plain.rejoin_first_s, plain.rejoin_max_s) == (defaults.rejoin_first_s, defaults.rejoin_max_s)
    assert (plain.rejoin_first_s, plain.rejoin_max_s) == (30.0, 600.0)


def _problems(engine: dict[str, Any]) -> list[tuple[str, str]]:
    reg = Registry()

    @reg.reward
    def env_return(traj: Trajectory) -> float:
        return traj.env_reward or 0.0

    data = {
        "envs": [{"id": "frozenlake-v1", "tag": "frozenlake"}],
        "rewards": {"frozenlake": [{"function": "env_return"}]},
        "engine": engine,
    }
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(data, registry=reg, env_ids=["frozenlake-v1"])
    return e.value.problems


@pytest.mark.parametrize(
    ("engine", "key", "text"),
    [
        ({"rejoin_first_s": 0}, "engine.rejoin_first_s", "must be > 0"),
        ({"rejoin_first_s": "soon"}, "engine.rejoin_first_s", "valid number"),
        ({"rejoin_max_s": -1}, "engine.rejoin_max_s", "must be > 0"),
        ({"rejoin_max_s": float("inf")}, "engine.rejoin_max_s", "finite"),
        ({"rejoin_max_s": None}, "engine.rejoin_max_s", "valid number"),
        (
            {"rejoin_first_s": 60, "rejoin_max_s": 30},
            "engine",
            "rejoin_max_s 30 is below rejoin_first_s 60: a dropped replica's tries start "
            "rejoin_first_s apart and back off up to rejoin_max_s; raise rejoin_max_s or lower "
            "rejoin_first_s",
        ),
    ],
)
def test_bad_rejoin_timings_are_refused_with_what_to_do(engine, key, text):
    [(k, msg)] = _problems(engine)
    assert k == key and text in msg


async def test_wakes_end_the_waits_filed_under_a_key_and_only_those():
    from core.rollout.wakes import Wakes, Woken

    wakes = Wakes()
    never = asyncio.Event()
    a = asyncio.create_task(wakes.wait(["a", "both"], never.wait()))
    b = asyncio.create_task(wakes.wait(["b", "both"], never.wait()))
    await until(lambda: wakes.waiting("a") and wakes.waiting("b"))
    assert wakes.wake("a") == 1
    await asyncio.sleep(0)  # a's expiry runs, its task not yet: a wake of "both" finds it expiring
    assert wakes.wake("both") == 2  # (rescheduling an expiring scope raised RuntimeError)
    with pytest.raises(Woken):
        await a
    with pytest.raises(Woken):
        await b
    assert not any(wakes.waiting(k) for k in ("a", "b", "both"))  # nothing left filed
    assert await wakes.wait(["c"], asyncio.sleep(0, "done")) == "done" and not wakes.waiting("c")
    assert wakes.wake("nobody") == 0

    async def times_out() -> None:
        async with asyncio.timeout(0):
            await never.wait()

    with pytest.raises(TimeoutError):  # the awaited call's own timeout is not a wake
        await wakes.wait(["d"], times_out())
    c = asyncio.create_task(wakes.wait(["e"], never.wait()))
    await until(lambda: wakes.waiting("e"))
    c.cancel()  # the waiter's own cancellation stays a cancellation
    with pytest.raises(asyncio.CancelledError):
        await c
    assert not wakes.waiting("e")


# ----------------------------------------------------------------------------- generate_many


async def test_generate_many_answers_every_request_errors_included():
    gate = asyncio.Event()
    slow, fast = Fake("slow", gate=gate), Fake("fast")
    proxy = LLMProxy({"default": [slow], "fast": [fast], "dead": [Fake("dead", fail=[ReplicaGone("x")])]})
    proxy.affinity.update({"f": "fast", "d": "dead"})
    items = [
        ("t1", "s", req(request_id="q1")),
        ("t2", "f", req(request_id="q2")),
        ("t3", "d", req(request_id="q3")),
    ]
    seen: list[list[str]] = []
    answers: dict[str, Answer] = {}
    async for batch in proxy.generate_many(items):
        seen.append(sorted(a.request_id for a in batch))
        answers.update({a.request_id: a for a in batch})
        if {"q2", "q3"} <= set(answers):
            gate.set()
    assert seen[-1] == ["q1"]  # the slow one comes last, on its own
    assert answers["q1"].value.text == "slow" and answers["q2"].value.text == "fast"
    assert isinstance(answers["q3"].error, NoReplicaError) and answers["q3"].value is None


async def test_a_dead_proxy_actor_is_a_proxy_died_error_told_once():
    import ray.exceptions as rex

    from core.errors import ProxyDiedError
    from core.rollout.replicas import RemoteProxy

    calls: list[str] = []

    class Method:
        def __init__(self, name: str, error: BaseException):
            self.name, self.error = name, error

        def remote(self, *args: Any) -> Any:
            calls.append(self.name)

            async def fail() -> Any:
                raise self.error

            return fail()

    class Handle:
        abort = Method("abort", rex.ActorUnavailableError("unreachable for a while", None))
        release = Method("release", rex.ActorDiedError())

    told: list[ProxyDiedError] = []
    proxy = RemoteProxy(Handle(), on_died=told.append)
    with pytest.raises(rex.ActorUnavailableError):  # not death: left as it is
        await proxy.abort("t")
    for _ in range(2):
        with pytest.raises(ProxyDiedError, match=r"the LLM proxy actor died .*--resume"):
            await proxy.release("t")
    with pytest.raises(ProxyDiedError):
        await proxy.abort("t")
    assert calls == ["abort", "release"]  # once dead, no call goes out
    assert len(told) == 1


# ----------------------------------------------------------------------------- coalescer


async def ready(value: Any) -> Any:
    return value


class Server:
    """The remote side of a Coalescer: runs each batch with ``answer_all`` and streams
    ``await``-able answer lists back, as Ray's streaming generator does."""

    def __init__(self, handle=None, *, break_after: int | None = None, drop: set[str] | None = None):
        self.batches: list[list[tuple[str, Any]]] = []
        self.handle = handle or self.double
        self.break_after = break_after
        self.drop = drop or set()

    @staticmethod
    async def double(x: Any) -> Any:
        await asyncio.sleep(0.001 * (5 - x) if isinstance(x, int) and x < 5 else 0)
        return 2 * x

    def send(self, items: list[tuple[str, Any]]):
        self.batches.append(list(items))

        async def stream():
            sent = 0
            work = ((rid, self.handle(x)) for rid, x in items if rid not in self.drop)
            async for answers in answer_all(work):
                if self.break_after is not None and sent >= self.break_after:
                    raise ConnectionError("actor died")
                sent += len(answers)
                yield ready(answers)

        return stream()


async def test_calls_within_the_window_go_in_one_batch_and_answers_find_their_callers():
    server = Server()
    co = Coalescer(server.send, window_s=0.01)
    # the server answers in reverse order (larger x sleeps less): answers are matched by id
    out = await asyncio.gather(*(co.call(f"r{i}", (f"r{i}", i)) for i in range(5)))
    assert out == [0, 2, 4, 6, 8]
    assert len(server.batches) == 1 and [rid for rid, _ in server.batches[0]] == [f"r{i}" for i in range(5)]
    assert (co.calls, co.requests) == (1, 5)
    # calls apart in time go in separate batches
    assert await co.call("a", ("a", 10)) == 20
    assert await co.call("b", ("b", 11)) == 22
    assert len(server.batches) == 3 and co.calls == 3


async def test_a_full_batch_is_sent_at_once():
    server = Server()
    co = Coalescer(server.send, window_s=10.0, max_batch=2)  # the window alone would take 10 s
    async with asyncio.timeout(2):
        out = await asyncio.gather(co.call("a", ("a", 1)), co.call("b", ("b", 2)))
    assert out == [2, 4] and [len(b) for b in server.batches] == [2]


async def test_an_error_answer_reaches_only_its_caller():
    async def handle(x):
        if x == "boom":
            raise KeyError("bad request")
        return x.upper()

    co = Coalescer(Server(handle).send)
    out = await asyncio.gather(
        co.call("1", ("1", "a")),
        co.call("2", ("2", "boom")),
        co.call("3", ("3", "c")),
        return_exceptions=True,
    )
    assert out[0] == "A" and out[2] == "C"
    assert isinstance(out[1], KeyError) and co.calls == 1


async def test_a_transport_failure_reaches_every_unanswered_caller_of_the_batch():
    server = Server(break_after=0)
    co = Coalescer(server.send, on_error=lambda e: EngineError(f"transport: {e}"), window_s=0.005)
    out = await asyncio.gather(*(co.call(f"r{i}", (f"r{i}", i)) for i in range(3)), return_exceptions=True)
    assert all(isinstance(e, EngineError) and "actor died" in str(e) for e in out)
    assert co.calls == 1
    # the coalescer is still usable: the next batch goes through
    server.break_after = None
    assert await co.call("again", ("again", 3)) == 6

    def broken_send(items):
        raise ConnectionError("cannot reach the actor")

    co2 = Coalescer(broken_send, on_error=lambda e: EngineError(str(e)))
    out = await asyncio.gather(co2.call("x", 1), co2.call("y", 2), return_exceptions=True)
    assert [str(e) for e in out] == ["cannot reach the actor"] * 2


async def test_answered_callers_keep_their_answers_when_the_transport_breaks_later():
    async def handle(x):
        await asyncio.sleep(0 if x == 0 else 0.05)
        return x

    server = Server(handle, break_after=1)
    co = Coalescer(server.send)
    out = await asyncio.gather(
        co.call("fast", ("fast", 0)), co.call("slow", ("slow", 1)), return_exceptions=True
    )
    assert out[0] == 0 and isinstance(out[1], ConnectionError)


async def test_a_call_cancelled_within_the_window_never_reaches_the_server():
    ran: list[Any] = []

    async def handle(x):
        ran.append(x)
        return x

    server = Server(handle)
    co = Coalescer(server.send, window_s=0.05)
    gone = asyncio.create_task(co.call("gone", ("gone", "late turn")))
    kept = asyncio.create_task(co.call("kept", ("kept", "turn")))
    await asyncio.sleep(0)  # both are waiting in the window
    gone.cancel()  # e.g. its trajectory was aborted
    assert await kept == "turn"
    assert gone.cancelled()
    assert server.batches == [[("kept", "turn")]] and ran == ["turn"]
    assert (co.calls, co.requests) == (1, 1)
    # a window whose every caller was cancelled sends nothing at all
    alone = asyncio.create_task(co.call("alone", ("alone", "nobody")))
    await asyncio.sleep(0)
    alone.cancel()
    await asyncio.sleep(0.1)  # past the window
    assert len(server.batches) == 1 and ran == ["turn"] and co.calls == 1


async def test_a_request_the_server_never_answers_fails_instead_of_hanging():
    co = Coalescer(Server(drop={"lost"}).send)
    async with asyncio.timeout(2):
        out = await asyncio.gather(
            co.call("kept", ("kept", 1)), co.call("lost", ("lost", 2)), return_exceptions=True
        )
    assert out[0] == 2
    assert isinstance(out[1], RuntimeError) and "did not answer" in str(out[1])


async def test_answer_all_yields_as_they_finish_and_cancels_the_rest_when_closed():
    events = {name: asyncio.Event() for name in ("a", "b", "bad", "fast", "slow")}
    cancelled: list[str] = []

    async def job(name: str) -> str:
        try:
            await events[name].wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise
        if name == "bad":
            raise ValueError("bad")
        return name

    def shown(answers: list[Answer]) -> list[tuple[str, Any, str | None]]:
        return [(x.request_id, x.value, type(x.error).__name__ if x.error else None) for x in answers]

    gen = answer_all([(n, job(n)) for n in ("a", "b", "bad")])
    events["b"].set()
    assert shown(await anext(gen)) == [("b", "b", None)]
    events["bad"].set()
    assert shown(await anext(gen)) == [("bad", None, "ValueError")]  # an exception is an answer
    events["a"].set()
    assert shown(await anext(gen)) == [("a", "a", None)]
    with pytest.raises(StopAsyncIteration):
        await anext(gen)

    gen = answer_all([("fast", job("fast")), ("slow", job("slow"))])
    events["fast"].set()
    assert shown(await anext(gen)) == [("fast", "fast", None)]
    await gen.aclose()  # the caller went away: the work still running is cancelled
    await asyncio.sleep(0)
    assert cancelled == ["slow"]


async def test_two_calls_with_one_request_id_in_one_window_each_get_their_own_answer():
    # a request id is the caller's (a retry or a user may reuse one): answers go by id, so two
    # in one batch were ambiguous and one caller waited for good. They go in separate batches
    server = Server()
    co = Coalescer(server.send, window_s=0.01)
    async with asyncio.timeout(2):
        out = await asyncio.gather(
            co.call("same", ("same", 1)), co.call("other", ("other", 2)), co.call("same", ("same", 3))
        )
    assert out == [2, 4, 6]
    assert [[rid for rid, _ in b] for b in server.batches] == [["same", "other"], ["same"]]
    assert (co.calls, co.requests) == (2, 3)

    # the engine refuses an id already in flight: the second caller gets that refusal, the
    # first its answer, as without coalescing
    inflight: set[str] = set()

    async def engine(item: tuple[str, int]) -> int:
        rid, x = item
        if rid in inflight:
            raise EngineError(f"request id {rid!r} is already in flight")
        inflight.add(rid)
        try:
            await asyncio.sleep(0.02)
            return x
        finally:
            inflight.discard(rid)

    co = Coalescer(Server(lambda x: engine(x)).send, window_s=0.01)
    async with asyncio.timeout(2):
        out = await asyncio.gather(
            co.call("dup", ("dup", ("dup", 1))), co.call("dup", ("dup", ("dup", 2))), return_exceptions=True
        )
    assert out[0] == 1 and isinstance(out[1], EngineError) and "already in flight" in str(out[1])
