"""A 429's ``Retry-After`` through both transports to the client's wait: the next attempt
comes no sooner than the server said, and a deadline that would pass first ends the call
with the throttle now. The gaps are measured where the requests arrive, at a stand-in that
answers as ``fabric serve`` does past a tenant's ``max_rps``."""

from __future__ import annotations

import asyncio
import json
import time

from lambda_helpers import TOKEN, transport_fixture  # noqa: F401 - by name=
from sample_fns import REG

from fabric.backends.base import LambdaConfig
from fabric.backends.lambda_ import LambdaBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation

_THROTTLED = json.dumps(
    {"__type": "TooManyRequestsException", "message": "Rate exceeded", "Reason": "CallerRateLimitExceeded"}
).encode()


class _StandIn:
    """Answers the first ``refuse`` requests 429 with ``Retry-After`` (as fabric serve does),
    the rest 200 with a plain value; keeps each request's arrival time."""

    def __init__(self, refuse: int, retry_after: str = "1") -> None:
        self.refuse = refuse
        self.retry_after = retry_after
        self.arrivals: list[float] = []
        self._server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                await reader.readexactly(length)
                self.arrivals.append(time.monotonic())
                if len(self.arrivals) <= self.refuse:
                    status, extra, body = (
                        "429 Too Many Requests",
                        f"x-amzn-ErrorType: TooManyRequestsException\r\nRetry-After: {self.retry_after}\r\n",
                        _THROTTLED,
                    )
                else:
                    status, extra, body = "200 OK", "", b"3"
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
                    f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def config(self, transport: str) -> LambdaConfig:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return LambdaConfig(endpoint_url=f"http://127.0.0.1:{port}", token=TOKEN, transport=transport)

    async def __aenter__(self) -> _StandIn:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


async def test_a_throttle_carries_the_servers_retry_after(transport):
    async with (
        _StandIn(refuse=1, retry_after="2") as server,
        LambdaBackend(REG, server.config(transport)) as b,
    ):
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error is not None and r.error.type == ErrorCode.THROTTLED and r.retryable
    assert r.error.retry_after_s == 2.0


async def test_a_throttle_without_a_usable_retry_after_says_none(transport):
    # HTTP's other form (a date) and garbage: the client's own backoff, as before
    for said in ("Wed, 21 Oct 2015 07:28:00 GMT", "-1", "nan"):
        async with (
            _StandIn(refuse=1, retry_after=said) as server,
            LambdaBackend(REG, server.config(transport)) as b,
        ):
            r = await b.invoke(Invocation(function="add", payload={"a": 1}))
        assert r.error is not None and r.error.type == ErrorCode.THROTTLED
        assert r.error.retry_after_s is None, said


async def test_the_next_attempt_waits_the_servers_retry_after(transport):
    """The client's own backoff (0.05 s scale, capped at 2 s) sent the retry within a tenth of
    a second, refused again by a server that had said to wait a second."""
    async with (
        _StandIn(refuse=1, retry_after="1") as server,
        Client(backend=server.config(transport), registry=REG, config={"hedge": {"enabled": False}}) as c,
    ):
        r = await c.call("add", {"a": 1})
    assert r.ok and r.value == 3 and r.attempts == 2, r.error
    first, second = server.arrivals
    assert second - first >= 1.0, f"retried {second - first:.3f} s after a 429 that said 1 s"


async def test_a_deadline_before_the_retry_after_ends_the_call_throttled_now(transport):
    async with (
        _StandIn(refuse=3, retry_after="5") as server,
        Client(backend=server.config(transport), registry=REG, config={"hedge": {"enabled": False}}) as c,
    ):
        r = await c.call("add", {"a": 1}, deadline_s=2.0)
    assert len(server.arrivals) == 1  # nothing sent into the 5 s the server asked for
    assert r.error is not None and r.error.type == ErrorCode.THROTTLED, r.error
    assert r.attempts == 1 and "the deadline left no time for attempt 2" in r.error.message
