"""Whose failure a failed tool call is, and what it costs the step.

* a tool that ran past its own ``timeout_s`` on the policy's arguments (``FunctionTimeout``,
  the call begun) is the tool's, as a deadline that cut it running is: ``error: ...`` text
  the policy learns from, not an infrastructure failure (a ``FunctionTimeout`` of a call
  that never began is the machinery's);
* a bridge of the caller's own that takes no ``deadline_s=`` is bounded by its step all the
  same: a hung tool fails the step, clearly and inside its time;
* a tool whose own setup is wrong (``fabric.Misconfigured``) fails the step once, naming the
  tool and what to fix, without replaying the episode on new containers that fail alike;
* tool arguments too big to cross from the container to the pool are text for the policy,
  as the fabric's ``PayloadTooLarge`` is, not the end of the session.
"""

from __future__ import annotations

import asyncio

import pytest
from echo_bundle import IMAGE, write_env_bundle

import fabric
from envpool.errors import InfraError, ToolMisconfigured, ToolUnavailable
from envpool.pool import EnvPool, SessionLost
from envpool.pool_config import fabric_tools, ran_too_long
from envpool.protocol import MAX_FRAME
from fabric.errors import ErrorCode
from fabric.testing import FakeBackend, Fault

POOL = {"min_warm": 0, "step_timeout_s": 3.0, "retry": {"attempts": 3}, "runtime": {"heartbeat_s": 0.1}}

REG = fabric.Registry()


@REG.tool(name="calculator", timeout_s=0.2, retry={"max_attempts": 1})
async def slow_calculator(expression: str) -> str:
    await asyncio.sleep(30)  # past its own 0.2 s, well inside any step
    return "late"


UNSET = fabric.Registry()


@UNSET.tool(name="calculator")
def unset_calculator(expression: str) -> str:
    raise fabric.Misconfigured("CALCULATOR_API_KEY is not set")


# -- 1. a tool's own time limit on these arguments is the tool's


async def test_a_tool_past_its_own_timeout_is_text_for_the_policy():
    # the step's deadline (20 s) is far off: the tool's own timeout_s (0.2 s) cut it
    async with fabric.Client(backend="inproc", registry=REG) as client:
        out = await asyncio.wait_for(
            fabric_tools(client)("calculator", {"expression": "1"}, deadline_s=20), 10
        )
    assert out.startswith("error: tool 'calculator' ran past its 0.2 s time limit")


@pytest.mark.parametrize(
    ("started", "tools"),
    [(True, True), (None, True), (False, False)],
)
async def test_a_function_timeout_is_the_tools_only_if_the_tool_began(started, tools):
    fake = FakeBackend(REG)
    fake.inject(
        "calculator", Fault(code=ErrorCode.TIMEOUT, message="ran past its 0.2 s limit", started=started)
    )
    async with fabric.Client(backend=fake, registry=REG) as client:
        call = fabric_tools(client)
        if tools:
            out = await call("calculator", {"expression": "1"}, deadline_s=5)
            assert out.startswith("error: tool 'calculator' ran past its 0.2 s time limit")
        else:
            with pytest.raises(ToolUnavailable, match="FunctionTimeout"):
                await call("calculator", {"expression": "1"}, deadline_s=5)


@pytest.mark.parametrize(
    ("message", "ran"),
    [
        ("calculator ran past its 0.2 s limit", True),
        ("no reply from Lambda in time: read timeout", True),
        ("calculator: timed out while queued", False),
    ],
)
def test_a_function_timeout_without_started_is_read_by_its_message(message, ran):
    # an older peer's answer (no Result.started): read as a DeadlineExceeded is
    assert ran_too_long("FunctionTimeout", message) is ran
    assert ran_too_long("FunctionTimeout", message, started=True)
    assert not ran_too_long("FunctionTimeout", message, started=False)


# -- 2. a bridge without deadline_s= is bounded by its step


