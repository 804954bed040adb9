"""A zygote that dies while a container's stop waits for its answer to the kill: the stop
ends with the zygote's death (its children died with it), not after the sweep's bound."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from envpool import escapees
from envpool.runtimes.base import ProcessRuntimeConfig
from envpool.runtimes.process import ProcessRuntime


async def test_a_stop_waiting_for_its_kill_ends_when_the_zygote_dies(monkeypatch: pytest.MonkeyPatch):
    # the dead zygote's reader swept its children's marks, and that sweep waited for the
    # stops still killing their groups; but it failed their kill requests only after it, so
    # the stop waited for the sweep, which waited for the stop, until GATHER_S (2 s) passed
    monkeypatch.setattr(escapees, "GATHER_S", 600.0)  # far past the bound below
    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1, zygote=True))
    try:
        c = await rt.start(None, None, timeout_s=20)
        zygote = rt._zygote
        assert zygote is not None and zygote.proc is not None
        os.kill(zygote.proc.pid, signal.SIGSTOP)  # it will not answer the kill
        asked = len(zygote.sent)
        stop = asyncio.create_task(rt.stop(c))
        while len(zygote.sent) == asked:  # noqa: ASYNC110 - the kill request went out
            await asyncio.sleep(0.01)
        os.kill(zygote.proc.pid, signal.SIGKILL)
        # (the bound only ends a failing test: the stop ends within moments)
        done, _ = await asyncio.wait({stop}, timeout=30)
        if not done:  # let it go (the close below would wait for it too)
            for fut in zygote.waiting.values():
                fut.set_exception(ConnectionError("the test gave up"))
        assert done, "the stop still waits for the dead zygote's sweep"
        assert c.id not in rt.live
    finally:
        await rt.aclose()
