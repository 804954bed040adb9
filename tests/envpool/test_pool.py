"""EnvPool with real containers (server processes): affinity, warm claims, failures, cleanup."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from echo_bundle import IMAGE, DirImages, write_env_bundle
from pool_util import alive, pool, swap_runtime, wait_for

import envpool
import envpool.envs  # the built-ins register on import
from envpool.api import EnvRegistry
from envpool.connection import Connection
from envpool.errors import (
    ActionError,
    EnvHung,
    EnvLogicError,
    EnvOrderError,
    EnvRegistryError,
    EnvUsageError,
    InfraError,
    ProtocolError,
    SessionTokenError,
)
from envpool.images.errors import ImageNotFound
from envpool.pool import EnvPool, SessionLost
from envpool.protocol import encode
from envpool.runtimes.base import Container
from envpool.runtimes.process import ProcessRuntime
from envpool.testing import check_env


async def test_session_reset_step_and_affinity(images):
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        obs, info = await s.reset(seed=7)
        assert obs.text == "ready 7" and info == {"seed": 7}
        pids = set()
        for i in range(5):
            r = await s.step(f"a{i}")
            assert r.obs.text == f"a{i} #{i + 1}" and r.reward == i + 1
            pids.add(s.container.pid)
        assert len(pids) == 1  # every step reached the same container
        assert s.container.isolation != "none" or os.geteuid() != 0


async def test_warm_claims_reuse_containers_across_episodes(images):
    async with pool(images, min_warm=2) as p:
        await p.prewarm(IMAGE)
        seen = set()
        for _ in range(4):
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset()
                seen.add(s.container.id)
        stats = p.stats()
        assert stats["claims_warm"] == 4 and stats.get("claims_cold", 0) == 0
        # the four episodes ran on fewer containers than that: released containers went back
        # to the idle queue and were claimed again. Not "on the two prewarmed ones": while a
        # session holds one, a maintenance tick (every 0.1 s) starts a third to keep two idle,
        # and a loaded machine, its sessions slower, has a tick fall inside one (3 seen)
        assert len(seen) < 4, seen


async def test_prewarm_of_an_image_that_cannot_start_says_so(images):
    # it once returned normally with no container, and the image, recorded as wanted before
    # anything started, was retried in the background for the pool's whole life
    async with pool(images, min_warm=2) as p:
        with pytest.raises(ImageNotFound):
            await p.prewarm("missing@sha256:" + "0" * 64)
        await asyncio.sleep(1.0)  # ten rounds of the maintenance loop
        assert images.gets == 2  # prewarm's own two starts, none since
        assert p.stats()["prestart_failed:ImageNotFound"] == 2


async def test_containers_recycle_after_max_episodes(images):
    async with pool(images, min_warm=0, max_episodes=2) as p:
        ids = []
        for _ in range(3):
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset()
                ids.append(s.container.id)
        assert ids[0] == ids[1] != ids[2]
        assert p.stats()["recycled"] == 1


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
    def __init__(self, k=0):
        self.k, self.closed = k, False

    def reset(self, *, seed=None, options=None):
        if self.closed:
            raise RuntimeError("reset after close")
        return f"ready {self.k}", {}

    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text=action))

    def close(self):
        self.closed = True
        raise RuntimeError("close failed")
"""


async def test_an_open_whose_previous_environment_fails_to_close_leaves_no_closed_one_behind(tmp_path):
    # a failed open now keeps its container: the previous environment's close that raised left
    # it, closed, under its kwargs, and the next session with those kwargs was handed it
    images = write_env_bundle(
        tmp_path / "b", "close_fails_env", _CLOSE_FAILS, {"close-fails-v0": "CloseFailsEnv"}
    )
    async with pool(images, min_warm=0, max_containers=1) as p:
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 1}) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1"
        with pytest.raises(EnvLogicError, match="close failed"):
            async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 2}):
                pass  # the session's entry (or exit) raises: the body is not the test
        async with p.session("close-fails-v0", image=IMAGE, env_kwargs={"k": 1}) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1"
        assert p.stats()["claims_cold"] == 1  # one container served all three


