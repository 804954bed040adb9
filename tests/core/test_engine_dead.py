"""An engine that dies inside a live replica (vLLM's engine core process died: every later
``generate`` raises vLLM's ``EngineDeadError``; the torch engine's batching loop ended) is
that replica's loss, as a dead process is: its turns move to a healthy replica, its
recovery restarts it and reloads the latest weights, and one that cannot be restarted
leaves its group, saying why. Before, every turn sent to it failed at once with a plain
engine error (the torch engine's never returned), no recovery began, and least-loaded
routing, seeing none of its turns in flight, sent it most new trajectories."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
import test_vllm_engine as tv
import torch
from proxy_fakes import Fake, engine, req, tiny, until

from core.config import JobConfig
from core.rollout import replicas as replicas_mod
from core.rollout.engines import vllm_
from core.rollout.engines.base import EngineDeadError, EngineError
from core.rollout.env_manager import EnvManager
from core.rollout.groups import GroupRunner
from core.rollout.llm_proxy import LLMProxy, LocalReplica, ReplicaEngineDead, ReplicaLost
from core.rollout.replicas import EngineReplicaActor, RayReplica
from envpool.api import Observation, StepResult
from fabric.protocol import Trajectory

fake_vllm = tv.fake_vllm  # the stand-in ``vllm`` package (a fixture)


class VLLMDead(Exception):
    """vLLM's ``EngineDeadError`` (``vllm.v1.engine.exceptions``), as a stand-in."""


@pytest.fixture
def vllm_dead(fake_vllm, monkeypatch):
    exc = types.ModuleType("vllm.v1.engine.exceptions")
    exc.EngineDeadError = VLLMDead  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.exceptions", exc)
    return VLLMDead


def kill_loop(e: Any) -> None:
    """The torch engine's next step raises outside its forward pass (a bug in the loop),
    once: the scheduler task ends."""

    def boom(*a: Any, **k: Any) -> None:
        del e._advance
        raise RuntimeError("a bug in the batching loop")

    e._advance = boom


# -- the engines say they are dead ------------------------------------------------------------


async def test_vllms_dead_engine_error_is_an_engine_dead_error(vllm_dead):
    llm = tv.FakeLLM()
    async with tv.engine(llm) as e:
        llm.fail = ValueError("token id 999999 is out of vocabulary")  # one request's error
        with pytest.raises(EngineError) as info:
            await e.generate(tv.chat())
        assert not isinstance(info.value, EngineDeadError) and e.dead is None
        llm.fail = vllm_dead("EngineCore encountered an issue")
        with pytest.raises(EngineDeadError, match=r"vLLM engine died.*EngineCore encountered"):
            await e.generate(tv.chat())
        assert e.dead is not None
        llm.fail = None  # a dead engine fails at once, without asking vLLM
        with pytest.raises(EngineDeadError):
            await e.generate(tv.chat())
        with pytest.raises(EngineDeadError):
            await e.load_weights({"w": torch.ones(1)}, version=1)


async def test_vllms_dead_error_as_a_cause_and_in_a_weight_load(vllm_dead):
    llm = tv.FakeLLM()
    async with tv.engine(llm) as e:
        generate_error = RuntimeError("EngineGenerateError")
        generate_error.__cause__ = vllm_dead("engine core died")
        llm.fail = generate_error
        with pytest.raises(EngineDeadError):
            await e.generate(tv.chat())
    llm = tv.FakeLLM()
    async with tv.engine(llm) as e:
        llm.fail = vllm_dead("engine core died")
        with pytest.raises(EngineDeadError):
            await e.load_weights({"w": torch.ones(1)}, version=1)
        assert e.dead is not None and e.version == 0


async def test_a_dead_torch_loop_fails_its_requests_and_a_restart_serves_again(tok):
    e = engine(tiny(tok), tok)
    async with e:
        await e.load_weights(e.model.state_dict(), version=3)
        kill_loop(e)
        # before, the requests in the dead loop waited for ever
        with pytest.raises(EngineDeadError, match=r"batching loop died.*a bug in the batching loop"):
            await asyncio.wait_for(e.generate(req()), 5)
        with pytest.raises(EngineDeadError):
            await e.generate(req())
        assert e.num_inflight == 0
        await e.restart()
        assert e.dead is None and e.version == 0  # reloaded by the proxy's recovery
        c = await asyncio.wait_for(e.generate(req()), 5)
        assert c.finish_reason in ("stop", "length")
        await e.restart()  # a live engine: nothing to do
        assert (await e.generate(req())).token_ids


