"""The persistent session protocol between a pool and the server in a container.

One long-lived connection per session over a Unix socket; every frame is a 4-byte length
and a JSON object (any language can implement the server side):

    client -> server   {"op": "open", "token": T, "env_id": ..., "kwargs": {...}}
                       {"op": "reset" | "step" | "ping" | "close", "id": N, "token": T, "args": {...}}
                       {"op": "tool_result", "tool_id": K, "result": "..."}
    server -> client   {"id": N, "ok": true, "result": ...} | {"id": N, "ok": false, "error": {...}}
                       {"id": null, "ok": false, "error": {...}}   a request it could not read;
                                                     it hangs up (never retried: a bug of one side)
                       {"op": "heartbeat"}           while a request runs; during an open,
                                                     {"op": "heartbeat", "phase": "close"} while
                                                     it closes the previous environment
                       {"op": "tool", "tool_id": K, "name": ..., "arguments": {...}}

Request ids pair each reply with its request; the server runs every request it reads and
keeps no replies. The pool never resends a request: one whose container fails (no reply, a
lost connection) has that container discarded, and a deterministic episode is replayed on a
fresh one and checked against what the policy saw, so a step never runs twice on one
environment and a server has no replies to remember. A server waiting on a tool's result
keeps the requests that arrive meanwhile (a session's close, sent while its step runs) and
runs them after the request under way.
Results: an open's is an object (``deterministic``: bool and ``max_action_bytes``: int > 0,
each optional, may be in it), a reset's ``{"obs": {"text": ..., "tools": [...] | null},
"info": {...} | null}``, a step's ``{"obs": ..., "reward": number, "terminated": bool,
"truncated": bool, "info": {...}}``; an error is ``{"type": str, "message": str,
"traceback": str | null}``, read by its type's name (``ProtocolError``, ``ActionError``,
``EnvOrderError``, ... are the pool's own) unless it adds ``"logic": true``: an exception the
environment's code raised, whatever its class is called (envpool's server marks every one;
the environment's own ``ProtocolError`` is no protocol bug, and is part of the episode). A
failed open's error may add ``"reusable": true``: the server
is sound after it (a clean error of the environment's constructor or of its lookup), and
its container is given to the next session; without it the container is replaced (envpool's
server leaves it off after a MemoryError or an OSError but one that only says a path the
caller named is wrong: ``envpool.server.sound_after``). So may a failed reset's or step's
error the environment raised: without it the episode goes on, on that container (the error
is part of it), but the container runs no other episode (retired at the next reset or at
the session's end).

The pool checks every reply against this (``reply_problem``, and the session the results'
shapes): one that breaks it (no ``ok`` bool, a missing result, an id it never sent, a
result of the wrong shape), whether a request waits for it or not (a stray reply between
requests fails the next one), is a ``ProtocolError`` that names what is wrong, never
retried; the connection ends, the container is discarded and the episode is over. So is a
frame that is no frame (``GarbledFrame``: a length prefix over ``MAX_FRAME``, often text a
server printed to the socket, or a body that is not a JSON object): not a lost connection,
since the server read the request and may have run it, and a retry could run a step twice.

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


def array_value(value: Any) -> Any:
    """pydantic-core's ``fallback`` for a value it cannot write: a numpy, torch or jax scalar
    or array as its value (``tolist()``), as the fabric's protocol sends it, and a
    ``TypeError`` for anything else. The fabric's own function, imported on first use: the
    fabric's import costs a container's start about 0.2 s, and only an environment that
    hands such values over needs it."""
    from fabric.protocol import array_fallback

    return array_fallback(value)


def encode(msg: dict[str, Any]) -> bytes:
    body = pydantic_core.to_json(msg, fallback=array_value)
    return HEADER.pack(len(body)) + body


class FrameError(Exception):
    """A frame that is not valid protocol (bad length, not JSON): the connection ends.
    ``data``: the first bytes received of it, its length prefix included (what was sent
    instead of a frame is the first thing to look at)."""

    def __init__(self, message: str, data: bytes = b"", *, too_large: bool = False):
        super().__init__(message)
        self.data = data
        self.too_large = too_large
        """A well-formed frame by its start (a JSON object follows the length) that is only
        over ``MAX_FRAME``: a reply too big, not stray output."""
        self.frames: list[dict[str, Any]] = []
        """The whole frames ``FrameDecoder.feed`` decoded before this one in the same read:
        sent before the garbage, they are what the server meant (a reply, then a stray print)."""


SHOWN = 120
"""How many bytes of a garbled frame an error shows: enough to recognise a print or a log
line, not a 16 MiB body."""


def _oversize(size: int, data: bytes) -> FrameError:
    if data[HEADER.size :].lstrip()[:1] == b"{":  # a frame after all: only too big
        return FrameError(
            f"a frame of {size:,} bytes, over the {MAX_FRAME:,}-byte limit; a JSON object by its start",
            data[:SHOWN],
            too_large=True,
        )
    return FrameError(f"a length prefix of {size:,} bytes, over the {MAX_FRAME:,}-byte limit", data[:SHOWN])


def _decode(header: bytes, body: bytes) -> dict[str, Any]:
    """The object a frame's ``body`` holds, or a ``FrameError`` showing the frame's start."""
    try:
        msg = pydantic_core.from_json(body)
    except ValueError as e:
        problem = f"a {len(body):,}-byte body that is not JSON ({e})"
    else:
        if isinstance(msg, dict):
            return msg
        problem = f"a {len(body):,}-byte body that is a JSON {type(msg).__name__}, not an object"
    raise FrameError(problem, header + body[: SHOWN - len(header)])


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    header = recv_exact(sock, HEADER.size)
    (size,) = HEADER.unpack(header)
    if size > MAX_FRAME:
        raise _oversize(size, header)
    return _decode(header, recv_exact(sock, size))


class FrameDecoder:
    """Incremental decoder for the asyncio side."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        try:
            while len(buf) - pos >= HEADER.size:
                (size,) = HEADER.unpack_from(buf, pos)
                if size > MAX_FRAME:
                    raise _oversize(size, bytes(buf[pos : pos + SHOWN]))
                start = pos + HEADER.size
                if len(buf) < start + size:
                    break
                out.append(_decode(bytes(buf[pos:start]), bytes(buf[start : start + size])))
                pos = start + size
        except FrameError as e:
            e.frames = out  # nothing after it can be framed; what came before it stands
            raise
        if pos:
            del buf[:pos]
        return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def reply_problem(msg: dict[str, Any], outstanding: set[int]) -> str | None:
    """What is wrong with a reply to a request, said as the end of "the reply to request
    N ...", or None if it keeps the protocol. ``outstanding``: the ids this connection sent
    and has no reply to yet. Checked on every reply: a server in another language has no
    envpool code to keep it to the format, and a reply read on faith failed later as an
    AttributeError, a KeyError or a raw ValidationError, or (a wrong id) waited out its
    timeout as if the container had hung, then was retried on fresh containers."""
    rid = msg.get("id")
    if rid not in outstanding:
        return f"{rid}, which this connection never sent (or had its reply to already)"
    ok = msg.get("ok")
    if not isinstance(ok, bool):
        return f"{rid} has 'ok': {_short(ok)}, not true or false"
    if ok:
        return None if "result" in msg else f"{rid} says ok but has no 'result'"
    err = msg.get("error")
    if not isinstance(err, dict):
        return f"{rid} has 'error': {_short(err)}, not an object"
    for key in ("type", "message"):
        if not isinstance(err.get(key), str):
            return f"{rid} has error.{key} {_short(err.get(key))}, not a string"
    tb = err.get("traceback")
    if tb is not None and not isinstance(tb, str):
        return f"{rid} has error.traceback {_short(tb)}, not a string or null"
    return None


def error_payload(exc: BaseException, *, traceback: str | None = None) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), "traceback": traceback}
