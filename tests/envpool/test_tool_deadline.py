"""A tool call's time is bounded by its step's.

* the job's bridge (``fabric_tools``) sends the fabric call the time the step has left as its
  deadline: a tool that runs past it is the tool's failure, an ``error: ...`` observation
  inside the step (the container is kept, nothing is retried), where it was a ``StepTimeout``
  (the container killed, the step retried, the trajectory ``infra_failed``); a call that
  never ran in that time (queued behind ``max_concurrency``) is the fabric's (``ToolUnavailable``);
* the default bridge (``inprocess_tools``) runs tools on the pool's own bounded threads, each
  call within the function's ``timeout_s`` or the step's time, whichever is less;
* a non-string result is shown as JSON, not as a Python repr.
"""

from __future__ import annotations

import asyncio

import pytest
from echo_bundle import IMAGE

import fabric
from envpool.pool import EnvPool, SessionLost
from envpool.pool_config import fabric_tools

# a heartbeat period well under the tool's time: a container waiting on a tool must not read as hung
POOL = {
    "min_warm": 0,
    "step_timeout_s": 3.0,
    "retry": {"attempts": 1},
    "runtime": {"heartbeat_s": 0.1},
}

REG = fabric.Registry()
HOLD = asyncio.Event()


@REG.tool(name="calculator", max_concurrency=1)
async def slow_calculator(expression: str) -> str:
    if expression == "hold":
        await HOLD.wait()
        return "held"
    await asyncio.sleep(60)  # far past the step's 3 s
    return "late"


async def test_a_fabric_tool_slower_than_the_step_is_a_tool_error_inside_it(images):
    async with fabric.Client(backend="inproc", registry=REG) as client:
        async with EnvPool(POOL, images=images, tool_caller=fabric_tools(client)) as p:
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset(seed=1)
                r = await s.step("tool 6*7")
                assert r.obs.text.startswith("error: tool 'calculator' ran past")
                assert s.status == "ok" and s.failures == []
                # the same container goes on: not killed as hung, nor retried
                assert (await s.step("hello")).obs.text == "hello #2"
            stats = p.stats()
            assert stats.get("env_hung", 0) == 0 and stats.get("discarded", 0) == 0


async def test_a_fabric_tool_queued_past_the_steps_time_is_the_fabrics_failure(images):
    HOLD.clear()
    async with fabric.Client(backend="inproc", registry=REG) as client:
        holder = asyncio.create_task(client.call("calculator", {"expression": "hold"}))
        await asyncio.sleep(0.05)  # it holds the one slot
        try:
            async with EnvPool(POOL, images=images, tool_caller=fabric_tools(client)) as p:
                async with p.session("bundle-echo-v0", image=IMAGE) as s:
                    await s.reset(seed=1)
                    # never ran: the policy's call was not wrong, the step fails as the infra's
                    with pytest.raises(SessionLost, match="concurrency slot"):
                        await s.step("tool 6*7")
        finally:
            HOLD.set()
            assert (await holder).value == "held"


async def test_the_fabric_bridge_passes_its_deadline_on():
    async with fabric.Client(backend="inproc", registry=REG) as client:
        call = fabric_tools(client)
        out = await asyncio.wait_for(call("calculator", {"expression": "1"}, deadline_s=0.2), 10)
        assert out.startswith("error: tool 'calculator' ran past the 0.2 s")


@pytest.mark.parametrize(
    ("message", "ran"),
    [
        ("deadline passed while running; the call was cancelled", True),
        ("t: deadline passed before the backend answered; the call was abandoned", True),
        ("t: deadline passed while the call waited for a concurrency slot (...); nothing was sent", False),
        ("deadline passed while queued", False),
        ("deadline passed before the call started", False),
        ("deadline passed while waiting for room in the pool (it did not run)", False),
        ("t: the call was not sent: its deadline passed while all 8 connections were busy", False),
    ],
)
def test_a_deadline_is_the_tools_only_if_the_tool_ran(message, ran):
    from envpool.pool_config import ran_too_long

    assert ran_too_long("DeadlineExceeded", message) is ran
    assert not ran_too_long("FunctionTimeout", message)