async def test_a_session_used_after_its_block_is_a_clear_error_and_claims_nothing(images):
    # it once claimed a fresh container on the spot, which nothing would ever release
    async with pool(images, min_warm=0) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
        with pytest.raises(EnvOrderError, match=r"session is closed.*open a new one with pool\.session"):
            await s.reset(seed=2)
        with pytest.raises(EnvOrderError, match="session is closed"):
            await s.step("x")
        assert p.stats()["claimed"] == 0 and p.stats()["claims_cold"] == 1


async def test_a_request_with_another_sessions_token_is_refused(images):
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset()
        with pytest.raises(SessionTokenError):
            await s.conn.request({"op": "step", "token": "not-" + s.token, "args": {"action": "x"}}, 5)
        assert (await s.step("mine")).obs.text.startswith("mine")


async def test_a_dead_container_is_replaced_and_the_episode_replayed(images):
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        await s.step("a")
        await s.step("b")
        old = s.container.pid
        os.killpg(old, signal.SIGKILL)
        r = await s.step("c")
        assert r.obs.text == "c #3" and r.reward == 3.0  # same episode, rebuilt on a new container
        assert s.container.pid != old and s.status == "ok"
        stats = p.stats()
        assert stats["replays"] == 1 and stats["step_retries"] == 1
        assert not alive(old)


async def test_a_frozen_container_misses_heartbeats_and_is_replaced(images):
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset()
        old = s.container.pid
        os.kill(old, signal.SIGSTOP)
        t0 = time.monotonic()
        r = await s.step("x")
        assert r.obs.text == "x #1" and time.monotonic() - t0 < 5
        assert p.stats()["infra:hung_or_timeout"] == 1


async def test_a_step_that_hangs_while_its_container_heartbeats_fails_fast_as_an_env_bug(images):
    # it was an infrastructure timeout: replayed on a fresh container and hung again, for
    # retry.attempts x step_timeout_s (5 x 30 s by default) before the session was lost
    # heartbeats every 0.1 s, 5 attempts; a timeout of 2 s (not 0.5 s) so that a container
    # starved of the CPU on a loaded machine still shows signs of life within it
    async with pool(images, step_timeout_s=2.0) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=3)
            await s.step("a")
            pid = s.container.pid
            t0 = time.monotonic()
            hung = r"bundle-echo-v0: step did not answer in 2 s while its container was alive"
            with pytest.raises(EnvHung, match=hung):
                await s.step("sleep 30")
            assert time.monotonic() - t0 < 5  # one timeout (2 s), not 5 attempts of it (10 s)
            stats = p.stats()
            assert stats["env_hung"] == 1
            assert stats.get("step_retries", 0) == 0 and stats.get("replays", 0) == 0
            assert s.status == "ok" and s.container is None  # not lost: the environment's bug
            with pytest.raises(EnvOrderError, match=r"step\(\) hung; call reset"):
                await s.step("b")
            assert (await s.reset(seed=4))[0].text == "ready 4"  # a new episode, a fresh container
            assert s.container.pid != pid
        # the container still running the hung step was discarded (its stop runs in the
        # background: 0.1 s was not enough under a loaded make test)
        await wait_for(lambda: not alive(pid))


async def test_a_step_that_holds_the_interpreter_lock_fails_fast_as_an_env_bug(images):
    # code that holds the GIL (a C extension, a runaway regex) silences the heartbeat thread:
    # it looked like a frozen container, replaced and replayed (hanging again) until the
    # retries ran out, and the trajectory was masked as an infrastructure failure
    async with pool(images, step_timeout_s=1.0) as p:  # silent for 0.4 s: missed heartbeats
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=3)
            t0 = time.monotonic()
            with pytest.raises(EnvHung, match=r"did not answer in 1 s .*running on the CPU"):
                await s.step("spin 30")
            assert time.monotonic() - t0 < 2.5
            stats = p.stats()
            assert stats["env_hung"] == 1 and stats.get("step_retries", 0) == 0
            assert s.status == "ok"  # the environment's bug, not a lost session


