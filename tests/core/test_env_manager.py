"""EnvManager: one trajectory's loop over a real EnvPool (process runtime) and a scripted
proxy, and how it ends: ok, truncated, aborted, infra_failed (engine errors, a container
lost, an environment that hangs or raises, the trajectory timeout), cancelled, a release
that fails. A turn's action, the context the policy is shown and the TurnBarrier's lockstep
are in test_env_manager_turns.py."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import warnings
from collections.abc import AsyncIterator
from typing import Any

import pytest
from env_manager_fixtures import _every_session_ends, pool_fixture, tools_fixture  # noqa: F401 - by name=
from env_manager_helpers import (
    ABORT,
    HANG,
    LAKE,
    MATH,
    ScriptedProxy,
    assistant_turns,
    check_turn_info,
    env,
    job,
    module_loop,
)

from core.errors import ProxyDiedError
from core.rollout.engines.base import Completion, EngineError, GenerateRequest
from core.rollout.env_manager import EnvManager, Task
from core.rollout.llm_proxy import LLMProxy, NoReplicaError, Replica
from envpool.api import Observation
from envpool.errors import EnvLogicError, ToolMisconfigured
from envpool.pool import EnvPool

# ----------------------------------------------------------------------------- statuses


@module_loop
async def test_an_episode_that_ends_is_ok(pool):
    cfg = job(LAKE)
    proxy = ScriptedProxy(["right", "down"])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 7, "g1"), version=3, traj_id="t-ok")
    assert traj.id == "t-ok" and traj.status == "ok" and traj.env_reward == 1.0
    assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert "reached the goal" in (traj.messages[-1].content or "")
    assert traj.task == {"env_id": "frozenlake-v1", "seed": 7, "tag": "lake", "group_id": "g1"}
    info = traj.info
    assert info["start_version"] == 3  # the version it started under, not the turns'
    assert [m.policy_version for m in traj.messages if m.role == "assistant"] == [5, 5]
    assert info["turn_rewards"] == [0.0, 1.0]
    assert info["turn_states"] == ["[0, 0]", "[0, 1]"]  # the env's info["position"], as JSON
    assert "invalid" not in info and "error" not in info
    assert all(isinstance(info[k], float) and info[k] >= 0 for k in ("gen_s", "env_s", "wall_s"))
    turn = traj.messages[1].model_extra or {}
    assert turn["token_ids"] == [3, 4] and turn["logprobs"] == [-0.1, -0.2] and turn["prompt_ids"] == [1, 2]
    reqs = [r for _, _, r in proxy.calls]
    assert [(t, tag) for t, tag, _ in proxy.calls] == [("t-ok", "lake")] * 2
    assert [r.request_id for r in reqs] == ["t-ok/0", "t-ok/1"]
    # the second turn carries what the first step returned (the schedulers' causal signal)
    assert [r.metadata for r in reqs] == [
        {"trajectory_id": "t-ok", "turn": 0, "tag": "lake"},
        {"trajectory_id": "t-ok", "turn": 1, "tag": "lake", "outcome": "ok"},
    ]
    assert all(r.max_new_tokens == 4 and r.temperature == 0.7 and r.allowed_token_ids is None for r in reqs)
    assert proxy.released == ["t-ok"]
    assert pool.stats()["claimed"] == 0  # the session gave its container back


@module_loop
async def test_max_turns_truncates(pool):
    cfg = job(env(LAKE, max_turns=3))
    proxy = ScriptedProxy(lambda tid, turn: "left")  # bumps into the edge, stays on S
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "truncated" and traj.env_reward == 0.0
    assert assistant_turns(traj) == 3 and len(proxy.calls) == 3
    assert traj.info["turn_states"] == ["[0, 0]"] * 3
    check_turn_info(traj)
    assert proxy.released == [traj.id]


@module_loop
async def test_the_environments_own_step_limit_truncates_too(pool):
    # math-tools stops an episode at 10 steps (truncated, not terminated): the trajectory
    # was "ok" past its limit and "truncated" at max_turns (found by review)
    cfg = job(env(MATH, max_turns=12))
    proxy = ScriptedProxy(lambda tid, turn: "hmm")
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "truncated" and assistant_turns(traj) == 10


@module_loop
async def test_an_aborted_turn_ends_the_trajectory_as_aborted(pool):
    cfg = job(LAKE)
    proxy = ScriptedProxy(["right", ABORT, "down"])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=2)
    assert traj.status == "aborted" and traj.env_reward is None
    assert assistant_turns(traj) == 1 and len(proxy.calls) == 2  # the aborted turn is not recorded
    check_turn_info(traj)
    assert proxy.released == [traj.id]


@module_loop
@pytest.mark.parametrize(
    "error", [NoReplicaError("no engine replica left for tag 'lake'"), EngineError("replica broke")]
)
async def test_an_engine_error_is_infra_failed(pool, error):
    cfg = job(LAKE)
    proxy = ScriptedProxy(["right", error])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "infra_failed"
    assert traj.info["error"] == f"{type(error).__name__}: {error}"
    assert assistant_turns(traj) == 1
    check_turn_info(traj)
    assert proxy.released == [traj.id]
    assert pool.stats()["claimed"] == 0


@module_loop
async def test_a_container_that_dies_for_good_is_infra_failed(pool):
    lat = {"id": "latency-v0", "tag": "lat", "max_turns": 4}
    cfg = job(env(lat, kwargs={"fail_prob": 1.0, "turns": 2, "mu_s": 0.0}))
    proxy = ScriptedProxy(lambda tid, turn: "go")
    lost_before = pool.stats().get("sessions_infra_failed", 0)
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "infra_failed"
    assert traj.info["error"].startswith("SessionLost: ")
    assert assistant_turns(traj) == 1 and traj.info["turn_rewards"] == []  # the step never returned
    assert proxy.released == [traj.id]
    assert pool.stats()["sessions_infra_failed"] == lost_before + 1


async def test_an_environment_that_hangs_is_infra_failed_at_once_not_retried():
    # its container heartbeats through the step: the environment's own fault (EnvHung), so the
    # trajectory is masked like any environment bug after one step timeout, instead of being
    # replayed on retry.attempts fresh containers that all hang the same way
    lat = {"id": "latency-v0", "tag": "lat", "max_turns": 4, "kwargs": {"mu_s": 30.0, "turns": 2}}
    cfg = job(lat)
    pool_cfg = {"min_warm": 0, "step_timeout_s": 0.5, "runtime": {"heartbeat_s": 0.1}}
    async with EnvPool(pool_cfg) as p:
        proxy = ScriptedProxy(lambda tid, turn: "go")
        traj = await EnvManager(cfg, p, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
        stats = p.stats()
    assert traj.status == "infra_failed"  # masked: never scored, the group runs another
    assert traj.info["error"].startswith("EnvHung: latency-v0: step did not answer in 0.5 s")
    assert traj.info["wall_s"] < 4  # one step timeout (0.5 s), not the 30 s step; slack for load
    assert stats["env_hung"] == 1 and stats.get("step_retries", 0) == 0
    assert proxy.released == [traj.id] and stats["claimed"] == 0 and not p.runtime.live


class _RaisingSession:
    """An environment whose step raises (the error as the pool hands it over)."""

    def __init__(self, error: EnvLogicError):
        self.error = error

    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="start"), {}

    async def step(self, action: Any) -> Any:
        raise self.error


class _RaisingPool:
    def __init__(self, *errors: EnvLogicError):
        self.errors = list(errors)

    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_RaisingSession]:
        yield _RaisingSession(self.errors.pop(0))


class _TaskSession(_RaisingSession):
    """An environment whose reset hands over task metadata that names the job's own keys."""

    async def reset(self, *, seed: int | None = None) -> tuple[Observation, dict[str, Any]]:
        return Observation(text="start"), {
            "task": {"answer": "7", "tag": "other", "group_id": "x", "seed": 99}
        }


