"""EnvManager: one trajectory's loop over a real EnvPool (process runtime) and a scripted
proxy; what the policy is shown (``context``); the TurnBarrier's lockstep."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from core.config import EnvConfig, JobConfig
from core.errors import ProxyDiedError
from core.rollout.engines.base import Completion, EngineError, GenerateRequest
from core.rollout.env_manager import EnvManager, Task, TurnBarrier
from core.rollout.llm_proxy import LLMProxy, NoReplicaError, Replica
from envpool.api import MAX_ACTION_BYTES, Observation
from envpool.envs.math_tools import MathToolsEnv
from envpool.errors import EnvLogicError
from envpool.pool import EnvPool
from fabric.protocol import Message

LAKE = {"id": "frozenlake-v1", "tag": "lake", "max_turns": 4, "kwargs": {"desc": ["SF", "FG"]}}
"""S F / F G: ``right`` then ``down`` reaches the goal; ``left`` bumps into the edge."""
MATH = {"id": "math-tools-v1", "tag": "math", "max_turns": 3}
CALL = json.dumps({"tool": "calculator", "arguments": {"expression": "6 * 7"}})

ABORT = object()
HANG = object()
Reply = str | BaseException | object


def job(*envs: dict[str, Any], timeout_s: float = 60.0) -> JobConfig:
    envs = tuple(e.model_dump() if isinstance(e, EnvConfig) else e for e in envs)
    tags = {e["tag"] for e in envs}
    return JobConfig.from_dict(
        {
            "envs": list(envs),
            "rewards": {t: [{"function": "unused"}] for t in tags},
            "engine": {"max_new_tokens": 4, "temperature": 0.7},
            "rollout": {"trajectory_timeout_s": timeout_s},
        },
        check_references=False,
    )


def env(base: dict[str, Any], **over: Any) -> EnvConfig:
    return EnvConfig.model_validate({**base, **over})


class ScriptedProxy:
    """Replies by turn (a list) or by ``(traj_id, turn)`` (a function): a string is the
    completion's text, ``ABORT`` an aborted turn, ``HANG`` a turn that never ends, an
    exception is raised. Records every request, abort and release."""

    def __init__(self, script: list[Reply] | Callable[[str, int], Reply], version: int = 5):
        self.script = script
        self.version = version
        self.calls: list[tuple[str, str, GenerateRequest]] = []
        self.released: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, traj_id: str, tag: str, request: GenerateRequest) -> Completion:
        self.calls.append((traj_id, tag, request))
        turn = request.metadata["turn"]
        reply = self.script(traj_id, turn) if callable(self.script) else self.script[turn]
        await asyncio.sleep(0)
        if reply is HANG:
            await asyncio.sleep(60)
        if isinstance(reply, BaseException):
            raise reply
        aborted = reply is ABORT
        return Completion(
            request_id=request.request_id,
            text="" if aborted else str(reply),
            prompt_ids=[1, 2],
            token_ids=[] if aborted else [3, 4],
            logprobs=[] if aborted else [-0.1, -0.2],
            policy_version=self.version,
            finish_reason="abort" if aborted else "stop",
            allowed_token_ids=request.allowed_token_ids,
            metadata=request.metadata,
        )

    async def abort(self, traj_id: str) -> int:
        self.aborted.append(traj_id)
        return 0

    async def release(self, traj_id: str) -> None:
        self.released.append(traj_id)


class Tools:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __call__(self, name: str, arguments: dict[str, Any]) -> str:
        self.calls.append((name, arguments))
        return "42"


# one pool (and event loop) for the module: its zygote starts once, containers stay warm
module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tools() -> Tools:
    return Tools()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool(tools: Tools) -> AsyncIterator[EnvPool]:
    cfg = {
        "min_warm": 0,
        "runtime": {"heartbeat_s": 0.1},
        "retry": {"attempts": 2, "initial_backoff_s": 0.01, "max_backoff_s": 0.02},
    }
    async with EnvPool(cfg, tool_caller=tools) as p:
        yield p
    assert not p.runtime.live  # every container stopped


@pytest.fixture(autouse=True)
def _every_session_ends(request):
    yield
    if "pool" in request.fixturenames:
        assert request.getfixturevalue("pool").stats()["claimed"] == 0  # containers given back


def assistant_turns(traj) -> int:
    return sum(m.role == "assistant" for m in traj.messages)


def check_turn_info(traj) -> None:
    n = assistant_turns(traj)
    assert len(traj.info["turn_rewards"]) == n and len(traj.info["turn_states"]) == n


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


# ----------------------------------------------------------------------------- actions


@module_loop
async def test_an_unparsable_action_is_an_invalid_turn(pool):
    cfg = job(LAKE)
    proxy = ScriptedProxy(["jump over the lake", "right", "down"])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "ok" and traj.env_reward == 1.0
    assert traj.info["invalid"] == 1
    assert "Invalid action" in (traj.messages[2].content or "")
    assert traj.info["turn_rewards"] == [0.0, 0.0, 1.0]
    check_turn_info(traj)


@module_loop
async def test_an_oversized_action_is_an_invalid_turn_not_a_crash(pool):
    cfg = job(LAKE)
    proxy = ScriptedProxy(["x" * (MAX_ACTION_BYTES + 1), "right", "down"])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "ok" and traj.env_reward == 1.0  # the episode went on
    assert traj.info["invalid"] == 1
    assert (traj.messages[2].content or "").startswith("Invalid action: action is 65,537 bytes")
    assert traj.info["turn_rewards"] == [0.0, 0.0, 1.0]
    check_turn_info(traj)


@module_loop
async def test_actions_and_greedy_shape_the_request(pool):
    cfg = job(env(LAKE, max_turns=1))
    proxy = ScriptedProxy(["left"])
    manager = EnvManager(cfg, pool, proxy, actions={"lake": [5, 6], "other": [9]})
    traj = await manager.run(Task(cfg.envs[0], 1, "g", greedy=True), version=0)
    [(_, _, request)] = proxy.calls
    assert request.temperature == 0.0 and request.allowed_token_ids == [5, 6]
    assert (traj.messages[1].model_extra or {})["allowed_token_ids"] == [5, 6]


@module_loop
async def test_reset_task_is_merged_and_tool_calls_reach_the_bridge(pool, tools):
    _, reset_info = MathToolsEnv().reset(seed=11)
    answer = reset_info["task"]["answer"]
    cfg = job(MATH)
    tools.calls.clear()
    proxy = ScriptedProxy([CALL, f"Answer: {answer}"])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 11, "g"), version=1)
    assert traj.task == {
        "env_id": "math-tools-v1",
        "seed": 11,
        "tag": "math",
        "group_id": "g",
        **reset_info["task"],
    }
    assert tools.calls == [("calculator", {"expression": "6 * 7"})]
    assert traj.messages[2].content == "42"  # the tool's output is the next observation
    assert traj.status == "ok" and traj.env_reward == 1.0
    # no state or position in math-tools' info: the state is the observation as shown
    assert traj.info["turn_states"] == [traj.messages[0].content, "42"]
    check_turn_info(traj)


# ----------------------------------------------------------------------------- context


def _chat() -> list[Message]:
    return [
        Message(role="system", content="sys"),
        Message(role="user", content="obs0\nLegend: x"),
        Message(role="assistant", content="a1"),
        Message(role="user", content="obs1\nLegend: x"),
        Message(role="assistant", content="Legend: mine"),
        Message(role="user", content="obs2\nLegend: x\nend"),
    ]


def _contents(msgs: list[Message]) -> list[str | None]:
    return [m.content for m in msgs]


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        (None, ["sys", "obs0\nLegend: x", "a1", "obs1\nLegend: x", "Legend: mine", "obs2\nLegend: x\nend"]),
        (0, ["sys", "obs2\nLegend: x\nend"]),
        (1, ["sys", "obs1\nLegend: x", "Legend: mine", "obs2\nLegend: x\nend"]),
        (5, ["sys", "obs0\nLegend: x", "a1", "obs1\nLegend: x", "Legend: mine", "obs2\nLegend: x\nend"]),
    ],
)
def test_context_keeps_the_system_message_and_the_last_history_pairs(history, expected):
    e = env(LAKE, prompt={"history": history})
    assert _contents(EnvManager.context(_chat(), e)) == expected
    no_system = _chat()[1:]
    assert _contents(EnvManager.context(no_system, e)) == [c for c in expected if c != "sys"]


def test_context_drops_lines_from_observations_only():
    e = env(LAKE, prompt={"history": 1, "drop_lines": ["Legend", "end"]})
    chat = _chat()
    out = EnvManager.context(chat, e)
    assert _contents(out) == ["sys", "obs1", "Legend: mine", "obs2"]  # the reply keeps its line
    assert chat[5].content == "obs2\nLegend: x\nend"  # the trajectory itself is not touched


@module_loop
async def test_the_policy_is_shown_the_configured_context(pool):
    lake = env(LAKE, max_turns=3, prompt={"history": 0, "system": "Be brief.", "drop_lines": ["Legend"]})
    cfg = job(lake.model_dump())
    proxy = ScriptedProxy(["left", "right", "down"])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "ok" and traj.messages[0].content == "Be brief."
    for turn, (_, _, request) in enumerate(proxy.calls):
        shown = request.messages or []
        assert [m.role for m in shown] == ["system", "user"]  # history 0: the latest observation
        assert shown[1].content == "\n".join(
            ln
            for ln in (traj.messages[1 + 2 * turn].content or "").split("\n")
            if not ln.startswith("Legend")
        )
        assert "Legend" not in (shown[1].content or "")
    assert "Legend" in (traj.messages[1].content or "")  # the trajectory keeps everything


@module_loop
async def test_drop_lines_apply_to_states_taken_from_the_observation(pool):
    cfg = job(env(MATH, max_turns=1, prompt={"drop_lines": ["Call the calculator"]}))
    proxy = ScriptedProxy(["I am not sure."])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 3, "g"), version=0)
    [state] = traj.info["turn_states"]
    assert traj.task["question"] in state and "Call the calculator" not in state
    assert "Call the calculator" in (traj.messages[0].content or "")


# ----------------------------------------------------------------------------- barrier


async def _member(
    name: str, turns: list[float], barrier: TurnBarrier, log: list[tuple[str, str, int]]
) -> None:
    try:
        for k, d in enumerate(turns):
            await barrier.wait()
            log.append(("start", name, k))
            await asyncio.sleep(d)
            log.append(("end", name, k))
    finally:
        await barrier.leave()


def _lockstep(log: list[tuple[str, str, int]]) -> None:
    """No member starts turn k+1 before every member that ran turn k has ended it."""
    for k in range(max(t for _, _, t in log)):
        last_end = max(i for i, (what, _, t) in enumerate(log) if what == "end" and t == k)
        first_next = min(i for i, (what, _, t) in enumerate(log) if what == "start" and t == k + 1)
        assert last_end < first_next, (k, log)


@module_loop
async def test_the_barrier_keeps_members_in_lockstep_and_a_leaver_does_not_block():
    barrier = TurnBarrier()
    log: list[tuple[str, str, int]] = []
    plans = {"a": [0.0, 0.03, 0.0, 0.0], "b": [0.03, 0.0, 0.01, 0.0], "c": [0.01, 0.0]}  # c leaves early
    for _ in plans:
        barrier.join()
    async with asyncio.timeout(5):
        await asyncio.gather(*(_member(n, p, barrier, log) for n, p in plans.items()))
    _lockstep(log)
    assert sorted(t for what, _, t in log if what == "start") == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


@module_loop
async def test_env_managers_with_a_barrier_generate_turn_by_turn(pool):
    lat = {"id": "latency-v0", "tag": "lat", "max_turns": 3}
    fast = env(lat, kwargs={"mu_s": 0.0, "turns": 3})
    slow = env(lat, kwargs={"mu_s": 0.04, "turns": 3})
    short = env(lat, kwargs={"mu_s": 0.0, "turns": 1})  # ends after one turn and leaves
    cfg = job(lat)
    proxy = ScriptedProxy(lambda tid, turn: "go")
    manager = EnvManager(cfg, pool, proxy)
    barrier = TurnBarrier()
    tasks = [Task(e, i, "g") for i, e in enumerate((fast, slow, short))]
    for _ in tasks:
        barrier.join()
    async with asyncio.timeout(20):
        trajs = await asyncio.gather(
            *(
                manager.run(t, version=0, traj_id=n, barrier=barrier)
                for t, n in zip(tasks, "fsx", strict=True)
            )
        )
    assert [t.status for t in trajs] == ["ok", "ok", "ok"]
    turns = [r.metadata["turn"] for _, _, r in proxy.calls]
    assert turns == sorted(turns) and turns.count(0) == 3 and turns.count(2) == 2
    assert sorted(proxy.released) == ["f", "s", "x"]


@module_loop
async def test_a_member_cancelled_at_the_barrier_does_not_release_the_round_early():
    barrier = TurnBarrier()
    for _ in range(3):
        barrier.join()
    released: list[str] = []

    async def arrive(name: str) -> None:
        await barrier.wait()
        released.append(name)

    tasks = {n: asyncio.create_task(arrive(n)) for n in ("a", "c")}
    try:
        await asyncio.sleep(0.01)  # a and c wait at turn k; b is still stepping its environment
        tasks["c"].cancel()  # c's group filled: the extra is aborted where it waits
        with contextlib.suppress(asyncio.CancelledError):
            await tasks["c"]
        await barrier.leave()  # c's EnvManager.run leaves in its finally
        await asyncio.sleep(0.01)
        assert released == []  # a still waits for b
        tasks["b"] = asyncio.create_task(arrive("b"))
        async with asyncio.timeout(1):
            await asyncio.gather(tasks["a"], tasks["b"])
        assert sorted(released) == ["a", "b"]
    finally:
        for t in tasks.values():
            t.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
