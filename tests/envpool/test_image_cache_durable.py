"""The image cache on the disk: what a close, a crash or a neighbour leaves behind. A close
waits for the unpack thread a cancel cannot stop (bounded), a tree without its completion
marker is never taken for whole, and what a rename publishes is on the disk before it.

Everything is real: HTTP on 127.0.0.1 (FakeOrigin), files in tmp_path; the unpack and the
fsync calls are slowed or counted through their module's names.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from image_cache_helpers import cache_with, member, tar_gz, until

import envpool.images.cache as cache_mod
import envpool.images.tiers.disk as disk_mod
import envpool.images.unpacked as unpacked_mod
from envpool.images import Bundle, DiskTier, DiskTierConfig, UnsafeBundle, build_bundle, digest_of, durable
from envpool.images.fake_origin import FakeOrigin


class _Held:
    """A blocking step (an unpack, a write), held at its start until ``release``: a big bundle's."""

    def __init__(self, real: Any):
        self.real = real
        self.started, self.release, self.ended = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.started.set()
        try:
            assert self.release.wait(30), "never released"
            self.real(*args, **kwargs)
        finally:
            self.ended.set()


def _unpack_root(tmp_path: Path) -> Path:
    return tmp_path / "a" / "unpacked" / "sha256"


async def test_a_close_waits_for_the_unpack_thread_it_cancelled(
    tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cancelling the load does not stop its thread: the close returned while the unpack
    # still wrote under unpack_dir (and renamed its tree into place after the close)
    slow = _Held(unpacked_mod.unpack)
    monkeypatch.setattr(unpacked_mod, "unpack", slow)
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        cache = cache_with(tmp_path, origin.url)
        await cache.start()
        cache.prefetch([bundle.digest])
        await asyncio.to_thread(slow.started.wait, 10)
        closing = asyncio.create_task(cache.aclose())
        try:
            await asyncio.sleep(0.05)
            assert not closing.done(), "the close returned while the unpack thread was still writing"
        finally:
            slow.release.set()
            await closing
        assert slow.ended.is_set()
    # closed before its tree was published: the thread removed its temp dir, placed nothing
    assert sorted(p.name for p in _unpack_root(tmp_path).iterdir()) == []


async def test_a_close_waits_for_an_unpack_a_bounded_time_and_says_so(
    tmp_path: Path,
    bundle: Bundle,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    slow = _Held(unpacked_mod.unpack)
    monkeypatch.setattr(unpacked_mod, "unpack", slow)
    monkeypatch.setattr(cache_mod, "_CLOSE_WAIT_S", 0.05)
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        try:
            async with cache_with(tmp_path, origin.url) as cache:
                cache.prefetch([bundle.digest])
                await asyncio.to_thread(slow.started.wait, 10)
        finally:
            slow.release.set()
        assert "1 unpack(s) still running" in caplog.text
        await asyncio.to_thread(slow.ended.wait, 10)
        # the thread ends as the close's stop says: its temp dir goes, nothing is placed
        await until(lambda: list(_unpack_root(tmp_path).iterdir()) == [])
        async with cache_with(tmp_path, origin.url) as cache:
            path = await cache.get(bundle.digest)
            assert (path / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"


async def test_a_tree_without_its_marker_is_unpacked_again(tmp_path: Path, bundle: Bundle) -> None:
    # a crash after the rename of a tree whose data was not on the disk yet leaves it with
    # empty files; it was taken for whole (is_dir) and run as it was, by every later open
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            path = await cache.get(bundle.digest)
        assert (path / unpacked_mod.MARKER).is_file()
        half = tmp_path / "half"
        path.rename(half)
        (half / unpacked_mod.MARKER).unlink()
        (half / "pkg" / "__init__.py").write_bytes(b"")  # what the crash left of it
        for attempt in ("at the start", "at a get"):
            shutil.copytree(half, path, symlinks=True)
            cache = cache_with(tmp_path, origin.url)
            if attempt == "at a get":  # (placed by a neighbour after the start's scan)
                cache.unpacked.scan = list  # type: ignore[method-assign]
            async with cache:
                if attempt == "at the start":  # not counted, and gone
                    assert cache.metrics()["unpacked"]["bundles"] == 0 and not path.exists()
                else:
                    assert path.is_dir()
                got = await cache.get(bundle.digest)
                assert got == path and (path / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
                assert (path / unpacked_mod.MARKER).is_file()
            leftovers = [p.name for p in _unpack_root(tmp_path).iterdir() if p.name != path.name]
            assert leftovers == []
            shutil.rmtree(path)


class _Syncs:
    """``durable``'s fsync and syncfs, recorded by the path of what they synced (the real
    calls made all the same), with or without syncfs (a platform without one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, with_syncfs: bool):
        self.calls: list[tuple[str, str]] = []
        real_fsync = durable.fsync

        def fsync(fd: int) -> None:
            self.calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def syncfs(fd: int) -> bool:
            self.calls.append(("syncfs", os.readlink(f"/proc/self/fd/{fd}")))
            return with_syncfs

        monkeypatch.setattr(durable, "fsync", fsync)
        monkeypatch.setattr(durable, "syncfs", syncfs)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a descriptor's file by /proc")
@pytest.mark.parametrize("with_syncfs", [True, False], ids=["syncfs", "an-fsync-each"])
async def test_an_unpacked_tree_is_on_the_disk_before_its_marker_and_its_rename(
    tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch, with_syncfs: bool
) -> None:
    syncs = _Syncs(monkeypatch, with_syncfs=with_syncfs)
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            path = await cache.get(bundle.digest)
    rel = _synced_in_temp(syncs.calls, _unpack_root(tmp_path))
    # the marker written and synced after the rest, its directory entry last
    assert rel[-2:] == [("fsync", unpacked_mod.MARKER), ("fsync", ".")]
    if with_syncfs:
        assert rel == [("syncfs", "."), ("fsync", unpacked_mod.MARKER), ("fsync", ".")]
    else:  # each file and directory of the tree, its bytecode too
        assert {p for _, p in rel} == _entries(path) | {"."}
        assert any(p.endswith(".pyc") for _, p in rel)


def _synced_in_temp(calls: list[tuple[str, str]], root: Path) -> list[tuple[str, str]]:
    """The syncs of the unpack, relative to its temp dir: all of them made there, before the
    rename."""
    tree = [(kind, p) for kind, p in calls if p.startswith(f"{root}/")]
    assert tree, calls
    [tmp] = {os.path.relpath(p, root).split("/")[0] for _, p in tree}
    assert tmp.startswith(".tmp-")
    return [(kind, os.path.relpath(p, root / tmp)) for kind, p in tree]


def _entries(path: Path) -> set[str]:
    """The tree's files and directories (not its links: no data of their own to sync)."""
    found = set()
    for parent, dirs, files in os.walk(path):
        for name in dirs + files:
            if not os.path.islink(os.path.join(parent, name)):
                found.add(os.path.relpath(os.path.join(parent, name), path))
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names a descriptor's file by /proc")
async def test_a_disk_tier_blob_is_on_the_disk_before_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # written and renamed into place unsynced: after a crash the blob was there, empty or
    # short, found corrupt by the next get (and fetched again from afar)
    syncs = _Syncs(monkeypatch, with_syncfs=True)
    data = b"blob" * 1000
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")) as disk:
        await disk.put(digest_of(data), data)
    [(kind, synced)] = syncs.calls
    assert kind == "fsync" and Path(synced).name.startswith(".tmp-")
    assert Path(synced).parent == disk.path_of(digest_of(data)).parent
    assert disk.path_of(digest_of(data)).read_bytes() == data


async def test_a_bundle_may_not_hold_the_marker_and_a_tree_bundled_again_keeps_its_digest(
    tmp_path: Path, bundle: Bundle
) -> None:
    # a bundle's own marker would say "whole" of a tree half written
    forged = tar_gz((member(unpacked_mod.MARKER), b""), (member("x.py"), b"X = 1\n"))
    with FakeOrigin({bundle.digest: bundle.data, digest_of(forged): forged}) as origin:
        async with cache_with(tmp_path, origin.url) as cache:
            with pytest.raises(UnsafeBundle, match="the image cache's own"):
                await cache.get(digest_of(forged))
            path = await cache.get(bundle.digest)
        assert sorted(p.name for p in _unpack_root(tmp_path).iterdir()) == [path.name]
    assert (path / unpacked_mod.MARKER).is_file()
    assert build_bundle(path).digest == bundle.digest  # (its bytecode and marker left out)


async def test_a_disk_tiers_close_waits_for_the_write_its_cancel_left_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as for the unpack: a close of the cache cancels a write-back to L1, not its thread,
    # which went on writing (and renamed the blob into place) after the tier was closed
    slow = _Held(disk_mod._write_atomic)
    monkeypatch.setattr(disk_mod, "_write_atomic", slow)
    data = b"blob" * 1000
    disk = DiskTier(DiskTierConfig(path=tmp_path / "l1"))
    await disk.start()
    put = asyncio.create_task(disk.put(digest_of(data), data))
    await asyncio.to_thread(slow.started.wait, 10)
    put.cancel()
    closing = asyncio.create_task(disk.aclose())
    try:
        await asyncio.sleep(0.05)
        assert not closing.done(), "the close returned while the write thread was still writing"
    finally:
        slow.release.set()
        await closing
    assert slow.ended.is_set() and disk.path_of(digest_of(data)).read_bytes() == data
    with pytest.raises(asyncio.CancelledError):
        await put


@pytest.mark.parametrize("refusal", [errno.ENOSYS, errno.EPERM], ids=["ENOSYS", "EPERM"])
def test_a_syncfs_the_sandbox_refuses_falls_back_to_an_fsync_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refusal: int
) -> None:
    # a seccomp profile that refuses syncfs (ENOSYS, EPERM) failed every unpack
    def refused(fd: int) -> int:
        ctypes.set_errno(refusal)
        return -1

    synced: list[str] = []
    real_fsync = durable.fsync
    monkeypatch.setattr(durable, "_libc_syncfs", lambda: refused)
    monkeypatch.setattr(
        durable, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    (tmp_path / "t" / "d").mkdir(parents=True)
    (tmp_path / "t" / "d" / "f").write_bytes(b"x")
    durable.sync_tree(tmp_path / "t")
    assert synced == [str(tmp_path / "t" / "d" / "f"), str(tmp_path / "t" / "d"), str(tmp_path / "t")]


async def test_processes_sharing_a_node_fetch_and_unpack_an_image_once(
    tmp_path: Path, bundle: Bundle
) -> None:
    # the single flight was per process: every process of a node (a pool's workers) that
    # cold-started an image downloaded it, held it in memory and unpacked a copy of its own
    # beside the others (a 5 GB image, 8 processes: 40 GB of temp dirs at once). Two caches
    # here stand for two processes: their locks are two open files, as theirs would be
    with FakeOrigin({bundle.digest: bundle.data}, latency_s=0.2) as origin:
        async with cache_with(tmp_path, origin.url) as one, cache_with(tmp_path, origin.url) as two:
            paths = await asyncio.gather(one.get(bundle.digest), two.get(bundle.digest))
            outcomes = [one.metrics()["outcomes"], two.metrics()["outcomes"]]
        assert paths[0] == paths[1] and (paths[0] / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
        assert origin.blob_requests[bundle.digest] == 1
        assert sorted(map(sorted, outcomes)) == [["loaded"], ["ready"]]
    assert sorted(p.name for p in _unpack_root(tmp_path).iterdir()) == [paths[0].name]  # no lock left


def test_an_unpack_told_to_stop_kills_its_compile_and_places_nothing(tmp_path: Path, bundle: Bundle) -> None:
    asked = 0

    def stop() -> bool:  # the close comes while the bundle is byte-compiled (its 3rd look)
        nonlocal asked
        asked += 1
        return asked >= 3

    root = tmp_path / "sha256"
    root.mkdir()
    with pytest.raises(unpacked_mod.UnpackClosed, match="byte-compiling"):
        unpacked_mod.unpack_tree(root, bundle.digest, bundle.data, max_bytes=None, precompile=True, stop=stop)
    assert list(root.iterdir()) == []


def test_a_neighbours_cleanup_leaves_an_unpack_under_way_however_old(tmp_path: Path, bundle: Bundle) -> None:
    # the cleanup at a cache's start (``prepare``) removed every .tmp-* directory over an
    # hour old, by its mtime alone: a live neighbour's unpack (its top directory's entries
    # all made at the start of a long extraction and byte-compile) was deleted under it
    root = tmp_path / "sha256"
    root.mkdir()
    swept = []

    def stop() -> bool:  # its first look, its tree begun: a neighbour's cache starts then
        if not swept:
            [tmp] = root.glob(".tmp-*")
            old = time.time() - 2 * unpacked_mod.STALE_TEMP_S
            os.utime(tmp, (old, old))
            unpacked_mod.prepare(root)
            swept.append(tmp.exists())
        return False

    path, _ = unpacked_mod.unpack_tree(
        root, bundle.digest, bundle.data, max_bytes=None, precompile=False, stop=stop
    )
    assert swept == [True] and (path / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    dead = root / ".tmp-left-by-a-dead-process"
    dead.mkdir()
    os.utime(dead, (time.time() - 2 * unpacked_mod.STALE_TEMP_S,) * 2)
    unpacked_mod.prepare(root)
    assert not dead.exists()  # (what nobody works on is still swept)
