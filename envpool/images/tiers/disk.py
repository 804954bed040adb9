"""L1: node-local disk. Blobs live at ``<path>/sha256/<hex>``; least recently used blobs are
evicted to stay under ``max_bytes``.

Writes go to a temp file in the same directory, synced, and are renamed into place, so a reader
(or a second process sharing the directory, or this one after a crash) sees a whole blob or
none. Reads touch the file's mtime, so the LRU order survives a restart. Several processes may
share one directory; each keeps its own view of the LRU order, so the cap is enforced per
process, not exactly across them.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import stat
import time
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Literal

from pydantic import Field

from envpool.images import durable
from envpool.images.held import remove_unless_held
from envpool.images.tiers.base import Tier, TierConfigBase

#: Temp files and directories older than this are debris of a dead process, removed at start.
STALE_TEMP_S = 3600.0
_HEX_RE = re.compile(r"[0-9a-f]{64}")
_CLOSE_WAIT_S = 30.0
"""How long a close waits for the blob writes under way (a cancelled put's thread goes on)."""

log = logging.getLogger(__name__)


class DiskTierConfig(TierConfigBase):
    type: Literal["disk"] = "disk"
    path: Path
    """Directory of this node's blob store (created if missing)."""
    max_bytes: int = Field(10 * 2**30, gt=0)
    """Least recently used blobs are evicted to stay under this many bytes."""


class DiskTier(Tier):
    kind = "disk"

    def __init__(self, config: DiskTierConfig):
        super().__init__(config.name or config.type)
        self.config = config
        self.root = Path(config.path) / "sha256"
        self._lru: OrderedDict[str, int] = OrderedDict()  # digest -> size, oldest first
        self._total = 0
        self._writes: set[asyncio.Future[None]] = set()
        """Blobs being written, in threads: the close waits for them (``_CLOSE_WAIT_S``)."""

    @property
    def total_bytes(self) -> int:
        return self._total

    def __contains__(self, digest: str) -> bool:
        return digest in self._lru

    def path_of(self, digest: str) -> Path:
        return self.root / digest.removeprefix("sha256:")

    async def _start(self) -> None:
        entries = await asyncio.to_thread(self._scan)
        self._lru.clear()  # a tier started again (after a cache's failed start) scans anew
        self._total = 0
        for digest, size in entries:
            self._lru[digest] = size
            self._total += size
        await self._evict()

    def _scan(self) -> list[tuple[str, int]]:
        self.root.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for entry in os.scandir(self.root):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # renamed away since the listing (a neighbour's write)
                continue
            if entry.name.startswith(".tmp-"):
                # left by a writer that died mid-write (a young one may be a live neighbour's)
                if now - st.st_mtime > STALE_TEMP_S:
                    remove_unless_held(Path(entry.path))
                continue
            if not _HEX_RE.fullmatch(entry.name) or not stat.S_ISREG(st.st_mode):
                continue
            found.append((st.st_mtime, "sha256:" + entry.name, st.st_size))
        found.sort()
        return [(d, size) for _, d, size in found]

    async def _get(self, digest: str) -> bytes | None:
        path = self.path_of(digest)
        known = digest in self._lru
        try:
            data = await asyncio.to_thread(_read_and_touch, path)
        except FileNotFoundError:
            # evicted by us in the meantime, or by another process sharing the directory
            self._forget(digest)
            return None
        if digest in self._lru:
            self._lru.move_to_end(digest)
        elif known:
            pass  # evicted (or dropped) by us while it was read: its file is gone, or going
        else:  # written by another process sharing the directory
            self._lru[digest] = len(data)
            self._total += len(data)
            await self._evict(keep=digest)
        return data

    async def _put(self, digest: str, data: bytes) -> bool:
        if len(data) > self.config.max_bytes:
            return False  # would evict everything and still not fit; the unpacked copy is kept anyway
        # not cancelled with the put (a cache's close cancels its write-backs): its thread
        # would go on all the same; the close waits for it
        write = asyncio.ensure_future(asyncio.to_thread(_write_atomic, self.path_of(digest), data))
        self._writes.add(write)
        write.add_done_callback(self._written)
        await asyncio.shield(write)
        self._forget(digest)
        self._lru[digest] = len(data)
        self._total += len(data)
        await self._evict(keep=digest)
        return True

    def _written(self, write: asyncio.Future[None]) -> None:
        self._writes.discard(write)
        if not write.cancelled():
            write.exception()  # retrieved: a put that was cancelled no longer awaits it

    async def _close(self) -> None:
        if not self._writes:
            return
        _, left = await asyncio.wait(self._writes, timeout=_CLOSE_WAIT_S)
        if left:
            log.warning(
                "disk tier %r closed with %d blob write(s) still running after %ss, in threads that "
                "cannot be stopped: each is renamed into place whole, or removed",
                self.name,
                len(left),
                _CLOSE_WAIT_S,
            )

    async def _delete(self, digest: str) -> None:
        self._forget(digest)
        await asyncio.to_thread(self.path_of(digest).unlink, missing_ok=True)

    def _forget(self, digest: str) -> None:
        size = self._lru.pop(digest, None)
        if size is not None:
            self._total -= size

    async def _evict(self, keep: str | None = None) -> None:
        victims: list[Path] = []
        while self._total > self.config.max_bytes and self._lru:
            digest = next(iter(self._lru))
            if digest == keep:
                break
            self._forget(digest)
            self.metrics.evictions += 1
            victims.append(self.path_of(digest))
        if victims:
            await asyncio.to_thread(_unlink_all, victims)


def _read_and_touch(path: Path) -> bytes:
    data = path.read_bytes()
    os.utime(path)
    return data


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name[:16]}-{uuid.uuid4().hex}")
    try:
        with tmp.open("wb") as f:
            # held (shared) until it is renamed into place: a neighbour's start leaves it
            # however old its mtime (``held.remove_unless_held``). Young, it is not stale before then
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            f.write(data)
            f.flush()
            # on the disk before the rename publishes it: a crash after an unsynced rename
            # left the blob empty or short at its name. (The directory is not synced: a
            # rename a crash loses leaves a temp file, removed at a start, and a miss.)
            durable.fsync(f.fileno())
            os.replace(tmp, path)  # (still open: the lock lasts until its name is the blob's)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
