"""The ``tool_use`` reward on an agentic environment's episode: the env manager records the
tool calls math-tools parsed and ran (and the ones it refused), and the reward stream hands
the rewards a trajectory in the OpenAI shape (assistant ``tool_calls``, ``role: "tool"``
results), while what the policy is shown and trained on stays the plain chat it was."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from env_manager_helpers import CALL, MATH, ScriptedProxy, env, job, module_loop

from core.config import RewardConfig
from core.rewards import RewardStream
from core.rollout.env_manager import EnvManager, Task
from core.rollout.tool_calls import record_calls, reward_trajectory
from core.sample import Sample
from core.trainer.base import turn_samples
from envpool.envs.math_tools import MathToolsEnv
from envpool.pool import EnvPool
from fabric.client import Client
from fabric.protocol import Message, Trajectory
from fabric.registry import Registry
from functions.rewards.tool_use import tool_use_reward

BAD_JSON = '{"tool": "calculator", "arguments": {"expression": 6 *'
UNKNOWN = json.dumps({"tool": "search", "arguments": {"query": "six times seven"}})
FAILS = json.dumps({"tool": "calculator", "arguments": {"expression": "1 / 0"}})
THINKS = "Let me think about it."  # neither a call nor an answer: no call


async def _bridge(name: str, arguments: dict[str, Any]) -> str:
    return "error: division by zero" if arguments.get("expression") == "1 / 0" else "42"


@pytest_asyncio.fixture(loop_scope="module", scope="module", name="pool")
async def pool_fixture() -> AsyncIterator[EnvPool]:
    async with EnvPool({"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}, tool_caller=_bridge) as p:
        yield p
    assert not p.runtime.live


def _answer(seed: int) -> str:
    return MathToolsEnv().reset(seed=seed)[1]["task"]["answer"]


SCRIPT = [CALL, BAD_JSON, UNKNOWN, THINKS, FAILS]


async def _episode(pool: EnvPool, seed: int = 3) -> tuple[Trajectory, ScriptedProxy]:
    cfg = job(env(MATH, max_turns=7))
    proxy = ScriptedProxy([*SCRIPT, f"Answer: {_answer(seed)}"])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], seed, "g"), version=0)
    assert traj.status == "ok" and traj.env_reward == 1.0
    return traj, proxy


@module_loop
async def test_tool_use_counts_the_calls_the_policy_made_valid_and_invalid(pool):
    traj, _ = await _episode(pool)
    r = tool_use_reward(reward_trajectory(traj), min_calls=1)
    # four calls: two run (one answered with the calculator's error), two refused by the env
    assert r.info["calls"] == 4 and r.info["results"] == 4
    assert r.info["errors"] == 1 and r.info["unanswered"] == []
    assert set(r.info["invalid"]) == {"call_1_0", "call_2_0"}
    assert "invalid JSON" in r.info["invalid"]["call_1_0"]
    assert "unknown tool 'search'" in r.info["invalid"]["call_2_0"]
    assert r.components == {
        "valid_calls": pytest.approx(0.5),
        "answered_calls": 1.0,
        "no_errors": pytest.approx(0.75),
        "within_budget": 1.0,
    }


@module_loop
async def test_the_reward_trajectory_is_openai_shaped_and_does_not_repeat_the_observation(pool):
    traj, _ = await _episode(pool)
    view = reward_trajectory(traj)
    assert [m.role for m in view.messages] == [
        "user",
        *["assistant", "tool"] * 3,
        "assistant",
        "user",  # the reminder after a reply that was no call stays an observation
        "assistant",
        "tool",
        "assistant",
        "user",  # the verdict
    ]
    first = view.messages[1]
    assert first.content == CALL  # the reply's text is kept (final_text, judges read it)
    assert [c.model_dump(exclude_none=True) for c in first.tool_calls or []] == [
        {
            "id": "call_0_0",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "6 * 7"}'},
        }
    ]
    assert (view.messages[2].tool_call_id, view.messages[2].content) == ("call_0_0", "42")
    refused = (view.messages[3].tool_calls or [])[0]
    assert refused.function == {"name": "", "arguments": BAD_JSON}
    assert view.messages[4].content == traj.messages[4].content  # the refusal the policy saw
    assert view.final_text() == traj.final_text()
    assert view.info == traj.info and view.task == traj.task


@module_loop
async def test_what_the_policy_sees_and_is_trained_on_is_unchanged(pool):
    traj, proxy = await _episode(pool)
    before = traj.model_dump_json()
    reward_trajectory(traj)
    assert traj.model_dump_json() == before  # the view is a copy
    # the recorded chat is the plain one: user observations and assistant text, nothing more
    assert [m.role for m in traj.messages] == ["user", *["assistant", "user"] * 6]
    assert all(m.tool_calls is None and m.tool_call_id is None for m in traj.messages)
    replies = [*SCRIPT, f"Answer: {_answer(3)}"]
    for turn, (_, _, request) in enumerate(proxy.calls):
        # exactly what an engine renders (the OpenAI engine and vLLM's chat template both
        # dump the messages this way): the observations and the replies' text
        sent = [m.model_dump(exclude_none=True, exclude={"policy_version"}) for m in request.messages]
        assert [m["role"] for m in sent] == ["user", *["assistant", "user"] * turn]
        assert [m["content"] for m in sent[1::2]] == replies[:turn]
        assert [m["content"] for m in sent[::2]] == [m.content for m in traj.messages[: 2 * turn + 1 : 2]]
        assert all(set(m) == {"role", "content"} for m in sent[::2])
        assert all(set(m) == {"role", "content", "prompt_ids", "token_ids", "logprobs"} for m in sent[1::2])
    samples = turn_samples(traj, reward=1.0, group_id="g")
    assert [(s.prompt_ids, s.completion_ids, s.old_logprobs) for s in samples] == [
        ([1, 2], [3, 4], [-0.1, -0.2])
    ] * 6


@module_loop
async def test_the_reward_stream_scores_the_openai_shape_and_delivers_the_plain_trajectory(pool):
    traj, _ = await _episode(pool)
    reg = Registry()
    reg.add(tool_use_reward)
    got: list[Sample] = []
    rewards = {"math": [RewardConfig(function="tool_use_reward", args={"min_calls": 1})]}
    async with Client("inproc", registry=reg) as client, RewardStream(client, rewards, got.append) as stream:
        assert stream.submit(traj)
    [s] = got
    assert s.status == "ok" and s.reward is not None
    info = s.reward.info["tool_use_reward"]["info"]
    assert info["calls"] == 4 and len(info["invalid"]) == 2 and info["errors"] == 1
    assert s.traj.model_dump_json() == traj.model_dump_json()  # the trainer's copy is untouched


def test_a_trajectory_without_recorded_calls_is_passed_as_it_is():
    t = Trajectory(messages=[Message(role="user", content="q"), Message(role="assistant", content="a")])
    assert reward_trajectory(t) is t


@module_loop
async def test_turn_tool_calls_line_up_with_the_turns_and_only_where_an_env_reports_calls(pool):
    cfg = job(env(MATH, max_turns=3))
    script = [THINKS, CALL, f"Answer: {_answer(5)}"]
    traj = await EnvManager(cfg, pool, ScriptedProxy(script)).run(Task(cfg.envs[0], 5, "g"), version=0)
    ran = {"name": "calculator", "arguments": '{"expression": "6 * 7"}', "output": "42"}
    assert traj.info["turn_tool_calls"] == [[], [ran], []]
    no_calls = await EnvManager(cfg, pool, ScriptedProxy([f"Answer: {_answer(5)}"])).run(
        Task(cfg.envs[0], 5, "g"), version=0
    )
    assert "turn_tool_calls" not in no_calls.info  # other environments' records are as they were


def test_record_calls_keeps_every_reported_call_as_text():
    assert record_calls({"tool_calls": 2}) == [] and record_calls({"calls": "x"}) == []
    got = record_calls({"calls": [{"name": "f", "arguments": {"a": 1}, "output": 3, "refused": ""}, "raw"]})
    assert got == [
        {"name": "f", "arguments": '{"a": 1}', "output": "3", "refused": "refused by the environment"},
        {"name": "", "arguments": "raw", "output": ""},
    ]
