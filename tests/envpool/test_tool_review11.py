"""The tool bridge, reviewed: a replay (a container lost mid-episode) or a retried step
answers the episode's earlier tool calls with the results the policy saw, without running
the tools again. Run again, a tool with side effects had them twice, and one whose answer
changes (a counter, a live search) made the replay differ and lost a session that could
have been saved."""

from __future__ import annotations

import os
import signal

from echo_bundle import IMAGE

from envpool.pool import EnvPool

POOL = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}


async def test_a_replay_does_not_run_the_episodes_tool_calls_again(images):
    calls = []

    async def tools(name, arguments):
        calls.append(arguments["expression"])
        return f"result {len(calls)}"  # a tool whose answer changes from call to call

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            assert (await s.step("tool 1+1")).obs.text == "result 1"
            await s.step("a")
            old = s.container.pid
            os.killpg(old, signal.SIGKILL)
            r = await s.step("b")  # replayed on a new container: reset, "tool 1+1", "a"
            assert r.obs.text == "b #3" and s.status == "ok" and s.container.pid != old
            assert p.stats()["replays"] == 1
            # the second step's tool call was answered from the episode's record
            assert calls == ["1+1"]
            # a new tool call in the episode runs the tool
            assert (await s.step("tool 2+2")).obs.text == "result 2"
            # a new episode on the same session records afresh
            await s.reset(seed=2)
            assert (await s.step("tool 1+1")).obs.text == "result 3"
    assert calls == ["1+1", "2+2", "1+1"]


async def test_a_step_retried_after_its_tool_ran_does_not_run_the_tool_again(images):
    calls = []

    async def tools(name, arguments):
        calls.append(arguments["expression"])
        if len(calls) == 1:
            # the tool ran (its effect happened); the container dies before the step answers
            os.killpg(pids[-1], signal.SIGKILL)
        return f"result {len(calls)}"

    pids: list[int] = []
    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            pids.append(s.container.pid)
            r = await s.step("tool 1+1")
            assert r.obs.text == "result 1" and s.container.pid != pids[0]
    assert calls == ["1+1"]