# -- the proxy counts it as the replica's loss ----------------------------------------------


async def test_a_replica_whose_vllm_engine_died_is_restarted_and_its_turns_move_on(vllm_dead, monkeypatch):
    built: list[tv.FakeLLM] = []

    def build(cfg: Any) -> tv.FakeLLM:  # a restart builds vLLM afresh
        built.append(tv.FakeLLM(token_delay=0.001))
        return built[-1]

    monkeypatch.setattr(vllm_, "_build_llm", build)
    first, other = tv.FakeLLM(token_delay=0.001), tv.FakeLLM(token_delay=0.001)
    dying = LocalReplica(tv.engine(first), "dying")
    healthy = LocalReplica(tv.engine(other), "healthy")
    proxy = LLMProxy({"default": [dying, healthy]}, recover_timeout_s=5.0)
    try:
        await proxy.update_weights(1, {"w": torch.ones(1)})
        first.fail = vllm_dead("EngineCore encountered an issue")  # every later call fails
        turns = [proxy.generate(f"t{i}", "x", tv.chat(max_new_tokens=3)) for i in range(12)]
        done = await asyncio.wait_for(asyncio.gather(*turns), 10)
        assert all(c.finish_reason == "length" and c.policy_version == 1 for c in done)
        await until(lambda: proxy.metrics["replicas_recovered"] == 1)
        m = proxy.metrics
        assert m["engine_restarts"] == 1 and m["replicas_removed"] == 0 and m["turns_rerun"] >= 1
        assert m["turns"] == 12 and m["replica_lost"] == m["turns_rerun"]
        # restarted: a new vLLM, given the latest weights before it serves again
        assert len(built) == 1 and dying.engine.version == 1
        assert [m for m, _ in built[0].rpcs] == [vllm_.LOAD_METHOD]
        assert dying in proxy.groups["default"]
        c = await proxy.generate("late", "x", tv.chat(max_new_tokens=2))
        assert c.policy_version == 1
    finally:
        await proxy.aclose()
        await dying.engine.aclose()
        await healthy.engine.aclose()


async def test_least_loaded_routing_stops_sending_turns_to_a_dead_engine(tok):
    # its turns failed at once, so it never had one in flight: least-loaded routing picked it
    # for every new trajectory. Now its first failure takes it out of routing until it is back
    a, b = engine(tiny(tok), tok), engine(tiny(tok, seed=1), tok)
    ra, rb = LocalReplica(a, "a"), LocalReplica(b, "b")
    restarts = 0

    async def no_restart() -> None:  # (held dead: the turns cannot go back to it)
        nonlocal restarts
        restarts += 1

    ra.restart = no_restart  # type: ignore[method-assign]
    proxy = LLMProxy({"default": [ra, rb]}, recover_timeout_s=0.3, rejoin_first_s=None)
    try:
        async with a, b:
            kill_loop(a)
            c = await asyncio.wait_for(proxy.generate("t0", "x", req(max_new_tokens=2)), 5)
            assert c.finish_reason in ("stop", "length")
            for i in range(1, 8):
                await asyncio.wait_for(proxy.generate(f"t{i}", "x", req(max_new_tokens=2)), 5)
            assert proxy.metrics["replica_lost"] <= 1  # only the first turn was sent there
            assert b.stats["tokens"] > 0
            await until(lambda: proxy.metrics["replicas_removed"] == 1)
            assert restarts >= 1 and proxy.groups["default"] == [rb]
    finally:
        await proxy.aclose()


