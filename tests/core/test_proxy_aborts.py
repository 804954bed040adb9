"""LLMProxy aborts: a turn stopped on a real engine, at a replica that is down, wedged or
slow to answer, and aborts that overlap a release.

No Ray: the proxy is a plain object here; fakes are in ``proxy_fakes``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from proxy_fakes import Fake, engine, req, tiny, until
from tiny_models import stopless

from core.rollout.engines.base import EngineError
from core.rollout.llm_proxy import (
    LLMProxy,
    LocalReplica,
    ReplicaLost,
)


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
