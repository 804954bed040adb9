"""``fabric serve``'s connections, over real sockets on 127.0.0.1: a tenant holds at most
``max_connections`` of them (its oldest idle ones go when it opens more; with every one busy,
a new one is refused), an idle connection closes after ``keepalive_s``, and a refused
request's connection (no valid token, over the bound, a compressed body) closes with its answer.

aiohttp bounds neither the number of a server's connections nor, in practice, how long an
idle one stays: its keep-alive timeout is an hour (3630 s), and counts from a connection's
opening, so one that never sends a request is kept as long."""

from __future__ import annotations

import asyncio
import json
import re
from contextlib import AsyncExitStack

import httpx
import pytest
from pydantic import ValidationError
from sample_fns import REG
from serve_helpers import PATH, TOKEN_A, TOKEN_B, config

from fabric.backends.base import InprocConfig
from fabric.serve import Gateway, TenantConfig

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _head(token: str, length: int) -> bytes:
    return (
        f"POST {PATH.format('add')} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


async def _answer(conn: Stream) -> tuple[int, bytes]:
    reader, _ = conn
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length is not None, head
    return int(head.split()[1]), await reader.readexactly(int(length.group(1)))


async def _call(conn: Stream, token: str = TOKEN_A, a: int = 1) -> tuple[int, bytes]:
    body = b'{"a": %d}' % a
    conn[1].write(_head(token, len(body)) + body)
    return await _answer(conn)


async def _closed_by_server(conn: Stream, within: float = 30) -> bool:
    """Whether the server closed ``conn`` (its FIN arrives ``within`` seconds)."""
    try:
        return await asyncio.wait_for(conn[0].read(), within) == b""
    except (TimeoutError, ConnectionError):
        return False


async def _connections(g: Gateway, stack: AsyncExitStack, n: int) -> list[Stream]:
    out = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", g.port)
        stack.callback(writer.close)
        out.append((reader, writer))
    return out


def _open_on_server(g: Gateway) -> int:
    assert g._runner is not None and g._runner.server is not None
    return len(g._runner.server.connections)


async def test_a_tenant_holds_at_most_twice_its_quota_of_idle_connections_by_default():
    # (every one stayed open: one token held thousands, and the server's file descriptors with them)
    tenants = {"job-a": TenantConfig(token=TOKEN_A, max_concurrency=2), "job-b": TenantConfig(token=TOKEN_B)}
    assert tenants["job-a"].connection_limit == 4
    async with AsyncExitStack() as stack:
        g = await stack.enter_async_context(Gateway(config(tenants=tenants, backend=InprocConfig()), REG))
        conns = await _connections(g, stack, 6)
        for i, conn in enumerate(conns):
            assert await _call(conn, a=i) == (200, str(i).encode())
        # the two least recently used went when the fifth and the sixth came
        assert [await _closed_by_server(c) for c in conns[:2]] == [True, True]
        for i, conn in enumerate(conns[2:]):  # the rest are as good as before
            assert await _call(conn, a=i) == (200, str(i).encode())
        assert _open_on_server(g) == 4
        # another tenant's connections are its own
        (other,) = await _connections(g, stack, 1)
        assert await _call(other, TOKEN_B) == (200, b"1")
        assert _open_on_server(g) == 5


async def test_a_busy_connection_is_not_taken_and_one_past_the_bound_is_refused():
    tenants = {
        "job-a": TenantConfig(token=TOKEN_A, max_concurrency=8, max_connections=2),
        "job-b": TenantConfig(token=TOKEN_B),
    }
    async with AsyncExitStack() as stack:
        g = await stack.enter_async_context(Gateway(config(tenants=tenants, backend=InprocConfig()), REG))
        busy = await _connections(g, stack, 2)
        for _, writer in busy:  # a request whose body has not all come: busy, not idle
            writer.write(_head(TOKEN_A, 8) + b'{"a":')
        for _ in range(500):
            if g.quotas.held["job-a"] == 2:
                break
            await asyncio.sleep(0.01)
        assert g.quotas.held["job-a"] == 2
        (third,) = await _connections(g, stack, 1)
        status, body = await _call(third)
        assert status == 429 and b"max_connections" in body, body
        assert json.loads(body)["Reason"] == "ConcurrentInvocationLimitExceeded"  # as Lambda's
        assert await _closed_by_server(third)
        for _, writer in busy:  # the busy ones were left alone: their calls end as they would
            writer.write(b" 7}")
        assert [await _answer(c) for c in busy] == [(200, b"7"), (200, b"7")]
        # idle now: a new connection takes the place of the one used least recently
        (fourth,) = await _connections(g, stack, 1)
        assert await _call(fourth) == (200, b"1")
        assert await _closed_by_server(busy[0])
        assert await _call(busy[1]) == (200, b"1")


async def test_a_connection_moves_to_the_tenant_of_its_latest_request():
    # a proxy in front of the server sends every tenant's requests over its own connections
    tenants = {
        "job-a": TenantConfig(token=TOKEN_A, max_connections=1),
        "job-b": TenantConfig(token=TOKEN_B, max_connections=1),
    }
    async with AsyncExitStack() as stack:
        g = await stack.enter_async_context(Gateway(config(tenants=tenants, backend=InprocConfig()), REG))
        shared, own = await _connections(g, stack, 2)
        assert await _call(shared, TOKEN_A) == (200, b"1")
        assert await _call(shared, TOKEN_B) == (200, b"1")  # job-b's now, not job-a's too
        assert await _call(own, TOKEN_A) == (200, b"1")  # job-a's one: nothing to close
        assert await _call(shared, TOKEN_B) == (200, b"1")
        assert _open_on_server(g) == 2


async def test_an_idle_connection_closes_after_keepalive_s():
    async with AsyncExitStack() as stack:
        g = await stack.enter_async_context(Gateway(config(backend=InprocConfig(), keepalive_s=0.2), REG))
        used, never = await _connections(g, stack, 2)
        assert await _call(used) == (200, b"1")
        # one that never sent a request goes too: it is nobody's, and bounded only by time
        assert await _closed_by_server(used) and await _closed_by_server(never)


def test_connection_bounds_are_checked():
    with pytest.raises(ValidationError, match="max_connections"):
        TenantConfig(token=TOKEN_A, max_connections=0)
    with pytest.raises(ValidationError, match="keepalive_s"):
        config(keepalive_s=0)


_REFUSED = {
    "no token": b"",
    "a wrong token": b"Authorization: Bearer not-a-token-of-anyone\r\n",
    "a compressed body": f"Authorization: Bearer {TOKEN_A}\r\nContent-Encoding: gzip\r\n".encode(),
    "over max_connections": f"Authorization: Bearer {TOKEN_A}\r\n".encode(),
    "a body over max_body_bytes": f"Authorization: Bearer {TOKEN_A}\r\n".encode(),
}


async def _refused(g: Gateway, stack: AsyncExitStack, why: str, body: bytes, length: int) -> Stream:
    """A connection whose request is refused for ``why``, ``body`` of its ``length`` sent."""
    if why == "over max_connections":  # job-a's one connection busy: its body has not all come
        (busy,) = await _connections(g, stack, 1)
        busy[1].write(_head(TOKEN_A, 8) + b'{"a":')
        for _ in range(500):
            if g.quotas.held["job-a"] == 1:
                break
            await asyncio.sleep(0.01)
        assert g.quotas.held["job-a"] == 1
    (conn,) = await _connections(g, stack, 1)
    conn[1].write(
        f"POST {PATH.format('add')} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n".encode()
        + _REFUSED[why]
        + b"\r\n"
        + body
    )
    return conn


@pytest.mark.parametrize("why", list(_REFUSED))
async def test_a_refused_request_s_connection_closes_without_reading_its_body(why):
    """Answered ``Connection: close``, a refused request's connection stayed open while
    aiohttp read on what it could of the body, for up to 10 s (its ``lingering_time``): one
    over ``max_connections`` held a socket it was refused, and a client without a token held
    as many as it opened. A body over the limit (413) was read and dropped for as long, on
    the server's one event loop, the connection kept if it all came. It closes once the
    answer is written."""
    tenants = {"job-a": TenantConfig(token=TOKEN_A, max_connections=1), "job-b": TenantConfig(token=TOKEN_B)}
    async with AsyncExitStack() as stack:
        g = await stack.enter_async_context(Gateway(config(tenants=tenants, backend=InprocConfig()), REG))
        conn = await _refused(g, stack, why, b'{"a": ', 10_000_000)  # over the 6 MB
        status, _ = await _answer(conn)
        assert status in (400, 401, 403, 413, 429)
        # well within aiohttp's 10 s: closed as the answer went, not after the lingering
        assert await _closed_by_server(conn, within=5)


@pytest.mark.parametrize("why", ["no token", "a wrong token"])
async def test_a_request_without_a_valid_token_does_not_keep_its_connection(why):
    """Its whole request sent, one without a valid token kept its connection as a keep-alive
    one, for ``keepalive_s``: counted against no tenant's ``max_connections`` (it has none),
    so a client without a token held as many as it opened. Closed with its 401 or 403."""
    async with AsyncExitStack() as stack:
        g = await stack.enter_async_context(Gateway(config(backend=InprocConfig(), keepalive_s=300), REG))
        conn = await _refused(g, stack, why, b'{"a": 1}', 8)
        status, _ = await _answer(conn)
        assert status in (401, 403)
        assert await _closed_by_server(conn)


@pytest.mark.parametrize("why", ["a wrong token", "a body over max_body_bytes"])
async def test_a_refusal_reaches_a_client_that_sends_its_whole_body_before_it_reads(why):
    """httpx (the lambda backend's http transport) and boto3 write a request whole before
    they read: a connection closed with their body unread is reset under them, and the
    answer with it (a ReadError, not the 403 or 413). The body still coming is read and
    dropped, and the connection closes when it has all come."""
    token = "not-a-token-of-anyone" if why == "a wrong token" else TOKEN_A
    size = 7 * 1024 * 1024 if why == "a body over max_body_bytes" else 5 * 1024 * 1024
    async with Gateway(config(backend=InprocConfig()), REG) as g, httpx.AsyncClient(base_url=g.url) as http:
        for _ in range(3):
            r = await http.post(
                PATH.format("add"), content=b"x" * size, headers={"Authorization": f"Bearer {token}"}
            )
            assert r.status_code == (403 if why == "a wrong token" else 413)
            assert r.headers["connection"] == "close"
