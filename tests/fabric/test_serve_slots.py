"""``fabric serve``'s slots (a tenant's quota, a function's gate) against what really runs:
held exactly as long as the work goes on, taken back the moment room opens. Real HTTP on
127.0.0.1; the functions here run in this process (inproc, or a scripted backend), so a test
holds a call where it wants it with an event instead of a sleep."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from test_serve import PATH, TOKEN_A, TOKEN_B, auth, config
from test_serve_hardening import _post_and_hang_up

from fabric.backends.base import InprocConfig
from fabric.protocol import Invocation
from fabric.registry import Registry
from fabric.serve import Gateway
from fabric.testing import FakeBackend


async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


class _Held:
    """A synchronous function that runs until the test lets it go (a thread that keeps
    running after its caller gave up, as a real slow reward does)."""

    def __init__(self, timeout_s: float):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.registry = Registry()
        entered, release = self.entered, self.release

        @self.registry.function(warm=0, timeout_s=timeout_s)
        def held() -> int:
            entered.set()
            release.wait(60)
            return 1


@pytest.mark.parametrize("how", ["hang-up", "deadline", "timeout"])
async def test_an_inproc_call_given_up_keeps_its_slots_until_its_thread_ends(how):
    """The inproc backend had no ``settled()``: a synchronous call whose client hung up (or
    whose deadline or timeout_s passed) gave its tenant's quota slot and its gate slot back at
    once while its thread still ran the handler, so a tenant could keep any number of
    threads busy while holding none of its quota. Both are now held until the thread ends."""
    fn = _Held(timeout_s=0.3 if how == "timeout" else 30)
    cfg = config(backend=InprocConfig(), drain_s=0)
    url = PATH.format("held")
    async with Gateway(cfg, fn.registry) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        try:
            if how == "hang-up":
                await _post_and_hang_up(g.port, url, b"{}", TOKEN_A, fn.entered.is_set)
                # the server hears of the hang-up: the call runs on, or (the bug) its slot is back
                await _until(
                    lambda: g.metrics.running_on == 1 or g.quotas.held["job-a"] == 0, "the hang-up seen"
                )
            else:
                deadline = time.time() + 0.3 if how == "deadline" else None
                env = Invocation(function="held", payload={}, deadline=deadline)
                r = await c.post(url, content=env.model_dump_json().encode(), headers=auth())
                want = "DeadlineExceeded" if how == "deadline" else "FunctionTimeout"
                assert r.json()["error"]["type"] == want, r.text
            assert fn.entered.is_set() and not fn.release.is_set()  # its thread still runs
            assert g.quotas.held["job-a"] == 1, "the quota slot came back while the thread ran"
            assert g._gates["held"].running == 1 and g.metrics.running_on == 1
        finally:
            fn.release.set()
        await _until(lambda: g.quotas.held["job-a"] == 0, "the slot back when the thread ended")
        assert g._gates["held"].running == 0 and g.metrics.running_on == 0


async def test_an_inproc_async_call_cancelled_keeps_its_slots_while_it_unwinds():
    """An async handler whose client hung up is cancelled where it runs, and may take a while
    to end (its clean-up: closing a session, a sandbox). The inproc backend's settled() said
    nothing ran on, so its slots came back while it still ran; the local pool holds them
    until its worker answers the cancel. Now so does inproc, until the task has ended."""
    reg = Registry()
    entered, release = asyncio.Event(), asyncio.Event()

    @reg.function(warm=0, timeout_s=30)
    async def unwinds() -> int:
        entered.set()
        try:
            await asyncio.sleep(60)
        finally:
            await release.wait()  # its clean-up
        return 1

    async with Gateway(config(backend=InprocConfig(), drain_s=0), reg) as g:
        try:
            await _post_and_hang_up(g.port, PATH.format("unwinds"), b"{}", TOKEN_A, entered.is_set)
            await _until(lambda: g.metrics.running_on == 1 or g.quotas.held["job-a"] == 0, "the hang-up seen")
            assert g.quotas.held["job-a"] == 1, "the slot came back while the handler still ran"
            assert g._gates["unwinds"].running == 1
        finally:
            release.set()
        await _until(lambda: g.quotas.held["job-a"] == 0, "the slot back when the handler ended")
        assert g._gates["unwinds"].running == 0 and g.metrics.running_on == 0


class _Growing(FakeBackend):
    """A backend whose room for a function grows while calls wait for it (a pool scaled up,
    or one that learned its calls are short)."""

    def __init__(self, registry: Registry):
        super().__init__(registry)
        self.room = 1
        self._watchers: list[Callable[[], None]] = []

    def capacity(self, function: str) -> int | None:
        return self.room

    def watch_capacity(self, function: str, grew: Callable[[], None]) -> None:
        self._watchers.append(grew)

    def grow(self, room: int) -> None:
        self.room = room
        for grew in self._watchers:
            grew()


async def test_calls_waiting_for_room_are_admitted_as_soon_as_the_pool_grows():
    """The fair gate admitted waiting calls only when a call ended (its release): room that
    the pool gained meanwhile (a scale-up, or the local pool's per-worker batch growing once it
    knew its calls were short) stood empty while calls waited for it."""
    reg = Registry()
    started: list[int] = []
    release = asyncio.Event()

    @reg.function(warm=0, timeout_s=30)
    async def waits(n: int) -> int:
        started.append(n)
        await release.wait()
        return n

    backend = _Growing(reg)
    async with (
        Gateway(config(), reg, backend=backend) as g,
        httpx.AsyncClient(base_url=g.url, timeout=30) as c,
    ):
        url = PATH.format("waits")
        first = asyncio.create_task(c.post(url, json={"n": 1}, headers=auth()))
        await _until(lambda: started == [1], "the first call to run")
        second = asyncio.create_task(c.post(url, json={"n": 2}, headers=auth(TOKEN_B)))
        await _until(lambda: g._gates["waits"].waiting == 1, "the second call to wait for room")
        try:
            backend.grow(2)
            await _until(lambda: started == [1, 2], "the second call to be admitted", timeout_s=5)
            assert not first.done()
        finally:
            release.set()
        assert [(await t).json() for t in (first, second)] == [1, 2]
        assert g.quotas.held == {"job-a": 0, "job-b": 0} and g._gates["waits"].running == 0


async def test_the_local_pool_says_when_its_room_grows():
    """What the gate above listens to, in the local pool: a synchronous pool holds one call
    per worker until it knows how long a call takes; once it learns they are short, each
    worker holds a batch, and the watchers hear of it."""
    from sample_fns import REG

    from fabric.backends.base import LocalConfig
    from fabric.backends.local import LocalBackend

    async with LocalBackend(REG, LocalConfig(max_workers=1, warm=1)) as backend:
        assert backend.capacity("add") == 1
        grew: list[int | None] = []
        backend.watch_capacity("add", lambda: grew.append(backend.capacity("add")))
        for i in range(50):  # one answer tells; more only if a loaded machine made one slow
            assert (await backend.invoke(Invocation(function="add", payload={"a": i}))).ok
            if grew:
                break
        assert grew and grew[0] is not None and grew[0] > 1, grew
        assert backend.capacity("inproc_only_no_such_function") is None


async def test_a_function_no_worker_can_import_is_answered_and_gives_its_slot_back():
    """Sizing its gate started the function's local pool, and for a function no worker can
    import (a nested one: a test's, a notebook's) that raised before anything held the call's
    quota slot: every call was a 500, and each kept its slot for good (two calls and the
    tenant was locked out). It is answered as the backend answers it, and the slot is back."""
    reg = Registry()

    @reg.function(warm=0)
    def nested(x: int) -> int:
        return x

    async with Gateway(config(quota_a=2), reg) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        for _ in range(3):
            r = await c.post(PATH.format("nested"), json={"x": 1}, headers=auth())
            assert r.status_code == 200 and r.headers["X-Amz-Function-Error"] == "Unhandled", r.text
            assert r.json()["errorType"] == "SetupFailed" and "nested" in r.json()["errorMessage"]
        assert g.quotas.held["job-a"] == 0


_SERVE_DIR = os.path.join("fabric", "serve", "")


async def test_an_event_cancelled_before_it_first_runs_gives_its_slot_back(tmp_path, caplog):
    """An Event call's task took over its quota slot only once it ran: one cancelled before
    its first step (the server stopping in the loop turn that accepted it: a drain with no
    time left, a second Ctrl-C) never gave the slot back. Played here by cancelling the
    event's task as the server creates it (the only task fabric.serve makes per request)."""
    loop = asyncio.get_running_loop()
    cancelled: list[asyncio.Task] = []

    def cancel_events(loop, coro, **kw):
        task = asyncio.Task(coro, loop=loop, **kw)
        code = getattr(coro, "cr_code", None)
        if code is not None and _SERVE_DIR in code.co_filename:
            task.cancel()
            cancelled.append(task)
        return task

    out = tmp_path / "ran.txt"
    cfg = config(backend=InprocConfig())
    reg = Registry()

    @reg.function(warm=0)
    def append(path: str) -> int:
        with open(path, "a") as f:
            f.write("ran\n")
        return 1

    async with Gateway(cfg, reg) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        loop.set_task_factory(cancel_events)
        try:
            headers = {**auth(), "X-Amz-Invocation-Type": "Event"}
            with caplog.at_level(logging.WARNING, logger="fabric.serve"):
                r = await c.post(PATH.format("append"), json={"path": str(out)}, headers=headers)
                assert r.status_code == 202
                await _until(lambda: bool(cancelled) and cancelled[0].done(), "the event's task to end")
        finally:
            loop.set_task_factory(None)
        await _until(lambda: g.quotas.held["job-a"] == 0, "the slot back", timeout_s=5)
        assert g.inflight == 0 and not out.exists()
        assert any("dropped" in rec.getMessage() for rec in caplog.records), caplog.text
        r = await c.post(PATH.format("append"), json={"path": str(out)}, headers=auth())
        assert r.json() == 1


