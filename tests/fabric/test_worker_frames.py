"""The worker reads every frame its pool sends, in order, however the socket's reads cut
them: the ("init") it reads before it serves may come in one read with what the pool sent
next (a ("stop") from a pool closed while the worker started), and a large init (a kept
module's text) ends in a read that may hold the start of the next frame. Real worker
processes (``python -m fabric.worker``) on a real socketpair."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from sample_fns import REG

from fabric.backends import _pool as pool_mod
from fabric.backends._wire import SLOT_SIZE, FrameReader, pack
from fabric.backends.base import LocalConfig
from fabric.backends.local import LocalBackend
from fabric.protocol import encode_payload

_WAIT_S = 15.0  # a loaded machine starts a worker slowly


class _Worker:
    """A worker process started as the pool starts one, its socket held by the test."""

    def __init__(self) -> None:
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        shm = os.memfd_create("fabric-test-slot", 0)
        try:
            os.ftruncate(shm, SLOT_SIZE)
            env = dict(
                os.environ,
                FABRIC_WORKER_FD=str(child.fileno()),
                FABRIC_WORKER_SHM=str(shm),
                FABRIC_PARENT_PID=str(os.getpid()),
                PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
            )
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fabric.worker"],
                pass_fds=(child.fileno(), shm),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
            os.close(shm)
        self.sock.settimeout(_WAIT_S)
        self.reader = FrameReader()
        self.got: list[Any] = []

    def recv(self, n: int = 1) -> list[Any]:
        """The next ``n`` messages the worker sent (fails after _WAIT_S without them)."""
        while len(self.got) < n:
            data = self.sock.recv(1 << 16)
            assert data, f"the worker closed its socket; it sent {self.got}"
            self.got.extend(self.reader.feed(data))
        out, self.got = self.got[:n], self.got[n:]
        return out

    def exit_code(self) -> int:
        """Its exit status, with the test's end of the socket still open: a worker that
        missed its stop would wait for more."""
        try:
            return self.proc.wait(timeout=_WAIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker did not exit within {_WAIT_S:g} s (its stop was lost?)")

    def close(self) -> None:
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def worker():
    w = _Worker()
    yield w
    w.close()


def _init(snapshot: list[tuple[str, str, bytes]] | None = None) -> bytes:
    init = {"entry": "sample_fns:add", "sys_path": list(sys.path), "fault": None, "snapshot": snapshot or []}
    return pack(("init", init))


def _calls(*a: int) -> bytes:
    """A batch of ``add(a, 1)`` calls, their cids 1, 2, ..."""
    return pack(("calls", [(cid, encode_payload({"a": x, "b": 1}), 0, 10.0) for cid, x in enumerate(a, 1)]))


def _results(worker: _Worker, n: int) -> dict[int, Any]:
    """The values of the next ``n`` results (one per message: the worker sends each alone)."""
    out = {}
    for kind, items in worker.recv(n):
        assert kind == "results", items
        for cid, ok, res, *_ in items:
            assert ok, res
            out[cid] = json.loads(res)  # the value as JSON
    return out


def test_a_stop_in_the_read_that_brought_the_init_stops_the_worker(worker):
    """A pool closed while its worker starts sends ("stop") right after ("init"); the worker,
    still starting, reads both at once. It kept the init and dropped the stop: it imported
    the function, ran its setup hook and waited for calls until the pool killed it (1 s
    later). It exits now, cleanly, without importing anything."""
    worker.sock.sendall(_init() + pack(("stop",)))
    assert worker.exit_code() == 0
    assert worker.sock.recv(1 << 16) == b""  # no ("ready"): it stopped before its import


def test_calls_in_the_read_that_brought_the_init_are_answered(worker):
    """Any message in the init's read was dropped, not only a stop."""
    worker.sock.sendall(_init() + _calls(1, 2))
    ((kind, info),) = worker.recv()
    assert kind == "ready", info
    assert _results(worker, 2) == {1: 2, 2: 3}
    worker.sock.sendall(pack(("stop",)))
    assert worker.exit_code() == 0


def test_a_frame_cut_by_the_init_s_last_read_is_read_whole(worker):
    """The read that ends the init holds the start of the next frame: the rest of that frame
    came later, read by the serving loop as if it were a frame of its own (a garbage length:
    the worker waited for bytes that never came, or died on an unpickling error)."""
    calls = _calls(5)
    worker.sock.sendall(_init() + calls[:3])  # a part of the next frame's length
    ((kind, info),) = worker.recv()
    assert kind == "ready", info
    worker.sock.sendall(calls[3:])
    assert _results(worker, 1) == {1: 6}
    worker.sock.sendall(pack(("stop",)))
    assert worker.exit_code() == 0


def test_a_large_init_read_in_many_pieces_keeps_what_follows_it(worker):
    """An init of a kept module's text (here 300 KB, a module nobody imports) takes many
    reads; what follows it in the last one is kept too."""
    filler = ("fabric_frames_never_imported", "/nonexistent/fabric_frames.py", b"#\n" * 150_000)
    worker.sock.sendall(_init([filler]) + _calls(7))
    ((kind, info),) = worker.recv()
    assert kind == "ready", info
    assert _results(worker, 1) == {1: 8}
    worker.sock.sendall(pack(("stop",)))
    assert worker.exit_code() == 0


async def test_a_pool_closed_while_its_worker_starts_stops_it_without_a_kill(monkeypatch):
    """The user-facing case: a pool closed as its worker starts. Its stop was lost with the
    init's read, so the worker started, waited, and was SIGKILLed by the close a second
    later; it exits by itself now. (The close's grace is raised: on a loaded machine the
    worker's start alone can take longer than the second, and the kill then says nothing.)"""
    monkeypatch.setattr(pool_mod, "STOP_GRACE_S", 60.0)
    async with LocalBackend(REG, LocalConfig(warm=0, max_workers=1)) as b:
        pool = b.pool("add")
        pool._spawn()
        (w,) = pool._workers
        deadline = time.monotonic() + _WAIT_S
        while w.proc is None or w.transport is None:  # launched, its init written
            assert time.monotonic() < deadline, "the worker did not launch"
            await asyncio.sleep(0.001)
        await pool.close()
    assert w.proc.returncode == 0


def test_the_init_reader_gives_every_frame_of_a_read_in_order():
    """The worker's blocking reader, on a socketpair: two frames and a part of a third in
    one send; each comes out in order, and the part stays in the reader for the loop."""
    from fabric.worker import _Frames

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(_WAIT_S)
        third = pack(("cancel", 3))
        a.sendall(pack(("init", {})) + pack(("extend", 1, 2)) + third[:5])
        frames = _Frames(b)
        assert frames.recv() == ("init", {})
        assert not frames.stopped()
        assert frames.recv() == ("extend", 1, 2)
        assert frames.reader.feed(third[5:]) == [("cancel", 3)]
