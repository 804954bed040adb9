"""L1: node-local disk. Blobs live at ``<path>/sha256/<hex>``; least recently used blobs are
evicted to stay under ``max_bytes``.

Writes go to a temp file in the same directory, synced, and are renamed into place, so a reader
(or a second process sharing the directory, or this one after a crash) sees a whole blob or
none. A download from a tier behind this one is streamed into such a file (``put_stream``),
its digest checked as it comes: renamed into place only whole and right. Reads touch the
file's mtime, so the LRU order survives a restart. Several processes may share one directory;
each keeps its own view of the LRU order, so the cap is enforced per process, not exactly
across them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import io
import logging
import os
import re
import stat
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Literal

from pydantic import Field

from envpool.images import durable
from envpool.images.bundle import parse_digest
from envpool.images.errors import DigestMismatch, ImageFetchError
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

    async def put_stream(self, digest: str, chunks: AsyncIterator[bytes], *, source: str) -> BinaryIO:
        """Write a blob streamed from ``source`` (a tier's ``stream``) a chunk at a time to a
        temp file, hashing it as it comes (off the loop, in the thread that writes it), and
        rename it into place once whole and matching its digest: a blob larger than memory
        never is held whole. Returns the blob open for reading (read from its descriptor:
        an eviction meanwhile does not take it). One over ``max_bytes`` is not kept (as
        ``put``): its file is unlinked, open. Raises ``DigestMismatch`` (nothing kept), what
        ``chunks`` raises (a fault of the source), or ``ImageFetchError`` of this tier (a
        write that failed: a full disk)."""
        parse_digest(digest)
        await self.start()
        path = self.path_of(digest)
        try:
            tmp, fd = await asyncio.to_thread(_open_temp, path)
        except OSError as e:
            raise self._write_failed(e) from e
        hasher = hashlib.sha256()
        size = 0
        step: asyncio.Future[Any] | None = None
        f: BinaryIO | None = None
        try:
            async for chunk in chunks:
                # hashed and written in a thread (a MiB takes a millisecond or two to hash:
                # on the loop it stalled every other session's I/O), not cancelled with the
                # put (its descriptor must outlive the write: see the cleanup below); the
                # close waits for them. One chunk at a time: the hasher is never shared
                step = self._tracked(_hash_and_write, hasher, fd, chunk)
                await asyncio.shield(step)
                size += len(chunk)
            actual = "sha256:" + hasher.hexdigest()
            if actual != digest:
                raise DigestMismatch(digest, actual, tier=source)
            keep = size <= self.config.max_bytes
            step = self._tracked(_publish_temp, fd, tmp, path if keep else None)
            f = await asyncio.shield(step)
        except BaseException as e:
            if step is not None and not step.done():  # (cancelled: its thread goes on)
                step.add_done_callback(partial(_abandon, fd, tmp))
            elif f is None:
                _discard(fd, tmp)
            if isinstance(e, OSError):
                raise self._write_failed(e) from e
            raise
        assert f is not None
        if keep:
            self._forget(digest)
            self._lru[digest] = size
            self._total += size
            self.metrics.puts += 1
            self.metrics.bytes_written += size
            await self._evict(keep=digest)
        return f

    async def open_blob(self, digest: str) -> BinaryIO | None:
        """``get``, as a file open for reading rather than its bytes (``None``: a miss)."""
        parse_digest(digest)
        await self.start()
        t0 = time.perf_counter()
        known = digest in self._lru
        try:
            f = await asyncio.to_thread(_open_and_touch, self.path_of(digest))
        except FileNotFoundError:
            self._forget(digest)  # evicted by us meanwhile, or by another process sharing it
            self.metrics.misses += 1
            return None
        except OSError as e:
            self.metrics.errors += 1
            raise ImageFetchError(f"read failed: {type(e).__name__}: {e}", tier=self.name) from e
        finally:
            self.metrics.observe(time.perf_counter() - t0)
        size = os.fstat(f.fileno()).st_size
        self.metrics.hits += 1
        self.metrics.bytes_read += size
        if digest in self._lru:
            self._lru.move_to_end(digest)
        elif not known:  # written by another process sharing the directory
            self._lru[digest] = size
            self._total += size
            await self._evict(keep=digest)
        return f

    def _tracked(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        write = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._writes.add(write)
        write.add_done_callback(self._written)
        return write

    def _write_failed(self, e: OSError) -> ImageFetchError:
        return ImageFetchError(f"write failed: {type(e).__name__}: {e}", tier=self.name)

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


def _open_temp(path: Path) -> tuple[Path, int]:
    """A temp file beside ``path`` for a blob streamed in, held (shared) as ``_write_atomic``
    holds its own: a neighbour's start leaves it however long the download takes."""
    tmp = path.with_name(f".tmp-{path.name[:16]}-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return tmp, fd


def _hash_and_write(hasher: Any, fd: int, chunk: bytes) -> None:
    hasher.update(chunk)  # (hashlib lets go of the GIL for a chunk this size)
    _write_chunk(fd, chunk)


def _write_chunk(fd: int, chunk: bytes) -> None:
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view) :]


def _publish_temp(fd: int, tmp: Path, path: Path | None) -> BinaryIO:
    """The whole blob at ``tmp``, synced and renamed to ``path`` (``None``: not kept, its
    name removed), open for reading; its writer's descriptor closed."""
    f = tmp.open("rb")
    try:
        if path is None:
            tmp.unlink()
        else:
            durable.fsync(fd)  # on the disk before the rename publishes it (as _write_atomic)
            os.replace(tmp, path)
    except BaseException:
        f.close()
        raise
    os.close(fd)  # (the lock lasts until its name is the blob's)
    return f


def _abandon(fd: int, tmp: Path, step: asyncio.Future[Any]) -> None:
    """A streamed blob's write whose put was cancelled, once its thread is done: a published
    blob stays (listed by the next start's scan), anything else is discarded."""
    if not step.cancelled() and step.exception() is None and step.result() is not None:
        step.result().close()  # (_publish_temp's file: it closed the descriptor itself)
    else:
        _discard(fd, tmp)


def _discard(fd: int, tmp: Path) -> None:
    """A streamed blob's temp file, given up (a fault, a mismatch, a cancel)."""
    tmp.unlink(missing_ok=True)
    os.close(fd)


@contextlib.contextmanager
def second_reader(f: BinaryIO) -> Iterator[BinaryIO]:
    """Another reader of the open file ``f``, at offsets of its own (``pread``): one thread
    uploads a blob while another unpacks it."""
    raw = _PositionalReader(os.dup(f.fileno()))
    with io.BufferedReader(raw) as reader:
        yield reader


class _PositionalReader(io.RawIOBase):
    def __init__(self, fd: int):
        self._fd = fd
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def readinto(self, buffer: Any) -> int:
        data = os.pread(self._fd, len(buffer), self._pos)
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: os.fstat(self._fd).st_size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def _open_and_touch(path: Path) -> BinaryIO:
    f = path.open("rb")
    os.utime(path)
    return f


def _unlink_all(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)
