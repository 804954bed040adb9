"""The tiered image cache over a real HTTP origin: one unpack written back to L1,
single-flight gets, cancels and close, corruption (in L1, in a download, persistent),
retries and what is not retried, a dead tier, starts that fail or race a neighbour's
renames, unsafe bundles, prefetch. Bundles, tiers and the unpacked budget have their own
test_image_*.py modules.

Everything is real: HTTP on 127.0.0.1 (FakeOrigin), files in tmp_path.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from image_cache_helpers import FAST_RETRY, cache_with, make_tree, member, tar_gz, until

from envpool.images import (
    Bundle,
    DigestMismatch,
    DiskTier,
    DiskTierConfig,
    HttpTier,
    ImageError,
    ImageFetchError,
    ImageNotFound,
    OriginTierConfig,
    PeerTierConfig,
    RetryPolicy,
    TieredCache,
    UnsafeBundle,
    build_bundle,
    digest_of,
)
from envpool.images.fake_origin import FakeOrigin, Faults

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


def _open_dir() -> Path:
    node = Path(tempfile.mkdtemp(prefix="envpool-test-"))  # (pytest's tmp_path is root's alone)
    node.chmod(0o755)
    return node


def _read_as_nobody(node: Path, path: Path) -> subprocess.CompletedProcess[str]:
    for d in (node / "a", node / "a" / "unpacked", path.parent):
        d.chmod(0o755)  # (made with the umask, which an operator may set so)
    read = ["cat", str(path / "run.sh")]  # (not this venv's python: under a dir of root's)
    return subprocess.run(read, capture_output=True, text=True, user=65534, group=65534, timeout=60)


async def test_an_unpacked_bundle_is_open_to_every_user_as_its_members_are(bundle: Bundle) -> None:
    # the bundle's directories are 0755 and its files 0644, but its root was mkdtemp's 0700:
    # a container (or an environment's sandbox) running as another user could read none of it
    node = _open_dir()
    try:
        with FakeOrigin({bundle.digest: bundle.data}) as origin:
            async with cache_with(node, origin.url) as cache:
                path = await cache.get(bundle.digest)
        assert stat.S_IMODE(os.stat(path).st_mode) == stat.S_IMODE(os.stat(path / "pkg").st_mode) == 0o755
        if os.geteuid() == 0:  # another user's eyes: nobody's
            out = _read_as_nobody(node, path)
            assert out.returncode == 0 and "echo hi" in out.stdout, out.stderr
    finally:
        shutil.rmtree(node)


async def test_an_unpacked_bundle_is_open_to_every_user_whatever_the_umask(
    tmp_path: Path, bundle: Bundle
) -> None:
    # the root is chmod-ed 0755, but tarfile's data filter drops a directory's mode (mkdir
    # with the umask) and the bytecode compile writes with the umask too: under an operator's
    # umask 077 the bundle's directories were 0700 and its bytecode 0600, closed to a
    # container (or an environment's sandbox) of another user
    old = os.umask(0o077)
    try:
        with FakeOrigin({bundle.digest: bundle.data}) as origin:
            async with cache_with(tmp_path, origin.url) as cache:
                path = await cache.get(bundle.digest)
    finally:
        os.umask(old)
    dirs, files = {}, {}
    for parent, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            p = Path(parent) / name
            if not p.is_symlink():
                (dirs if p.is_dir() else files)[str(p.relative_to(path))] = stat.S_IMODE(p.lstat().st_mode)
    assert {"pkg", "pkg/data", "empty", "pkg/__pycache__"} <= dirs.keys()
    assert {name: oct(mode) for name, mode in dirs.items() if mode != 0o755} == {}
    assert any(name.endswith(".pyc") for name in files)
    assert {name: oct(mode) for name, mode in files.items() if mode & 0o044 != 0o044} == {}


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
        assert m["tiers"]["disk"]["hits"] == 0  # bad bytes are no hit
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
        assert m["tiers"]["origin"]["hits"] == 1  # the good copy only


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


async def test_an_unpack_that_fails_with_an_os_error_is_counted_and_logged(
    tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # only ImageErrors were counted as failed: a full disk under unpack_dir went uncounted
    import errno

    import envpool.images.unpacked as unpacked_mod

    def full(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(unpacked_mod, "unpack", full)
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            with pytest.raises(OSError, match="No space left"):
                await cache.get(bundle.digest)
            m = cache.metrics()
    assert m["outcomes"]["failed"] == 1 and m["outcomes"].get("loaded", 0) == 0
    assert "No space left" in caplog.text


async def test_a_publish_hashes_the_bundle_off_the_loop(
    tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fetched blob was checked in a thread (an 8 GB hash stalls the loop for seconds), a
    # published one on the loop itself
    import threading

    import envpool.images.cache as cache_mod

    on_the_loop: list[bool] = []
    real = cache_mod.verify

    def verify(*args: Any, **kwargs: Any) -> None:
        on_the_loop.append(threading.current_thread() is threading.main_thread())
        real(*args, **kwargs)

    monkeypatch.setattr(cache_mod, "verify", verify)
    async with TieredCache(
        [DiskTier(DiskTierConfig(path=tmp_path / "l1"))], unpack_dir=tmp_path / "u"
    ) as cache:
        await cache.publish(bundle)
    assert on_the_loop == [False]