class _TaskPool:
    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_TaskSession]:
        yield _TaskSession(EnvLogicError("KeyError: x", remote_type="KeyError"))


async def test_an_environment_cannot_override_the_jobs_own_task_keys(caplog):
    # a `tag` in reset's info["task"] sent the trajectory to another reward, a `group_id`
    # mixed it into another group's advantages: the job's keys win, and it is said once
    cfg = job(LAKE)
    manager = EnvManager(cfg, _TaskPool(), ScriptedProxy(lambda tid, turn: "right"))  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="core.rollout.env_manager"):
        trajs = [await manager.run(Task(cfg.envs[0], i, "g1"), version=0) for i in range(2)]
    for i, t in enumerate(trajs):
        assert t.task["answer"] == "7"  # the environment's own key is taken
        assert (t.task["tag"], t.task["group_id"], t.task["seed"]) == (cfg.envs[0].tag, "g1", i)
    warned = [r.getMessage() for r in caplog.records if "task key" in r.getMessage()]
    assert len(warned) == 1 and "group_id, seed, tag" in warned[0]


async def test_an_environments_own_error_is_said_once_per_type_and_typed(caplog):
    # it was logged at INFO only: a user's environment raising on some seeds showed up as
    # "group given up" and an infra_failed count, its exception nowhere
    tb = 'Traceback (most recent call last):\n  File "/b/buggy_env.py", line 28, in step\nKeyError: 1\n'
    key = EnvLogicError("KeyError: 'oops in step'", remote_type="KeyError", traceback=tb)
    value = EnvLogicError("ValueError: bad", remote_type="ValueError")
    cfg = job(LAKE)
    manager = EnvManager(cfg, _RaisingPool(key, key, value), ScriptedProxy(lambda tid, turn: "right"))  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="core.rollout.env_manager"):
        trajs = [await manager.run(Task(cfg.envs[0], i, "g"), version=0) for i in range(3)]
    assert [t.status for t in trajs] == ["infra_failed"] * 3
    assert [t.info["error_type"] for t in trajs] == ["EnvLogicError:KeyError"] * 2 + [
        "EnvLogicError:ValueError"
    ]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2  # once per error type, not once per trajectory
    assert "frozenlake-v1 raised: KeyError: 'oops in step' (buggy_env.py, line 28, in step)" in warned[0]
    assert "ValueError: bad" in warned[1]


