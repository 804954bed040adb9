"""The tiered image cache: bundles, tiers, single-flight, retries, corruption, metrics.

Everything is real: HTTP on 127.0.0.1 (FakeOrigin), S3 through moto, files in tmp_path.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import io
import logging
import os
import shutil
import sys
import tarfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

import envpool.images.cache as cache_module
from envpool.errors import InfraError
from envpool.images import (
    Bundle,
    CacheConfig,
    DigestMismatch,
    DiskTier,
    DiskTierConfig,
    HttpTier,
    ImageError,
    ImageFetchError,
    ImageNotFound,
    ImageRef,
    InvalidImageRef,
    OriginTierConfig,
    PeerTierConfig,
    RetryPolicy,
    S3Tier,
    S3TierConfig,
    TieredCache,
    UnsafeBundle,
    build_bundle,
    digest_of,
    unpack,
    verify,
)
from envpool.images.fake_origin import FakeOrigin, Faults

FAST_RETRY = RetryPolicy(attempts=4, backoff_s=0.001, max_backoff_s=0.01)


def make_tree(root: Path, *, payload: bytes = b"x" * 1000) -> Path:
    (root / "pkg" / "data").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (root / "pkg" / "data" / "blob.bin").write_bytes(payload)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    os.symlink("pkg/__init__.py", root / "link.py")
    return root


@pytest.fixture
def bundle(tmp_path: Path) -> Bundle:
    return build_bundle(make_tree(tmp_path / "src"))


def cache_with(
    tmp_path: Path, origin_url: str, *, node: str = "a", retry: RetryPolicy = FAST_RETRY
) -> TieredCache:
    return TieredCache(
        [
            DiskTier(DiskTierConfig(path=tmp_path / node / "l1", max_bytes=10 * 2**20)),
            HttpTier(OriginTierConfig(url=origin_url)),
        ],
        unpack_dir=tmp_path / node / "unpacked",
        retry=retry,
    )


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


def tar_gz(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, *, type: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = type
    info.linkname = linkname
    info.mode = 0o644
    return info


# -- bundles


def test_bundle_is_deterministic(tmp_path: Path) -> None:
    a = build_bundle(make_tree(tmp_path / "a"))
    b_root = make_tree(tmp_path / "b")
    os.utime(b_root / "run.sh", (1, 1))  # other mtimes, same content
    b = build_bundle(b_root)
    assert a.digest == b.digest == digest_of(a.data)
    (b_root / "run.sh").write_text("#!/bin/sh\necho changed\n")
    assert build_bundle(b_root).digest != a.digest


def test_bundle_round_trip(tmp_path: Path, bundle: Bundle) -> None:
    unpack(bundle.data, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (out / "pkg" / "data" / "blob.bin").read_bytes() == b"x" * 1000
    assert os.access(out / "run.sh", os.X_OK)
    assert (out / "empty").is_dir()
    assert (out / "link.py").is_symlink() and (out / "link.py").read_text() == "VALUE = 42\n"


def test_build_refuses_symlink_out_of_the_root(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "src")
    os.symlink("../../etc/passwd", root / "pkg" / "evil")
    with pytest.raises(UnsafeBundle, match="outside"):
        build_bundle(root)


def test_image_ref_and_digest_checks(bundle: Bundle) -> None:
    ref = ImageRef.parse(f"envs/frozenlake@{bundle.digest}")
    assert (ref.name, ref.digest) == ("envs/frozenlake", bundle.digest)
    assert str(ref) == f"envs/frozenlake@{bundle.digest}"
    assert ImageRef.parse(bundle.digest).name == ""
    for bad in ["envs/x", "envs/x@sha256:abc", f"x@{bundle.digest.upper()}", "a b@" + bundle.digest, ""]:
        with pytest.raises(InvalidImageRef, match="expected 'name@sha256"):
            ImageRef.parse(bad)
    verify(bundle.data, bundle.digest)
    with pytest.raises(DigestMismatch, match="expected " + bundle.digest) as e:
        verify(bundle.data + b"!", bundle.digest, source="mirror")
    assert e.value.retryable and isinstance(e.value, InfraError)


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([(member("/etc/cron.d/x"), b"boom")], "absolute"),
        ([(member("../outside.txt"), b"boom")], r"'\.\.'"),
        ([(member("a/../../outside.txt"), b"boom")], r"'\.\.'"),
        ([(member("ln", type=tarfile.SYMTYPE, linkname="/etc/passwd"), None)], "absolute path"),
        ([(member("a/ln", type=tarfile.SYMTYPE, linkname="../../etc"), None)], "outside"),
        ([(member("hard", type=tarfile.LNKTYPE, linkname="../../etc/passwd"), None)], "outside"),
        ([(member("dev", type=tarfile.CHRTYPE), None)], "device"),
        ([(member("blk", type=tarfile.BLKTYPE), None)], "device"),
        ([(member("fifo", type=tarfile.FIFOTYPE), None)], "fifo"),
    ],
    ids=["abs", "dotdot", "dotdot2", "abs-symlink", "symlink-out", "hardlink-out", "chr", "blk", "fifo"],
)
def test_unpack_refuses_path_attacks(tmp_path: Path, members: list, message: str) -> None:
    (tmp_path / "jail").mkdir()
    with pytest.raises(UnsafeBundle, match=message):
        unpack(tar_gz(*members), tmp_path / "jail" / "dest")
    assert list(tmp_path.rglob("*")) == [tmp_path / "jail"]  # refused before anything was written


def test_unpack_refuses_escape_through_a_symlink_chain(tmp_path: Path) -> None:
    # each link looks harmless on its own; only the real path on disk shows the escape
    data = tar_gz(
        (member("here", type=tarfile.SYMTYPE, linkname="."), None),
        (member("up", type=tarfile.SYMTYPE, linkname="here/.."), None),
        (member("up/escaped.txt"), b"boom"),
    )
    with pytest.raises(UnsafeBundle):
        unpack(data, tmp_path / "jail" / "dest")
    assert not (tmp_path / "jail" / "escaped.txt").exists()


def test_unpack_refuses_garbage_and_bombs(tmp_path: Path, bundle: Bundle) -> None:
    with pytest.raises(UnsafeBundle, match=r"not a tar\.gz"):
        unpack(b"definitely not gzip", tmp_path / "x")
    with pytest.raises(UnsafeBundle, match="over the 100-byte limit"):
        unpack(bundle.data, tmp_path / "y", max_bytes=100)


# -- L1 disk


async def test_disk_tier_evicts_least_recently_used(tmp_path: Path) -> None:
    blobs = [bytes([i]) * 100 for i in range(4)]
    digests = [digest_of(b) for b in blobs]
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1", max_bytes=250)) as l1:
        await l1.put(digests[0], blobs[0])
        await l1.put(digests[1], blobs[1])
        assert await l1.get(digests[0]) == blobs[0]  # 0 is now more recent than 1
        await l1.put(digests[2], blobs[2])
        assert await l1.get(digests[1]) is None
        assert await l1.get(digests[0]) == blobs[0]
        assert l1.total_bytes == 200 and l1.metrics.evictions == 1
        await l1.put(digests[3], blobs[3])  # evicts 2, the least recently used
        assert digests[2] not in l1 and digests[0] in l1
        assert l1.metrics.snapshot()["hits"] == 2
        # a blob bigger than the cap is not stored rather than emptying the tier
        await l1.put(digest_of(b"z" * 300), b"z" * 300)
        assert l1.total_bytes == 200
    files = sorted(p.name for p in (tmp_path / "l1" / "sha256").iterdir())
    assert files == sorted(d.removeprefix("sha256:") for d in (digests[0], digests[3]))  # no temp files


async def test_tiers_refuse_what_is_not_a_digest(tmp_path: Path) -> None:
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")) as l1:
        with pytest.raises(InvalidImageRef, match="bad digest"):
            await l1.put("sha256:../../../etc/cron.d/x", b"boom")
        with pytest.raises(InvalidImageRef, match="bad digest"):
            await l1.get("../l1")
        assert l1.total_bytes == 0 and l1.metrics.errors == 0


async def test_disk_tier_survives_restart_and_cleans_temp_files(tmp_path: Path) -> None:
    data = b"persisted"
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")) as l1:
        await l1.put(digest_of(data), data)
    store = tmp_path / "l1" / "sha256"
    (store / ".tmp-dead-writer").write_bytes(b"half")
    os.utime(store / ".tmp-dead-writer", (1, 1))
    (store / ".tmp-live-writer").write_bytes(b"half")  # a neighbour process, still writing
    (store / "README").write_text("not a blob")
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")) as l1:
        assert l1.total_bytes == len(data)
        assert await l1.get(digest_of(data)) == data
    assert {p.name for p in store.iterdir()} == {".tmp-live-writer", "README", digest_of(data)[7:]}


# -- the cache over a real HTTP origin


async def test_get_unpacks_once_and_writes_back_to_l1(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            path = await cache.get(f"envs/demo@{bundle.digest}")
            assert (path / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
            assert await cache.get(bundle.digest) == path
            m = cache.metrics()
        assert m["outcomes"] == {"loaded": 1, "ready": 1}
        assert m["tiers"]["disk"]["misses"] == 1 and m["tiers"]["disk"]["puts"] == 1
        assert m["tiers"]["origin"]["hits"] == 1 and m["tiers"]["origin"]["bytes_read"] == bundle.size
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp dirs left

        # a node restarted with its L1 but without the unpacked copy: served from disk
        shutil.rmtree(tmp_path / "a" / "unpacked")
        async with cache_with(tmp_path, origin.url) as cache:
            await cache.get(bundle.digest)
            assert cache.metrics()["tiers"]["disk"]["hits"] == 1
        assert origin.blob_requests[bundle.digest] == 1


async def test_single_flight_32_concurrent_gets_fetch_once(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, latency_s=0.05) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            paths = await asyncio.gather(*(cache.get(bundle.digest) for _ in range(32)))
            outcomes = cache.metrics()["outcomes"]
        assert len(set(paths)) == 1
        assert origin.blob_requests[bundle.digest] == 1 and origin.bytes_served == bundle.size
        assert outcomes == {"loaded": 1, "coalesced": 31}


async def test_a_cancelled_waiter_does_not_cancel_the_fetch(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, latency_s=0.1) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            impatient = asyncio.create_task(cache.get(bundle.digest))
            patient = asyncio.create_task(cache.get(bundle.digest))
            await asyncio.sleep(0.02)
            impatient.cancel()
            assert (await patient).is_dir()
        assert origin.blob_requests[bundle.digest] == 1


async def test_closing_the_cache_ends_waiting_gets_with_an_error(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, latency_s=5) as origin:
        cache = cache_with(tmp_path, origin.url)
        async with cache:
            waiter = asyncio.create_task(cache.get(bundle.digest))
            await until(lambda: origin.requests == 1)
        with pytest.raises(ImageError, match="closed while fetching"):
            await waiter
        with pytest.raises(ImageError, match="is closed"):
            await cache.get(bundle.digest)


async def test_corrupt_l1_blob_is_dropped_and_refetched(tmp_path: Path, bundle: Bundle) -> None:
    blob = tmp_path / "a" / "l1" / "sha256" / bundle.digest.removeprefix("sha256:")
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"bit rot" + bundle.data[7:])
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            await cache.get(bundle.digest)
            m = cache.metrics()
        assert m["tiers"]["disk"]["corrupt"] == 1 and m["outcomes"]["corrupt"] == 1
        assert m["tiers"]["disk"]["puts"] == 1  # the good copy replaced the bad one
        assert blob.read_bytes() == bundle.data
        assert origin.blob_requests[bundle.digest] == 1


class _UndeletableDisk(DiskTier):
    """A disk tier this process cannot delete from (a read-only or shared L1 directory; a
    chmod is no test here, where the tests may run as root)."""

    async def _delete(self, digest: str) -> None:
        raise PermissionError(13, "Permission denied", str(self.path_of(digest)))


async def test_a_corrupt_blob_that_cannot_be_dropped_does_not_stop_the_walk(
    tmp_path: Path, bundle: Bundle
) -> None:
    # the PermissionError of the delete escaped the walk: the origin, which had a good copy,
    # was never asked
    blob = tmp_path / "l1" / "sha256" / bundle.digest.removeprefix("sha256:")
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"bit rot" + bundle.data[7:])
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        disk = _UndeletableDisk(DiskTierConfig(path=tmp_path / "l1"))
        tiers = [disk, HttpTier(OriginTierConfig(url=origin.url))]
        async with TieredCache(tiers, unpack_dir=tmp_path / "u", retry=FAST_RETRY) as cache:
            path = await cache.get(bundle.digest)
            assert (path / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
            m = cache.metrics()
        assert m["tiers"]["disk"]["corrupt"] == 1 and m["tiers"]["origin"]["hits"] == 1


async def test_corrupt_download_is_refetched(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, faults=Faults(script=["corrupt"])) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            path = await cache.get(bundle.digest)
            m = cache.metrics()
        assert path.is_dir()
        assert origin.blob_requests[bundle.digest] == 2
        assert m["tiers"]["origin"]["corrupt"] == 1 and m["outcomes"]["retries"] == 1


async def test_persistent_corruption_surfaces_as_digest_mismatch(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, faults=Faults(corrupt_rate=1.0)) as origin:
        async with cache_with(tmp_path, origin.url, retry=FAST_RETRY.model_copy(update={"attempts": 3})) as c:
            with pytest.raises(DigestMismatch, match="wrong blob"):
                await c.get(bundle.digest)
            assert c.metrics()["outcomes"]["failed"] == 1
        assert origin.blob_requests[bundle.digest] == 3
    assert not (tmp_path / "a" / "unpacked" / "sha256" / bundle.digest[7:]).exists()


async def test_retries_injected_500s_and_resets(tmp_path: Path, bundle: Bundle) -> None:
    faults = Faults(script=["error", "reset", "error"])
    with FakeOrigin({bundle.digest: bundle.data}, faults=faults) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            assert (await cache.get(bundle.digest)).is_dir()
            m = cache.metrics()
        assert origin.faults_injected == {"error": 2, "reset": 1}
        assert origin.blob_requests[bundle.digest] == 4
        assert m["outcomes"]["retries"] == 3 and m["tiers"]["origin"]["errors"] == 3


async def test_gives_up_after_the_attempts(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, faults=Faults(error_rate=1.0)) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            with pytest.raises(ImageFetchError, match="HTTP 500") as e:
                await cache.get(bundle.digest)
        assert e.value.retryable and e.value.tier == "origin"
        assert origin.blob_requests[bundle.digest] == FAST_RETRY.attempts


async def test_a_garbled_compressed_reply_is_retried(tmp_path: Path, bundle: Bundle) -> None:
    """A reply that says gzip and is not (a proxy that mangled it) raised httpx.DecodingError,
    which is no TransportError: the tier called it "unexpected", not retryable, and the image
    failed at the first such reply. It is retried as a transport fault now."""
    with FakeOrigin({bundle.digest: bundle.data}, faults=Faults(script=["garble", "garble"])) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            assert (await cache.get(bundle.digest)).is_dir()
            m = cache.metrics()
        assert origin.faults_injected == {"garble": 2}
        assert m["outcomes"]["retries"] == 2 and m["tiers"]["origin"]["errors"] == 2


async def test_replies_garbled_every_time_fail_after_the_attempts_saying_so(
    tmp_path: Path, bundle: Bundle
) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, faults=Faults(garble_rate=1.0)) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            with pytest.raises(ImageFetchError, match="could not be decoded") as e:
                await cache.get(bundle.digest)
        assert e.value.retryable and e.value.tier == "origin"
        assert "Content-Encoding" in str(e.value) and "unexpected" not in str(e.value)
        assert origin.blob_requests[bundle.digest] == FAST_RETRY.attempts


async def test_missing_image_is_not_retried(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({}) as origin:
        async with cache_with(tmp_path, origin.url, retry=RetryPolicy(backoff_s=5)) as cache:
            with pytest.raises(ImageNotFound, match=r"none of the tiers \(disk, origin\)"):
                await asyncio.wait_for(cache.get(bundle.digest), 2)  # a backoff would take 5 s
            assert cache.metrics()["outcomes"] == {"not_found": 1}
        assert origin.blob_requests[bundle.digest] == 1


async def test_a_dead_tier_is_skipped(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin() as dead:
        dead_url = dead.url  # nothing listens there once closed
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        tiers = [
            HttpTier(PeerTierConfig(url=dead_url, connect_timeout_s=1)),
            HttpTier(OriginTierConfig(url=origin.url)),
        ]
        async with TieredCache(tiers, unpack_dir=tmp_path / "u", retry=FAST_RETRY) as cache:
            await cache.get(bundle.digest)
            m = cache.metrics()
        assert m["tiers"]["peer"]["errors"] == 1 and m["tiers"]["origin"]["hits"] == 1
        assert "retries" not in m["outcomes"]


class _Vanishing:
    """What ``os.scandir`` lists under ``root``, with the entries ``gone`` picks renamed away
    by a neighbour process right after the listing (an atomic write, an unpack, an eviction
    of a process sharing the directories): each is listed once more, then missing."""

    def __init__(self, root: Path, gone: Callable[[str], bool]):
        self.root, self.gone, self.vanished = str(root), gone, []
        self._scandir = os.scandir

    def __call__(self, path: Any = ".") -> Any:
        with self._scandir(path) as it:
            entries = list(it)
        if os.fspath(path).startswith(self.root):
            for e in entries:
                if self.gone(e.name):
                    os.rename(e.path, os.path.join(os.path.dirname(e.path), "moved-" + e.name))
                    self.vanished.append(e.name)
        return _Listing(entries)


class _Listing(list[Any]):
    """A listing that, like ``os.scandir``'s, is also a context manager."""

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # nothing to release


