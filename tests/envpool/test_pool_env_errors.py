"""EnvPool with real containers: what an environment's own errors do. Its bugs and usage
errors are raised, never retried; a reply or arguments that cannot be sent are clear errors;
a constructor that raises keeps its container only where the process is still sound (not
after running out of a resource, nor after the previous environment's close failed)."""

from __future__ import annotations

import asyncio
import gc
import struct

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import pool

from envpool.connection import Connection
from envpool.errors import (
    ActionError,
    EnvLogicError,
    EnvOrderError,
    EnvRegistryError,
    EnvUsageError,
    ProtocolError,
)
from envpool.pool import EnvPool
from envpool.protocol import encode


async def test_environment_bugs_and_usage_errors_are_not_retried(images):
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        with pytest.raises(EnvOrderError):
            await s.step("x")  # before reset
        await s.reset()
        with pytest.raises(EnvLogicError, match="ZeroDivisionError: env bug"):
            await s.step("boom")
        with pytest.raises(ActionError, match="UTF-8"):
            await s.step(b"\xff\xfe")
        with pytest.raises(ActionError, match="limit"):
            await s.step("x" * (64 * 1024 + 1))
        assert (await s.step("still here")).obs.text.startswith("still here")
        assert p.stats().get("step_retries", 0) == 0 and s.status == "ok"


async def test_a_reset_info_that_cannot_be_serialised_is_an_env_bug_not_an_infra_failure(images, caplog):
    # as in step()'s info: the server once failed to send such a reply outside its handler,
    # answered with a null id and hung up; the pool crashed on the null id and retried the
    # session as a dead container, killing containers and masking an env bug as infra_failed
    async with pool(images, min_warm=0) as p:
        with pytest.raises(EnvLogicError, match=r"reset\(\) returned a value that cannot be serialized"):
            async with p.session("bundle-bad-reset-info-v0", image=IMAGE) as s:
                await s.reset(seed=1)
        stats = p.stats()
        assert stats.get("reset_retries", 0) == 0 and stats.get("sessions_infra_failed", 0) == 0
        assert stats.get("discarded", 0) == 0  # the container is fine: it stays in the pool
    assert "data_received" not in caplog.text


async def test_a_reply_without_a_request_id_is_a_protocol_error_not_a_crash(tmp_path, caplog):
    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(struct.unpack("!I", await r.readexactly(4))[0])
        w.write(encode({"id": None, "ok": False, "error": {"type": "ProtocolError", "message": "bad"}}))
        await w.drain()

    server = await asyncio.start_unix_server(answer, str(tmp_path / "s"))
    async with server:
        conn = await Connection.open(str(tmp_path / "s"), heartbeat_s=0.5, misses=4, tool_caller=None)
        with pytest.raises(ProtocolError, match=r"no valid request id.*: bad"):
            await conn.request({"op": "ping", "token": "t"}, 5)
        await asyncio.wait_for(conn.closed, 5)  # and the connection is closed, not left half-dead
    assert "data_received" not in caplog.text


async def test_arguments_that_cannot_be_sent_are_a_clear_error_with_no_stray_future(images, caplog):
    # they once raised a raw PydanticSerializationError, leaving a registered reply future
    # that the connection's close failed later: "Future exception was never retrieved"
    async with pool(images, min_warm=0) as p:
        with pytest.raises(EnvUsageError, match="env_kwargs must be JSON-safe"):
            async with p.session("bundle-echo-v0", image=IMAGE, env_kwargs={"rng": object()}):
                pass  # the session's entry raises: its body never runs
        assert p.stats().get("claims_cold", 0) == 0  # refused before a container was claimed
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            with pytest.raises(EnvUsageError, match=r"'reset' to the container.*must be JSON-safe"):
                await s.reset(seed=1, options={"rng": object()})
            assert (await s.reset(seed=1))[0].text == "ready 1"  # the session is still fine
            assert s.conn is not None and s.conn.waiting == {}
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_unknown_environment_is_a_clear_error(images):
    async with pool(images) as p:
        with pytest.raises(EnvRegistryError, match="unknown environment 'no-such-env-v0'; registered: "):
            async with p.session("no-such-env-v0"):
                pass  # the session's entry (or exit) raises: the body is not the test
        with pytest.raises(EnvRegistryError, match="no-such-env-v0"):
            async with p.session("no-such-env-v0", image=IMAGE) as s:
                await s.reset()
        async with p.session("bundle-echo-v0", image=IMAGE) as s:  # the pool keeps serving
            await s.reset()


