"""envpool, reviewed (17b).

* ``prewarm(n)`` with ``n`` over ``max_containers`` is refused (``EnvUsageError``, naming
  both), as ``PoolConfig`` refuses such a ``min_warm``: it stored the want unclamped, the
  housekeeping then started ``n`` - idle do-nothing tasks every tick, forever, and the want
  let go of every other image's warm containers.
  A negative ``n`` is refused too (it was kept as a negative want).
* The housekeeping starts no more idle containers than the pool has room for: with every
  slot claimed it started one task per missing idle container every tick, each of which
  found no room and returned.
* The image cache's HTTP and S3 tiers stream a blob into the disk tier's temp file, chunk by
  chunk, its digest checked and its size counted as it streams; the bundle is unpacked from
  that file. They handed the whole object over as one ``bytes``: an image larger than memory
  could not be cached. A stream cut off, over its cap or corrupt leaves no blob behind.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from echo_bundle import IMAGE
from image_cache_helpers import FAST_RETRY, make_tree
from pool_util import wait_for

import envpool.images.cache as cache_mod
import envpool.images.tiers.disk as disk_mod
from envpool.errors import EnvUsageError
from envpool.images import (
    Bundle,
    DiskTier,
    DiskTierConfig,
    HttpTier,
    ImageFetchError,
    OriginTierConfig,
    S3Tier,
    S3TierConfig,
    TieredCache,
    build_bundle,
)
from envpool.images.tiers.base import Tier
from envpool.pool import EnvPool

POOL = {"runtime": {"heartbeat_s": 0.1}}


async def test_prewarm_of_more_than_max_containers_is_refused(images):
    async with EnvPool({**POOL, "min_warm": 1, "max_containers": 2}, images=images) as p:
        await p.prewarm(IMAGE, 1)
        with pytest.raises(EnvUsageError, match=r"prewarm\(n=3\).*max_containers \(2\)"):
            await p.prewarm(None, 3)
        # nothing started for it, and the other image is still kept warm
        assert p.stats()["containers"] == 1
        assert p._wanted == {IMAGE: 1}


async def test_prewarm_of_a_negative_count_is_refused():
    # it was kept as a want of -1: the wants' sum, which bounds them by max_containers, read
    # one less, and let the other images keep more warm than the pool can hold
    async with EnvPool({**POOL, "min_warm": 0, "max_containers": 2}) as p:
        with pytest.raises(EnvUsageError, match=r"prewarm\(n=-1\)"):
            await p.prewarm(None, -1)
        assert p._wanted == {}


async def test_housekeeping_starts_no_idle_container_it_has_no_room_for():
    async with EnvPool({**POOL, "min_warm": 2, "max_containers": 2}) as p:
        starts = 0
        real = p._start_idle

        async def counted(image: str | None, *, background: bool = True) -> None:
            nonlocal starts
            starts += 1
            await real(image, background=background)

        p._start_idle = counted  # type: ignore[method-assign]
        async with p.session("frozenlake-v1") as a, p.session("frozenlake-v1") as b:
            await a.reset(seed=1)
            await b.reset(seed=2)
            # (a tick between the two claims had a slot to fill: that start was due)
            starts = 0
            await asyncio.sleep(0.5)  # a few ticks of the housekeeping, every slot claimed
            assert starts == 0
            assert p.stats()["containers"] == 2


# -- blobs streamed into the disk tier

CHUNK = 4096


@pytest.fixture
def big(tmp_path: Path) -> Bundle:
    """A bundle of many chunks (random: gzip cannot shrink it under one)."""
    return build_bundle(make_tree(tmp_path / "src", payload=os.urandom(64 * 1024)))


@pytest.fixture
def no_whole_blob(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    return _forbid_whole_blobs(monkeypatch)


def _forbid_whole_blobs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Fail the test wherever a whole blob is read, written or hashed as one ``bytes``;
    the sizes of the chunks the disk tier writes."""

    def whole(*a: object, **kw: object) -> None:
        raise AssertionError("the whole blob passed through memory as one bytes")

    monkeypatch.setattr(Tier, "get", whole)
    monkeypatch.setattr(Tier, "put", whole)
    monkeypatch.setattr(cache_mod, "verify", whole)
    written: list[int] = []
    real = getattr(disk_mod, "_write_chunk", None)

    def spy(fd: int, chunk: bytes) -> None:
        written.append(len(chunk))
        assert real is not None
        real(fd, chunk)

    monkeypatch.setattr(disk_mod, "_write_chunk", spy, raising=False)
    return written


async def _serve(body: bytes, *, cut_at: int | None = None) -> asyncio.Server:
    """An origin on 127.0.0.1 sending ``body`` in ``CHUNK``-byte pieces of a chunked reply;
    with ``cut_at``, it hangs up after that many bytes (a connection lost mid-download)."""

    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        end = len(body) if cut_at is None else cut_at
        for i in range(0, end, CHUNK):
            piece = body[i : min(i + CHUNK, end)]
            w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await w.drain()
        if cut_at is None:
            w.write(b"0\r\n\r\n")
        await w.drain()
        w.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


def _disk(tmp_path: Path) -> DiskTier:
    return DiskTier(DiskTierConfig(path=tmp_path / "l1", max_bytes=10 * 2**20))


def _left(tmp_path: Path) -> list[str]:
    """What a fetch left in the disk tier's directory and the unpack directory."""
    found = [p.name for p in (tmp_path / "l1" / "sha256").iterdir()]
    unpacked = tmp_path / "unpacked" / "sha256"
    return found + (
        [p.name for p in unpacked.iterdir() if not p.name.startswith(".")] if unpacked.exists() else []
    )