async def test_a_bridge_without_a_deadline_is_bounded_by_its_step(images):
    calls = []

    async def tools(name, arguments):  # a caller's own bridge: no deadline_s=
        calls.append(name)
        await asyncio.Event().wait()  # hangs for good
        return "never"

    pool = {**POOL, "step_timeout_s": 2.0, "retry": {"attempts": 1}}
    async with EnvPool(pool, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            with pytest.raises(InfraError) as e:
                await asyncio.wait_for(s.step("tool 6*7"), 30)
            # said as the tool's call that did not answer in the step's time (less the reserve
            # for the step's reply), not as a step that timed out "with a tool call pending"
            assert "tool 'calculator' did not answer" in str(e.value)
            assert "deadline_s" in str(e.value)
    assert calls == ["calculator"]


async def test_a_bridges_own_timeout_error_is_still_its_error_text(images):
    async def tools(name, arguments):  # its own client gave up on a slow upstream
        raise TimeoutError("upstream took too long")

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            assert (await s.step("tool 1")).obs.text == "error: TimeoutError: upstream took too long"


# -- 3. a misconfigured tool fails the step once, without replays


async def test_a_misconfigured_fabric_tool_fails_the_step_without_replays(images):
    async with fabric.Client(backend="inproc", registry=UNSET) as client:
        async with EnvPool(POOL, images=images, tool_caller=fabric_tools(client)) as p:
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset(seed=1)
                await s.step("a")
                with pytest.raises(ToolMisconfigured, match=r"'calculator'.*CALCULATOR_API_KEY is not set"):
                    await s.step("tool x")
                # no new container, no replay of the episode on one: it would fail alike
                stats = p.stats()
                assert stats.get("replays", 0) == 0 and stats.get("step_retries", 0) == 0
                assert s.status == "infra_failed"  # masked, never a fake reward
                with pytest.raises(SessionLost, match="CALCULATOR_API_KEY"):
                    await s.reset()


async def test_a_misconfigured_inprocess_tool_fails_the_step_without_replays(images, monkeypatch):
    monkeypatch.setattr(fabric, "default_registry", UNSET)
    async with EnvPool(POOL, images=images) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            with pytest.raises(ToolMisconfigured, match=r"'calculator'.*CALCULATOR_API_KEY"):
                await s.step("tool x")
            assert p.stats().get("replays", 0) == 0 and s.status == "infra_failed"


def test_a_misconfigured_tool_is_still_an_infrastructure_failure():
    # masked from training (infra_failed), never a fake reward: only its retries are gone
    assert issubclass(ToolMisconfigured, ToolUnavailable) and not ToolMisconfigured.retryable


# -- 4. tool arguments too big for a frame are text for the policy

BIG_SOURCE = '''
import envpool


class BigArgsEnv(envpool.Env):
    """'big N' calls the calculator with an N-byte expression (an env that builds a tool's
    arguments out of the policy's action, a file it wrote, a history)."""

    example_actions = ("hello",)

    def reset(self, *, seed=None, options=None):
        return "ready", {}

    def step(self, action):
        if action.startswith("big "):
            out = self.call_tool("calculator", {"expression": "x" * int(action[4:])})
            return envpool.StepResult(obs=envpool.Observation(text=out))
        return envpool.StepResult(obs=envpool.Observation(text=action))
'''


async def test_tool_arguments_over_the_frame_limit_are_text_for_the_policy(tmp_path):
    images = write_env_bundle(tmp_path / "big", "big_env", BIG_SOURCE, {"big-args-v0": "BigArgsEnv"})
    calls = []

    async def tools(name, arguments):
        calls.append(len(arguments["expression"]))
        return "ran"

    async with EnvPool(POOL, images=images, tool_caller=tools) as p:
        async with p.session("big-args-v0", image=IMAGE) as s:
            await s.reset()
            assert (await s.step("big 10")).obs.text == "ran"
            r = await s.step(f"big {MAX_FRAME + 1}")
            assert r.obs.text.startswith("error: the tool call's arguments are")
            assert "frame limit" in r.obs.text
            # the session goes on, on the same container
            assert (await s.step("hello")).obs.text == "hello" and s.status == "ok"
            assert p.stats().get("protocol_errors", 0) == 0
    assert calls == [10]


async def test_arguments_the_fabric_refuses_as_too_large_are_text_for_the_policy():
    # (the fabric's own limit, under the frame's: a Lambda's 6 MiB, a serve's 413)
    fake = FakeBackend(REG)
    fake.inject(
        "calculator", Fault(code=ErrorCode.PAYLOAD_TOO_LARGE, message="payload of calculator is too big")
    )
    async with fabric.Client(backend=fake, registry=REG) as client:
        out = await fabric_tools(client)("calculator", {"expression": "1"}, deadline_s=5)
    assert out == "error: payload of calculator is too big"