async def test_a_replica_whose_engine_cannot_be_restarted_leaves_its_group_saying_why(caplog):
    class Dead(Fake):
        async def ping(self) -> int:
            self.pings += 1
            raise ReplicaEngineDead(f"{self.name}: the vLLM engine died")

        async def restart(self) -> None:
            raise EngineError("no GPU memory to start vLLM again")

    dead = Dead("dead", fail=[ReplicaEngineDead("dead: the vLLM engine died")])
    ok = Fake("ok")
    proxy = LLMProxy({"default": [dead, ok]}, recover_timeout_s=1.0, rejoin_first_s=None)
    caplog.set_level(logging.ERROR, logger="core.rollout.llm_proxy")
    try:
        c = await asyncio.wait_for(proxy.generate("t", "x", req()), 5)
        assert c.finish_reason == "stop" and ok.generated
        await until(lambda: proxy.metrics["replicas_removed"] == 1)
        assert proxy.groups["default"] == [ok] and proxy.metrics["engine_restarts"] == 1
        assert "engine died and its restart failed: EngineError: no GPU memory" in caplog.text
        assert "dead left its group" in caplog.text
    finally:
        await proxy.aclose()


async def test_an_engine_that_dies_after_every_restart_leaves_after_max_restarts(caplog):
    # each restart succeeded and the engine died again at once: the recovery restarted it
    # (a model load each time) until recover_timeout_s, then left it to rejoin later, where
    # it was restarted again, for the rest of the job; a Ray actor stops at max_restarts
    class Relapsing(Fake):
        restarts = 0

        async def ping(self) -> int:
            self.pings += 1
            raise ReplicaEngineDead(f"{self.name}: the vLLM engine died")

        async def restart(self) -> None:
            self.restarts += 1

    sick = Relapsing("sick", fail=[ReplicaEngineDead("sick: the vLLM engine died")])
    ok = Fake("ok")
    proxy = LLMProxy(
        {"default": [sick, ok]}, recover_timeout_s=30.0, max_engine_restarts=2, rejoin_first_s=0.01
    )
    caplog.set_level(logging.ERROR, logger="core.rollout.llm_proxy")
    try:
        c = await asyncio.wait_for(proxy.generate("t", "x", req()), 5)
        assert c.finish_reason == "stop" and ok.generated
        await until(lambda: proxy.metrics["replicas_removed"] == 1)
        assert proxy.groups["default"] == [ok] and sick.restarts == 2
        assert proxy.metrics["engine_restarts"] == 2
        assert "died again after 2 restart(s) (engine.max_restarts: 2)" in caplog.text
        await asyncio.sleep(0.1)
        assert sick.restarts == 2 and not proxy._rejoining  # gone for good: no rejoin tries it
    finally:
        await proxy.aclose()


# -- as a Ray actor: the replica's process exits for Ray to restart it ------------------------


async def test_the_replica_actor_exits_for_ray_only_when_its_engine_is_dead(monkeypatch):
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)  # (the real one never returns)

    monkeypatch.setattr(replicas_mod.os, "_exit", fake_exit)
    a = _actor()
    try:
        assert a.restart() is False and exits == []  # alive: a call that reached a new process
        assert await a.ping() == 0
        kill_loop(a.engine)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(a.generate(req()), 5)
        with pytest.raises(EngineDeadError):
            await a.ping()
        with pytest.raises(SystemExit):
            a.restart()
        assert exits == [1]
    finally:
        await a.engine.aclose()


def _actor() -> EngineReplicaActor:
    from test_proxy_replica_order import actor

    return actor()


class _Call:
    def __init__(self, outcome: Any) -> None:
        self.outcome = outcome

    def remote(self, *args: Any) -> Any:
        async def answer() -> Any:
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome

        return answer()


