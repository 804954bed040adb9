"""The ``Tier`` ABC: one level of the image cache, from node-local disk out to the origin.

A tier maps a digest to the bundle's bytes. ``get`` returns ``None`` for a blob the tier does
not have (a miss, never retried) and raises ``ImageFetchError`` when the tier itself failed
(``retryable`` says whether trying again can help). Tiers do not verify digests: the cache
does, once, for whatever any tier returns. ``stream`` hands a blob over a chunk at a time
(the cache streams one into its disk tier, checking its digest as it comes), ``put_file``
stores one from a file. The public methods live here and keep the metrics; tiers override
the hooks ``_get``, ``_stream``, ``_put``, ``_put_file``, ``_delete``, ``_start`` and ``_close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, BinaryIO, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from envpool.images.bundle import parse_digest
from envpool.images.errors import DigestMismatch, ImageError, ImageFetchError


class TierConfigBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    """Label of the tier in metrics and errors (default: its ``type``)."""


DEFAULT_MAX_BLOB_BYTES = 2 * 2**30


class FetchingTierConfig(TierConfigBase):
    """A tier that downloads its blobs (HTTP, S3): how much of one it reads at most."""

    max_blob_bytes: int = Field(DEFAULT_MAX_BLOB_BYTES, gt=0)
    """The most bytes of one blob this tier downloads (2 GiB by default): a reply whose
    stated length (``Content-Length``, S3's ``ContentLength``) says more is refused before
    its body is read, and one whose body (decompressed) runs past it is cut off there, so a
    huge or endless body cannot fill the node's disk (behind a disk tier a blob is streamed
    into it, and counted as it streams) or memory (with none, a blob is held whole while it
    is verified and unpacked). Not retried (``ImageFetchError``, naming this key): raise it
    for images that big."""


def blob_too_big(tier: str, cap: int, digest: str, source: object, why: str) -> ImageFetchError:
    """The error of a blob over a tier's ``max_blob_bytes``: ``why`` says how it showed."""
    return ImageFetchError(
        f"{digest} from {source}: {why}, over this tier's max_blob_bytes ({cap:,}); raise "
        "max_blob_bytes in the tier's config for an image this big",
        tier=tier,
        retryable=False,  # (the same blob is as big on every try)
    )


class TierMetrics:
    """Counters of one tier. Latencies keep the most recent ``window`` gets."""

    def __init__(self, window: int = 4096):
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self.corrupt = 0
        """Blobs the cache found not to match their digest (and dropped, where it could)."""
        self.puts = 0
        self.put_errors = 0
        self.evictions = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self._latencies: deque[float] = deque(maxlen=window)

    def observe(self, seconds: float) -> None:
        self._latencies.append(seconds)

    def snapshot(self) -> dict[str, Any]:
        lat = sorted(self._latencies)

        def pct(p: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 3) if lat else None

        return {
            "hits": self.hits,
            "misses": self.misses,
            "errors": self.errors,
            "corrupt": self.corrupt,
            "puts": self.puts,
            "put_errors": self.put_errors,
            "evictions": self.evictions,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
            "get_latency_ms": {"n": len(lat), "p50": pct(0.50), "p99": pct(0.99), "max": pct(1.0)},
        }


