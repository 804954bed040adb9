"""The persistent session protocol between a pool and the server in a container.

One long-lived connection per session over a Unix socket; every frame is a 4-byte length
and a JSON object (any language can implement the server side):

    client -> server   {"op": "open", "token": T, "env_id": ..., "kwargs": {...}}
                       {"op": "reset" | "step" | "ping" | "close", "id": N, "token": T, "args": {...}}
                       {"op": "tool_result", "tool_id": K, "result": "..."}
    server -> client   {"id": N, "ok": true, "result": ...} | {"id": N, "ok": false, "error": {...}}
                       {"id": null, "ok": false, "error": {...}}   a request it could not read;
                                                     it hangs up (never retried: a bug of one side)
                       {"op": "heartbeat"}           while a request runs
                       {"op": "tool", "tool_id": K, "name": ..., "arguments": {...}}

Request ids pair each reply with its request; the server runs every request it reads and
keeps no replies. The pool never resends a request: one whose container fails (no reply, a
lost connection) has that container discarded, and a deterministic episode is replayed on a
fresh one and checked against what the policy saw, so a step never runs twice on one
environment and a server has no replies to remember.
A token other than the session's is refused, so one session can never drive another's
environment.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import pydantic_core

HEADER = struct.Struct("!I")
MAX_FRAME = 16 * 1024 * 1024
EXIT_IMAGE_NOT_FOUND = 66
"""The server's exit code when the image it was told to fetch is in none of its sources
(sysexits' EX_NOINPUT): a wrong reference, which the remote runtimes turn into
``ImageNotFound`` (never retried) rather than a failed start (retried, a pod per attempt)."""


def encode(msg: dict[str, Any]) -> bytes:
    body = pydantic_core.to_json(msg)
    return HEADER.pack(len(body)) + body


class FrameError(Exception):
    """A frame that is not valid protocol (bad length, not JSON): the connection ends."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (size,) = HEADER.unpack(recv_exact(sock, 4))
    if size > MAX_FRAME:
        raise FrameError(f"frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    msg = pydantic_core.from_json(recv_exact(sock, size))
    if not isinstance(msg, dict):
        raise FrameError("a frame must be a JSON object")
    return msg


class FrameDecoder:
    """Incremental decoder for the asyncio side."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        while len(buf) - pos >= 4:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > MAX_FRAME:
                raise FrameError(f"frame of {size} bytes is over the {MAX_FRAME}-byte limit")
            if len(buf) - pos - 4 < size:
                break
            msg = pydantic_core.from_json(bytes(buf[pos + 4 : pos + 4 + size]))
            if not isinstance(msg, dict):
                raise FrameError("a frame must be a JSON object")
            out.append(msg)
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out


def error_payload(exc: BaseException, *, traceback: str | None = None) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), "traceback": traceback}
