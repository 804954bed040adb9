"""Helpers for the tests that speak to AWS's protocol: a free port, a function made in
moto's Lambda (the control plane only: without Docker, moto's invoke echoes the payload),
and an Invoke API endpoint that answers every call with one fixed body."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator


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


@contextlib.asynccontextmanager
async def fixed_reply_endpoint(
    body: bytes, function_error: str | None = None, hits: list[int] | None = None
) -> AsyncIterator[str]:
    """An Invoke API endpoint on 127.0.0.1 whose every call answers 200 with ``body`` whole
    (its Content-Length), and ``X-Amz-Function-Error`` when given (as Lambda sends with its
    own error objects); ``hits``, when given, counts the calls."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:  # keep-alive: one connection may carry several calls
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if hits is not None:
                    hits.append(1)
                extra = f"X-Amz-Function-Error: {function_error}\r\n" if function_error else ""
                writer.write(
                    (
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        f"{extra}Content-Length: {len(body)}\r\n\r\n"
                    ).encode()
                    + body
                )
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()
