"""Framing between the local pool and its worker processes: a 4-byte length, then a pickle.

Pickle is safe here: both ends are our own processes, started by us, over a socketpair.
Messages are tuples whose first item names them:

parent -> worker: ("init", dict) ("calls", [(cid, raw, deadline_ns | 0, timeout_s)]) ("cancel", cid)
                  ("extend", cid, deadline_ns | 0) ("stop",)
worker -> parent: ("ready", dict) ("fatal", code, message, traceback)
                  ("results", [(cid, ok, out, start_ns, exec_ms)])

The worker also publishes ``(cid, start_ns)`` of the synchronous call it is running in a
16-byte shared-memory slot, so the parent can tell a hung call from a busy queue without
any message from a process that may be stuck in C code, and which calls a dead worker had
started.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

HEADER = struct.Struct("!I")
# cid, start (time.monotonic_ns, shared across processes) of the running call; while idle
# (cid of the last call started, 0), so a death shows which calls ran; (0, 0) before any
SLOT = struct.Struct("qq")
SLOT_SIZE = 4096


def pack(msg: Any) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


class FrameReader:
    """Incremental decoder: feed bytes, get complete messages."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (size,) = HEADER.unpack_from(buf, pos)
            if n - pos - 4 < size:
                break
            out.append(pickle.loads(memoryview(buf)[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return out


def read_slot(mem: Any) -> tuple[int, int]:
    """(cid, start_ns) of the running synchronous call, or (cid of the last one started, 0)
    while none runs; (0, 0) before any (or after torn reads, which are retried)."""
    for _ in range(3):
        cid, start = SLOT.unpack_from(mem, 0)
        cid2, _ = SLOT.unpack_from(mem, 0)
        if cid == cid2:
            return cid, start
    return 0, 0
