"""The image cache's tiers on their own and across nodes: the L1 disk tier (LRU eviction,
digests only, a restart), a peer tier serving another node's L1, L2 on S3 (moto) shared
between nodes; the configs' validation, and the fake origin itself.

Everything is real: HTTP on 127.0.0.1 (FakeOrigin), S3 through moto, files in tmp_path.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from image_cache_helpers import FAST_RETRY, cache_with
from pydantic import ValidationError

from envpool.images import (
    Bundle,
    CacheConfig,
    DiskTier,
    DiskTierConfig,
    HttpTier,
    ImageError,
    ImageFetchError,
    InvalidImageRef,
    OriginTierConfig,
    PeerTierConfig,
    S3Tier,
    S3TierConfig,
    TieredCache,
    digest_of,
)
from envpool.images.fake_origin import FakeOrigin

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


async def test_a_blob_the_disk_tier_does_not_store_is_not_counted_written(tmp_path: Path) -> None:
    # a blob over max_bytes is skipped, but its put was counted with its bytes: the metrics
    # said the tier wrote what it never did
    big = b"z" * 300
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1", max_bytes=250)) as l1:
        await l1.put(digest_of(big), big)
        snap = l1.metrics.snapshot()
        assert (snap["puts"], snap["bytes_written"]) == (0, 0)
        await l1.put(digest_of(b"a" * 100), b"a" * 100)
        snap = l1.metrics.snapshot()
        assert (snap["puts"], snap["bytes_written"]) == (1, 100)


async def test_a_publish_no_tier_keeps_says_so(tmp_path: Path, bundle: Bundle) -> None:
    # the disk tier skips a blob over its cap, and publish returned a reference all the same:
    # its get then said the image was in none of the tiers (EnvPool's images publish a built
    # directory into the job's disk tier, then acquire it)
    with FakeOrigin({}) as origin:
        cache = TieredCache(
            [
                DiskTier(DiskTierConfig(path=tmp_path / "l1", max_bytes=100)),
                HttpTier(OriginTierConfig(url=origin.url)),
            ],
            unpack_dir=tmp_path / "unpacked",
        )
        async with cache:
            with pytest.raises(ImageError, match="no writable tier kept the bundle"):
                await cache.publish(bundle, name="big")


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


async def test_s3_stores_a_blob_past_a_single_puts_limit_in_parts(
    s3: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # one put_object takes 5 GB at most: a bigger bundle (8 GB images are in view) could not
    # be published to the S3 tier, nor written back to it. Parts from _MULTIPART_BYTES on
    # (5 MiB here, S3's smallest part, to see it without gigabytes)
    import boto3

    import envpool.images.tiers.s3 as s3_mod

    monkeypatch.setattr(s3_mod, "_MULTIPART_BYTES", 5 * 2**20, raising=False)
    data = os.urandom(6 * 2**20)
    async with S3Tier(S3TierConfig(bucket=s3)) as tier:
        await tier.put(digest_of(data), data)
        assert await tier.get(digest_of(data)) == data
        head = boto3.client("s3", region_name="us-east-1").head_object(
            Bucket=s3, Key=tier.key_of(digest_of(data))
        )
    assert head["ETag"].strip('"').endswith("-2")  # two parts
    async with S3Tier(S3TierConfig(bucket="no-such-bucket")) as tier:
        with pytest.raises(ImageFetchError, match="does not exist: create it") as e:
            await tier.put(digest_of(data), data)  # (botocore's error, through boto3's transfer)
        assert not e.value.retryable


# -- what a tier may hand over, and what a bundle may unpack to


async def _serve_blob(header: bytes, chunk: bytes | None) -> asyncio.Server:
    """An origin on 127.0.0.1 answering every request with ``header``, then ``chunk`` over
    and over (a body without end) until the client hangs up, or nothing (``None``)."""

    async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(header)
        try:
            while chunk is not None:
                w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await w.drain()
        except ConnectionError:
            pass  # the client stopped reading and hung up, as it should
        finally:
            w.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


@pytest.mark.parametrize(
    ("header", "chunk", "said"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"x" * 65536, "its body ran past"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n", None, "Content-Length"),
    ],
    ids=["endless-body", "huge-content-length"],
)
async def test_an_http_tier_refuses_a_blob_over_its_cap_by_name(
    header: bytes, chunk: bytes | None, said: str
) -> None:
    # a reply was read whole into memory (and then to the disk tier), however big: a body
    # without end filled the node. Refused at the cap, never retried, naming the key to raise
    server = await _serve_blob(header, chunk)
    port = server.sockets[0].getsockname()[1]
    async with server:
        tier = HttpTier(OriginTierConfig(url=f"http://127.0.0.1:{port}", max_blob_bytes=2**20))
        async with tier:
            with pytest.raises(ImageFetchError) as e:
                await asyncio.wait_for(tier.get("sha256:" + "a" * 64), 30)
    assert said in str(e.value) and "max_blob_bytes" in str(e.value) and "1,048,576" in str(e.value)
    assert not e.value.retryable


def test_the_download_and_unpack_caps_have_finite_documented_defaults(tmp_path: Path) -> None:
    # neither had one: a tier's reply and a bundle's unpacked size (a tar bomb) were unbounded
    assert OriginTierConfig(url="http://origin:5000").max_blob_bytes == 2 * 2**30
    cfg = CacheConfig.model_validate(
        {"tiers": [{"type": "origin", "url": "http://o:1"}], "unpack_dir": str(tmp_path)}
    )
    assert cfg.max_unpacked_bytes == 8 * 2**30
    cache = TieredCache([HttpTier(OriginTierConfig(url="http://o:1"))], unpack_dir=tmp_path)
    assert cache.max_unpacked_bytes == 8 * 2**30


async def test_a_bundle_over_the_unpack_cap_names_the_key_to_raise(tmp_path: Path, bundle: Bundle) -> None:
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        tiers = [HttpTier(OriginTierConfig(url=origin.url))]
        async with TieredCache(tiers, unpack_dir=tmp_path / "u", max_unpacked_bytes=4096) as cache:
            with pytest.raises(ImageError, match=r"over the 4096-byte limit.*max_unpacked_bytes"):
                await cache.get(bundle.digest)


def test_a_remote_containers_fetch_keeps_to_the_caps_it_was_given(
    tmp_path: Path, bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (its server's fetch, given the runtime's image_max_blob_bytes and image_max_unpacked_bytes)
    import tempfile

    from envpool.server import fetch_image

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (its unpack dir: the container's /tmp)
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        with pytest.raises(ImageFetchError, match="max_blob_bytes"):
            fetch_image(bundle.digest, origin.url, max_blob_bytes=10)
        with pytest.raises(ImageError, match="max_unpacked_bytes"):
            fetch_image(bundle.digest, origin.url, max_unpacked_bytes=4096)
        assert (fetch_image(bundle.digest, origin.url) / "run.sh").is_file()


async def test_an_s3_tier_refuses_an_object_over_its_cap_by_name(s3: str) -> None:
    # the S3 tier read a whole object with Body.read(), however big: a huge one filled the
    # node. Refused on its ContentLength before the body is read, as the HTTP tier does
    data = b"x" * 4096
    async with S3Tier(S3TierConfig(bucket=s3, max_blob_bytes=1024)) as tier:
        await tier.put(digest_of(data), data)
        with pytest.raises(ImageFetchError) as e:
            await tier.get(digest_of(data))
    said = str(e.value)
    assert "its ContentLength says 4,096 bytes" in said
    assert f"s3://{s3}/{tier.key_of(digest_of(data))}" in said
    assert "max_blob_bytes" in said and "1,024" in said and not e.value.retryable
    assert S3TierConfig(bucket=s3).max_blob_bytes == 2 * 2**30
    small = b"y" * 1024  # (at the cap: read whole)
    async with S3Tier(S3TierConfig(bucket=s3, max_blob_bytes=1024)) as tier:
        await tier.put(digest_of(small), small)
        assert await tier.get(digest_of(small)) == small


async def test_an_s3_tier_cuts_off_a_body_past_its_cap(s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a body longer than its ContentLength says (or a reply without one) is still read no
    # further than the cap
    import envpool.images.tiers.s3 as s3_mod

    monkeypatch.setattr(s3_mod, "_READ_CHUNK", 256, raising=False)
    data = os.urandom(64 * 1024)
    async with S3Tier(S3TierConfig(bucket=s3, max_blob_bytes=1024)) as tier:
        await tier.put(digest_of(data), data)
        real = tier._client.get_object
        read: list[int] = []

        def unsized(**kw: object) -> dict[str, object]:
            resp = real(**kw)
            del resp["ContentLength"]
            body = resp["Body"]
            plain_read = body.read
            resp["Body"].read = lambda n=None: read.append(len(chunk := plain_read(n))) or chunk
            return resp

        monkeypatch.setattr(tier._client, "get_object", unsized)
        with pytest.raises(ImageFetchError, match=r"its body ran past 1,024 bytes.*max_blob_bytes") as e:
            await tier.get(digest_of(data))
    assert not e.value.retryable and sum(read) <= 1024 + 256


async def test_a_neighbours_start_leaves_a_blob_write_under_way_however_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a disk tier's start removed every .tmp-* file over an hour old, by its mtime alone: a
    # live neighbour's write (stalled in its fsync, or its process stopped) lost its file,
    # and its rename into place failed
    import envpool.images.tiers.disk as disk_mod

    data = b"blob bytes"
    store = tmp_path / "l1" / "sha256"
    neighbour = DiskTier(DiskTierConfig(path=tmp_path / "l1"))
    real_fsync = disk_mod.durable.fsync
    swept: list[bool] = []

    def fsync(fd: int) -> None:  # mid-write, its file old: the neighbour starts then
        [tmp] = store.glob(".tmp-*")
        os.utime(tmp, (time.time() - 2 * disk_mod.STALE_TEMP_S,) * 2)
        neighbour._scan()
        swept.append(tmp.exists())
        real_fsync(fd)

    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")) as l1:
        monkeypatch.setattr(disk_mod.durable, "fsync", fsync)
        assert await l1.put(digest_of(data), data)
        monkeypatch.undo()
        assert swept == [True] and await l1.get(digest_of(data)) == data
    dead = store / ".tmp-left-by-a-dead-writer"
    dead.write_bytes(b"half")
    os.utime(dead, (time.time() - 2 * disk_mod.STALE_TEMP_S,) * 2)
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")):
        pass
    assert not dead.exists()  # (what nobody writes is still swept)
