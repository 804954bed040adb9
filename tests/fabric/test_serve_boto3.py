"""``fabric serve`` as a plain boto3 Lambda client sees it (not the fabric client): the
fields Lambda tooling reads off ``lambda.invoke``'s response (``LogResult`` with
``LogType='Tail'``, ``ExecutedVersion``), a name qualifier at odds with ``Qualifier=``, the
shape of a service fault, and how a call cut by the server's drain is counted. A real boto3
client against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
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


@pytest.mark.parametrize("name,qualifier", [("add:live", "$LATEST"), ("add:v9", "live"), ("add:live", "v9")])
async def test_a_name_qualifier_at_odds_with_qualifier_is_400(gw, name, qualifier):
    """Lambda: 400 InvalidParameterValueException. The server took ``?Qualifier=`` and
    dropped the name's: ``add:v9`` with ``Qualifier=live`` ran, ``add:live`` with ``v9`` was 404."""
    client = _lambda(gw)
    with pytest.raises(ClientError) as e:
        await _invoke(client, FunctionName=name, Qualifier=qualifier, Payload=b'{"a": 1}')
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert e.value.response["Error"]["Code"] == "InvalidParameterValueException"
    assert "does not match" in e.value.response["Error"]["Message"]


async def test_the_same_qualifier_in_both_places_and_an_empty_one_are_served(gw):
    client = _lambda(gw)
    resp = await _invoke(client, FunctionName="add:live", Qualifier="live", Payload=b'{"a": 4}')
    assert json.loads(resp["Payload"].read()) == 4
    async with httpx.AsyncClient(base_url=gw.url) as http:  # boto3 sends no empty Qualifier
        r = await http.post(PATH.format("add") + "?Qualifier=", json={"a": 3}, headers=auth())
    assert r.status_code == 200 and r.json() == 3 and r.headers["X-Amz-Executed-Version"] == "$LATEST"
