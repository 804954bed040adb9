"""The local backend with real worker processes: calls, a handler's errors, a worker lost or
hung mid-call, setup hooks and failures (and a pool's recovery from them), bad arguments and
results. Scaling and closing: test_local_backend_lifecycle.py; calls in flight when a worker
dies, a deadline passes or a call is cancelled: test_local_backend_in_flight.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import pytest

# test_integrations_bridge.py imports alive from here
from local_backend_helpers import _until, alive, local

import fabric
from fabric.errors import ErrorCode, SetupFailedError


async def test_call_returns_value_timings_and_worker():
    async with local() as c:
        r = await c.call("add", {"a": 2, "b": 3})
        assert r.ok and r.value == 5
        assert r.worker and r.worker.startswith("add-")
        assert r.timings.total_ms > 0 and r.timings.exec_ms >= 0
        assert (await c.call("add", {"a": 1})).value == 1  # the function's default applies


async def test_map_keeps_order_and_stream_yields_every_result():
    async with local() as c:
        rs = await c.map("add", [{"a": i, "b": i} for i in range(300)])
        assert [r.value for r in rs] == [2 * i for i in range(300)]
        assert [r.index for r in rs] == list(range(300))
        seen = {r.index: r.value async for r in c.stream("add", ({"a": i} for i in range(100)))}
        assert seen == {i: i for i in range(100)}


async def test_user_exception_is_data_and_the_pool_keeps_serving():
    async with local() as c:
        r = await c.call("boom", {"x": 7})
        assert not r.ok and r.error.type == ErrorCode.USER_ERROR and not r.error.retryable
        assert "ValueError: bad x=7" in r.error.message
        assert "boom" in r.error.traceback
        assert r.attempts == 1
        exited = await c.call("exits", {})
        assert exited.error.type == ErrorCode.USER_ERROR and "SystemExit" in exited.error.message
        # same worker process still serves
        p1 = (await c.call("pid", {})).value
        p2 = (await c.call("pid", {})).value
        assert p1 == p2


async def test_worker_killed_mid_call_is_retryable_and_replaced(tmp_path):
    async with local() as c:
        r = await c.call("suicide", {})
        assert not r.ok and r.error.type == ErrorCode.WORKER_LOST and r.error.retryable
        assert "killed by SIGKILL" in r.error.message  # how it died, not "exit code None"
        assert r.attempts == 2  # the policy allows 2; both died
        # the retry lands on a fresh worker and succeeds when the failure was transient
        r = await c.call("flaky", {"path": str(tmp_path / "n"), "fail_times": 1})
        assert r.ok and r.value == 2 and r.attempts == 2
        assert c.backend.stats()["flaky"]["lost"] == 1


async def test_hung_handler_times_out_and_its_worker_is_replaced():
    async with local() as c:
        t0 = time.monotonic()
        r = await c.call("hang", {})
        took = time.monotonic() - t0
        assert not r.ok and r.error.type == ErrorCode.TIMEOUT and "0.5 s" in r.error.message
        assert took < 5
        stats = c.backend.stats()["hang"]
        assert stats["timeouts"] == 1
        # another function's pool is untouched, and the replaced pool would serve again
        assert (await c.call("add", {"a": 1})).ok


async def test_calls_queued_behind_a_timed_out_call_run_on_another_worker_without_a_retry():
    async with local() as c:
        await c.call("hang_or_echo", {"hang": False, "x": 0})  # one warm, ready worker
        # the hanging call and three more go to that one worker in one batch; its timeout
        # kills the worker before the three start: they are re-queued, not failed. Batched
        # for sure: a loaded machine that made the first call take over 0.5 ms had the pool
        # hold some of the three back for a second worker (never queued behind the hang)
        c.backend.pool("hang_or_echo")._exec_ewma_ms = 0.01
        rs = await asyncio.gather(
            c.call("hang_or_echo", {"hang": True, "x": -1}),
            *(c.call("hang_or_echo", {"hang": False, "x": i}) for i in (1, 2, 3)),
        )
        assert rs[0].error.type == ErrorCode.TIMEOUT
        assert [(r.ok, r.value, r.attempts) for r in rs[1:]] == [(True, i, 1) for i in (1, 2, 3)]
        stats = c.backend.stats()["hang_or_echo"]
        assert stats["timeouts"] == 1 and stats["requeued"] == 3


async def test_deadline_travels_with_the_call():
    async with local() as c:
        t0 = time.monotonic()
        r = await c.call("sleepy", {"seconds": 5}, deadline_s=0.4)
        assert not r.ok and r.error.type in (ErrorCode.TIMEOUT, ErrorCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - t0 < 3


async def test_setup_hook_runs_once_per_worker():
    async with local() as c:
        rs = await c.map("with_setup", [{"x": i} for i in range(50)])
        assert all(r.ok for r in rs)
        by_pid: dict[int, set] = {}
        for r in rs:
            by_pid.setdefault(r.value["pid"], set()).add(r.value["setup_calls"])
        assert by_pid and all(calls == {1} for calls in by_pid.values())


async def test_a_stopped_worker_runs_the_exit_handlers_its_function_registered(tmp_path, monkeypatch):
    # the code verifier's closes its sandbox: skipped, the zygote was killed with the
    # worker's process group and left its cgroups behind
    marker = tmp_path / "exited"
    monkeypatch.setenv("FABRIC_TEST_MARKER", str(marker))
    async with local() as c:
        pid = (await c.call("exit_handler", {"x": 1})).value
        assert not marker.exists()
    assert marker.read_text() == str(pid)  # before the close returned


async def test_setup_failure_fails_fast_with_the_cause():
    async with local(setup_failure_cooldown_s=30) as c:
        r = await c.call("bad_setup", {"x": 1})
        assert not r.ok and r.error.type == ErrorCode.SETUP_FAILED and not r.error.retryable
        assert "model weights not found" in r.error.message
        spawned = c.backend.stats()["bad_setup"]["spawned"]
        t0 = time.monotonic()
        r2 = await c.call("bad_setup", {"x": 1})
        assert r2.error.type == ErrorCode.SETUP_FAILED and time.monotonic() - t0 < 2
        # fast because no worker was started to run the setup again
        assert c.backend.stats()["bad_setup"]["spawned"] == spawned


async def test_warmup_reports_a_setup_failure():
    async with local(warm=1, setup_failure_cooldown_s=30) as c:
        with pytest.raises(SetupFailedError) as e:
            await c.warmup(["add", "bad_setup"])
        # the cause and where it was raised, for a CLI that prints the error
        assert str(e.value).startswith(
            "bad_setup: worker setup failed: RuntimeError: model weights not found"
        )
        assert "_bad_setup" in str(e.value)
        assert e.value.traceback and "RuntimeError" in e.value.traceback
        assert c.backend.stats()["add"]["ready"] == 1  # the healthy function warmed up all the same


async def test_warmup_of_a_warm_0_function_starts_one_worker_that_answers_for_its_setup():
    # warm=0 made warmup a no-op: a job's start-up check passed, then every call failed
    # SetupFailed and masked every reward; and the first call paid the cold start
    async with local(setup_failure_cooldown_s=30, idle_window_s=0.3) as c:
        with pytest.raises(SetupFailedError, match="model weights not found"):
            await c.warmup(["bad_setup"])  # sample_fns: warm=0
        await c.warmup(["sleepy"])  # warm=0 too
        assert c.backend.stats()["sleepy"]["ready"] == 1
        r = await c.call("sleepy", {"seconds": 0})
        assert r.ok and not r.cold_start
        # beyond warm=0: it goes when unused, as a worker grown for a burst does
        await _until(lambda: c.backend.stats()["sleepy"]["workers"] == 0, "the idle worker to go")
        await _until(lambda: not alive(r.value), "its process to end")


async def test_one_failed_setup_does_not_fail_calls_a_ready_sibling_can_serve(tmp_path, monkeypatch):
    # warm=2: the first worker's setup fails while its sibling is still starting; the pool
    # must wait for the sibling, not fail every call fast for setup_failure_cooldown_s
    monkeypatch.setenv("FABRIC_TEST_MARKER", str(tmp_path / "marker"))
    async with local(max_workers=2, setup_failure_cooldown_s=30) as c:
        await c.warmup(["first_setup_fails"])  # returns: a worker serves although one failed
        stats = c.backend.stats()["first_setup_fails"]
        assert stats["ready"] >= 1 and stats["start_failures"] == 1
        r = await c.call("first_setup_fails", {})
        assert r.ok and r.value == "loaded", r.error


async def test_a_worker_that_does_not_start_in_time_says_so():
    async with local(start_timeout_s=0.5, setup_failure_cooldown_s=30) as c:
        r = await c.call("slow_to_start", {})
        assert r.error.type == ErrorCode.SETUP_FAILED, r.error
        assert "did not become ready within start_timeout_s=0.5 s" in r.error.message
        assert "start_timeout_s=..." in r.error.message  # what to do about it
        assert c.backend.stats()["slow_to_start"]["start_failures"] == 3


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        *(("raises_base", k) for k in ("KeyboardInterrupt", "GeneratorExit", "CancelledError")),
        *(
            ("async_raises_base", k)
            for k in ("KeyboardInterrupt", "SystemExit", "GeneratorExit", "CancelledError")
        ),
    ],
)
async def test_a_handler_raising_a_base_exception_is_a_user_error_not_a_dead_worker(fn, kind):
    # (a synchronous SystemExit: test_user_exception_is_data_and_the_pool_keeps_serving)
    async with local(max_workers=1) as c:
        r = await c.call(fn, {"kind": kind})
        assert r.error is not None and r.error.type == ErrorCode.USER_ERROR, r.error
        assert kind in r.error.message and r.attempts == 1
        assert (await c.call(fn, {"kind": "ValueError"})).error.type == ErrorCode.USER_ERROR
        stats = c.backend.stats()[fn]
        assert stats["lost"] == 0 and stats["spawned"] == 1  # one worker served both


def test_a_function_defined_without_a_file_gets_a_clear_error(tmp_path):
    # python -c (like a notebook cell or stdin) has no file for a worker to import
    code = textwrap.dedent(
        """
        import asyncio, fabric
        @fabric.reward
        def match(traj: str, ground_truth: str) -> float:
            return float(traj == ground_truth)
        async def main():
            async with fabric.Client(backend="local") as c:
                r = await c.call("match", {"traj": "a", "ground_truth": "a"})
                print("RESULT", r.ok, r.error.type if r.error else "", r.error.message if r.error else "")
            async with fabric.Client(backend="inproc") as c:
                print("INPROC", (await c.call("match", {"traj": "a", "ground_truth": "a"})).value)
        asyncio.run(main())
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(fabric.__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert "RESULT False SetupFailed match is defined in __main__ without a file" in p.stdout, (
        p.stdout + p.stderr[-2000:]
    )
    assert "define it in a module or a .py file (or use backend='inproc')" in p.stdout
    assert "INPROC 1.0" in p.stdout


async def test_bad_results_and_bad_arguments_are_clear_errors():
    async with local() as c:
        r = await c.call("not_json", {})
        assert r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE and "object" in r.error.message
        r = await c.call("big_result", {"n": 7 * 1024 * 1024})
        assert r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE and "6 MB" in r.error.message
        r = await c.call("add", {"a": "not a number"})
        assert r.error.type == ErrorCode.INVALID_ARGUMENTS and "a:" in r.error.message
        r = await c.call("add", {"b": 1, "c": 2})
        assert r.error.type == ErrorCode.INVALID_ARGUMENTS
        assert "missing 'a'" in r.error.message and "unexpected 'c'" in r.error.message
        r = await c.call("add", {"a": object()})
        assert r.error.type == ErrorCode.PAYLOAD_NOT_SERIALIZABLE
        r = await c.call("big_result", {"n": "x" * (7 * 1024 * 1024)})
        assert r.error.type == ErrorCode.PAYLOAD_TOO_LARGE and "MiB" in r.error.message
        r = await c.call("ad", {"a": 1})
        assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and "add" in r.error.message
        # none of those reached a worker of big_result except the oversized result
        assert c.backend.stats()["big_result"]["calls"] == 1
        assert (await c.call("add", {"a": 1})).ok


async def test_a_failing_scale_up_worker_does_not_break_a_healthy_pool(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRIC_TEST_MARKER", str(tmp_path / "marker"))
    async with local(max_workers=2, setup_failure_cooldown_s=30) as c:
        await c.backend.warmup(["picky"])
        rs = await c.map("picky", [{"seconds": 0.02}] * 30)  # enough to ask for a second worker
        # a loaded machine may still be starting that worker when the 30 are done (0.6 s of
        # work): calls keep coming until its setup has failed, so some are queued when it does
        deadline = time.monotonic() + 30
        while not c.backend.stats()["picky"]["start_failures"]:
            assert time.monotonic() < deadline, "the scale-up worker's setup never failed"
            rs += await c.map("picky", [{"seconds": 0.02}] * 5)
        assert all(r.ok for r in rs), [r.error for r in rs if not r.ok]
        stats = c.backend.stats()["picky"]
        assert stats["start_failures"] >= 1 and stats["ready"] == 1
        assert (await c.call("picky", {"seconds": 0})).ok


async def test_the_pool_recovers_after_a_transient_setup_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRIC_TEST_MARKER", str(tmp_path / "marker"))
    async with local(setup_failure_cooldown_s=0.2) as c:
        r = await c.call("recovers", {"x": 1})
        assert r.error.type == ErrorCode.SETUP_FAILED and "transient" in r.error.message
        await asyncio.sleep(0.3)
        r = await asyncio.wait_for(c.call("recovers", {"x": 2}), 10)
        assert r.ok and r.value == 2


async def test_a_failed_spawn_does_not_wedge_the_pool(monkeypatch):
    from fabric.backends import _pool_workers

    real = _pool_workers.subprocess.Popen
    calls = {"n": 0}

    def flaky_popen(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(11, "Resource temporarily unavailable")
        return real(*a, **kw)

    monkeypatch.setattr(_pool_workers.subprocess, "Popen", flaky_popen)
    async with local(setup_failure_cooldown_s=0.1) as c:
        r = await asyncio.wait_for(c.call("pid", {}), 10)
        if not r.ok:  # the first spawn failed with the call queued: it is answered, then retried
            assert r.error.type == ErrorCode.SETUP_FAILED
            await asyncio.sleep(0.2)
            r = await asyncio.wait_for(c.call("pid", {}), 10)
        assert r.ok and calls["n"] >= 2


async def test_a_value_nested_past_the_strict_parsers_limit_is_answered():
    """The worker encodes a value nested up to about 280 deep; pydantic-core's parser refuses
    JSON past about 200 levels. The parent's decode raised out of its socket's protocol: the
    call was never answered (it waited for its deadline) and its worker was torn down."""
    from reply_fns import REG

    from fabric.backends.base import LocalConfig
    from fabric.client import Client

    async with Client(backend=LocalConfig(), registry=REG) as c:
        r = await c.call("nested", {"depth": 250}, deadline_s=10)
        assert r.ok, r.error
        value, depth = r.value, 0
        while isinstance(value, list):
            value, depth = value[0], depth + 1
        assert (depth, value) == (250, 1)
        assert c.backend.stats()["nested"]["lost"] == 0


@pytest.mark.parametrize("name", ["raises_unprintable", "async_raises_unprintable"])
async def test_an_exception_whose_str_raises_is_the_functions_user_error(name):
    """Formatting the handler's raise raised in the worker: a synchronous call came back
    WorkerLost (its worker ended; retried, and a side effect's key kept OutcomeUnknown), an
    async one was never answered until its worker was killed for the timeout."""
    from reply_fns import REG

    from fabric.backends.base import LocalConfig
    from fabric.client import Client

    async with Client(backend=LocalConfig(), registry=REG) as c:
        r = await c.call(name, {}, deadline_s=10)
        assert r.error is not None and r.error.type == ErrorCode.USER_ERROR, r.error
        assert r.error.message == "Unprintable: <exception str() failed>"
        assert "Unprintable" in (r.error.traceback or "")
        stats = c.backend.stats()[name]
        assert (stats["lost"], stats["timeouts"]) == (0, 0)


@pytest.mark.parametrize("name", ["checked", "async_checked"])
async def test_an_arguments_own_check_raising_past_pydantic_is_the_functions_user_error(name):
    """pydantic makes a ValidationError of a validator's ValueError or AssertionError only;
    any other raise (a lookup in a check) went through the worker's argument check: a
    synchronous call came back WorkerLost (its worker ended), an async one was never answered
    until its worker was killed for the timeout."""
    from reply_fns import REG

    from fabric.backends.base import LocalConfig
    from fabric.client import Client

    async with Client(backend=LocalConfig(), registry=REG) as c:
        r = await c.call(name, {"n": -1}, deadline_s=10)
        assert r.error is not None and r.error.type == ErrorCode.USER_ERROR, r.error
        assert r.error.message == "LookupError: no entry for -1"
        assert (await c.call(name, {"n": 3}, deadline_s=10)).value == 3  # the same worker serves on
        stats = c.backend.stats()[name]
        assert (stats["lost"], stats["timeouts"], stats["spawned"]) == (0, 0, 1)


async def test_an_int_past_the_parsers_digit_limit_is_answered():
    """The encoder writes an int of any length; both parsers refuse one past 4,300 digits
    (pydantic-core "number out of range", Python's int-conversion limit). The parent's decode
    raised out of its socket's protocol: the call was never answered (it waited for its
    deadline) and its worker was torn down."""
    from reply_fns import REG

    from fabric.backends.base import LocalConfig
    from fabric.client import Client

    async with Client(backend=LocalConfig(), registry=REG) as c:
        r = await c.call("power_of_ten", {"digits": 5000}, deadline_s=10)
        assert r.error is not None and r.error.type == ErrorCode.RESULT_NOT_SERIALIZABLE, r.error
        assert "digits" in r.error.message
        assert (await c.call("power_of_ten", {"digits": 3}, deadline_s=10)).value == 1000
        stats = c.backend.stats()["power_of_ten"]
        assert (stats["lost"], stats["timeouts"], stats["spawned"]) == (0, 0, 1)
