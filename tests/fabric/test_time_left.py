"""``fabric.runner.time_left_s()`` read by a handler during its run, on the backends that run
functions on this machine: the local backend's worker processes and in-process."""

from __future__ import annotations

import asyncio
import time

import pytest
from time_left_fns import REG

from fabric.client import Client

BACKENDS = ["local", "inproc"]


@pytest.mark.parametrize("backend", BACKENDS)
async def test_an_async_handler_reads_what_its_timeout_leaves(backend):
    async with Client(backend=backend, registry=REG) as c:
        r = await c.call("time_left", {"nap": 0.2})
        assert r.ok, r.error
        before, after = r.value
        assert 4.0 < before <= 5.0, before  # timeout_s=5, from the run's start
        assert 0.15 < before - after < 2.0, (before, after)  # it counts down


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_sooner_deadline_is_the_limit(backend):
    async with Client(backend=backend, registry=REG) as c:
        r = await c.call("time_left", {}, deadline_s=2.0)
        assert r.ok, r.error
        assert 0.0 < r.value[0] <= 2.0, r.value


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_keyed_run_whose_deadline_moves_later_reads_the_moved_limit(backend, tmp_path):
    """A caller with a later deadline joins a keyed run under way: the run's limit moves (in
    the worker too), and what the handler reads moves with it (the handler waits for that:
    without it, the run is cut at the first caller's deadline)."""
    started = tmp_path / "started"
    payload = {"started": str(started)}
    async with Client(backend=backend, registry=REG) as c:
        first = asyncio.ensure_future(
            c.call("time_left_moving", payload, idempotency_key="k", deadline_s=4.0)
        )
        deadline = time.monotonic() + 15
        while not started.exists():
            assert time.monotonic() < deadline, "the run did not start"
            await asyncio.sleep(0.01)
        joined = await c.call("time_left_moving", payload, idempotency_key="k", deadline_s=12.0)
        assert joined.ok, joined.error
        before, after = joined.value
        assert before <= 4.0 < after <= 12.0, joined.value
        await first  # its caller gave up at its deadline; the run was the joined caller's


def test_outside_a_run_it_is_none():
    from fabric.runner import time_left_s

    assert time_left_s() is None


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_synchronous_handler_reads_what_its_timeout_leaves(backend):
    """A synchronous run is cut from outside (its worker killed; in-process, its wait given
    up), with no timer in its context: time_left_s() was None there, so a sync judge could not
    stop in time. It reads the limit its run started with."""
    async with Client(backend=backend, registry=REG) as c:
        r = await c.call("time_left_sync", {"nap": 0.2})
        assert r.ok, r.error
        before, after = r.value
        assert before is not None and 4.0 < before <= 5.0, before  # timeout_s=5, from the run's start
        assert after is not None and 0.15 < before - after < 2.0, (before, after)
        r = await c.call("time_left_sync", {}, deadline_s=2.0)  # a sooner deadline is the limit
        assert r.ok, r.error
        assert 0.0 < r.value[0] <= 2.0, r.value


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_blocking_helper_on_a_thread_of_the_run_reads_it_too(backend):
    """asyncio.to_thread carries the run's context to its thread, where there is no running
    loop: time_left_s() raised RuntimeError there (a judge whose blocking HTTP client runs on
    a thread failed every call), where it should read the run's limit."""
    async with Client(backend=backend, registry=REG) as c:
        r = await c.call("time_left_in_a_thread", {})
        assert r.ok, r.error
        assert 4.0 < r.value <= 5.0, r.value