class _CountingCpuRuntime(ProcessRuntime):
    reads = 0

    def cpu_seconds(self, c: Container) -> float | None:
        self.reads += 1
        return super().cpu_seconds(c)


async def test_the_cpu_is_read_only_late_in_a_silence_not_per_step(images):
    # a read per request cost ~12 us, 5% of a step's round trip
    p = pool(images)
    rt = await swap_runtime(p, _CountingCpuRuntime(p.config.runtime))
    async with p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        for _ in range(50):
            await s.step("x")
        assert rt.reads == 0
        await s.step("sleep 0.5")  # heartbeats all along: still nothing read
        assert rt.reads == 0


async def test_a_constructor_that_outruns_its_timeout_while_heartbeating_is_not_retried(images):
    # the env takes 1 s to build; 0.6 s (not 0.3) gives a container starved of the CPU on a
    # loaded machine several 0.1 s heartbeats to show it is alive (else: retried as infra)
    async with pool(images, min_warm=0, reset_timeout_s=0.6) as p:
        await _one_reset(p)  # the zygote is up: what is timed is the claim
        t0 = time.monotonic()
        with pytest.raises(EnvHung, match=r"bundle-slow-init-v0: open did not answer in 0\.6 s"):
            async with p.session("bundle-slow-init-v0", image=IMAGE):
                pass  # the session's entry (or exit) raises: the body is not the test
        assert time.monotonic() - t0 < 3 and p.stats().get("claim_retries", 0) == 0


async def test_a_step_past_its_timeout_with_no_sign_of_life_is_an_infra_failure(images):
    # a timeout shorter than a heartbeat period proves nothing about the container: retried
    cfg = {"step_timeout_s": 0.5, "retry": {"attempts": 2, "initial_backoff_s": 0.01}}
    async with pool(images, runtime={"heartbeat_s": 5.0}, **cfg) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset()
            with pytest.raises(SessionLost, match=r"longer than 0\.5 s \(no recent heartbeat\)"):
                await s.step("sleep 30")
            assert s.status == "infra_failed" and p.stats()["step_retries"] == 1
            with pytest.raises(SessionLost):
                await s.step("x")


async def test_a_step_waiting_on_a_slow_tool_past_its_timeout_is_an_infra_failure(images):
    # the container heartbeats while the pool runs its tool call: the time is the tool's
    async def slow_tool(name, arguments):
        await asyncio.sleep(30)
        return "late"

    cfg = {"min_warm": 0, "step_timeout_s": 0.5, "retry": {"attempts": 1}, "runtime": {"heartbeat_s": 0.1}}
    async with EnvPool(cfg, images=images, tool_caller=slow_tool) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset()
            with pytest.raises(SessionLost, match="tool call was still pending"):
                await s.step("tool 6*7")
            assert p.stats().get("env_hung", 0) == 0


async def test_a_step_whose_time_went_to_a_tool_that_finished_is_an_infra_failure():
    # a tool that took 0.9 s of a 1 s budget, then 0.2 s of the env's own work: EnvHung (not
    # retried, the trajectory masked), while a tool 0.2 s slower (still pending) was retried
    conn = Connection(heartbeat_s=0.1, misses=4, tool_caller=None)
    sent = time.monotonic() - 1.0
    conn.last_frame = time.monotonic()  # heartbeats heard: the container is alive
    assert isinstance(conn._timeout("step", 1.0, sent), EnvHung)  # no tool: the env hangs
    conn.tool_seen = sent + 0.9  # a tool call ended during the request
    err = conn._timeout("step", 1.0, sent)
    assert isinstance(err, InfraError) and not isinstance(err, EnvHung)
    assert "tool calls ran during it" in str(err)


