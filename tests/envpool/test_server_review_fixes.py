"""EnvPool with real containers: what a review found the server and the connection did
wrong. An environment's own sys.exit() or KeyboardInterrupt ended its server, read as a dead
container, retried and replayed on fresh ones; a tool result over the frame limit was never
sent, and the step waited out its timeout, then was retried with the tool run again."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import pool

from envpool.errors import EnvLogicError, SessionLost
from envpool.pool import EnvPool
from envpool.protocol import MAX_FRAME

EXITING = '''
import asyncio
import sys
import time
import envpool


class ExitEnv(envpool.Env):
    """'exit' calls sys.exit("the env gave up"), 'exit-bare' sys.exit(), 'interrupt' raises
    KeyboardInterrupt, 'cancelled' asyncio.CancelledError, 'sleep S' blocks; anything else is echoed."""

    example_actions = ("x",)

    def reset(self, *, seed=None, options=None):
        return f"ready {seed}", {}

    def step(self, action):
        if action == "exit":
            sys.exit("the env gave up")
        if action == "exit-bare":
            sys.exit()
        if action == "interrupt":
            raise KeyboardInterrupt
        if action == "cancelled":  # (an asyncio run of its own, cancelled inside it, say)
            raise asyncio.CancelledError("the env's own task was cancelled")
        if action.startswith("sleep "):
            time.sleep(float(action.split()[1]))
        return envpool.StepResult(obs=envpool.Observation(text=f"echo {action}"))


class ExitInitEnv(ExitEnv):
    def __init__(self):
        sys.exit(3)
'''


@pytest.fixture
def exiting(tmp_path):
    return write_env_bundle(
        tmp_path / "exiting", "exit_env", EXITING, {"exit-v0": "ExitEnv", "exit-init-v0": "ExitInitEnv"}
    )


def _no_infra(stats: dict) -> bool:
    return not any(k.startswith("infra:") for k in stats) and stats.get("step_retries", 0) == 0


@pytest.mark.parametrize(
    ("action", "said"),
    [
        ("exit", "SystemExit: the env gave up"),
        ("exit-bare", r"SystemExit: the environment called sys\.exit\(\)"),
        ("interrupt", "KeyboardInterrupt: raised by the environment's code"),
        ("cancelled", "CancelledError: the env's own task was cancelled"),
    ],
)
async def test_an_environments_sys_exit_or_keyboard_interrupt_is_its_error_not_retried(exiting, action, said):
    # the server caught only Exception: the process ended, the pool saw a lost connection and
    # retried (and replayed) the step on a fresh container per attempt: SessionLost after 5,
    # for the environment's own bug that the docs say is never retried
    async with pool(exiting, min_warm=0) as p, p.session("exit-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        held = s.container
        with pytest.raises(EnvLogicError, match=said) as raised:
            await s.step(action)
        assert raised.value.traceback and "step" in raised.value.traceback
        # the episode goes on on the same container (the error is part of it) ...
        assert (await s.step("still")).obs.text == "echo still" and s.container is held
        stats = p.stats()
        assert _no_infra(stats) and stats["runtime"]["started"] == 1, stats
        # ... which runs no other: its code was cut off wherever it was, meaning to end it
        assert stats.get("retired_unsound", 0) == 1, stats


async def test_a_constructor_that_calls_sys_exit_fails_the_session_not_retried(exiting):
    async with pool(exiting, min_warm=0) as p:
        with pytest.raises(EnvLogicError, match=r"raised SystemExit: 3"):
            async with p.session("exit-init-v0", image=IMAGE):
                pass  # never reached: the session's open raises
        stats = p.stats()
        assert _no_infra(stats) and stats.get("open_failed", 0) == 1, stats
        assert stats["runtime"]["started"] == 1 and stats.get("discarded", 0) == 1, stats  # replaced


async def test_a_sigint_to_a_server_mid_step_is_still_ignored_and_a_sigterm_still_ends_it(exiting):
    # that an environment's KeyboardInterrupt or SystemExit is its error must not turn the
    # signals that stop a server into one: SIGINT (a Ctrl-C to the pool's process group) is
    # the pool's to act on, and SIGTERM ends the server, a lost container
    async with pool(exiting, min_warm=0, retry={"attempts": 1}) as p, p.session("exit-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        pid = s.container.pid
        assert pid
        step = asyncio.create_task(s.step("sleep 0.5"))
        await asyncio.sleep(0.2)
        os.kill(pid, signal.SIGINT)
        assert (await step).obs.text == "echo sleep 0.5"
        step = asyncio.create_task(s.step("sleep 30"))
        await asyncio.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        with pytest.raises(SessionLost, match="session connection"):
            await step
        assert p.stats().get("infra:ConnectionLost", 0) == 1


def _tool_pool(images, result: object, calls: list[str]) -> EnvPool:
    async def tool(name: str, arguments: dict) -> object:
        calls.append(name)
        return result

    cfg = {"min_warm": 0, "step_timeout_s": 5.0, "runtime": {"heartbeat_s": 0.1}, "retry": {"attempts": 2}}
    return EnvPool(cfg, images=images, tool_caller=tool)


@pytest.mark.parametrize(
    ("result", "said"),
    [
        (
            "x" * (MAX_FRAME + 1),
            r"error: the tool's result is 16,777,219 bytes as JSON, too big for the 16,777,216",
        ),
        (object(), r"error: the tool's result cannot be sent as JSON \(.*object"),
    ],
    ids=["too-big", "not-json"],
)
async def test_a_tool_result_that_cannot_be_sent_is_a_tool_error_for_the_env(images, result, said, caplog):
    # send() raised EnvUsageError in the task that brokers the tool call, which nobody awaited
    # ("Task exception was never retrieved"); the environment waited for the result until the
    # step timed out, and the step was retried and replayed, running the tool again each time
    calls: list[str] = []
    async with _tool_pool(images, result, calls) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        held = s.container
        r = await s.step("tool 1+1")
        assert re.match(said, r.obs.text), r.obs.text  # "error: ...", as other tool failures are
        assert calls == ["calculator"] and s.container is held  # run once: no retry, no replay
        assert (await s.step("again")).obs.text == "again #2"
        stats = p.stats()
        assert _no_infra(stats) and stats.get("replays", 0) == 0, stats
    gc.collect()
    assert "never retrieved" not in caplog.text