class Tier(ABC):
    """One cache level. Use as ``async with tier:`` (or let ``TieredCache`` own it);
    ``start``, ``stop`` and ``aclose`` are idempotent, and ``get``/``put`` start a tier on
    first use (again after a ``stop``)."""

    kind: ClassVar[str]
    writable: ClassVar[bool] = True
    """False for registries and origins: the cache never writes back to them."""

    def __init__(self, name: str):
        self.name = name
        self.metrics = TierMetrics()
        self._started = False
        self._closed = False
        self._start_lock = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    async def __aenter__(self) -> Tier:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if self._closed:
                raise ImageError(f"tier {self.name!r} is closed")
            if not self._started:
                await self._start()
                self._started = True

    async def stop(self) -> None:
        """Close what ``start`` opened, leaving the tier able to start again: a cache whose
        own start failed releases its tiers this way. ``aclose`` closes it for good."""
        async with self._start_lock:
            if self._started and not self._closed:
                self._started = False
                await asyncio.shield(self._close())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._started:
            # shielded: a cancelled caller must not leave connection pools open
            await asyncio.shield(self._close())

    async def get(self, digest: str) -> bytes | None:
        """The blob's bytes, ``None`` if this tier does not have it, ``ImageFetchError`` if
        the tier failed."""
        parse_digest(digest)  # a digest is also a file name and a URL path: nothing else gets in
        await self.start()
        t0 = time.perf_counter()
        try:
            data = await self._get(digest)
        except ImageFetchError:
            self.metrics.errors += 1
            raise
        except ImageError:
            raise
        except Exception as e:
            # a hook let a third-party error through: surface it as a tier fault, not a crash
            # of the whole walk, but do not retry what nobody understood
            self.metrics.errors += 1
            raise ImageFetchError(
                f"unexpected {type(e).__name__}: {e}", tier=self.name, retryable=False
            ) from e
        finally:
            self.metrics.observe(time.perf_counter() - t0)
        if data is None:
            self.metrics.misses += 1
        else:
            self.metrics.hits += 1
            self.metrics.bytes_read += len(data)
        return data

    @contextlib.asynccontextmanager
    async def stream(self, digest: str) -> AsyncIterator[AsyncIterator[bytes] | None]:
        """The blob's bytes a chunk at a time (``None``: this tier does not have it), for a
        blob that must not be held whole in memory: the cache streams one into its disk
        tier. A fault, opening or mid-stream, raises ``ImageFetchError``, as ``get``."""
        parse_digest(digest)
        await self.start()
        t0 = time.perf_counter()
        try:
            async with self._stream(digest) as chunks:
                if chunks is None:
                    self.metrics.misses += 1
                    yield None
                    return
                self.metrics.hits += 1
                counted = self._counted(chunks)
                try:
                    yield counted
                finally:  # (a reader that stopped early: before the reply or body is closed)
                    await counted.aclose()
        except ImageFetchError as e:
            if not isinstance(e, DigestMismatch):  # (the cache's verdict on the bytes, counted there)
                self.metrics.errors += 1
            raise
        except ImageError:
            raise
        except Exception as e:  # a hook let a third-party error through: as ``get`` does
            self.metrics.errors += 1
            raise ImageFetchError(
                f"unexpected {type(e).__name__}: {e}", tier=self.name, retryable=False
            ) from e
        finally:
            self.metrics.observe(time.perf_counter() - t0)

    async def _counted(self, chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in chunks:
                self.metrics.bytes_read += len(chunk)
                yield chunk
        finally:
            aclose = getattr(chunks, "aclose", None)  # (an async generator's: its finally runs now)
            if aclose is not None:
                await aclose()

    async def put_file(self, digest: str, f: BinaryIO) -> bool:
        """``put`` of a verified blob read from ``f`` (a file the disk tier holds), which
        tiers that can (S3) read a part at a time."""
        parse_digest(digest)
        if not self.writable:
            return False
        await self.start()
        size = os.fstat(f.fileno()).st_size  # (before: boto3's upload closes the file it read)
        return await self._stored(self._put_file(digest, f), size)

    async def put(self, digest: str, data: bytes) -> bool:
        """Store a verified blob; whether the tier kept it (read-only tiers never do, nor a
        disk tier a blob over its cap). Raises ``ImageFetchError``."""
        parse_digest(digest)
        if not self.writable:
            return False
        await self.start()
        return await self._stored(self._put(digest, data), len(data))

    async def _stored(self, write: Awaitable[bool | None], size: int) -> bool:
        """Await a ``put``'s write of ``size`` bytes and count it; whether the tier kept it."""
        try:
            stored = await write
        except ImageError:
            self.metrics.put_errors += 1
            raise
        except Exception as e:
            self.metrics.put_errors += 1
            raise ImageFetchError(f"write failed: {type(e).__name__}: {e}", tier=self.name) from e
        if stored is False:  # the tier chose not to keep it (a disk tier's blob over its cap)
            return False
        self.metrics.puts += 1
        self.metrics.bytes_written += size
        return True

    async def delete(self, digest: str) -> None:
        """Drop a blob (the cache calls this on a corrupt one); a no-op on read-only tiers.
        Raises ``ImageFetchError``: a blob that cannot be dropped (a read-only or shared
        directory) is the tier's fault, never a crash of the cache's walk."""
        parse_digest(digest)
        if not self.writable:
            return
        await self.start()
        try:
            await self._delete(digest)
        except ImageError:
            raise
        except Exception as e:
            raise ImageFetchError(f"delete failed: {type(e).__name__}: {e}", tier=self.name) from e

    # -- hooks
    async def _start(self) -> None:  # noqa: B027 - optional hook
        pass

    async def _close(self) -> None:  # noqa: B027 - optional hook
        pass

    @abstractmethod
    async def _get(self, digest: str) -> bytes | None: ...

    async def _put(self, digest: str, data: bytes) -> bool | None:
        """Store the blob (read-only tiers: never called); ``False`` if the tier chose not to:
        it is not counted written."""
        return None

    async def _delete(self, digest: str) -> None:  # noqa: B027 - read-only tiers
        pass

    @contextlib.asynccontextmanager
    async def _stream(self, digest: str) -> AsyncIterator[AsyncIterator[bytes] | None]:
        """The blob's chunks, or ``None`` on a miss; raising ``ImageFetchError`` (opening, or
        from the chunks). By default ``_get``'s bytes as one chunk: the tiers that download
        (HTTP, S3) stream theirs."""
        data = await self._get(digest)
        yield None if data is None else _one(data)

    async def _put_file(self, digest: str, f: BinaryIO) -> bool | None:
        """By default ``_put`` of the file's bytes, read whole; S3 uploads it in parts."""
        return await self._put(digest, await asyncio.to_thread(f.read))


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data
