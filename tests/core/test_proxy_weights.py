"""LLMProxy weight updates: every replica loads them, a replica that is down, hangs or
refuses them does not hold the update, and an update no replica took is refused.

No Ray: the proxy is a plain object here; fakes are in ``proxy_fakes``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch
from proxy_fakes import Fake, SlowPing, engine, req, tiny, until

from core.rollout.engines.base import EngineError
from core.rollout.llm_proxy import (
    LLMProxy,
    LocalReplica,
    ReplicaLost,
    swap_weights,
)


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