class _Sink(asyncio.Transport):
    """A transport that takes every frame and sends nothing: the test plays the replies."""

    def write(self, data):
        pass  # frames are taken and dropped: the test plays the replies

    def is_closing(self):
        return False


async def test_a_tool_call_that_ends_after_its_container_is_gone_raises_nothing_unread(caplog):
    # its result had no connection left to go back on: the send raised ConnectionLost in the
    # tool's task, which nobody awaits ("Task exception was never retrieved")
    done = asyncio.Event()

    async def tool(name: str, arguments: dict) -> str:
        await done.wait()
        return "42"

    conn = Connection(heartbeat_s=5.0, misses=4, tool_caller=tool)
    sink = _Sink()
    conn.transport = sink
    conn.data_received(encode({"op": "tool", "tool_id": 1, "name": "calculator", "arguments": {}}))
    [task] = conn.tasks
    sink.is_closing = lambda: True  # type: ignore[method-assign]
    conn.connection_lost(None)  # the container died meanwhile
    done.set()
    await asyncio.wait({task}, timeout=10)
    assert task.done() and not task.cancelled() and task.exception() is None
    del task
    gc.collect()
    assert "never retrieved" not in caplog.text


async def test_a_request_cancelled_in_the_turn_its_reply_came_stays_cancelled():
    # asyncio.wait_for (Python 3.11) returned the reply when the cancel and the reply met in
    # one loop turn: the cancel was lost, and a Ctrl-C of `envpool bench resets` (one cancel
    # of the main task) left its loop of resets running for good (seen under load)
    conn = Connection(heartbeat_s=5.0, misses=4, tool_caller=None)
    conn.transport = _Sink()
    task = asyncio.create_task(conn.request({"op": "step"}, 30.0))
    for _ in range(3):  # into its wait for the reply
        await asyncio.sleep(0)
    [fut] = conn.waiting.values()
    fut.set_result({"ok": True, "result": "late"})  # the reply, read in this turn...
    task.cancel()  # ...and the cancel, in the same one
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not conn.waiting


async def test_a_claim_cancelled_in_the_turn_capacity_frees_stays_cancelled(images):
    # the claimer's wait for capacity lost the cancel the same way (wait_for, Python 3.11):
    # it claimed on, or waited out its claim_timeout_s, for a trajectory already aborted
    async with (
        pool(images, min_warm=0, max_containers=1, claim_timeout_s=30) as p,
        p.session("bundle-echo-v0", image=IMAGE) as s,
    ):
        await s.reset()  # the one container is held: a claim waits for capacity
        asked = asyncio.Event()
        changed_future = p._changed_future

        def spy() -> asyncio.Future[None]:
            asked.set()
            return changed_future()

        p._changed_future = spy  # type: ignore[method-assign]
        claim = asyncio.create_task(p._claim(IMAGE))
        await asked.wait()  # the claim found no room and waits
        p._notify_changed()  # capacity may have freed up...
        claim.cancel()  # ...and the claimer is cancelled, in the same turn
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(claim, 10)


async def test_a_non_deterministic_session_is_lost_not_faked(images):
    async with pool(images) as p, p.session("bundle-random-v0", image=IMAGE) as s:
        await s.reset()
        await s.step("a")
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="not deterministic"):
            await s.step("b")
        assert s.status == "infra_failed" and p.stats()["sessions_infra_failed"] == 1


