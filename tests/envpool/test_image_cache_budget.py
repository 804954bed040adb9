"""The image cache's budget for unpacked bundles (``unpacked_budget_bytes``): least
recently used bundles are evicted to it, never one pinned (by a container here or another
process sharing ``unpack_dir``); a bundle over it is evicted when its pin drops (its release,
another process's, at asyncio.run's shutdown), never between a get and its pin.

Everything is real: HTTP on 127.0.0.1 (FakeOrigin), other processes' flocks, files in tmp_path.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import logging
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from image_cache_helpers import FAST_RETRY, until

import envpool.images.cache as cache_module
from envpool.images import (
    Bundle,
    HttpTier,
    ImageError,
    OriginTierConfig,
    TieredCache,
    build_bundle,
)
from envpool.images.fake_origin import FakeOrigin


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
