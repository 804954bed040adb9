"""What test_lambda_backend.py and test_lambda_backend_transport.py share: fabric serve's
token, a lambda config for a gateway, and the ``transport`` fixture (http and boto3: a
module imports ``transport_fixture``, known to pytest by ``name=``)."""

from __future__ import annotations

import pytest

from fabric.backends.base import LambdaConfig
from fabric.serve import Gateway

TOKEN = "lambda-test-token-0123456789"


@pytest.fixture(params=["http", "boto3"], name="transport")
def transport_fixture(request) -> str:
    return request.param


def lam(gw: Gateway, transport: str = "auto", **kw) -> LambdaConfig:
    return LambdaConfig(endpoint_url=gw.url, token=kw.pop("token", TOKEN), transport=transport, **kw)
