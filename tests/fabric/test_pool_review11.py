"""Review 11 of the local pool: an async call that runs on past its ``timeout_s`` (it swallowed
the worker's cancellation) gets its worker killed and replaced even while the worker answers
other calls."""

from __future__ import annotations

import asyncio

from review11_fns import REG

from fabric.backends.base import LocalConfig
from fabric.client import Client, ClientConfig
from fabric.errors import ErrorCode


async def test_an_async_call_deaf_to_its_timeout_is_killed_while_others_answer():
    """The parent stepped in for an async worker only when it answered nothing at all for
    ``timeout_s`` plus a grace: a handler that swallowed the cancellation at its timeout (a
    bare ``except`` in a polling loop) ran on for good while the worker's other calls kept
    answering, and its caller (with no deadline) waited for good, holding a
    ``max_concurrency`` slot."""
    cfg = ClientConfig.model_validate({"hedge": {"enabled": False}})
    async with Client(backend=LocalConfig(max_workers=1), registry=REG, config=cfg) as c:
        await c.warmup(["stubborn"])
        deaf = asyncio.create_task(c.call("stubborn", {"seconds": 3600, "deaf": True}))
        answered = 0
        # a steady trickle of quick calls on the same worker: it answers, so it is not stuck
        for _ in range(200):
            if deaf.done():
                break
            assert (await c.call("stubborn", {"seconds": 0.01})).ok or deaf.done()
            answered += 1
            await asyncio.sleep(0.02)
        assert deaf.done(), "the deaf call was never cut: its worker kept running it"
        r = deaf.result()
        assert r.error is not None and r.error.type == ErrorCode.TIMEOUT
        assert answered > 0
        stats = c.backend.stats()["stubborn"]
        assert stats["timeouts"] == 1 and stats["lost"] == 1
