"""LLMProxy replica recovery: a lost replica is pinged, reloaded and its turn re-run; a
replica gone for good leaves its group.

No Ray: the proxy is a plain object here; fakes are in ``proxy_fakes``."""

from __future__ import annotations

import asyncio

import pytest
from proxy_fakes import Fake, engine, req, tiny, until
from tiny_models import stopless

from core.rollout.engines.base import Completion, EngineError, GenerateRequest
from core.rollout.engines.torch_ import TorchEngine
from core.rollout.llm_proxy import (
    LLMProxy,
    LocalReplica,
    NoReplicaError,
    ReplicaGone,
    ReplicaLost,
)


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


async def test_no_replica_left_says_which_left_last_why_and_what_to_do():
    # the error ends every trajectory infra_failed, and the job's RolloutError quotes it:
    # "no engine replica left" alone sent the user through the proxy actor's log for why
    never = Fake("never", fail=[ReplicaLost("died")], ping_down=float("inf"))
    proxy = LLMProxy({"default": [never]}, recover_timeout_s=0.2, rejoin_first_s=None)
    with pytest.raises(NoReplicaError) as err:
        await asyncio.wait_for(proxy.generate("t", "x", req()), 5)
    msg = str(err.value)
    assert "no engine replica left for tag 'x' (group 'default')" in msg
    assert "the last to leave it, never: not back by the recover timeout (restarting)" in msg
    assert "engine.recover_timeout_s" in msg and "tried again" not in msg
    # one that is tried again says so
    back = Fake("back", fail=[ReplicaLost("died")], ping_down=float("inf"))
    proxy = LLMProxy({"default": [back]}, recover_timeout_s=0.2, rejoin_first_s=60)
    with pytest.raises(NoReplicaError, match=r"to leave it, back: .*; it is tried again"):
        await asyncio.wait_for(proxy.generate("t", "x", req()), 5)
    await proxy.aclose()


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
