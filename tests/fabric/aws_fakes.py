"""Helpers for the tests that speak to AWS's protocol: a free port, and a function made in
moto's Lambda (the control plane only: without Docker, moto's invoke echoes the payload)."""

from __future__ import annotations

import socket


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def create_function(url: str, name: str) -> None:
    """``name`` with a published version and a ``live`` alias, as a deploy leaves it."""
    import boto3

    iam = boto3.client("iam", endpoint_url=url, region_name="us-east-1")
    role = iam.create_role(RoleName="r", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    aws = boto3.client("lambda", endpoint_url=url, region_name="us-east-1")
    aws.create_function(
        FunctionName=name,
        Runtime="python3.11",
        Role=role,
        Handler="functions.handler.handler",
        Code={"ZipFile": b"PK\x05\x06" + b"\x00" * 18},
    )
    version = aws.publish_version(FunctionName=name)["Version"]
    aws.create_alias(FunctionName=name, Name="live", FunctionVersion=version)
