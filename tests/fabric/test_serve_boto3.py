"""``fabric serve`` as a plain boto3 Lambda client sees it (not the fabric client): the
fields Lambda tooling reads off ``lambda.invoke``'s response (``LogResult`` with
``LogType='Tail'``, ``ExecutedVersion``), a name qualifier at odds with ``Qualifier=``, the
shape of a service fault, and how a call cut by the server's drain is counted. A real boto3
client against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from typing import Any

import boto3
import httpx
import pytest
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import ClientError
from sample_fns import REG
from serve_helpers import PATH, TOKEN_A, auth, config

from fabric.backends.base import InprocConfig
from fabric.protocol import Invocation
from fabric.serve import Gateway
from fabric.testing import FakeBackend


def _lambda(g: Gateway) -> Any:
    """A boto3 Lambda client for ``g``: unsigned, with the tenant's bearer token, no retries."""
    client = boto3.session.Session().client(
        "lambda",
        region_name="us-east-1",
        endpoint_url=g.url,
        config=Config(signature_version=UNSIGNED, retries={"total_max_attempts": 1}, read_timeout=30),
    )

    def add_token(request: Any, **_: Any) -> None:
        request.headers["Authorization"] = f"Bearer {TOKEN_A}"

    client.meta.events.register("before-send.lambda.Invoke", add_token)
    return client


async def _invoke(client: Any, **kw: Any) -> dict[str, Any]:
    return await asyncio.to_thread(client.invoke, **kw)


@pytest.fixture
async def gw():
    async with Gateway(config(backend=InprocConfig()), REG) as g:
        yield g


class _Broken(FakeBackend):
    def _submit(self, inv: Invocation) -> asyncio.Future:
        raise RuntimeError("a bug in a backend")


async def test_a_fault_inside_the_server_is_a_service_error_not_a_user_one():
    """Lambda's ``ServiceException`` says ``"Type": "Service"``; the server's said ``User``."""
    async with Gateway(config(), REG, backend=_Broken(REG)) as g:
        with pytest.raises(ClientError) as e:
            await _invoke(_lambda(g), FunctionName="add", Payload=b'{"a": 1}')
        async with httpx.AsyncClient(base_url=g.url) as http:
            raw = await http.post(PATH.format("add"), json={"a": 1}, headers=auth())
    assert e.value.response["Error"]["Code"] == "ServiceException"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    assert raw.json()["Type"] == "Service"