async def test_an_http_blob_is_streamed_into_the_disk_tier_in_chunks(
    tmp_path: Path, big: Bundle, no_whole_blob: list[int]
) -> None:
    server = await _serve(big.data)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        tiers = [_disk(tmp_path), HttpTier(OriginTierConfig(url=url))]
        async with TieredCache(tiers, unpack_dir=tmp_path / "unpacked", retry=FAST_RETRY) as cache:
            root = await cache.get(big.digest)
            assert (root / "pkg" / "data" / "blob.bin").stat().st_size == 64 * 1024
            # the disk tier holds the blob, written a chunk at a time
            assert tiers[0].path_of(big.digest).read_bytes() == big.data
            assert len(no_whole_blob) > 1 and max(no_whole_blob) < big.size
            assert sum(no_whole_blob) == big.size
            assert cache.metrics()["tiers"]["origin"]["hits"] == 1


async def test_an_s3_object_is_streamed_into_the_disk_tier_in_chunks(
    s3: str, tmp_path: Path, big: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    import envpool.images.tiers.s3 as s3_mod

    monkeypatch.setattr(s3_mod, "_READ_CHUNK", CHUNK)
    l2 = S3Tier(S3TierConfig(bucket=s3))
    await l2.start()  # (the cache owns it, and closes it)
    await l2.put(big.digest, big.data)
    read: list[int] = []
    real = l2._client.get_object

    def chunked(**kw: object) -> dict[str, object]:
        resp = real(**kw)
        plain = resp["Body"].read
        resp["Body"].read = lambda n=None: read.append(len(chunk := plain(n))) or chunk
        return resp

    monkeypatch.setattr(l2._client, "get_object", chunked)
    written = _forbid_whole_blobs(monkeypatch)
    async with TieredCache(
        [_disk(tmp_path), l2], unpack_dir=tmp_path / "unpacked", retry=FAST_RETRY
    ) as cache:
        root = await cache.get(big.digest)
        assert (root / "run.sh").is_file()
    assert len(read) > 1 and max(read) <= CHUNK and sum(read) == big.size
    assert written == [n for n in read if n]
    assert (tmp_path / "l1" / "sha256" / big.digest[7:]).read_bytes() == big.data


@pytest.mark.parametrize("how", ["cut-off", "corrupt", "over-cap"])
async def test_a_stream_that_fails_leaves_no_blob_behind(
    tmp_path: Path, big: Bundle, no_whole_blob: list[int], how: str
) -> None:
    body = big.data[:-1] + bytes([big.data[-1] ^ 1]) if how == "corrupt" else big.data
    server = await _serve(body, cut_at=big.size // 2 if how == "cut-off" else None)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    cap = big.size // 3 if how == "over-cap" else 2**30
    async with server:
        tiers = [_disk(tmp_path), HttpTier(OriginTierConfig(url=url, max_blob_bytes=cap))]
        async with TieredCache(tiers, unpack_dir=tmp_path / "unpacked", retry=FAST_RETRY) as cache:
            with pytest.raises(ImageFetchError) as e:
                await cache.get(big.digest)
            assert _left(tmp_path) == []
    assert no_whole_blob  # (it streamed some of it: then stopped, and removed the temp file)
    said = {"cut-off": "RemoteProtocolError", "corrupt": "hashing to", "over-cap": "max_blob_bytes"}[how]
    assert said in str(e.value)


async def test_a_streamed_blob_is_written_back_to_s3_from_the_disk_tiers_file(
    s3: str, tmp_path: Path, big: Bundle, no_whole_blob: list[int]
) -> None:
    server = await _serve(big.data)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        l2 = S3Tier(S3TierConfig(bucket=s3))
        tiers = [_disk(tmp_path), l2, HttpTier(OriginTierConfig(url=url))]
        async with TieredCache(tiers, unpack_dir=tmp_path / "unpacked", retry=FAST_RETRY) as cache:
            await cache.get(big.digest)
            got = l2._client.get_object(Bucket=s3, Key=l2.key_of(big.digest))["Body"].read()
            assert got == big.data
            assert cache.metrics()["tiers"]["s3"]["bytes_written"] == big.size
    assert len(no_whole_blob) > 1


async def test_a_stream_cut_off_by_the_caches_close_leaves_no_temp_file(
    tmp_path: Path, big: Bundle, no_whole_blob: list[int]
) -> None:
    stalled = asyncio.Event()
    done = asyncio.Event()

    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        half = big.data[: big.size // 2]
        w.write(b"%x\r\n%s\r\n" % (len(half), half))
        await w.drain()
        stalled.set()
        await done.wait()  # (the rest never comes)
        w.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        tiers = [_disk(tmp_path), HttpTier(OriginTierConfig(url=url))]
        cache = TieredCache(tiers, unpack_dir=tmp_path / "unpacked", retry=FAST_RETRY)
        await cache.start()
        cache.prefetch([big.digest])
        await asyncio.wait_for(stalled.wait(), 10)
        await wait_for(lambda: bool(no_whole_blob), 10)  # the first chunk is in the temp file
        [tmp] = (tmp_path / "l1" / "sha256").glob(".tmp-*")
        # held while it streams: a neighbour's start leaves it however old (held.py)
        os.utime(tmp, (time.time() - 2 * disk_mod.STALE_TEMP_S,) * 2)
        DiskTier(DiskTierConfig(path=tmp_path / "l1"))._scan()
        assert tmp.exists()
        await cache.aclose()
        done.set()
    assert _left(tmp_path) == []
