"""What the pool makes of an error a reset or step of the environment raises: the
environment's own exception whatever its class is called, part of the episode (a replay
repeats it), and a container that may be broken by it (out of memory, file descriptors or
disk) not given to another episode."""

from __future__ import annotations

import os
import signal

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import pool

from envpool.errors import EnvLogicError

_RAISING = """
import errno
import subprocess

import envpool


class ProtocolError(Exception):
    \"\"\"The environment's own, named as one of envpool's (xmlrpc.client and urllib3 have one).\"\"\"


class ActionError(Exception):
    \"\"\"Likewise.\"\"\"


class RaisingEnv(envpool.Env):
    example_actions = ("a",)

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return f"ready {seed}", {}

    def step(self, action):
        self.n += 1
        if action == "protocol":
            raise ProtocolError("its own protocol broke")
        if action == "action":
            raise ActionError("its own action check")
        if action == "value":
            raise ValueError("no such move")
        if action == "memory":
            raise MemoryError("cannot allocate the board")
        if action == "disk":
            raise OSError(errno.ENOSPC, "No space left on device")
        if action.startswith("boards/"):  # a file the action names that is not there
            open(action).close()
        if action == "exec":  # the environment's own program is gone from its container
            subprocess.run(["/nonexistent-envpool-test/bin/solver"], check=False)
        return envpool.StepResult(obs=envpool.Observation(text=f"{action} #{self.n}"))
"""


@pytest.fixture
def raising(tmp_path):
    return write_env_bundle(tmp_path / "b", "raising_env", _RAISING, {"raising-v0": "RaisingEnv"})


@pytest.mark.parametrize(("action", "name"), [("protocol", "ProtocolError"), ("action", "ActionError")])
async def test_an_environment_exception_named_like_an_envpool_error_is_the_environments(
    raising, action, name
):
    # the pool read the error's class name only: the environment's own ProtocolError ended the
    # episode and discarded the container (a protocol bug), its own ActionError was the
    # caller's mistake and left out of the episode, so a replay rebuilt another one
    async with pool(raising, min_warm=0) as p, p.session("raising-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        pid = s.container.pid
        with pytest.raises(EnvLogicError, match=f"{name}: its own") as err:
            await s.step(action)
        assert err.value.remote_type == name
        assert (await s.step("a")).obs.text == "a #2" and s.container.pid == pid  # the episode goes on
        os.killpg(pid, signal.SIGKILL)
        assert (await s.step("b")).obs.text == "b #3"  # the replay repeated the raising step
        assert s.status == "ok" and p.metrics["replays"] == 1 and p.metrics.get("protocol_errors", 0) == 0


@pytest.mark.parametrize(
    ("action", "kept"),
    [
        ("value", True),
        ("memory", False),
        ("disk", False),
        ("boards/no-such-board.txt", True),
        ("exec", False),
    ],
    ids=["ValueError", "MemoryError", "OSError", "FileNotFoundError", "FileNotFoundError-own"],
)
async def test_a_step_that_runs_out_of_a_resource_ends_its_containers_service_at_release(
    raising, action, kept
):
    # the container of a step that raised MemoryError or OSError (no memory, file descriptors
    # or disk left) went back to the pool, and the next episode, maybe another trajectory's,
    # ran in a server the error may have left broken. A path that is not there (the
    # environment's or its input's error, FileNotFoundError) leaves it as sound as a ValueError.
    # But not one for a path the caller never named: the environment's own program (or file)
    # gone from its container, which every later episode there would fail on too
    async with pool(raising, min_warm=0) as p:
        async with p.session("raising-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            first = s.container
            with pytest.raises(EnvLogicError):
                await s.step(action)
            # the error is part of this episode: it goes on where it raised, on that container
            assert (await s.step("a")).obs.text == "a #2" and s.container is first
            await s.reset(seed=2)  # another episode: on a fresh container unless it was sound
            assert (s.container is first) == kept
            second = s.container
        stats = p.stats()
        assert stats["idle"] == 1 and p._idle[IMAGE][0] is second, stats
        assert stats.get("discarded", 0) == int(not kept) and stats["claims_cold"] == 1 + int(not kept), stats
        assert stats.get("retired_unsound", 0) == int(not kept), stats


async def test_a_replay_of_a_step_out_of_memory_retires_the_replays_container_too(raising):
    async with pool(raising, min_warm=0) as p:
        async with p.session("raising-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            with pytest.raises(EnvLogicError, match="MemoryError"):
                await s.step("memory")
            os.killpg(s.container.pid, signal.SIGKILL)
            assert (await s.step("a")).obs.text == "a #2"  # replayed: the MemoryError again
            assert s.status == "ok" and p.metrics["replays"] == 1
        assert p.stats()["idle"] == 0 and p.stats()["retired_unsound"] == 2
