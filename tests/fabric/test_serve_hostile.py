"""``fabric serve`` against a hostile tenant, over real sockets on 127.0.0.1: a compressed
body (a megabyte that inflates to a gigabyte on the server's one event loop), ``/metrics``
requests past the tenant's ``max_rps``, function names percent-encoded twice, and a token
in the log line of a malformed header."""

from __future__ import annotations

import asyncio
import gzip
import logging

import httpx
import pytest
from sample_fns import REG
from serve_helpers import PATH, TOKEN_A, auth, config

from fabric.backends.base import InprocConfig
from fabric.serve import Gateway, TenantConfig


@pytest.fixture
async def gw():
    async with Gateway(config(backend=InprocConfig()), REG) as g:
        yield g


@pytest.fixture
async def http(gw):
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "GZIP"])
async def test_a_compressed_body_is_refused_before_it_is_inflated(gw, http, encoding):
    """aiohttp inflated a ``Content-Encoding`` body by itself: 1 MB of gzip is 1 GB of
    zeros, inflated on the server's one event loop (and inflated on to its end after a 413,
    as aiohttp drains a body not read), some seconds of CPU per request that the tenant's
    quota did not bound: four such requests held another tenant's call for 9 s. No Lambda
    client compresses an Invoke body (boto3 does not, nor the lambda backend); Lambda reads
    the bytes as they come, and they are not JSON."""
    body = gzip.compress(b'{"a": 1}')
    r = await http.post(PATH.format("add"), content=body, headers={**auth(), "Content-Encoding": encoding})
    assert r.status_code == 400, r.text
    assert r.headers["x-amzn-ErrorType"] == "InvalidRequestContentException"
    assert "content-encoding" in r.json()["message"].lower()
    assert r.headers.get("connection", "").lower() == "close"  # the body is not read, nor drained
    assert gw.quotas.held["job-a"] == 0


async def test_a_body_that_says_it_is_not_encoded_is_served(http):
    r = await http.post(PATH.format("add"), json={"a": 3}, headers={**auth(), "Content-Encoding": "identity"})
    assert r.status_code == 200 and r.json() == 3


async def test_a_compressed_body_is_not_read_at_all(gw):
    """Refused on its headers: the answer comes with none of the body sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(
            b"POST " + PATH.format("add").encode() + b" HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + TOKEN_A.encode() + b"\r\nContent-Encoding: gzip\r\n"
            b"Content-Length: 1000000\r\n\r\n"
        )
        await writer.drain()
        reply = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # the answer's head
    finally:
        writer.close()
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert b"InvalidRequestContentException" in reply and b"Connection: close" in reply


async def test_metrics_requests_are_paced_by_the_tenants_max_rps():
    """``max_rps`` paced invocations only: a tenant "you do not control" could ask for
    ``/metrics`` as fast as it liked, each answer a render of every series, far dearer than
    the refused call that pacing exists to spare the server's one core."""
    tenants = {"job-a": TenantConfig(token=TOKEN_A, max_rps=2)}
    async with (
        Gateway(config(tenants=tenants, backend=InprocConfig()), REG) as g,
        httpx.AsyncClient(base_url=g.url, timeout=30) as c,
    ):
        for _ in range(2):
            assert (await c.get("/metrics", headers=auth())).status_code == 200
        assert g.rates.delayed["job-a"] == 1  # the second waited for its turn
        text = (await c.get("/metrics", headers=auth())).text
        assert 'fabric_serve_tenant_delayed_total{tenant="job-a"} 2.0' in text


async def test_metrics_requests_far_over_max_rps_are_refused():
    tenants = {"job-a": TenantConfig(token=TOKEN_A, max_rps=0.1)}  # 10 s apart: past 5 s of backlog
    async with (
        Gateway(config(tenants=tenants, backend=InprocConfig()), REG) as g,
        httpx.AsyncClient(base_url=g.url, timeout=30) as c,
    ):
        replies = await asyncio.gather(*(c.get("/metrics", headers=auth()) for _ in range(3)))
        refused = [r for r in replies if r.status_code == 429]
        assert len(refused) == 2 and all(
            r.headers["x-amzn-ErrorType"] == "TooManyRequestsException" for r in refused
        )
        assert g.quotas.throttled["job-a"] == len(refused)


@pytest.mark.parametrize(("sent", "named"), [("%2561dd", "%61dd"), ("add%253Alive", "add%3Alive")])
async def test_a_function_name_is_percent_decoded_once(http, sent, named):
    """aiohttp hands the route's ``{name}`` over decoded; the server decoded it again, so the
    name ``%61dd`` (boto3 sends it as ``%2561dd``) ran ``add``, and a 404 named another name
    than the one asked for."""
    r = await http.post(f"/2015-03-31/functions/{sent}/invocations", json={"a": 1}, headers=auth())
    assert r.status_code == 404, r.text
    assert f"Function not found: {named} " in r.json()["message"]


async def test_a_name_and_qualifier_sent_encoded_as_boto3_sends_them_are_served(http):
    # botocore percent-encodes the ARN's colons: aiohttp decodes them, once
    arn = "arn%3Aaws%3Alambda%3Aus-east-1%3A123456789012%3Afunction%3Aadd%3Alive"
    r = await http.post(f"/2015-03-31/functions/{arn}/invocations", json={"a": 6}, headers=auth())
    assert r.status_code == 200 and r.json() == 6


@pytest.mark.parametrize("header", [b"Authorization", b"authorization", b"Proxy-Authorization"])
async def test_a_malformed_authorization_header_is_logged_without_its_token(gw, http, caplog, header):
    """aiohttp's reason for refusing a header line quotes the line: a client whose header
    ends in a stray control character had its (otherwise valid) token written to the
    server's log, at DEBUG."""
    caplog.set_level(logging.DEBUG)
    reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    try:
        writer.write(
            b"POST "
            + PATH.format("add").encode()
            + b" HTTP/1.1\r\nHost: x\r\n"
            + header
            + b": Bearer "
            + TOKEN_A.encode()
            + b"\x01\r\nContent-Length: 2\r\n\r\n{}"
        )
        await writer.drain()
        await asyncio.wait_for(reader.read(), 30)  # the 400, then the server hangs up
    finally:
        writer.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "fabric.serve"]
    assert any("malformed HTTP request" in m and "Invalid header value" in m for m in lines), lines
    assert TOKEN_A not in caplog.text and TOKEN_A[:8] not in caplog.text


def test_the_installed_aiohttp_lets_the_server_keep_bodies_compressed():
    """Without ``auto_decompress`` (a later aiohttp may drop it) a compressed body the server
    refused is still inflated as aiohttp drains it: the refusal holds, the cost comes back."""
    from fabric.serve.app import _NO_INFLATING

    assert _NO_INFLATING == {"auto_decompress": False}