async def test_a_constructor_that_raises_fails_the_session_and_keeps_the_container(images):
    # a bad env kwarg: the container's server answered the error and waits for the next
    # session, but the pool discarded it (a cold start for the next claim, per bad session)
    async with pool(images, min_warm=0) as p:
        with pytest.raises(EnvLogicError, match=r"bundle-echo-v0: making the environment.*'nope'") as err:
            async with p.session("bundle-echo-v0", image=IMAGE, env_kwargs={"nope": 1}):
                pass  # the session's entry (or exit) raises: the body is not the test
        assert err.value.remote_type == "TypeError"
        stats = p.stats()
        assert stats.get("discarded", 0) == 0 and stats["idle"] == 1 and stats["containers"] == 1
        [kept] = p._idle[IMAGE]
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1" and s.container is kept
        assert p.stats()["claims_warm"] == 1 and p.stats()["claims_cold"] == 1


_FAILING_INIT = """
import errno

import envpool


class FailingInitEnv(envpool.Env):
    def __init__(self, fail=None, level=None):
        if fail == "memory":
            raise MemoryError("cannot allocate the level")
        if fail == "fds":
            raise OSError(errno.EMFILE, "Too many open files")
        if fail == "value":
            raise ValueError("no such level")
        if fail == "path":  # a path the caller named that is not there
            open(f"levels/{level}.txt").close()
        if fail == "own":  # the environment's own file gone from its container
            open("/nonexistent-envpool-test/levels.json").close()

    def reset(self, *, seed=None, options=None):
        return f"ready {seed}", {}

    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text=action))
"""


@pytest.mark.parametrize(
    ("fail", "kept"),
    [("value", True), ("memory", False), ("fds", False), ("path", True), ("own", False)],
    ids=["ValueError", "MemoryError", "OSError", "FileNotFoundError", "FileNotFoundError-own"],
)
async def test_a_constructor_that_runs_out_of_a_resource_does_not_keep_its_container(tmp_path, fail, kept):
    # every failed open kept its container, a MemoryError or an OSError (no file descriptors
    # left, a full disk) included, which may leave its server broken: the next session got it.
    # Then every OSError replaced it, a path the caller got wrong (FileNotFoundError) too: a
    # cold start per bad env_kwargs, for a process as sound as after a ValueError. But a path
    # the caller never named (the environment's own file gone) is the container's fault
    images = write_env_bundle(
        tmp_path / "b", "failing_init_env", _FAILING_INIT, {"failing-v0": "FailingInitEnv"}
    )
    async with pool(images, min_warm=0) as p:
        with pytest.raises(EnvLogicError, match=r"failing-v0: making the environment with env_kwargs") as err:
            async with p.session(
                "failing-v0", image=IMAGE, env_kwargs={"fail": fail, "level": "no-such-level"}
            ):
                pass  # the session's entry (or exit) raises: the body is not the test
        assert (
            err.value.remote_type
            == {
                "value": "ValueError",
                "memory": "MemoryError",
                "fds": "OSError",
                "path": "FileNotFoundError",
                "own": "FileNotFoundError",
            }[fail]
        )
        stats = p.stats()
        assert stats["open_failed"] == 1 and stats["idle"] == int(kept), stats
        assert stats.get("discarded", 0) == int(not kept), stats
        async with p.session("failing-v0", image=IMAGE) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1"
        assert p.stats()["claims_cold"] == 1 + int(not kept)


