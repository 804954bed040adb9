"""``TieredCache``: image bundles from the nearest tier that has them, unpacked once per node.

    async with TieredCache.from_config(config) as cache:
        cache.prefetch(["envs/frozenlake@sha256:..."])   # before the step starts
        root = await cache.get("envs/frozenlake@sha256:...")   # the unpacked directory
        root = await cache.acquire(ref); ...; cache.release(ref)  # pinned while in use

A ``get`` walks the tiers fastest first. Whatever a tier returns is checked against the digest;
a corrupt blob is counted, dropped from that tier and the walk goes on to the next one. The
first good copy is written back to the faster writable tiers it missed and unpacked (both at
once). Behind a disk tier, a blob is streamed into it a chunk at a time, its digest checked
as it comes, and unpacked and written back from that file: an image larger than memory is
never held whole (with no disk tier in front, it is). Concurrent gets of one digest share a
single fetch (single-flight), so a thousand resets of a cold image cost one download; the
processes sharing ``unpack_dir`` share it too (a lock file per bundle being loaded: the others
wait for the bundle to be there). A walk that ends in a transport fault is retried with
exponential backoff and full jitter; one that ends in "no tier has it" is not.

Unpacked bundles are evicted least recently used first to stay under
``unpacked_budget_bytes`` (``envpool.images.unpacked``) after each unpack and at each
``release``; one pinned with ``acquire`` (a container runs from it) is never evicted until
then. One pinned by another process sharing ``unpack_dir`` is tried again every second while
it keeps the bundles over the budget (no unpack or release here may come soon).

A close cancels the fetches under way and waits (``_CLOSE_WAIT_S``) for their unpacks, whose
threads a cancel does not stop: each gives up at its next step, and publishes nothing after.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)
from tenacity.stop import stop_base

from envpool.images.bundle import Bundle, ImageRef, verify
from envpool.images.cache_config import (  # the settings live there; importable from here too
    DEFAULT_MAX_UNPACKED_BYTES,
    DEFAULT_UNPACKED_BUDGET,
    CacheConfig,
    RetryPolicy,
)
from envpool.images.errors import DigestMismatch, ImageError, ImageFetchError, ImageNotFound
from envpool.images.tiers import DiskTier, Tier, make_tier
from envpool.images.tiers.disk import second_reader
from envpool.images.unpacked import (
    MARKER,
    UnpackedStore,
    complete,
    remove_all,
    try_lock,
    unlock,
    unpack_tree,
)

log = logging.getLogger(__name__)


Blob = bytes | BinaryIO
"""A blob in hand: its bytes, or a file of them (the disk tier's: never read whole)."""


class _Streamed:
    """A blob streamed into the disk tier, its digest checked on the way: its file."""

    def __init__(self, file: BinaryIO):
        self.file = file


def _close(f: BinaryIO, _: object) -> None:
    f.close()


def _retryable(e: BaseException) -> bool:
    return isinstance(e, ImageFetchError) and e.retryable


_OVER_BUDGET_RETRY_S = 1.0
"""How soon an eviction that another process's pin blocked is tried again: a node stays over
the budget about this long after that pin drops (a retry costs a few system calls a bundle)."""

_CLOSE_WAIT_S = 30.0
"""How long a close waits for the unpacks under way: a cancel does not stop a thread, and
each stops at its next step (``unpack_tree``), but one member of a big bundle may
take a while to write."""

_NODE_FLIGHT_POLL_S = 0.05
"""How often a load waits on another process's load of the same bundle checks on it."""

_NODE_FLIGHT_WAIT_S = 900.0
"""How long a load waits on another process's load of the same bundle (its retries' deadline,
600 s by default, and its unpack) before it loads the bundle itself."""

_ACQUIRE_ATTEMPTS = 3
"""Fetches of one ``acquire`` whose bundle another process evicts before the pin each time."""


class TieredCache:
    """Owns its tiers: they start with the cache and close with it."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        unpack_dir: str | os.PathLike[str],
        retry: RetryPolicy | None = None,
        max_concurrent_fetches: int = 8,
        max_unpacked_bytes: int | None = DEFAULT_MAX_UNPACKED_BYTES,
        unpacked_budget_bytes: int | None = DEFAULT_UNPACKED_BUDGET,
        precompile: bool = True,
    ):
        """``precompile``: byte-compile each bundle as it is unpacked (``_precompile``), for
        the containers that share it; not for a directory one container alone uses."""
        if not tiers:
            raise ImageError("a TieredCache needs at least one tier (the origin)")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ImageError(f"tier names must be unique (they key the metrics): {names}")
        self.tiers = list(tiers)
        self._disk = next((t for t in self.tiers if isinstance(t, DiskTier)), None)
        """The disk tier the tiers behind it stream their blobs into (``_get``)."""
        self.unpack_root = Path(unpack_dir) / "sha256"
        self.retry = retry or RetryPolicy()
        self.max_unpacked_bytes = max_unpacked_bytes
        self.precompile = precompile
        self.unpacked = UnpackedStore(self.unpack_root, unpacked_budget_bytes)
        self._fetch_slots = asyncio.Semaphore(max_concurrent_fetches)
        self._inflight: dict[str, asyncio.Task[Path]] = {}
        self._unpacks: set[asyncio.Future[tuple[Path, int]]] = set()
        """Unpacks under way, in threads; the close waits for them (``_CLOSE_WAIT_S``)."""
        self._stopping = threading.Event()
        """Set by the close: the unpack threads stop at their next step."""
        self._removals: set[asyncio.Future[None]] = set()
        """Deletions of evicted directories under way (``release`` is sync): the close awaits them."""
        self._budget_retry: asyncio.TimerHandle | None = None
        """The next try of an eviction another process's pin blocked (``_watch_budget``)."""
        self._outcomes: Counter[str] = Counter()
        self._started = False
        self._closed = False
        self._start_lock = asyncio.Lock()

    @classmethod
    def from_config(cls, config: CacheConfig | dict[str, Any]) -> TieredCache:
        cfg = config if isinstance(config, CacheConfig) else CacheConfig.model_validate(config)
        return cls(
            [make_tier(t) for t in cfg.tiers],
            unpack_dir=cfg.unpack_dir,
            retry=cfg.retry,
            max_concurrent_fetches=cfg.max_concurrent_fetches,
            max_unpacked_bytes=cfg.max_unpacked_bytes,
            unpacked_budget_bytes=cfg.unpacked_budget_bytes,
        )

    async def __aenter__(self) -> TieredCache:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if self._closed:
                raise ImageError("the image cache is closed")
            if not self._started:
                try:
                    found = await asyncio.to_thread(self.unpacked.scan)
                    self.unpacked.load(found)
                    await self._evict()
                    await asyncio.gather(*(t.start() for t in self.tiers))
                except BaseException:
                    # `async with` calls no __aexit__ when __aenter__ fails: release what started,
                    # but only stop the tiers: a later get tries the start again (a closed tier
                    # never starts again, and the cache would be broken for good by one failure)
                    await asyncio.gather(*(t.stop() for t in self.tiers), return_exceptions=True)
                    raise
                self._started = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._budget_retry is not None:
            self._budget_retry.cancel()
            self._budget_retry = None
        flights = list(self._inflight.values())
        for task in flights:
            task.cancel()
        # shielded: a cancelled caller must not leave connection pools or threads behind
        await asyncio.shield(self._close(flights))

    async def _close(self, flights: list[asyncio.Task[Path]]) -> None:
        await asyncio.gather(*flights, return_exceptions=True)
        if self._unpacks:
            # the loads are cancelled, their threads are not: nothing may write under
            # unpack_dir once the close has returned (as long as they let it)
            _, left = await asyncio.wait(self._unpacks, timeout=_CLOSE_WAIT_S)
            if left:
                log.warning(
                    "the image cache closed with %d unpack(s) still running after %ss, in threads "
                    "that cannot be stopped: they may write under %s for a while; what they leave "
                    "is never taken for a whole bundle (no %s), and their temp dirs are removed",
                    len(left),
                    _CLOSE_WAIT_S,
                    self.unpack_root,
                    MARKER,
                )
        await asyncio.gather(*self._removals, return_exceptions=True)
        await asyncio.gather(*(t.aclose() for t in self.tiers), return_exceptions=True)
        self.unpacked.unpin_all()

    def path_of(self, image: str) -> Path:
        """Where the bundle of ``image`` (a reference or a digest) is, or will be, unpacked."""
        return self.unpack_root / ImageRef.parse(image).digest.removeprefix("sha256:")

    async def get(self, image: str) -> Path:
        """The unpacked directory of ``image`` (``name@sha256:<hex>`` or ``sha256:<hex>``).

        Raises ``ImageNotFound`` (no tier has it; not retried), ``ImageFetchError`` (tiers kept
        failing after the retries; an ``InfraError``), ``DigestMismatch`` (every copy was
        corrupt) or ``UnsafeBundle`` (the bundle tries to write outside its directory)."""
        digest = ImageRef.parse(image).digest
        if self._closed:
            raise ImageError("the image cache is closed")
        path = self.path_of(digest)
        if digest not in self._inflight and complete(path):
            self._outcomes["ready"] += 1
            await self._used(path.name)
            return path
        task = self._flight(digest)
        try:
            # shielded: one caller giving up must not cancel the fetch the others are waiting on
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and self._closed and not (me and me.cancelling()):
                raise ImageError(f"the image cache was closed while fetching {digest}") from None
            raise

    async def acquire(self, image: str) -> Path:
        """``get``, and pin the bundle: it is not evicted (by this process, or another sharing
        ``unpack_dir``) until ``release(image)``. One release per acquire; an ``EnvPool``
        pins the bundle of each container it starts until the container has stopped."""
        hex_ = self.path_of(image).name
        # reserved from the fetch to the pin: this process's evictions (an unpack of another
        # image, a release) would otherwise take it in the loop turns between the two
        self.unpacked.reserve(hex_)
        try:
            for _ in range(_ACQUIRE_ATTEMPTS):
                path = await self.get(image)
                if self.unpacked.pin(path.name):
                    return path
                # another process sharing unpack_dir evicted it between the get and the pin
        finally:
            self.unpacked.unreserve(hex_)
        budget = self.unpacked.budget_bytes
        raise ImageError(
            f"image {image}: its unpacked bundle was evicted {_ACQUIRE_ATTEMPTS} times in a row "
            f"before it could be pinned, by another process sharing {self.unpack_root.parent}: "
            f"the bundles in use on this node need more than unpacked_budget_bytes ({budget} "
            "bytes, enforced per process); raise it, or give each process its own unpack_dir"
        )

    def release(self, image: str) -> None:
        """Undo one ``acquire``: the bundle may be evicted again, at once if the bundles are
        over the budget (they went over while it was pinned: an unpack had to keep it)."""
        hex_ = self.path_of(image).name
        self.unpacked.unpin(hex_)
        if self._closed or self.unpacked.pinned(hex_):
            return  # still in use here: nothing more may go than before (and no warning again)
        self._remove_soon(self.unpacked.evict())
        self._watch_budget()

    def _remove_soon(self, victims: list[Path]) -> None:
        """Delete evicted directories (renamed away already) off the loop, as ``_evict`` does:
        a big tree must not stall it."""
        if not victims:
            return
        try:
            # a future of the executor's, not a task: one a loop closes unfinished says nothing
            removal = asyncio.get_running_loop().run_in_executor(None, remove_all, victims)
        except RuntimeError:
            # outside a loop (nothing to stall), or in asyncio.run's shutdown of a cache never
            # closed (the retry timer fired while the loop waited for its executor, which takes
            # no more work): removed here, not left renamed away with an error logged
            remove_all(victims)
            return
        self._removals.add(removal)
        removal.add_done_callback(self._removals.discard)

    def _watch_budget(self) -> None:
        """After an eviction that another process's pin kept over the budget, try again in
        ``_OVER_BUDGET_RETRY_S`` (and so on until under it, or nothing but our own pins is
        left): this process hears nothing when that pin drops, and its next unpack or last
        release of an image may be far off (a busy pool holds its own pins, and fetches
        nothing new), while the node stayed over the budget all along."""
        if not self.unpacked.blocked_elsewhere or self._budget_retry is not None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (a sync release): the next eviction watches
            return
        self._budget_retry = loop.call_later(_OVER_BUDGET_RETRY_S, self._retry_budget)

    def _retry_budget(self) -> None:
        self._budget_retry = None
        if self._closed:
            return
        self._remove_soon(self.unpacked.evict())
        self._watch_budget()

    async def publish(self, bundle: Bundle, name: str = "image") -> str:
        """Put a bundle into every writable tier (a local image, or a push to the shared
        cache) and return its reference ``name@sha256:<hex>`` for ``EnvPool.session``."""
        await asyncio.to_thread(verify, bundle.data, bundle.digest, source="publish")  # (as _walk)
        writable = [t for t in self.tiers if t.writable]
        if not writable:
            raise ImageError("no writable tier to publish to; add a disk or S3 tier")
        kept = await asyncio.gather(*(t.put(bundle.digest, bundle.data) for t in writable))
        if not any(kept):
            # a reference to nowhere: its get said "in none of the tiers", of a bundle in hand
            raise ImageError(
                f"no writable tier kept the bundle {bundle.digest} ({bundle.size} bytes): "
                f"{', '.join(t.name for t in writable)} would not store it (a disk tier keeps no blob "
                "over its max_bytes); raise their max_bytes, or add an S3 tier"
            )
        return str(bundle.ref(name))

    def prefetch(self, images: Iterable[str]) -> int:
        """Start fetching ``images`` in the background; return how many fetches started.

        A later ``get`` joins a fetch still running. Failures are logged and counted, and the
        next ``get`` tries again. Wait for all with ``asyncio.gather(*map(cache.get, images))``."""
        if self._closed:
            raise ImageError("the image cache is closed")
        started = 0
        for image in images:
            digest = ImageRef.parse(image).digest
            if digest in self._inflight or complete(self.path_of(digest)):
                continue
            self._flight(digest, prefetch=True)
            started += 1
        self._outcomes["prefetched"] += started
        return started

    def metrics(self) -> dict[str, Any]:
        return {
            "tiers": {t.name: t.metrics.snapshot() for t in self.tiers},
            "outcomes": dict(self._outcomes),
            "inflight": len(self._inflight),
            "unpacked": self.unpacked.snapshot(),
        }

    # -- single flight
    def _flight(self, digest: str, *, prefetch: bool = False) -> asyncio.Task[Path]:
        task = self._inflight.get(digest)
        if task is not None:
            self._outcomes["coalesced"] += 1
            return task
        task = asyncio.create_task(self._load(digest), name=f"envpool-image-fetch {digest[:19]}")
        self._inflight[digest] = task
        task.add_done_callback(partial(self._landed, digest, prefetch))
        return task

    def _landed(self, digest: str, prefetch: bool, task: asyncio.Task[Path]) -> None:
        if self._inflight.get(digest) is task:
            del self._inflight[digest]
        if task.cancelled():
            return
        exc = task.exception()  # retrieved here so a prefetch nobody awaits does not warn
        if exc is not None and prefetch:
            log.warning("prefetch of %s failed: %s", digest, exc)

    async def _load(self, digest: str) -> Path:
        await self.start()
        path = self.path_of(digest)
        lock = await self._node_flight(path)
        if lock is None:  # another process sharing unpack_dir unpacked it
            self._outcomes["ready"] += 1
            await self._used(path.name)
            return path
        try:
            return await self._fetch_and_unpack(digest)
        finally:
            if lock >= 0:
                unlock(self.unpack_root, path.name, lock)

    async def _node_flight(self, path: Path) -> int | None:
        """The node's lock on loading the bundle at ``path`` (single flight across the
        processes sharing unpack_dir, as ``_flight`` is within one): its descriptor, -1 if
        its holder kept it past ``_NODE_FLIGHT_WAIT_S`` (loaded here all the same), or None
        once the bundle is there whole."""
        waited = 0.0
        while not await asyncio.to_thread(complete, path):
            fd = try_lock(self.unpack_root, path.name)
            if fd is not None:
                try:
                    whole = await asyncio.to_thread(complete, path)
                except BaseException:  # (cancelled: the lock must not outlive this load)
                    unlock(self.unpack_root, path.name, fd)
                    raise
                if not whole:
                    return fd
                unlock(self.unpack_root, path.name, fd)  # its holder finished as we looked
                break
            if waited >= _NODE_FLIGHT_WAIT_S:
                log.warning(
                    "another process has held the load of %s for %ss: loading it here too",
                    path.name,
                    _NODE_FLIGHT_WAIT_S,
                )
                return -1
            await asyncio.sleep(_NODE_FLIGHT_POLL_S)
            waited += _NODE_FLIGHT_POLL_S
        return None

    async def _fetch_and_unpack(self, digest: str) -> Path:
        data: Blob | None = None
        unpacking: asyncio.Future[tuple[Path, int]] | None = None
        try:
            async with self._fetch_slots:
                data, found_at = await self._fetch(digest)
            # (a blob in a file is in the disk tier already, or was too big for it)
            faster = [
                t
                for t in self.tiers[:found_at]
                if t.writable and (isinstance(data, bytes) or t is not self._disk)
            ]
            # unpack while the copies are written back; _write_back never raises. Not
            # cancelled with the load (only the close cancels it): its thread would go on
            unpacking = self._unpack(digest, data)
            await asyncio.gather(*(self._write_back(t, digest, data) for t in faster))
            path, size = await asyncio.shield(unpacking)
        except ImageNotFound:
            self._outcomes["not_found"] += 1
            raise
        except ImageError as e:
            self._outcomes["failed"] += 1
            log.warning("fetching image %s failed: %s", digest, e)
            raise
        except Exception as e:  # not ours (an OSError unpacking: a full disk): counted all the same
            self._outcomes["failed"] += 1
            log.warning("loading image %s failed: %s: %s", digest, type(e).__name__, e)
            raise
        finally:
            if data is not None and not isinstance(data, bytes):
                # once its unpack is done: a cancelled load's thread may still read it
                if unpacking is None or unpacking.done():
                    data.close()
                else:
                    unpacking.add_done_callback(partial(_close, data))
        self._outcomes["loaded"] += 1
        self.unpacked.added(path.name, size)
        await self._evict(keep=path.name)
        return path

    async def _used(self, hex_: str) -> None:
        if not self.unpacked.known(hex_):  # unpacked by another process sharing the directory
            self.unpacked.added(hex_, await asyncio.to_thread(self.unpacked.sized, hex_))
            self.unpacked.used(hex_)
            await self._evict(keep=hex_)
        else:
            self.unpacked.used(hex_)

    async def _evict(self, keep: str | None = None) -> None:
        victims = self.unpacked.evict(keep)
        self._watch_budget()
        if victims:  # renamed away already: deleting them off the loop races with nothing
            await asyncio.to_thread(remove_all, victims)

    # -- the walk
    async def _fetch(self, digest: str) -> tuple[Blob, int]:
        r = self.retry
        stop: stop_base = stop_after_attempt(r.attempts)
        if r.deadline_s is not None:
            stop = stop | stop_after_delay(r.deadline_s)
        retrying = AsyncRetrying(
            stop=stop,
            wait=wait_random_exponential(multiplier=r.backoff_s, max=r.max_backoff_s),
            retry=retry_if_exception(_retryable),
            before_sleep=partial(self._before_retry, digest),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._walk(digest)
        raise AssertionError("unreachable: tenacity reraises the last error")

    def _before_retry(self, digest: str, state: RetryCallState) -> None:
        self._outcomes["retries"] += 1
        exc = state.outcome.exception() if state.outcome else None
        log.info("retrying image %s after attempt %d: %s", digest, state.attempt_number, exc)

    async def _walk(self, digest: str) -> tuple[Blob, int]:
        """One pass over the tiers. Its verdict is the last tier's: a miss there means the
        image does not exist (final), a fault there means try again later. Behind a disk
        tier, a blob is streamed into it (``_get``) and handed on as its file."""
        last_error: ImageFetchError | None = None
        for i, tier in enumerate(self.tiers):
            data: bytes | BinaryIO | _Streamed | None = None
            try:
                data = await self._get(tier, i, digest)
                if data is not None and not isinstance(data, _Streamed):
                    # hashing releases the GIL; off the loop so an 8 GB check does not stall it
                    await asyncio.to_thread(verify, data, digest, source=tier.name)
            except DigestMismatch as e:
                # bytes, not the image: counted corrupt, not a hit (a tier whose every copy is
                # bad read as a healthy hit ratio)
                tier.metrics.hits -= 1
                tier.metrics.corrupt += 1
                self._outcomes["corrupt"] += 1
                then = "trying the next tier" if i + 1 < len(self.tiers) else "fetching it again"
                log.warning("%s; dropping it and %s", e, then)
                if data is not None and not isinstance(data, bytes | _Streamed):
                    data.close()  # (a disk tier's file)
                await self._drop(tier, digest)
                last_error = e
                continue
            except ImageFetchError as e:
                log.info("tier %s failed for %s: %s", tier.name, digest, e)
                last_error = e
                continue
            if data is None:
                last_error = None
                continue
            return (data.file if isinstance(data, _Streamed) else data), i
        if last_error is not None:
            raise last_error
        raise ImageNotFound(digest, [t.name for t in self.tiers])

    async def _get(self, tier: Tier, i: int, digest: str) -> bytes | BinaryIO | _Streamed | None:
        """``tier``'s copy of the blob: its bytes; a disk tier's file; or, behind a disk
        tier, streamed into that tier a chunk at a time (its digest checked as it came):
        an image larger than memory is never held whole. A disk that cannot take it (full)
        is passed by: the blob is read into memory, as with no disk tier."""
        disk = self._disk
        if tier is disk:
            return await disk.open_blob(digest)
        if disk is None or self.tiers.index(disk) > i:
            return await tier.get(digest)
        async with tier.stream(digest) as chunks:
            if chunks is None:
                return None
            try:
                return _Streamed(await disk.put_stream(digest, chunks, source=tier.name))
            except ImageFetchError as e:
                if e.tier != disk.name or isinstance(e, DigestMismatch):
                    raise
                log.warning("could not stream %s into %s (%s): reading it into memory", digest, disk.name, e)
        return await tier.get(digest)

    async def _drop(self, tier: Tier, digest: str) -> None:
        try:
            await tier.delete(digest)
        except ImageError as e:
            log.warning("could not drop corrupt %s from %s: %s", digest, tier.name, e)

    async def _write_back(self, tier: Tier, digest: str, data: Blob) -> None:
        try:
            if isinstance(data, bytes):
                await tier.put(digest, data)
            else:
                # a reader of its own: the unpack reads the same file meanwhile
                with second_reader(data) as f:
                    await tier.put_file(digest, f)
        except (ImageError, OSError) as e:
            # the image is in hand; a tier that cannot keep a copy costs a later fetch only
            log.warning("could not write %s back to %s: %s", digest, tier.name, e)

    def _unpack(self, digest: str, data: Blob) -> asyncio.Future[tuple[Path, int]]:
        """The bundle unpacked in a thread (``unpack_tree``), tracked for the close."""
        work = partial(
            unpack_tree,
            self.unpack_root,
            digest,
            data,
            max_bytes=self.max_unpacked_bytes,
            precompile=self.precompile,
            stop=self._stopping.is_set,
        )
        future = asyncio.ensure_future(asyncio.to_thread(work))
        self._unpacks.add(future)
        future.add_done_callback(self._unpacked)
        return future

    def _unpacked(self, future: asyncio.Future[tuple[Path, int]]) -> None:
        self._unpacks.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: a load the close cancelled no longer awaits it
