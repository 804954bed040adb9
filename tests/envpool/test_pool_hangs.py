"""EnvPool with real containers: hangs and timeouts. A frozen container misses its
heartbeats and is replaced; a step or constructor that hangs while its container heartbeats
(or holds the interpreter lock) is the environment's bug, fast; a timeout with no sign of
life, or spent waiting on a tool, is an infrastructure failure. And the connection's races:
a tool call ending after its container, a cancel meeting its reply in one loop turn."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import pytest
from echo_bundle import IMAGE
from pool_util import alive, pool, swap_runtime, wait_for
from test_pool import _one_reset

from envpool.connection import Connection
from envpool.errors import (
    EnvHung,
    EnvOrderError,
    InfraError,
)
from envpool.pool import EnvPool, SessionLost
from envpool.protocol import encode
from envpool.runtimes.base import Container
from envpool.runtimes.process import ProcessRuntime


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
    # (cancelled at the step's time less its reserve: the bridge takes no deadline_s=)
    async def slow_tool(name, arguments):
        await asyncio.sleep(30)
        return "late"

    cfg = {"min_warm": 0, "step_timeout_s": 0.5, "retry": {"attempts": 1}, "runtime": {"heartbeat_s": 0.1}}
    async with EnvPool(cfg, images=images, tool_caller=slow_tool) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset()
            with pytest.raises(SessionLost, match="tool 'calculator' did not answer"):
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