async def test_a_misconfigured_tool_is_said_once(caplog):
    # the session fails it once, masked (not replayed); without a word here the user saw only
    # groups given up and an infra_failed count
    bad = ToolMisconfigured("tool 'search' is misconfigured: set SEARCH_API_KEY")
    cfg = job(LAKE)
    manager = EnvManager(cfg, _RaisingPool(bad, bad), ScriptedProxy(lambda tid, turn: "right"))  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="core.rollout.env_manager"):
        trajs = [await manager.run(Task(cfg.envs[0], i, "g"), version=0) for i in range(2)]
    assert [t.info["error_type"] for t in trajs] == ["ToolMisconfigured"] * 2
    [warned] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "frozenlake-v1 called a misconfigured tool: tool 'search'" in warned
    assert "set SEARCH_API_KEY" in warned


@module_loop
async def test_a_trajectory_over_its_timeout_is_infra_failed(pool):
    cfg = job(LAKE, timeout_s=0.3)
    proxy = ScriptedProxy(["right", HANG])
    traj = await asyncio.wait_for(EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0), 10)
    assert traj.status == "infra_failed"
    assert "trajectory_timeout_s=0.3" in traj.info["error"]
    assert 0.3 <= traj.info["wall_s"] < 5
    assert proxy.released == [traj.id] and pool.stats()["claimed"] == 0
    # the hung turn is stopped on the engine too: under Ray the proxy's side of the call runs
    # on without its caller, holding the replica's batch slot
    assert proxy.aborted == [traj.id]


