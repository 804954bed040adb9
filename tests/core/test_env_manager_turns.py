"""EnvManager turn by turn: an action the environment refuses (unparsable, oversized), the
request a turn makes (actions, greedy), the reset's task and tool calls, the context the
policy is shown (history, drop_lines), and the TurnBarrier's lockstep."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from env_manager_fixtures import _every_session_ends, pool_fixture, tools_fixture  # noqa: F401 - by name=
from env_manager_helpers import CALL, LAKE, MATH, ScriptedProxy, check_turn_info, env, job, module_loop

from core.rollout.env_manager import EnvManager, Task, TurnBarrier
from envpool.api import MAX_ACTION_BYTES
from envpool.envs.math_tools import MathToolsEnv
from fabric.protocol import Message

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
