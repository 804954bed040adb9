"""``fabric serve``'s start-up and shutdown: functions that cannot start, be imported or
warm in time (reported, the rest served; a named one stops the server and its pools), a port
in use, and the drain of the calls in flight at close (drain_s, none, a second Ctrl-C)."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import pytest
from sample_fns import REG, SERVE_REG
from serve_helpers import PATH, auth, config

from fabric.errors import BackendError, SetupFailedError
from fabric.registry import Registry
from fabric.serve import Gateway
from fabric.testing import FakeBackend


async def test_a_function_that_cannot_start_is_reported_and_the_rest_are_served():
    cfg = config(warm=True)
    async with Gateway(cfg, SERVE_REG) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        assert list(g.not_ready) == ["serve_broken"]
        assert "model weights not found" in g.not_ready["serve_broken"]
        assert (await http.post(PATH.format("serve_add"), json={"a": 1}, headers=auth())).json() == 2
        r = await http.post(PATH.format("serve_broken"), json={"x": 1}, headers=auth())
        assert "model weights not found" in r.text


async def test_a_function_that_cannot_be_imported_is_reported_and_the_rest_are_served():
    """Without ``-f`` only a failed setup hook was listed in ``not_ready``: an entry point the
    workers cannot import (EntryPointError) stopped the whole server at its warm-up, every
    good function with it. It is listed with its reason now, and its calls answer
    SetupFailed."""
    import sample_fns

    reg = Registry()
    reg.add(sample_fns.serve_add)

    @reg.function(name="nested", warm=1)
    def nested(x: int) -> int:
        return x

    async with Gateway(config(warm=True), reg) as g, httpx.AsyncClient(base_url=g.url, timeout=30) as http:
        assert list(g.not_ready) == ["nested"] and "nested function" in g.not_ready["nested"]
        assert not g.slow_to_start  # it cannot start: its calls answer SetupFailed
        assert (await http.post(PATH.format("serve_add"), json={"a": 1}, headers=auth())).json() == 2
        r = await http.post(PATH.format("nested"), json={"x": 1}, headers=auth())
        assert r.headers.get("x-amz-function-error") and "nested function" in r.text, r.text


class _SlowToWarm(FakeBackend):
    """The warm workers of ``serve_broken`` are not ready in time (the local pool's wait gives
    up: BackendError); every other function warms."""

    async def _warmup(self, names: list[str] | None) -> None:
        if names and "serve_broken" in names:
            raise BackendError("serve_broken: 0 of 1 warm workers ready after 240 s")


async def test_a_warm_up_that_times_out_is_reported_and_the_rest_are_served():
    """A function whose warm workers were not ready in time stopped the whole server (the
    warm-up's BackendError), without ``-f``; it is listed in ``not_ready`` now. With ``-f``
    naming it, the server still does not start."""
    async with (
        Gateway(config(warm=True), SERVE_REG, backend=_SlowToWarm(SERVE_REG)) as g,
        httpx.AsyncClient(base_url=g.url, timeout=30) as http,
    ):
        assert list(g.not_ready) == ["serve_broken"]
        assert "warm workers ready after 240 s" in g.not_ready["serve_broken"]
        assert g.slow_to_start == {"serve_broken"}  # only late: its calls wait for a worker
        assert (await http.post(PATH.format("serve_add"), json={"a": 1}, headers=auth())).json() == 2
    strict = Gateway(config(warm=True, functions=["serve_broken"]), SERVE_REG, backend=_SlowToWarm(SERVE_REG))
    with pytest.raises(BackendError, match="240 s"):
        await strict.start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_named_function_that_cannot_start_stops_the_server_and_its_pools():
    gw = Gateway(config(warm=True, functions=["serve_add", "serve_broken"]), SERVE_REG)
    with pytest.raises(SetupFailedError, match="model weights not found"):
        await gw.start()
    pids = [pid for p in gw.backend.stats().values() for pid in p["pids"]]
    assert pids  # serve_add's worker had started...
    assert [pid for pid in pids if _alive(pid)] == []  # ...and stopped with the rest


async def test_a_named_warm_0_function_that_cannot_start_stops_the_server_too():
    # -f checked only the functions with warm > 0: a warm=0 one's broken setup was found by
    # the first call of some job, after the server said it was up
    gw = Gateway(config(warm=True, functions=["add", "bad_setup"]), REG)  # bad_setup: warm=0
    with pytest.raises(SetupFailedError, match="model weights not found"):
        await gw.start()


async def test_port_in_use_is_an_os_error():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        g = Gateway(config().model_copy(update={"port": s.getsockname()[1]}), REG)
        with pytest.raises(OSError):
            await g.start()
        await g.aclose()
    finally:
        s.close()


async def until_in_flight(g: Gateway) -> None:
    for _ in range(3000):  # until the server has the request
        if g.inflight:
            break
        await asyncio.sleep(0.01)
    assert g.inflight == 1


async def test_close_lets_the_calls_in_flight_finish():
    g = Gateway(config(drain_s=30), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        call = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 1.0}, headers=auth()))
        await until_in_flight(g)
        await g.aclose()  # stops accepting, waits for the call
        r = await call
    assert r.status_code == 200 and isinstance(r.json(), int)
    assert g.inflight == 0


@pytest.mark.parametrize("how", ["drain_s", "no_drain", "stop_now"])
async def test_a_call_that_outlives_the_drain_is_cancelled(how):
    # no_drain: drain_s=0, which aiohttp's shutdown_timeout would read as "wait forever"
    g = Gateway(config(drain_s={"drain_s": 0.3, "no_drain": 0, "stop_now": 60}[how]), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        call = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 20}, headers=auth()))
        await until_in_flight(g)
        t0 = time.monotonic()
        closing = asyncio.create_task(g.aclose())
        if how == "stop_now":  # a second Ctrl-C
            await asyncio.sleep(0.3)
            assert not closing.done()  # still draining: the call has 60 s
            g.stop_now()
        await closing
        took = time.monotonic() - t0
        with pytest.raises(httpx.TransportError):  # the connection dropped: the client retries
            await call
    assert took < 10, took  # not the call's 20 s, nor the 60 s drain
    assert g.inflight == 0


@pytest.mark.parametrize("drain_s", [0, 3])
async def test_the_drain_lasts_drain_s_and_zero_means_none(drain_s):
    """aiohttp's shutdown_timeout was the drain: it waits that long for a handler, then as
    long again after cancelling only its body read (a 30 s drain was 60 s), and 0 is no limit
    at all (drain_s 0 waited for the call to end)."""
    g = Gateway(config(drain_s=drain_s), REG)
    await g.start()
    async with httpx.AsyncClient(base_url=g.url, timeout=30) as c:
        call = asyncio.create_task(c.post(PATH.format("sleepy"), json={"seconds": 9}, headers=auth()))
        for _ in range(3000):  # until the server has the request
            if g.inflight:
                break
            await asyncio.sleep(0.01)
        assert g.inflight == 1
        t0 = time.monotonic()
        closing = asyncio.create_task(g.aclose())
        with pytest.raises(httpx.TransportError):  # the connection dropped at the drain's end
            await call
        dropped = time.monotonic() - t0
        await closing
    # the slow paths: the call's 9 s (drain_s 0), twice the drain (6 s)
    assert dropped < drain_s + 2, dropped
    assert g.inflight == 0