@pytest.mark.parametrize("deterministic", [False, True])
async def test_an_image_modules_own_registration_decides_whether_a_lost_session_is_replayed(
    tmp_path, deterministic
):
    # the driver's registry never sees what an image's module registers: the session learns
    # the spec from the container's hello (an image env was once feared replayed regardless)
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "coin_env.py").write_text(
        "import envpool\n"
        "class Coin(envpool.Env):\n"
        "    def reset(self, *, seed=None, options=None):\n"
        "        return f'seed {seed}', {}\n"
        "    def step(self, action):\n"
        "        return envpool.StepResult(obs=envpool.Observation(text=action))\n"
        f"envpool.register('mod-coin-v0', entry_point='coin_env:Coin', deterministic={deterministic})\n"
    )
    (root / "envpool.json").write_text(json.dumps({"modules": ["coin_env"]}))
    async with pool(DirImages(root)) as p, p.session("mod-coin-v0", image=IMAGE) as s:
        await s.reset(seed=3)
        await s.step("a")
        assert s.deterministic is deterministic
        os.killpg(s.container.pid, signal.SIGKILL)
        if deterministic:
            assert (await s.step("b")).obs.text == "b" and s.status == "ok"
            assert p.stats()["replays"] == 1
        else:
            with pytest.raises(SessionLost, match="mod-coin-v0 is not deterministic"):
                await s.step("b")
            assert s.status == "infra_failed" and "replays" not in p.stats()


async def test_reset_retries_through_container_crashes(images):
    async with pool(images, min_warm=0, runtime={"heartbeat_s": 0.1, "faults": {"crash_rate": 0.3}}) as p:
        ok = 0
        for seed in range(20):
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                try:
                    await s.reset(seed=seed)
                    ok += 1
                except SessionLost:
                    pass  # its retries ran out: counted as sessions_infra_failed, checked below
        stats = p.stats()
        assert stats.get("reset_retries", 0) > 0
        assert ok + stats.get("sessions_infra_failed", 0) == 20  # every reset accounted for


async def test_tool_calls_are_brokered_by_the_pool(images):
    calls = []

    async def tools(name, arguments):
        calls.append((name, arguments))
        return "42"

    async with EnvPool({"min_warm": 0}, images=images, tool_caller=tools) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset()
            r = await s.step("tool 6*7")
            assert r.obs.text == "42" and calls == [("calculator", {"expression": "6*7"})]


async def test_the_default_pool_runs_tool_calls_like_make_does():
    # without tool_caller= every calculator call once observed "error: no tool bridge
    # configured for 'calculator'", while envpool.make ran the tool: silently wrong data
    call = '{"tool": "calculator", "arguments": {"expression": "6*7"}}'
    env = envpool.make("math-tools-v1")
    env.reset(seed=1)
    assert env.step(call).obs.text == "42"
    async with EnvPool({"min_warm": 0}) as p, p.session("math-tools-v1") as s:
        await s.reset(seed=1)
        assert (await s.step(call)).obs.text == "42"


async def test_close_leaves_no_container(images):
    async with pool(images, min_warm=3) as p:
        await p.prewarm(IMAGE)
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset()
        pids = [c.pid for c in p.runtime.live.values()]
        assert len(pids) >= 3
    await asyncio.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


async def test_image_without_cache_and_bad_reference_are_clear_errors(images):
    async with EnvPool({"min_warm": 0}) as p:
        with pytest.raises(ValueError, match="no image cache"):
            async with p.session("bundle-echo-v0", image=IMAGE):
                pass  # the session's entry (or exit) raises: the body is not the test
    async with pool(images) as p:
        with pytest.raises(ValueError, match="expected 'name@sha256:<64 hex>'"):
            async with p.session("bundle-echo-v0", image="echo:latest"):
                pass  # the session's entry (or exit) raises: the body is not the test


def test_connection_module_has_no_side_effects():
    assert Connection.__doc__


async def test_without_the_zygote_each_container_is_a_fresh_interpreter(images):
    async with pool(images, min_warm=0, runtime={"zygote": False, "heartbeat_s": 0.1}) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=2)
            assert (await s.step("z")).obs.text == "z #1"
            assert isinstance(s.container.handle, subprocess.Popen)  # not a fork of the zygote


