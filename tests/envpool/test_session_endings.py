"""How a session ends, after a review: a close sent while the environment waits on a tool
call is answered (the server keeps the frames that arrive meanwhile); a previous
environment's close that hangs costs the container, not the next session; a session that
is lost lets its container go at once; and a close queued behind a slow step keeps its
container (the server heartbeats through the step)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import alive, pool, wait_for

from envpool.connection import Connection
from envpool.errors import EnvHung
from envpool.pool import EnvPool, SessionLost


def _when_close_sent(conn: Connection, monkeypatch: pytest.MonkeyPatch, then: asyncio.Event) -> None:
    """Set ``then`` as the session's goodbye (its close) is written to ``conn``."""
    send = conn.send

    def sending(msg):
        send(msg)
        if msg.get("op") == "close":
            then.set()

    monkeypatch.setattr(conn, "send", sending)


async def test_a_close_sent_while_the_environment_waits_on_a_tool_is_answered(images, monkeypatch):
    # the block ends while a step (in a task of its own) waits on a tool: its goodbye reached
    # the server inside the environment's call_tool, which threw away every frame but its
    # tool result; the close was never answered and the healthy container was discarded
    called, go = asyncio.Event(), asyncio.Event()

    async def tool(name, arguments):
        called.set()
        await go.wait()
        return "42"

    cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}
    async with EnvPool(cfg, images=images, tool_caller=tool) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            step = asyncio.create_task(s.step("tool 6*7"))
            await called.wait()
            # the tool answers once the goodbye is on its way: after it on the wire
            _when_close_sent(s.conn, monkeypatch, go)
        assert (await step).obs.text == "42"
        stats = p.stats()
        assert stats.get("discarded", 0) == 0 and stats["idle"] == 1, stats


async def test_a_close_queued_behind_a_slow_step_keeps_its_container(images):
    # the server answers a goodbye sent during a step once the step is done; it heartbeats
    # all through the step, so the wait is no silence (checked: the review's worry that a
    # slow close reply, with a small heartbeat_s, discarded a healthy container)
    async with pool(images, min_warm=0) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            step = asyncio.create_task(s.step("sleep 1"))
            await asyncio.sleep(0.2)
        assert (await step).obs.text == "sleep 1 #1"
        stats = p.stats()
        assert stats.get("discarded", 0) == 0 and stats["idle"] == 1, stats


_CLOSE_HANGS = """
import time
import envpool


class CloseHangsEnv(envpool.Env):
    def reset(self, *, seed=None, options=None):
        return f"ready {seed}", {}

    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text=action))

    def close(self):
        time.sleep(3600)


class OtherEnv(CloseHangsEnv):
    def close(self):
        pass


class InitHangsEnv(OtherEnv):
    def __init__(self):
        time.sleep(3600)
"""


async def test_a_previous_environments_close_that_hangs_costs_its_container_not_the_next_session(
    tmp_path,
):
    # the container's next session opens another environment: the last one's close hangs,
    # and the open ran past its timeout. That failed the new session, not retried, as an
    # EnvHung of its own constructor; the container is discarded and the session claims a
    # fresh one, the failure said as the previous environment's close
    images = write_env_bundle(
        tmp_path / "b",
        "close_hangs_env",
        _CLOSE_HANGS,
        {"close-hangs-v0": "CloseHangsEnv", "other-v0": "OtherEnv", "init-hangs-v0": "InitHangsEnv"},
    )
    async with pool(images, min_warm=0, reset_timeout_s=1.0) as p:
        async with p.session("other-v0", image=IMAGE) as s:
            await s.reset(seed=1)
        # a constructor that hangs after a close that returned is still its own EnvHung
        with pytest.raises(EnvHung, match="init-hangs-v0: open did not answer"):
            async with p.session("init-hangs-v0", image=IMAGE):
                pass
        async with p.session("close-hangs-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            pid = s.container.pid
        async with p.session("other-v0", image=IMAGE) as s:
            assert s.container.pid != pid
            assert (await s.reset(seed=2))[0].text == "ready 2"
            assert len(s.failures) == 1 and "previous environment's close()" in s.failures[0], s.failures
            assert s.status == "ok"
        stats = p.stats()
        assert stats["env_close_hung"] == 1 and stats["env_hung"] == 1, stats
        await wait_for(lambda: not alive(pid))


async def test_a_lost_non_deterministic_session_lets_its_container_go_at_once(images):
    # its step's container died and the episode cannot be rebuilt: the session is lost, and
    # its dead container stayed claimed until the block ended
    async with pool(images, min_warm=0) as p:
        async with p.session("bundle-random-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            os.killpg(s.container.pid, signal.SIGKILL)
            with pytest.raises(SessionLost, match="not deterministic"):
                await s.step("a")
            assert s.container is None and s.conn is None
            assert p.stats()["claimed"] == 0


async def test_a_replay_that_differs_lets_its_container_go_at_once(images):
    # the fresh container the replay ran on is held by no live session either
    async with pool(images, min_warm=0) as p:
        async with p.session("bundle-liar-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            os.killpg(s.container.pid, signal.SIGKILL)
            with pytest.raises(SessionLost, match="differs"):
                await s.step("a")
            assert s.container is None and p.stats()["claimed"] == 0


async def test_a_close_behind_a_step_longer_than_the_close_budget_keeps_its_container(images):
    # the goodbye's wait began as it was sent: behind a step that ran longer than that (the
    # server heartbeating all through it), it ran out, read as a hung container, and the
    # healthy container was discarded. The step has its own time; the close's comes after
    async with pool(images, min_warm=0, close_timeout_s=0.5) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            c = s.container
            step = asyncio.create_task(s.step("sleep 1.5"))
            await wait_for(lambda: c.in_flight > 0)  # the step is sent: the goodbye goes behind it
        assert (await step).obs.text == "sleep 1.5 #1"
        stats = p.stats()
        assert stats.get("discarded", 0) == 0 and stats["idle"] == 1, stats


async def test_a_previous_environments_close_that_hangs_is_given_up_at_the_close_budget(tmp_path):
    # an open waited for a hung close for the whole reset_timeout_s (60 s by default)
    # before it discarded the container: the close has a budget of its own
    images = write_env_bundle(
        tmp_path / "b",
        "close_hangs_env",
        _CLOSE_HANGS,
        {"close-hangs-v0": "CloseHangsEnv", "other-v0": "OtherEnv"},
    )
    async with pool(images, min_warm=0, reset_timeout_s=5.0, close_timeout_s=0.5) as p:
        async with p.session("close-hangs-v0", image=IMAGE) as s:
            await s.reset(seed=1)
        async with p.session("other-v0", image=IMAGE) as s:
            assert (await s.reset(seed=2))[0].text == "ready 2"
            [failure] = s.failures
            assert "previous environment's close() did not return in 0.5 s" in failure, failure
            assert "close_timeout_s" in failure, failure
        assert p.stats()["env_close_hung"] == 1
