"""A backend whose ``submit`` raises (its dispatch broke: a closed executor, a bug) for a call's
own attempt, not a hedge: the exception went up through ``Client.call``, which answers every
failed call with a ``Result`` and never raises for one. It is now that call's failed
``Result`` (a retryable ``TransportError`` naming the backend and the exception), logged with
its traceback, and the call's slot is given back."""

from __future__ import annotations

import asyncio
import logging

import pytest
from client_fns import REG

from fabric.client import Client
from fabric.protocol import Invocation, Result
from fabric.testing import FakeBackend


class BrokenDispatch(FakeBackend):
    def __init__(self, refusals: int) -> None:
        super().__init__(REG)
        self.refusals = refusals

    def _submit(self, inv: Invocation) -> asyncio.Future[Result]:
        if self.refusals > 0:
            self.refusals -= 1
            raise RuntimeError("dispatch broke")
        return super()._submit(inv)


async def test_a_submit_that_raises_is_the_calls_failed_result(caplog: pytest.LogCaptureFixture):
    fake = BrokenDispatch(refusals=100)
    async with Client(backend=fake, registry=REG) as c:
        with caplog.at_level(logging.ERROR):
            r = await c.call("two_at_a_time", {"seconds": 0})
        assert not r.ok and r.error is not None
        assert r.error.type == "TransportError" and r.error.retryable
        assert "dispatch broke" in r.error.message and "RuntimeError" in r.error.message
        assert "dispatch broke" in caplog.text  # logged, with its traceback, for the backend's owner
        # every slot given back: two calls at a time still go once the backend sends again
        fake.refusals = 0
        a, b = await asyncio.wait_for(
            asyncio.gather(*(c.call("two_at_a_time", {"seconds": 0}) for _ in range(2))), 5
        )
        assert a.ok and b.ok


async def test_a_submit_that_raises_once_is_retried():
    fake = BrokenDispatch(refusals=1)
    async with Client(backend=fake, registry=REG) as c:
        r = await c.call("two_at_a_time", {"seconds": 0})
    assert r.ok and r.attempts == 2
