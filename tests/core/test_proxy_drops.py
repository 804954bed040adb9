"""LLMProxy dropped replicas: turns go around a replica while it recovers and move off one
that is dropped; a dropped replica rejoins once it answers.

No Ray: the proxy is a plain object here; fakes are in ``proxy_fakes``."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from proxy_fakes import Fake, SlowPing, req, until

from core.rollout.engines.base import Completion, EngineError, GenerateRequest
from core.rollout.llm_proxy import (
    LLMProxy,
    ReplicaGone,
    ReplicaLost,
)


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


class RunsOn(Fake):
    """A replica alive as a Ray actor is: its engine runs a turn on when the proxy stops
    waiting for it (a Ray call's remote side outlives its caller) until the turn ends or is
    aborted; and its weights reload fails with the engine's own error (out of memory)."""

    def __init__(self, name: str, **kw: Any):
        super().__init__(name, **kw)
        self.runs: dict[str, asyncio.Future[Completion]] = {}

    async def generate(self, request: GenerateRequest) -> Completion:
        run = self.runs[request.request_id] = asyncio.ensure_future(super().generate(request))
        return await asyncio.shield(run)

    def running(self) -> set[str]:
        return {rid for rid, run in self.runs.items() if not run.done()}

    async def swap(self, version: int, state: Any) -> None:
        raise EngineError("CUDA out of memory while loading")


async def test_what_a_replica_never_tried_again_was_running_is_aborted():
    # engine.rejoin_first_s null: a dropped replica is never tried again, and what it was
    # running was never stopped (only a rejoin aborted it). One still alive (its reload
    # failed) ran those turns on to max_new_tokens for nobody, each rerun on another
    # replica, on a card it may share with the trainer or another replica
    hold = asyncio.Event()  # never set: t/1 runs on r until it is aborted
    r, ok = RunsOn("r", gate=hold, only={"t/1"}), Fake("ok")
    proxy = LLMProxy({"default": [r, ok]}, rejoin_first_s=None)
    try:
        for traj in ("t", "u"):  # both stick to r (one at a time: a tie each)
            assert (await proxy.generate(traj, "x", req(request_id=f"{traj}/0"))).text == "r"
        turn = asyncio.create_task(proxy.generate("t", "x", req(request_id="t/1")))
        await until(lambda: "t/1" in r.generated)
        proxy._latest = (1, "W1")  # weights were published: the recovery reloads them, and fails
        r.fail = [ReplicaLost("unreachable for a while")]  # u/1's call: its recovery begins
        assert (await asyncio.wait_for(proxy.generate("u", "x", req(request_id="u/1")), 5)).text == "ok"
        assert (await asyncio.wait_for(turn, 5)).text == "ok"  # moved off r when it was dropped
        assert proxy.groups["default"] == [ok] and proxy.metrics["recover_errors"] == 1
        await until(lambda: not proxy._background)  # (the aborts go in the background)
        assert r.running() == set(), "the dropped replica's engine still runs them"
        assert sorted(r.aborted) == ["t/1", "u/1"]  # u/1's first run may go on too: stopped
        assert proxy.metrics["left_running_aborted"] == 1  # t/1 (u/1's had ended: not found)
        assert proxy._to_stop == {}
    finally:
        for run in r.runs.values():
            run.cancel()
        await proxy.aclose()


async def test_aborts_a_replica_never_tried_again_does_not_answer_are_given_up_at_once(caplog):
    # those aborts are best effort: a replica dropped because it hangs answers none, and
    # each was waited for (and warned of) on its own
    stuck, up = Stuck("stuck"), Fake("up")
    proxy = LLMProxy(
        {"default": [stuck, up]},
        swap_timeout_s=0.2,
        recover_timeout_s=0.3,
        rejoin_first_s=None,
        abort_timeout_s=0.2,
    )
    try:
        for traj in ("t", "u"):  # both stick to "stuck" (one at a time: a tie each)
            assert (await proxy.generate(traj, "x", req(request_id=f"{traj}/0"))).text == "stuck"
        stuck.wedged = True
        turns = [asyncio.create_task(proxy.generate(t, "x", req(request_id=f"{t}/1"))) for t in ("t", "u")]
        await until(lambda: {"t/1", "u/1"} <= set(stuck.generated))
        await asyncio.wait_for(proxy.update_weights(1, ["W1"]), 5)
        assert [c.text for c in await asyncio.wait_for(asyncio.gather(*turns), 5)] == ["up", "up"]
        await until(lambda: not proxy._background)
        assert proxy.metrics["abort_timeouts"] == 1 and proxy.metrics["left_running_aborted"] == 0
        given_up = [r.getMessage() for r in caplog.records if "did not answer the aborts" in r.getMessage()]
        assert len(given_up) == 1 and "of the 2 turns it was left running" in given_up[0]
        assert proxy._to_stop == {} and proxy._never_back == {}  # nothing more is sent to it
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
