"""A garbled frame from a container (``GarbledFrame``: bytes that are no frame, most often a
print to the session socket) has a counter of its own in the pool's stats,
``garbled_frames``, beside ``protocol_errors`` (which counts it too): an operator tells a
server that writes stray output from one whose replies are malformed."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from pool_util import pool, swap_runtime
from test_foreign_server import _foreign_pool, _ForeignRuntime

from envpool.errors import GarbledFrame, ProtocolError
from envpool.runtimes.base import Container

# a server that garbles one frame where the foreign server never does: its open's reply, or
# (unasked, while nothing waits) once its reset was answered and a line comes on its stdin
_SERVER = r"""
import json, socket, struct, sys

def send(conn, msg):
    body = json.dumps(msg).encode()
    conn.sendall(struct.pack("!I", len(body)) + body)

def recv(conn):
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = conn.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf
    (size,) = struct.unpack("!I", exact(4))
    return json.loads(exact(size))

path, mode = sys.argv[1], sys.argv[2]
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(path)
listener.listen(4)
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    try:
        recv(conn)
        if mode == "open-print":
            conn.sendall(b"starting up...\n")
        else:
            send(conn, {"id": 0, "ok": True, "result": {"deterministic": True}})
        while True:
            msg = recv(conn)
            send(conn, {"id": msg["id"], "ok": True, "result": {"obs": {"text": "ready"}, "info": {}}})
            if mode == "print-after-reset" and msg.get("op") == "reset":
                sys.stdin.readline()  # the test's go: the reply was read, nothing waits now
                conn.sendall(b"reset done\n")
    except (EOFError, OSError):
        pass  # the pool hung up (or broke the connection on the garbage): this server is done
    finally:
        conn.close()
"""


class _GarblingRuntime(_ForeignRuntime):
    """Each container is ``_SERVER`` in ``mode``."""

    async def _start(self, image: str | None, bundle=None) -> Container:
        cid = f"g{next(self.ids)}"
        sock = self.dir / cid
        proc = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, "-c", _SERVER, str(sock), self.mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        c = Container(id=cid, endpoint=str(sock), image=image, runtime=self.kind, pid=proc.pid, handle=proc)
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        if line.strip() != b"ready":
            await self._stop(c)
            raise AssertionError(f"the garbling server did not start: {line!r}")
        return c

    async def _stop(self, c: Container) -> None:
        await super()._stop(c)
        c.handle.stdin.close()


async def _garbling_pool(mode: str):
    p = pool(None, min_warm=0, runtime={"heartbeat_s": 0.5}, reset_timeout_s=10, step_timeout_s=10)
    await swap_runtime(p, _GarblingRuntime(mode))
    return p


@pytest.mark.parametrize("mode", ["step-print", "step-not-json", "step-huge"])
async def test_a_garbled_reply_to_a_step_is_counted_as_a_garbled_frame(mode):
    # it was counted only as one of protocol_errors, with every malformed reply
    async with await _foreign_pool(mode) as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            with pytest.raises(GarbledFrame):
                await s.step("a")
        stats = p.stats()
        assert stats.get("garbled_frames") == 1 and stats["protocol_errors"] == 1, stats


@pytest.mark.parametrize("mode", ["ok-not-bool", "wrong-id", "reset-shape"])
async def test_a_malformed_but_framed_reply_is_no_garbled_frame(mode):
    async with await _foreign_pool(mode) as p:
        async with p.session("echo-v0") as s:
            with pytest.raises(ProtocolError) as err:
                await s.reset(seed=1)
            assert not isinstance(err.value, GarbledFrame)
        stats = p.stats()
        assert stats.get("garbled_frames", 0) == 0 and stats["protocol_errors"] == 1, stats


async def test_a_garbled_reply_to_the_open_is_counted_as_a_garbled_frame():
    async with await _garbling_pool("open-print") as p:
        with pytest.raises(GarbledFrame, match=r"b'starting up"):
            async with p.session("echo-v0"):  # the open (the session's start) raises
                pass  # never reached
        stats = p.stats()
        assert stats.get("garbled_frames") == 1 and stats["protocol_errors"] == 1, stats
        assert stats.get("reset_retries", 0) == 0, stats


async def test_a_garbled_frame_found_at_the_goodbye_is_counted():
    # stray output after the last reply broke the connection with nothing waiting; the
    # goodbye found it broken and the container was discarded, with no error counted at all
    async with await _garbling_pool("print-after-reset") as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            conn = s.conn
            assert conn is not None and s.container is not None
            server = s.container.handle
            server.stdin.write(b"go\n")
            server.stdin.flush()
            deadline = asyncio.get_running_loop().time() + 5
            while conn.broken is None:  # the stray bytes were read
                assert asyncio.get_running_loop().time() < deadline, "the stray output never arrived"
                await asyncio.sleep(0.01)
            assert isinstance(conn.broken, GarbledFrame)
        stats = p.stats()
        assert stats.get("garbled_frames") == 1 and stats["protocol_errors"] == 1, stats
        assert stats["discarded"] == 1, stats
