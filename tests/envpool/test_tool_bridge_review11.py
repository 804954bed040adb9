"""The tool bridge, reviewed: what an environment's tool call may reach and what a failed
one becomes.

* a tool that fails for the infrastructure's reasons (the fabric's retries spent, a backend
  down) fails the step as an infrastructure failure (retried, then ``infra_failed``), never
  an ``error: ...`` observation the policy is trained on;
* the bridge runs tools only: a reward (an LLM judge, a code verifier) named by an
  environment's tool call is refused as an unknown tool, not run with the policy's
  arguments.
"""

from __future__ import annotations

import pytest
from echo_bundle import IMAGE

import fabric
from envpool.errors import InfraError
from envpool.pool import EnvPool, SessionLost
from envpool.pool_config import fabric_tools, inprocess_tools

POOL = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}


async def test_a_tool_infrastructure_failure_is_not_an_observation(images):
    calls = []

    async def tools(name, arguments):
        calls.append(name)
        raise InfraError("the tool's backend is down")

    cfg = {**POOL, "retry": {"attempts": 2, "initial_backoff_s": 0.01, "max_backoff_s": 0.01}}
    async with EnvPool(cfg, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            with pytest.raises(SessionLost, match="backend is down"):
                await s.step("tool 1+1")
            assert s.status == "infra_failed"
    assert calls == ["calculator", "calculator"]  # retried as a step, like a lost container


async def test_a_tool_error_is_still_an_observation(images):
    async def tools(name, arguments):
        raise ValueError("division by zero")  # the tool refused its input: the policy's mistake

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            r = await s.step("tool 1/0")
            assert r.obs.text == "error: ValueError: division by zero" and s.status == "ok"


# -- the bridges: tools only, and a fabric failure told apart from the tool's own

REG = fabric.Registry()
RAN: list[str] = []


@REG.tool(retry=fabric.RetryPolicy(max_attempts=2, initial_backoff_s=0.001, max_backoff_s=0.001))
def echo_tool(text: str) -> str:
    if text == "bad":
        raise ValueError("bad input")
    if text == "down":
        raise fabric.Unavailable("the tool's dependency is down")
    return f"echo {text}"


@REG.reward
def secret_reward(traj: fabric.Trajectory, *, ground_truth: str = "") -> float:
    RAN.append("secret_reward")
    return 1.0


async def test_the_fabric_bridge_runs_tools_and_tells_their_errors_from_the_fabrics():
    RAN.clear()
    async with fabric.Client(backend="inproc", registry=REG) as client:
        call = fabric_tools(client)
        assert await call("echo_tool", {"text": "hi"}) == "echo hi"
        # the policy's mistakes: observations it learns from
        assert (await call("echo_tool", {"text": "bad"})).startswith("error:")
        assert (await call("echo_tool", {"txt": "hi"})).startswith("error:")
        assert (await call("no_such_tool", {})).startswith("error:")
        out = await call("secret_reward", {"traj": {"messages": []}})
        assert out.startswith("error:") and "not a tool" in out and RAN == []
        # the fabric's failure: an infrastructure error, never an observation
        with pytest.raises(InfraError, match="dependency is down"):
            await call("echo_tool", {"text": "down"})


async def test_the_inprocess_bridge_runs_tools_only(monkeypatch):
    RAN.clear()
    monkeypatch.setattr(fabric, "default_registry", REG)
    assert await inprocess_tools("echo_tool", {"text": "hi"}) == "echo hi"
    out = await inprocess_tools("secret_reward", {"traj": {"messages": []}})
    assert out.startswith("error:") and "not a tool" in out and RAN == []


def test_the_tool_errors_the_policy_sees_are_fabric_error_types_none_retryable():
    from envpool.pool_config import TOOL_ERRORS
    from fabric.errors import RETRYABLE, ErrorCode

    assert TOOL_ERRORS <= {c.value for c in ErrorCode} and not TOOL_ERRORS & RETRYABLE


async def test_the_inprocess_bridge_tells_a_tools_unavailable_from_its_error(monkeypatch):
    # fabric.Unavailable is a tool's way to say "not your input: my dependency failed";
    # the default bridge made it an observation, where the job's bridge fails the step
    monkeypatch.setattr(fabric, "default_registry", REG)
    assert (await inprocess_tools("echo_tool", {"text": "bad"})) == "error: ValueError: bad input"
    with pytest.raises(InfraError, match="dependency is down"):
        await inprocess_tools("echo_tool", {"text": "down"})
