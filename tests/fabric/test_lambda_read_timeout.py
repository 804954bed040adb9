"""The lambda backend's read timeout is the call's own: a connection that never answers is
given up when the call's time is up (its deadline, or its function's ``timeout_s`` plus a
margin), not after a fixed 910 s; boto3 gets a client per read-timeout step."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from lambda_helpers import TOKEN, transport_fixture  # noqa: F401 - by name=

from fabric.backends import lambda_
from fabric.backends.base import LambdaConfig
from fabric.backends.lambda_ import LambdaBackend
from fabric.errors import ErrorCode
from fabric.protocol import Invocation
from fabric.registry import Registry


@contextlib.asynccontextmanager
async def silent_endpoint() -> AsyncIterator[str]:
    """An Invoke endpoint on 127.0.0.1 that reads each request and never answers (a hung
    connection); its URL. Closing it ends the connections, and so any thread still reading."""
    closing = asyncio.Event()
    writers: set[asyncio.StreamWriter] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.add(writer)
        try:
            await reader.readuntil(b"\r\n\r\n")
            await closing.wait()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client hung up
        finally:
            writers.discard(writer)
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        closing.set()
        for w in list(writers):
            w.close()
        server.close()
        await server.wait_closed()


def _registry() -> Registry:
    reg = Registry()

    @reg.function(name="judge", warm=0, timeout_s=60)
    def judge() -> int:
        return 1

    return reg


async def test_a_hung_connection_is_given_up_when_the_calls_deadline_passes(transport):
    """The endpoint took the call and never answers. The backend waited the fixed
    read_timeout_s, 910 s, for its reply, holding a thread and a connection for 15 minutes
    after the caller's deadline. It gives up soon after the deadline now (a read timeout
    derived from it), and says the deadline passed, not that the function ran too long."""
    async with silent_endpoint() as url:
        cfg = LambdaConfig(endpoint_url=url, token=TOKEN, transport=transport)
        async with LambdaBackend(_registry(), cfg) as b:
            inv = Invocation(function="judge", payload={}, deadline=time.time() + 0.5)
            # bounded, so that the old behaviour fails here instead of hanging for 910 s
            r = await asyncio.wait_for(b.invoke(inv), 60)
    assert r.error is not None and r.error.type == ErrorCode.DEADLINE_EXCEEDED, r.error
    assert r.started is True  # sent: it may run on the far side
    assert "deadline" in r.error.message


async def test_the_read_timeout_follows_the_functions_timeout_and_the_ceiling(monkeypatch):
    """No deadline (a keyed execution's call goes without one): on AWS Lambda, the function's
    ``timeout_s`` plus the margin for a cold start, rounded up to a step; never past
    ``read_timeout_s``. A ``fabric serve`` (a token) queues calls, bounded by their deadline
    only: a call without one gets the ceiling there."""
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    reg = _registry()
    aws = LambdaConfig(endpoint_url="http://127.0.0.1:9", transport="boto3")  # moto-style: signed
    b = LambdaBackend(reg, aws)
    read_s, by_deadline = b._read_limit(Invocation(function="judge", payload={}))
    assert not by_deadline and read_s is not None
    assert 60 + lambda_._READ_MARGIN_S <= read_s < 910
    keyed = Invocation(function="judge", payload={}, deadline=time.time() + 1, wait_for_run=True)
    assert b._read_limit(keyed) == (read_s, False)  # sent with no deadline: its run's time
    # a function this client does not know: the configured ceiling
    assert b._read_limit(Invocation(function="other", payload={})) == (None, False)
    low = LambdaConfig(endpoint_url="http://127.0.0.1:9", transport="boto3", read_timeout_s=30)
    assert LambdaBackend(reg, low)._read_limit(Invocation(function="judge", payload={})) == (None, False)
    served = LambdaBackend(reg, LambdaConfig(endpoint_url="http://127.0.0.1:9", token=TOKEN))
    assert served._read_limit(Invocation(function="judge", payload={})) == (None, False)
    soon = Invocation(function="judge", payload={}, deadline=time.time() + 1)
    assert served._read_limit(soon) == (2.0, True)  # the deadline bounds it there too


async def test_boto3_gets_a_client_per_read_timeout_step():
    """botocore takes its read timeout per client: a call's step has a client of its own,
    made once and shared by the calls of that step; the ceiling is the first client."""
    cfg = LambdaConfig(endpoint_url="http://127.0.0.1:9", token=TOKEN, transport="boto3")
    async with LambdaBackend(_registry(), cfg) as b:
        assert b._client.meta.config.read_timeout == cfg.read_timeout_s
        assert b._client_for(None) is b._client
        two = await asyncio.to_thread(b._client_for, 2.0)
        assert two.meta.config.read_timeout == 2.0 and two is not b._client
        assert await asyncio.to_thread(b._client_for, 2.0) is two
        assert (await asyncio.to_thread(b._client_for, 5.0)).meta.config.read_timeout == 5.0
        assert len(b._clients) == 2