@pytest.mark.parametrize("how", ["drained", "stop_now"])
async def test_a_run_given_up_on_is_in_flight_and_the_drain_waits_for_it(how):
    """``Gateway.inflight`` counted requests being answered and Event calls only: a
    synchronous call answered at its deadline while its thread ran on was in no count, so
    `fabric serve` stopping said it waited for 0 calls, and the drain closed the backend
    under it at once. It counts until its run ends, and the drain waits for it (within
    drain_s; a second Ctrl-C, ``stop_now``, ends that wait)."""
    fn = _Held(timeout_s=30)
    g = Gateway(config(backend=InprocConfig(), drain_s=30), fn.registry)
    await g.start()
    closing: asyncio.Task[None] | None = None
    try:
        async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
            env = Invocation(function="held", payload={}, deadline=time.time() + 0.3)
            r = await c.post(PATH.format("held"), content=env.model_dump_json().encode(), headers=auth())
            assert r.json()["error"]["type"] == "DeadlineExceeded", r.text
        assert fn.entered.is_set() and not fn.release.is_set()  # its thread runs on
        assert g.inflight == 1, "a run given up on is not in flight"
        closing = asyncio.create_task(g.aclose())
        done, _ = await asyncio.wait({closing}, timeout=0.5)
        assert not done, "the drain did not wait for the run given up on"
        if how == "stop_now":
            g.stop_now()
            await asyncio.wait_for(asyncio.shield(closing), 10)
            assert g.inflight == 1  # closed; the thread still runs (it cannot be stopped)
        fn.release.set()
        await asyncio.wait_for(asyncio.shield(closing), 30)
        await _until(lambda: g.inflight == 0, "the run to end")
    finally:
        fn.release.set()
        if closing is None:
            await g.aclose()
        else:
            await asyncio.gather(closing, return_exceptions=True)