async def test_entries_renamed_away_during_the_starts_scans_do_not_fail_it(
    tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a neighbour's temp file renamed between the start's listing and its stat failed the
    # start with FileNotFoundError (and the failed start closed every tier for good)
    l1 = tmp_path / "a" / "l1" / "sha256"
    unpacked = tmp_path / "a" / "unpacked" / "sha256"
    l1.mkdir(parents=True)
    (l1 / ".tmp-neighbour-write").write_bytes(b"half")
    (unpacked / ".tmp-neighbour-unpack").mkdir(parents=True)
    (unpacked / ("f" * 64)).mkdir()  # a neighbour's bundle, evicted by it as we start
    vanishing = _Vanishing(tmp_path, lambda name: name.startswith(".tmp-") or name == "f" * 64)
    monkeypatch.setattr(os, "scandir", vanishing)
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            monkeypatch.undo()
            path = await cache.get(bundle.digest)
            assert (path / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert sorted(vanishing.vanished) == sorted([".tmp-neighbour-write", ".tmp-neighbour-unpack", "f" * 64])


class _LateOrigin(HttpTier):
    """An origin whose first start fails (its endpoint not up yet)."""

    starts = 0

    async def _start(self) -> None:
        self.starts += 1
        if self.starts == 1:
            raise ImageFetchError("not reachable yet", tier=self.name)
        await super()._start()


async def test_a_failed_start_does_not_close_the_cache_for_good(tmp_path: Path, bundle: Bundle) -> None:
    # a start that failed closed every tier, and a closed tier never starts again: every
    # later get failed with "tier 'disk' is closed" though nothing was wrong any more
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")) as seed:
        await seed.put(bundle.digest, bundle.data)  # a blob already in L1, found by its scan
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        disk = DiskTier(DiskTierConfig(path=tmp_path / "l1"))
        late = _LateOrigin(OriginTierConfig(url=origin.url))
        cache = TieredCache([disk, late], unpack_dir=tmp_path / "u", retry=FAST_RETRY)
        with pytest.raises(ImageFetchError, match="not reachable yet"):
            await cache.get(bundle.digest)
        path = await cache.get(bundle.digest)  # the start is tried again, and works
        assert (path / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
        assert disk.total_bytes == bundle.size  # scanned again, not counted twice
        await cache.aclose()
        with pytest.raises(ImageError, match="closed"):  # the cache's own close is for good
            await cache.get(bundle.digest)


async def test_unsafe_bundle_with_a_valid_digest_is_refused(tmp_path: Path) -> None:
    evil = tar_gz((member("../../escape.txt"), b"boom"))
    digest = digest_of(evil)
    with FakeOrigin({digest: evil}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            with pytest.raises(UnsafeBundle, match=r"'\.\.'"):
                await cache.get(digest)
        assert origin.blob_requests[digest] == 1  # not retried
    assert list((tmp_path / "a" / "unpacked" / "sha256").iterdir()) == []
    assert not (tmp_path / "escape.txt").exists()


async def test_prefetch_runs_in_the_background(tmp_path: Path, bundle: Bundle) -> None:
    other = build_bundle(make_tree(tmp_path / "other", payload=b"y" * 5000))
    with FakeOrigin({bundle.digest: bundle.data, other.digest: other.data}, latency_s=0.05) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            assert cache.prefetch([f"envs/a@{bundle.digest}", other.digest, other.digest]) == 2
            assert cache.metrics()["inflight"] == 2
            assert cache.prefetch([bundle.digest]) == 0  # already on its way
            # landed: unpacked, and the flight done (a get joining a flight still closing is "coalesced")
            await until(
                lambda: (
                    cache.metrics()["inflight"] == 0
                    and all(cache.path_of(b.digest).is_dir() for b in (bundle, other))
                )
            )
            await cache.get(bundle.digest)
            m = cache.metrics()
        assert m["outcomes"] == {"prefetched": 2, "loaded": 2, "ready": 1}
        assert origin.blob_requests == {bundle.digest: 1, other.digest: 1}


async def test_a_failed_prefetch_is_retried_by_get(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}, faults=Faults(script=["error"] * 2)) as origin:
        retry = FAST_RETRY.model_copy(update={"attempts": 2})
        async with cache_with(tmp_path, origin.url, retry=retry) as cache:
            cache.prefetch([bundle.digest])
            await until(lambda: cache.metrics()["inflight"] == 0)
            assert cache.metrics()["outcomes"]["failed"] == 1
            assert (await cache.get(bundle.digest)).is_dir()
        assert origin.blob_requests[bundle.digest] == 3


def payload_bundle(tmp_path: Path, name: str, size: int) -> Bundle:
    """A bundle that unpacks to ``size`` bytes (one file)."""
    root = tmp_path / "src" / name
    root.mkdir(parents=True)
    (root / "data.bin").write_bytes(name.encode() * size)
    return build_bundle(root)


def origin_cache(tmp_path: Path, url: str, budget: int | None) -> TieredCache:
    tiers = [HttpTier(OriginTierConfig(url=url))]
    return TieredCache(tiers, unpack_dir=tmp_path / "u", retry=FAST_RETRY, unpacked_budget_bytes=budget)


async def test_unpacked_bundles_are_evicted_least_recently_used_to_the_budget(tmp_path: Path) -> None:
    # they were never evicted: a run over many images filled the node's disk
    a, b, c = (payload_bundle(tmp_path, x, 10_000) for x in "abc")
    with FakeOrigin({x.digest: x.data for x in (a, b, c)}) as origin:
        async with origin_cache(tmp_path, origin.url, 25_000) as cache:
            pa, pb = await cache.get(a.digest), await cache.get(b.digest)
            await cache.get(a.digest)  # a is used again: b is the least recently used
            pc = await cache.get(c.digest)
            assert pa.is_dir() and pc.is_dir() and not pb.exists()
            m = cache.metrics()["unpacked"]
            assert m["evictions"] == 1 and m["bundles"] == 2 and m["bytes"] == 20_000
            assert (await cache.get(b.digest) / "data.bin").read_bytes() == b"b" * 10_000  # fetched again
            assert not pa.exists() and pc.is_dir()  # a was the least recently used by then
        # a restart keeps the order (directory mtimes) and enforces a smaller budget at once
        async with origin_cache(tmp_path, origin.url, 10_000) as cache:
            assert pb.is_dir() and not pc.exists()
        leftovers = [p.name for p in (tmp_path / "u" / "sha256").iterdir() if p.name.startswith(".")]
        assert leftovers == []  # evicted directories are deleted, not left renamed


@contextlib.asynccontextmanager
async def pinned_by_another_process(bundle: Path) -> AsyncIterator[None]:
    """``bundle`` pinned (its shared flock held) by another process sharing the directory,
    as another pool on the node pins it, until the block ends."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
        "fcntl.flock(fd, fcntl.LOCK_SH)\n"
        "print('pinned', flush=True)\n"
        "sys.stdin.read()\n",
        str(bundle),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"pinned\n"
        yield
    finally:
        holder.stdin.close()
        await holder.wait()


async def test_a_pinned_bundle_is_never_evicted(tmp_path: Path) -> None:
    a, b, c, d = (payload_bundle(tmp_path, x, 10_000) for x in "abcd")
    with FakeOrigin({x.digest: x.data for x in (a, b, c, d)}) as origin:
        async with origin_cache(tmp_path, origin.url, 15_000) as cache:
            pa = await cache.acquire(a.digest)  # a container runs from it
            pb = await cache.get(b.digest)  # over the budget, and nothing may go
            assert pa.is_dir() and pb.is_dir() and cache.metrics()["unpacked"]["over_budget"] == 1
            cache.release(a.digest)
            pc = await cache.get(c.digest)
            assert not pa.exists() and not pb.exists() and pc.is_dir()
            # pinned by another process sharing the directory (another pool on this node)
            async with pinned_by_another_process(pc):
                pd = await cache.get(d.digest)
                assert pc.is_dir() and pd.is_dir()
            assert cache.metrics()["unpacked"]["pinned"] == 0


async def test_a_bundle_another_process_stops_pinning_is_evicted_without_a_call_here(tmp_path: Path) -> None:
    # an eviction skipped a bundle another process sharing unpack_dir had pinned, and was not
    # tried again before this process's next unpack or release: one that held its own pins
    # and fetched nothing new (a busy pool on its images) kept the node over for good
    c, d = (payload_bundle(tmp_path, x, 10_000) for x in "cd")
    with FakeOrigin({x.digest: x.data for x in (c, d)}) as origin:
        async with origin_cache(tmp_path, origin.url, 15_000) as cache:
            pc = await cache.get(c.digest)
            async with pinned_by_another_process(pc):
                pd = await cache.acquire(d.digest)  # over the budget: c is pinned over there
                assert pc.is_dir() and cache.metrics()["unpacked"]["over_budget"] == 1
            await until(lambda: not pc.exists(), timeout_s=10)  # no get, no release meanwhile
            m = cache.metrics()["unpacked"]
            assert pd.is_dir() and m["bytes"] == 10_000 and m["evictions"] == 1, m
            assert m["over_budget"] == 1  # warned once, not at every try
            cache.release(d.digest)


async def test_a_released_bundle_over_the_budget_is_evicted_at_its_release(tmp_path: Path) -> None:
    # the budget was enforced only after an unpack: a run that unpacked nothing new after its
    # containers stopped kept the node over the budget (by whatever they had pinned) for good
    a, b = (payload_bundle(tmp_path, x, 10_000) for x in "ab")
    with FakeOrigin({x.digest: x.data for x in (a, b)}) as origin:
        async with origin_cache(tmp_path, origin.url, 15_000) as cache:
            pa = await cache.acquire(a.digest)
            await cache.acquire(a.digest)  # two containers run from a
            pb = await cache.get(b.digest)  # over the budget: a is pinned
            assert cache.metrics()["unpacked"]["bytes"] == 20_000
            cache.release(a.digest)  # one of them stops: a is still in use
            assert pa.is_dir() and cache.metrics()["unpacked"]["over_budget"] == 1  # not warned again
            cache.release(a.digest)
            assert not pa.exists() and pb.is_dir()
            assert cache.metrics()["unpacked"]["bytes"] == 10_000
            assert cache.metrics()["unpacked"]["evictions"] == 1
        leftovers = [p.name for p in (tmp_path / "u" / "sha256").iterdir() if p.name.startswith(".")]
        assert leftovers == []  # the evicted directory is deleted by the close at the latest


def _until_gone(path: Path, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_an_eviction_retried_in_asyncio_runs_shutdown_is_quiet_and_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the retry timer of a cache never closed fired while asyncio.run shut the loop down:
    # its deletion went to the default executor, shut down by then, and the loop logged
    # "Task exception was never retrieved" (RuntimeError), the bundle left renamed away
    monkeypatch.setattr(cache_module, "_OVER_BUDGET_RETRY_S", 0.05)
    c, d = (payload_bundle(tmp_path, x, 10_000) for x in "cd")
    with FakeOrigin({x.digest: x.data for x in (c, d)}) as origin:

        async def main() -> tuple[TieredCache, Path]:
            cache = origin_cache(tmp_path, origin.url, 15_000)
            pc = await cache.get(c.digest)
            fd = os.open(pc, os.O_RDONLY | os.O_DIRECTORY)
            fcntl.flock(fd, fcntl.LOCK_SH)  # a pin as another process's (a lock of its own)
            await cache.acquire(d.digest)  # over the budget: c is pinned over there
            assert cache.metrics()["unpacked"]["over_budget"] == 1
            os.close(fd)  # that pin drops: the next try takes c
            # asyncio.run's shutdown waits for the default executor, held until that try
            asyncio.get_running_loop().run_in_executor(None, _until_gone, pc)
            return cache, pc  # never closed

        with caplog.at_level(logging.WARNING, logger="asyncio"):
            cache, pc = asyncio.run(main())
            gc.collect()
        cache.unpacked.unpin_all()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []
    assert not pc.exists()
    leftovers = [p.name for p in (tmp_path / "u" / "sha256").iterdir() if p.name.startswith(".")]
    assert leftovers == []  # deleted, not left renamed away


class _BetweenGetAndPin(TieredCache):
    """Runs ``then`` once, right after a get returns: what else the loop runs in the turns
    before ``acquire`` resumes to pin (a container's stop releasing its bundle, an unpack)."""

    then: Callable[[], None] | None = None

    async def get(self, image: str) -> Path:
        path = await super().get(image)
        if self.then is not None:
            then, self.then = self.then, None
            then()
        return path


def _between_cache(tmp_path: Path, url: str) -> _BetweenGetAndPin:
    tiers = [HttpTier(OriginTierConfig(url=url))]
    return _BetweenGetAndPin(tiers, unpack_dir=tmp_path / "u", retry=FAST_RETRY, unpacked_budget_bytes=15_000)


async def test_a_bundle_being_acquired_is_not_evicted_by_this_process_before_its_pin(tmp_path: Path) -> None:
    # the fetch of b lands over the budget (a and d are pinned) and is kept; a release in the
    # turns before acquire pinned it evicted it (d is still pinned, so a's bytes were not
    # enough): acquire fetched it again, and after three times in a row gave up
    a, b, d = (payload_bundle(tmp_path, x, 10_000) for x in "abd")
    with FakeOrigin({x.digest: x.data for x in (a, b, d)}) as origin:
        async with _between_cache(tmp_path, origin.url) as cache:
            pa, _ = await cache.acquire(a.digest), await cache.acquire(d.digest)
            cache.then = lambda: cache.release(a.digest)
            pb = await cache.acquire(b.digest)
            assert pb.is_dir() and not pa.exists()
            assert origin.blob_requests[b.digest] == 1  # fetched once, pinned at once
            cache.release(b.digest)
            cache.release(d.digest)
            assert cache.metrics()["unpacked"]["pinned"] == 0


async def test_an_acquire_that_keeps_losing_its_bundle_says_which_budget_to_raise(tmp_path: Path) -> None:
    # another process sharing unpack_dir evicts it each time before the pin: the error said
    # only that it "kept being evicted"
    a = payload_bundle(tmp_path, "a", 10_000)
    with FakeOrigin({a.digest: a.data}) as origin:
        cache = _between_cache(tmp_path, origin.url)

        def neighbour_evicts() -> None:
            shutil.rmtree(cache.path_of(a.digest))
            cache.then = neighbour_evicts  # every time

        cache.then = neighbour_evicts
        async with cache:
            with pytest.raises(ImageError, match=r"unpacked_budget_bytes \(15000 bytes.*unpack_dir"):
                await cache.acquire(a.digest)
            cache.then = None
            assert cache.metrics()["unpacked"]["pinned"] == 0


async def test_peer_tier_serves_another_nodes_l1(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        async with cache_with(tmp_path, origin.url, node="a") as node_a:
            await node_a.get(bundle.digest)
        # node b reads node a's L1 over HTTP before going to the origin
        with FakeOrigin(tmp_path / "a" / "l1") as peer:
            tiers = [
                DiskTier(DiskTierConfig(path=tmp_path / "b" / "l1")),
                HttpTier(PeerTierConfig(url=peer.url)),
                HttpTier(OriginTierConfig(url=origin.url)),
            ]
            async with TieredCache(tiers, unpack_dir=tmp_path / "b" / "unpacked") as node_b:
                await node_b.get(bundle.digest)
                m = node_b.metrics()
        assert m["tiers"]["peer"]["hits"] == 1 and m["tiers"]["disk"]["puts"] == 1
        assert origin.blob_requests[bundle.digest] == 1


# -- L2 on S3 (moto)


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    moto = pytest.importorskip("moto")
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with moto.mock_aws():
        import boto3

        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="images")
        yield "images"


async def test_s3_tier_against_moto(s3: str) -> None:
    data = b"bundle bytes"
    digest = digest_of(data)
    async with S3Tier(S3TierConfig(bucket=s3)) as tier:
        assert await tier.get(digest) is None
        await tier.put(digest, data)
        assert await tier.get(digest) == data
        await tier.delete(digest)
        assert await tier.get(digest) is None
        assert tier.metrics.snapshot() | {"get_latency_ms": None} == {
            "hits": 1,
            "misses": 2,
            "errors": 0,
            "corrupt": 0,
            "puts": 1,
            "put_errors": 0,
            "evictions": 0,
            "bytes_read": len(data),
            "bytes_written": len(data),
            "get_latency_ms": None,
        }
    async with S3Tier(S3TierConfig(bucket="no-such-bucket")) as tier:
        with pytest.raises(ImageFetchError, match="does not exist: create it") as e:
            await tier.get(digest)
        assert not e.value.retryable


async def test_s3_shares_an_image_between_nodes(s3: str, tmp_path: Path, bundle: Bundle) -> None:
    def config(node: str, origin_url: str) -> CacheConfig:  # as a node would read it from YAML
        return CacheConfig.model_validate(
            {
                "tiers": [
                    {"type": "disk", "path": str(tmp_path / node / "l1"), "max_bytes": 2**20},
                    {"type": "s3", "bucket": s3, "name": "cluster"},
                    {"type": "origin", "url": origin_url},
                ],
                "unpack_dir": str(tmp_path / node / "unpacked"),
                "retry": FAST_RETRY.model_dump(),
            }
        )

    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        metrics = []
        for node in ("a", "b"):
            async with TieredCache.from_config(config(node, origin.url)) as cache:
                await asyncio.gather(*(cache.get(bundle.digest) for _ in range(8)))
                metrics.append(cache.metrics()["tiers"])
        assert origin.blob_requests[bundle.digest] == 1
    assert metrics[0]["cluster"]["puts"] == 1 and metrics[0]["disk"]["puts"] == 1
    assert metrics[1]["cluster"]["hits"] == 1 and metrics[1]["disk"]["puts"] == 1
    assert metrics[1]["origin"]["get_latency_ms"]["n"] == 0


def test_configs_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        CacheConfig.model_validate({"tiers": [{"type": "ftp"}], "unpack_dir": str(tmp_path)})
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DiskTierConfig.model_validate({"path": str(tmp_path), "max_gb": 3})
    with pytest.raises(ValidationError, match="at least 1 item"):
        CacheConfig.model_validate({"tiers": [], "unpack_dir": str(tmp_path)})


# -- the fake origin itself


def test_fake_origin_limits_bandwidth_and_leaves_no_threads() -> None:
    before = set(threading.enumerate())
    data = os.urandom(200_000)
    with FakeOrigin({digest_of(data): data}, bandwidth_bps=1_000_000) as origin:
        with httpx.Client(base_url=origin.url) as client:
            t0 = time.perf_counter()
            assert client.get(f"/blobs/{digest_of(data)}").content == data
            elapsed = time.perf_counter() - t0
            assert client.get("/blobs/sha256:" + "0" * 64).status_code == 404
            assert client.get("/nope").status_code == 404
        assert 0.15 < elapsed < 2.0
        assert origin.stats()["requests"] == 3 and origin.bytes_served == len(data)
        with httpx.Client(base_url=origin.url) as client:
            client.get("/nope")
            origin.close()  # while a kept-alive connection holds a handler thread
    assert set(threading.enumerate()) == before
