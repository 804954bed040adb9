"""What the client test modules (test_client*.py) share: a client on the shipped
FakeBackend, and a backend the test answers by hand."""

from __future__ import annotations

import asyncio

from client_fns import REG

from fabric.client import Client, ClientConfig
from fabric.errors import ErrorCode
from fabric.protocol import Invocation
from fabric.testing import FakeBackend


def make(**cfg) -> tuple[Client, FakeBackend]:
    fake = FakeBackend(REG)
    return Client(backend=fake, registry=REG, config=ClientConfig.model_validate(cfg)), fake


class _ManualBackend(FakeBackend):
    """Answers each invocation when the test says so: no timing decides who answers first."""

    def __init__(self) -> None:
        super().__init__(REG)
        self.futures: list[asyncio.Future] = []
        self.submitted = asyncio.Event()

    def _submit(self, inv: Invocation) -> asyncio.Future:
        self.invocations.append(inv)
        fut = asyncio.get_running_loop().create_future()
        self.futures.append(fut)
        self.submitted.set()
        return fut

    async def next(self) -> tuple[Invocation, asyncio.Future]:
        """The next invocation sent, once it is."""
        while len(self.futures) <= self._taken:
            self.submitted.clear()
            await self.submitted.wait()
        self._taken += 1
        return self.invocations[self._taken - 1], self.futures[self._taken - 1]

    _taken = 0

    @staticmethod
    def answer(inv: Invocation, fut: asyncio.Future, code: ErrorCode | None = None) -> None:
        from fabric.protocol import Result

        fut.set_result(
            Result.built(True, function=inv.function, request_id=inv.request_id, value=0)
            if code is None
            else Result.failure(code, "injected", function=inv.function, request_id=inv.request_id)
        )