async def test_a_replay_rebuilds_the_same_random_episode(images):
    async with EnvPool({"min_warm": 0}) as p, p.session("frozenlake-v1") as s:
        obs, _ = await s.reset()  # no seed: the pool draws one, so a replay can rebuild it
        await s.step("up")  # into the wall: the agent stays on S, whatever the random map
        os.killpg(s.container.pid, signal.SIGKILL)
        res = await s.step("left")  # replayed on a new container, checked step by step
        assert s.status == "ok" and p.stats()["replays"] == 1
        assert res.info["position"] == [0, 0] and not res.terminated

        def grid(text: str) -> list[str]:
            return [ln for ln in text.splitlines() if ln.strip() and set(ln) <= set("@SFHG ")]

        assert grid(res.obs.text) == grid(obs.text)  # the same map as the episode the policy saw


async def test_a_replay_checks_what_the_policy_saw_not_info_timings(images, monkeypatch):
    # deterministic where it counts (check_env passes) but with wall-clock times in info, which
    # the docs allow: a replay that compared info lost every such session with its container
    monkeypatch.syspath_prepend(str(images.root))
    reg = EnvRegistry()
    reg.register("bundle-timed-info-v0", entry_point="echo_env:TimedInfoEnv", max_episode_steps=4)
    check_env("bundle-timed-info-v0", reg)
    async with pool(images) as p, p.session("bundle-timed-info-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        await s.step("a")
        os.killpg(s.container.pid, signal.SIGKILL)
        res = await s.step("b")
        assert res.obs.text == "b #2" and res.reward == 2.0 and s.status == "ok"
        assert p.stats()["replays"] == 1


async def test_a_replay_that_diverges_loses_the_session(images):
    async with pool(images) as p, p.session("bundle-liar-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="differs from the original"):
            await s.step("x")
        assert s.status == "infra_failed"


async def test_a_replay_repeats_a_step_that_raised(images):
    # the step ran (the env counted it) before it raised: a replay that left it out rebuilt
    # another episode, and the session went on with a result the policy would not have got
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        assert (await s.step("a")).obs.text == "a #1"
        with pytest.raises(EnvLogicError, match="ZeroDivisionError"):
            await s.step("boom")  # the env's counter is 2 now
        os.killpg(s.container.pid, signal.SIGKILL)  # the container is lost
        assert (await s.step("c")).obs.text == "c #3"  # as on the container that was lost
        assert s.status == "ok" and p.metrics["replays"] == 1


_HALFWAY = """
import os
import envpool


class HalfwayEnv(envpool.Env):
    \"\"\"A reset that fails half way (the episode goes on from where it left the state), and a
    step that raises only the first time it runs anywhere (a marker file): not the
    deterministic environment it claims to be.\"\"\"

    example_actions = ("a",)

    def __init__(self, marker=""):
        self.marker = marker

    def reset(self, *, seed=None, options=None):
        self.n = 100
        if (options or {}).get("fail"):
            raise RuntimeError("reset failed half way")
        self.n = 0
        return "ready", {}

    def step(self, action):
        self.n += 1
        if action == "once" and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise ValueError("raised the first time only")
        return envpool.StepResult(obs=envpool.Observation(text=f"{action} #{self.n}"))
"""


async def test_a_replay_repeats_a_reset_that_raised_mid_episode(tmp_path):
    images = write_env_bundle(tmp_path / "b", "halfway_env", _HALFWAY, {"halfway-v0": "HalfwayEnv"})
    async with pool(images, min_warm=0) as p, p.session("halfway-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        assert (await s.step("a")).obs.text == "a #1"
        with pytest.raises(EnvLogicError, match="half way"):
            await s.reset(seed=2, options={"fail": True})
        assert (await s.step("b")).obs.text == "b #101"  # the episode goes on from there
        os.killpg(s.container.pid, signal.SIGKILL)
        assert (await s.step("c")).obs.text == "c #102"
        assert s.status == "ok" and p.metrics["replays"] == 1


async def test_a_replayed_step_that_no_longer_raises_loses_the_session(tmp_path):
    images = write_env_bundle(tmp_path / "b", "halfway_env", _HALFWAY, {"halfway-v0": "HalfwayEnv"})
    kwargs = {"marker": str(tmp_path / "raised")}
    async with pool(images, min_warm=0) as p, p.session("halfway-v0", image=IMAGE, env_kwargs=kwargs) as s:
        await s.reset(seed=1)
        with pytest.raises(EnvLogicError, match="first time only"):
            await s.step("once")
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="differs from the original"):
            await s.step("c")  # the replayed "once" answered instead of raising


async def test_a_slow_constructor_keeps_heartbeating(images):
    async with pool(images, min_warm=0) as p, p.session("bundle-slow-init-v0", image=IMAGE) as s:
        obs, _ = await s.reset(seed=3)  # 1 s to construct, 0.4 s of heartbeat window
        assert obs.text == "ready 3" and p.stats().get("claim_retries", 0) == 0


async def test_a_claim_waiting_for_capacity_wakes_when_it_frees(images):
    async with pool(images, min_warm=0, max_containers=1) as p:
        holder = p.session("bundle-echo-v0", image=IMAGE)
        s = await holder.__aenter__()
        await s.reset()
        waiter = asyncio.create_task(_one_reset(p))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        t0 = time.monotonic()
        await holder.__aexit__(None, None, None)
        assert await asyncio.wait_for(waiter, 10) == "ready 1"
        # the release wakes it, then a fresh container starts: seconds on a loaded machine
        assert time.monotonic() - t0 < 3.0


async def test_claimers_cancelled_while_waiting_for_capacity_do_not_break_the_others(images):
    # aborted trajectories cancel their claims at any moment, the backstop timeouts included;
    # twice, too; the claimers left must still be served (a Condition under wait_for hung here)
    rng = random.Random(0)
    async with pool(images, min_warm=0, max_containers=1) as p:
        holder = p.session("bundle-echo-v0", image=IMAGE)
        s = await holder.__aenter__()
        await s.reset()
        waiters = [asyncio.create_task(_one_reset(p)) for _ in range(60)]
        doomed = rng.sample(waiters, 45)
        for _ in range(300):  # a claim may be cancelled again while it handles the first
            await asyncio.sleep(rng.uniform(0, 0.01))
            rng.choice(doomed).cancel()
        for w in doomed:
            w.cancel()
        await holder.__aexit__(None, None, None)
        kept = [w for w in waiters if w not in doomed]
        _, pending = await asyncio.wait(waiters, timeout=30)
        assert not pending, f"{len(pending)} claims never finished"
        assert [w.result() for w in kept] == ["ready 1"] * len(kept)
        assert all(w.cancelled() for w in doomed)


async def _one_reset(p):
    async with p.session("bundle-echo-v0", image=IMAGE) as s:
        return (await s.reset(seed=1))[0].text


async def _hold_a_slow_step(p: EnvPool, started: asyncio.Event, pids: list[int]) -> None:
    async with p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=0)
        pids.append(s.container.pid)
        started.set()
        await s.step("sleep 30")


async def test_a_trajectory_cancelled_mid_step_frees_its_container_at_once(images):
    # an aborted (redundant) rollout is cancelled mid-step, and cancelled again (the group
    # scheduler's aclose() then _abort()): its task ends at once, not after a step nobody
    # wants (nor a 5 s goodbye), and its container, in an unknown state, is discarded
    async with pool(images, min_warm=0) as p:
        started, pids = asyncio.Event(), []
        t = asyncio.create_task(_hold_a_slow_step(p, started, pids))
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(0.2)  # inside the step
        t0 = time.monotonic()
        t.cancel()
        await asyncio.sleep(0)
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
        assert time.monotonic() - t0 < 2.0, f"the cancelled task took {time.monotonic() - t0:.1f} s to end"
        assert p.stats()["claimed"] == 0 and p.stats()["discarded"] == 1
        await asyncio.sleep(0.1)  # the stop a second cancel may interrupt goes on, shielded
        assert p.stats()["containers"] == 0 and not alive(pids[0])


async def test_a_cancel_during_the_goodbye_discards_the_container(images):
    # the second cancel of an aborted rollout can land while the session says goodbye; that
    # once skipped the release, leaving the container claimed until the reaper (1 h)
    async with pool(images, min_warm=0, runtime={"heartbeat_s": 1.0}) as p:
        leaving, pids = asyncio.Event(), []

        async def play() -> None:
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset(seed=0)
                pids.append(s.container.pid)
                os.kill(s.container.pid, signal.SIGSTOP)  # the goodbye gets no answer for 4 s
                leaving.set()
            # the task's next suspension is the goodbye's wait for its reply

        t = asyncio.create_task(play())
        await asyncio.wait_for(leaving.wait(), 30)
        t0 = time.monotonic()
        t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await t
        assert time.monotonic() - t0 < 2.0
        stats = p.stats()
        assert stats["claimed"] == 0 and stats["idle"] == 0 and stats["discarded"] == 1
        await wait_for(lambda: not alive(pids[0]))


async def test_a_closed_pool_refuses_new_sessions(images):
    from envpool.pool import PoolClosed

    p = pool(images)
    async with p:
        pass  # only the pool's start and close are under test
    with pytest.raises(PoolClosed):
        async with p.session("bundle-echo-v0", image=IMAGE):
            pass  # never reached: the closed pool refuses the session


async def test_a_garbled_frame_ends_that_connection_not_the_container(images):
    async with pool(images, min_warm=0) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset()
            pid, endpoint = s.container.pid, s.container.endpoint
        # the container is idle again: throw garbage at it, then use it
        r, w = await asyncio.open_unix_connection(endpoint)
        w.write(b"\x00\x00\x00\x05nope!")
        await w.drain()
        await asyncio.wait_for(r.read(), 5)  # the server answers with an error and hangs up
        w.close()
        assert alive(pid)
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            assert s.container.pid == pid and (await s.reset(seed=4))[0].text == "ready 4"


async def test_a_cancelled_cold_claim_leaves_no_container(images):
    async with pool(images, min_warm=0) as p:
        await _one_reset(p)  # the zygote is up
        zygote = p.runtime._zygote.proc.pid
        for _ in range(3):
            t = asyncio.create_task(_one_reset(p))
            await asyncio.sleep(0.001)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await asyncio.sleep(0.5)
        children = [int(x) for x in Path(f"/proc/{zygote}/task/{zygote}/children").read_text().split()]  # noqa: ASYNC240
        tracked = {c.pid for c in p.runtime.live.values()}
        assert set(children) <= tracked


async def test_a_server_listening_on_tcp_speaks_the_same_protocol():
    # what a docker/kubernetes/modal container runs: its own network, the pool connects over TCP
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "envpool.server",
        "--tcp",
        "127.0.0.1:0",
        "--no-netns",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert info["ready"] and info["endpoint"].startswith("tcp://127.0.0.1:")
        conn = await Connection.open(info["endpoint"], heartbeat_s=0.5, misses=4, tool_caller=None)
        await conn.request({"op": "open", "id": 0, "token": "t", "env_id": "echo-v0", "kwargs": {}}, 10)
        reset = await conn.request({"op": "reset", "token": "t", "args": {"seed": 5}}, 10)
        step = await conn.request({"op": "step", "token": "t", "args": {"action": "hi"}}, 10)
        assert reset["obs"]["text"] == "echo ready (seed=5)" and step["obs"]["text"] == "hi"
        conn.close()
    finally:
        proc.kill()
        await proc.wait()