@module_loop
async def test_the_trajectory_timeout_fires_when_the_replica_is_wedged(pool):
    # the usual reason for the timeout, a hung turn, is a replica that answers nothing, not
    # even the abort the timeout sends: the trajectory ended only when that abort did (never)
    class Wedged(Replica):
        name = "wedged"

        async def generate(self, request: GenerateRequest) -> Completion:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def abort(self, request_id: str) -> bool:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def swap(self, version: int, state: Any) -> None:
            pass  # weights are not what this replica is for: it is wedged in generate

        async def ping(self) -> int:
            return 0

    class Detached:
        """The proxy as its actor is to the env manager: a call's proxy side runs on when its
        caller stops waiting (Ray does not cancel it)."""

        def __init__(self, proxy: LLMProxy):
            self.proxy = proxy
            self.turns: list[asyncio.Task[Completion]] = []

        async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
            self.turns.append(asyncio.ensure_future(self.proxy.generate(traj_id, tag, request)))
            return await asyncio.shield(self.turns[-1])

        async def abort(self, traj_id: str) -> int:
            return await self.proxy.abort(traj_id)

        async def release(self, traj_id: str) -> None:
            await self.proxy.release(traj_id)

    cfg = job(LAKE, timeout_s=0.3)
    proxy = LLMProxy({"default": [Wedged()]})
    proxy.abort_timeout_s = 0.2
    remote = Detached(proxy)
    try:
        run = EnvManager(cfg, pool, remote).run(Task(cfg.envs[0], 1, "g"), version=0)
        traj = await asyncio.wait_for(run, 10)
        assert traj.status == "infra_failed" and "trajectory_timeout_s=0.3" in traj.info["error"]
        assert proxy.metrics["abort_timeouts"] == 1 and not proxy._sticky
    finally:
        for t in remote.turns:
            t.cancel()
        await asyncio.gather(*remote.turns, return_exceptions=True)


@module_loop
async def test_a_cancelled_trajectory_still_releases_its_affinity_and_container(pool):
    cfg = job(LAKE)
    proxy = ScriptedProxy([HANG])
    run = asyncio.create_task(
        EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0, traj_id="c")
    )
    async with asyncio.timeout(10):
        while not proxy.calls:  # noqa: ASYNC110 - the scripted proxy records, it does not signal
            await asyncio.sleep(0.005)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert proxy.released == ["c"]
    await asyncio.sleep(0.05)
    assert pool.stats()["claimed"] == 0


@module_loop
async def test_a_release_that_fails_does_not_throw_away_a_played_trajectory(pool, caplog):
    # an error of proxy.release (not its death) came out of run() in place of the finished
    # trajectory: the group runner logged it as a manager bug and played it again
    class FailingRelease(ScriptedProxy):
        async def release(self, traj_id: str) -> None:
            await super().release(traj_id)
            raise RuntimeError("node unreachable")

    cfg = job(LAKE)
    proxy = FailingRelease(["right", "down"])
    traj = await asyncio.wait_for(EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0), 10)
    assert traj.status != "infra_failed" and len(proxy.calls) == 2
    assert "release failed (RuntimeError: node unreachable)" in caplog.text
    # the proxy's death still stops the trajectory (and the job) as it did
    died = FailingRelease(["right", "down"])

    async def dead(traj_id: str) -> None:
        raise ProxyDiedError("the LLM proxy actor died")

    died.release = dead  # type: ignore[method-assign]
    with pytest.raises(ProxyDiedError):
        await asyncio.wait_for(EnvManager(cfg, pool, died).run(Task(cfg.envs[0], 1, "g"), version=0), 10)
    assert pool.stats()["claimed"] == 0


class _BarePool:
    @contextlib.asynccontextmanager
    async def session(self, env_id: str, **kw: Any) -> AsyncIterator[_TaskSession]:
        yield _TaskSession(EnvLogicError("unused"))


def test_a_run_whose_loop_closed_under_it_ends_without_a_release_it_cannot_send():
    # a loop closed with a trajectory still running (a test that failed halfway) leaves the
    # run to the garbage collector, which closes it with no loop to run anything on: its
    # finally scheduled the proxy's release all the same, and each such run printed "There is
    # no current event loop" and "coroutine 'EnvManager._end' was never awaited"
    cfg = job(LAKE)
    proxy = ScriptedProxy([HANG])
    loop = asyncio.new_event_loop()
    run = loop.create_task(EnvManager(cfg, _BarePool(), proxy).run(Task(cfg.envs[0], 1, "g"), version=0))  # type: ignore[arg-type]

    async def until_its_turn() -> None:
        async with asyncio.timeout(60):
            while not proxy.calls:  # noqa: ASYNC110 - the scripted proxy records, it does not signal
                await asyncio.sleep(0.005)

    loop.run_until_complete(until_its_turn())
    loop.close()
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del run
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [str(u.exc_value) for u in unraisable] == []
    assert [str(w.message) for w in caught if "never awaited" in str(w.message)] == []
    assert proxy.released == []  # nothing could send it