class _TaskError(Exception):
    """Ray's RayTaskError: it carries the actor's error as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::EngineReplicaActor.ping()\n{cause}")
        self.cause = cause


async def test_ray_replica_says_engine_dead_and_a_restart_that_exits_is_asked():
    pytest.importorskip("ray")
    import ray.exceptions as rex

    handle = types.SimpleNamespace(
        ping=_Call(_TaskError(EngineDeadError("the torch engine's batching loop died"))),
        restart=_Call(rex.ActorDiedError()),
        abort=_Call(_TaskError(EngineError("other"))),
    )
    r = RayReplica(handle, "r0")
    with pytest.raises(ReplicaEngineDead, match="r0: the torch engine's batching loop died"):
        await r.ping()
    await r.restart()  # the actor exited, as asked: Ray restarts it
    with pytest.raises(_TaskError):  # any other error of the engine is its own
        await r.abort("x")
    handle.ping = _Call(rex.ActorDiedError())
    with pytest.raises(ReplicaLost) as info:
        await r.ping()
    assert not isinstance(info.value, ReplicaEngineDead)


# -- a whole rollout: no group is given up, the counts stay right ----------------------------


class _Steps:
    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="you are at row 0"), {}

    async def step(self, action: Any) -> StepResult:
        await asyncio.sleep(0.001)
        return StepResult(obs=Observation(text="you are at row 1"), reward=1.0, terminated=True)


class _Pool:
    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_Steps]:
        yield _Steps()


async def test_a_rollout_whose_replica_engine_dies_gives_up_no_group(tok):
    engines = [engine(tiny(tok, seed=i), tok) for i in range(2)]
    replicas = [LocalReplica(e, f"r{i}") for i, e in enumerate(engines)]
    proxy = LLMProxy({"default": replicas}, recover_timeout_s=5.0)
    cfg = JobConfig.from_dict(
        {
            "envs": [{"id": "latency-v0", "tag": "lat", "max_turns": 2}],
            "rewards": {"lat": [{"function": "unused"}]},
            "group_size": 4,
            "engine": {"max_new_tokens": 3},
            "rollout": {"max_reruns": 0, "trajectory_timeout_s": 10},
        },
        check_references=False,
    )
    manager = EnvManager(cfg, _Pool(), proxy)  # type: ignore[arg-type]
    finished: list[Trajectory] = []
    runner = GroupRunner(cfg, manager, proxy, submit=finished.append)  # type: ignore[arg-type]
    try:
        for _ in range(2):
            runner.start(cfg.envs[0], 0, 0)
        await until(lambda: len(finished) == 8, 10)
        kill_loop(engines[0])  # mid-run: its next step dies
        for _ in range(4):
            runner.start(cfg.envs[0], 1, 0)
        await until(lambda: len(finished) == 24, 10)
        assert all(t.status == "ok" for t in finished), {t.status for t in finished}
        await until(lambda: proxy.metrics["replicas_recovered"] == 1)
        assert runner.metrics["given_up"] == 0 and runner.metrics["reruns"] == 0
        assert runner.metrics["ok"] == 24 and proxy.metrics["engine_restarts"] == 1
        assert proxy.metrics["replicas_removed"] == 0 and engines[0].dead is None
    finally:
        await runner.aclose()
        await proxy.aclose()
        for e in engines:
            await e.aclose()


# -- the job, its replica a Ray actor -----------------------------------------------------------


@pytest.mark.ray
async def test_a_replica_actor_whose_engine_died_is_restarted_by_ray_and_reloaded(tmp_path, ray_cluster):
    from job_helpers import check_invariants, job_config
    from test_job_faults import _past_its_first_step

    # a single replica: once its engine dies no step past the one or two the buffer holds
    # (alpha 1) trains before Ray's restart and the reload, so a dozen steps outlive them
    # (30 trained on for seconds after the restart, proving nothing more)
    job, task = await _past_its_first_step(job_config(tmp_path, steps=12))
    [replica] = job.replicas

    def kill_loop_in_actor(actor: Any) -> None:  # (a closure: Ray ships it by value)
        e = actor.engine

        def boom(*a: Any, **k: Any) -> None:
            del e._advance
            raise RuntimeError("a bug in the batching loop")

        e._advance = boom

    await replica.__ray_call__.remote(kill_loop_in_actor)
    summary = await task
    check_invariants(summary, job.cfg)
    proxy = summary["proxy"]
    assert proxy.get("engine_restarts", 0) >= 1 and proxy.get("replicas_recovered", 0) >= 1, proxy
    assert proxy.get("weights_reloaded", 0) >= 1 and proxy.get("replicas_removed", 0) == 0, proxy
    # weights_reloaded: the process Ray restarted began on the initial weights (its pid is
    # not asked here: the job killed its actors on its way out)
    assert summary["trajectories"].get("infra_failed", 0) == 0, summary["trajectories"]
