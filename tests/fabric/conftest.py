from __future__ import annotations

import pytest
from aws_fakes import free_port


@pytest.fixture
def aws_env(monkeypatch):
    """Fake credentials, and no fabric serve token: boto3 signs as against AWS."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)


@pytest.fixture
def moto_url(aws_env):
    """A moto server on 127.0.0.1 (Lambda, IAM, S3, ...), emptied first."""
    import httpx
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        # moto's state is per process, not per server: start from nothing. Without Docker
        # moto creates functions but cannot run them (invoke echoes the payload)
        httpx.post(f"{url}/moto-api/reset")
        httpx.post(f"{url}/moto-api/config", json={"lambda": {"use_docker": False}})
        yield url
    finally:
        server.stop()