_CLOSE_FAILS = """
import envpool


class CloseFailsEnv(envpool.Env):
    def __init__(self, k=0, fail="RuntimeError"):
        self.k, self.fail, self.closed = k, fail, False

    def reset(self, *, seed=None, options=None):
        if self.closed:
            raise RuntimeError("reset after close")
        return f"ready {self.k}", {}

    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text=action))

    def close(self):
        self.closed = True
        if self.fail != "nothing":
            raise {"RuntimeError": RuntimeError, "MemoryError": MemoryError}[self.fail]("close failed")
"""


async def test_a_previous_environments_close_that_raises_does_not_fail_the_next_session(tmp_path, caplog):
    # the container's last session (k=1) is over; its environment's close runs when another
    # session (k=2) opens there, and raised into that open: the new session failed, not
    # retried, with "making the environment with env_kwargs {'k': 2} raised ... close failed",
    # an error of another session's environment. Its close is said, and the session goes on
    images = write_env_bundle(
        tmp_path / "b", "close_fails_env", _CLOSE_FAILS, {"close-fails-v0": "CloseFailsEnv"}
    )
    async with pool(images, min_warm=0, max_containers=1) as p:
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 1}) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1"
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 2}) as s:
            assert (await s.reset(seed=1))[0].text == "ready 2"
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 1}) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1"  # made anew, not the closed one
        stats = p.stats()
        assert (stats["claims_cold"], stats["env_close_failed"]) == (1, 2)  # one container for all
    assert "RuntimeError: close failed" in caplog.text


async def test_a_close_that_runs_out_of_a_resource_retires_the_container_after_the_session(tmp_path):
    # a MemoryError may have left the process short of memory: as after a request that raised
    # one, no episode runs there (the session that found it resets on a fresh container)
    images = write_env_bundle(
        tmp_path / "b", "close_fails_env", _CLOSE_FAILS, {"close-fails-v0": "CloseFailsEnv"}
    )
    async with pool(images, min_warm=0, max_containers=1) as p:
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"fail": "MemoryError"}) as s:
            await s.reset(seed=1)
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 2, "fail": "nothing"}) as s:
            assert (await s.reset(seed=1))[0].text == "ready 2"
            assert (await s.step("on")).obs.text == "on"
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 3}) as s:
            assert (await s.reset(seed=1))[0].text == "ready 3"
        stats = p.stats()
        assert (stats["claims_cold"], stats["retired_unsound"], stats["env_close_failed"]) == (2, 1, 1)


_NUMPY_ENV = """
import numpy as np
import envpool


class NumpyEnv(envpool.Env):
    def reset(self, *, seed=None, options=None):
        self.n = np.int64(0)
        return "ready", {"seed": np.int64(seed), "board": np.arange(3)}

    def step(self, action):
        self.n += 1
        text = action
        if action == "tool":
            text = self.call_tool("echo", {"n": self.n, "xs": np.array([1.5, 2.5])})
        info = {"n": self.n, "probs": np.array([0.25, 0.75]), "ok": np.bool_(True)}
        return envpool.StepResult(obs=envpool.Observation(text=text), reward=np.float32(0.5), info=info)
"""


async def test_numpy_scalars_and_arrays_in_infos_and_tool_arguments_go_as_their_values(tmp_path):
    # the fabric's protocol sends them as their values (its to_json fallback); an
    # environment's reply or tool call holding one was refused here (NotJSONSafe: "a numpy
    # scalar: .item(), an array: .tolist()")
    pytest.importorskip("numpy")
    images = write_env_bundle(tmp_path / "b", "numpy_env", _NUMPY_ENV, {"numpy-v0": "NumpyEnv"})
    calls = []

    async def tool(name, arguments):
        calls.append((name, arguments))
        return "answered"

    cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}
    async with EnvPool(cfg, images=images, tool_caller=tool) as p:
        async with p.session("numpy-v0", image=IMAGE) as s:
            _, info = await s.reset(seed=3)
            assert info == {"seed": 3, "board": [0, 1, 2]}
            r = await s.step("go")
            assert r.info == {"n": 1, "probs": [0.25, 0.75], "ok": True} and r.reward == 0.5
            assert (await s.step("tool")).obs.text == "answered"
    assert calls == [("echo", {"n": 2, "xs": [1.5, 2.5]})]
