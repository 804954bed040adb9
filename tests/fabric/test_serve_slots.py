"""``fabric serve``'s slots (a tenant's quota, a function's gate) against what really runs:
held exactly as long as the work goes on, taken back the moment room opens. Real HTTP on
127.0.0.1; the functions here run in this process (inproc, or a scripted backend), so a test
holds a call where it wants it with an event instead of a sleep."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from test_serve import PATH, TOKEN_A, auth, config
from test_serve_hardening import _post_and_hang_up

from fabric.backends.base import InprocConfig
from fabric.protocol import Invocation
from fabric.registry import Registry
from fabric.serve import Gateway


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
