"""``fabric serve`` against careless and hostile callers: requests that used to crash a
handler (500 with a traceback), hold memory past a tenant's quota, or answer in a shape
boto3 does not know. Real HTTP on 127.0.0.1, real local pools where a call must run."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from sample_fns import REG

from fabric.backends.base import LocalConfig
from fabric.protocol import Invocation
from fabric.serve import Gateway, ServeConfig, TenantConfig
from fabric.testing import FakeBackend

TOKEN_A = "token-a-0123456789abcdef"
TOKEN_B = "token-b-0123456789abcdef"
PATH = "/2015-03-31/functions/{}/invocations"


def config(**kw) -> ServeConfig:
    tenants = kw.pop(
        "tenants",
        {
            "job-a": TenantConfig(token=TOKEN_A, max_concurrency=kw.pop("quota_a", 64)),
            "job-b": TenantConfig(token=TOKEN_B, max_concurrency=64),
        },
    )
    kw.setdefault("warm", False)
    kw.setdefault("backend", LocalConfig(max_workers=2))
    return ServeConfig(port=0, tenants=tenants, **kw)


def auth(token: str = TOKEN_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
async def gw():
    async with Gateway(config(), REG) as g:
        yield g


@pytest.fixture
async def http(gw):
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("deadline", [b"NaN", b"Infinity", b"-Infinity", b"1e300", b"-1e300", b'"inf"'])
async def test_a_deadline_that_is_no_time_is_400_not_a_crash(gw, http, deadline):
    # the pool turned it into nanoseconds: OverflowError, a 500 the lambda backend retried
    body = b'{"function": "add", "payload": {"a": 1}, "deadline": ' + deadline + b"}"
    r = await http.post(PATH.format("add"), content=body, headers=auth())
    assert r.status_code == 400, r.text
    assert r.headers["x-amzn-ErrorType"] == "InvalidRequestContentException"
    assert "deadline" in r.json()["message"]
    assert gw.quotas.held["job-a"] == 0
    assert (await http.post(PATH.format("add"), json={"a": 2}, headers=auth())).json() == 2


class _Broken(FakeBackend):
    def _submit(self, inv: Invocation) -> asyncio.Future:
        raise RuntimeError("a bug in a backend")


async def test_a_bug_inside_the_server_is_a_json_service_exception(caplog):
    async with (
        Gateway(config(), REG, backend=_Broken(REG)) as g,
        httpx.AsyncClient(base_url=g.url, timeout=30) as c,
    ):
        r = await c.post(PATH.format("add"), json={"a": 1}, headers=auth())
        # botocore reads the code from x-amzn-ErrorType: boto3 raises ServiceException, and
        # the lambda backend maps a 5xx to a retryable TransportError
        assert r.status_code == 500 and r.headers["x-amzn-ErrorType"] == "ServiceException"
        assert r.headers["x-amzn-RequestId"] in r.json()["message"]
        assert g.quotas.held["job-a"] == 0 and g._gates["add"].running == 0
    assert "a bug in a backend" in caplog.text  # logged once, with the traceback
