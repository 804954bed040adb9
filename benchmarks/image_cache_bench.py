"""64 environments resetting at once on a cold image, behind a bandwidth-limited origin.

    .venv/bin/python benchmarks/image_cache_bench.py [--concurrency 64] [--size-mb 8] [--bandwidth-mbps 40]

Measured in one run, against the same kind of origin (a FakeOrigin on 127.0.0.1 whose link
is shared by every download, like a saturated registry uplink):

* ``tiered``: one node's ``TieredCache`` (L1 disk -> origin); single-flight turns the 64
  concurrent ``get``s into one download, unpacked once.
* ``independent``: 64 fetchers, each with its own empty L1 and unpack directory, as when every
  container pulls its own image: 64 downloads share the link.

Latency is from the moment all gets are released to the moment each has its unpacked
directory. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from envpool.images import (
    Bundle,
    DiskTier,
    DiskTierConfig,
    HttpTier,
    OriginTierConfig,
    RetryPolicy,
    TieredCache,
    build_bundle,
)
from envpool.images.fake_origin import FakeOrigin

RETRY = RetryPolicy(attempts=3, backoff_s=0.05)


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[max(0, math.ceil(p * len(s)) - 1)]


def summary(latencies: list[float], origin: FakeOrigin) -> dict[str, Any]:
    return {
        "p50_s": round(pct(latencies, 0.50), 4),
        "p99_s": round(pct(latencies, 0.99), 4),
        "max_s": round(max(latencies), 4),
        "origin_requests": origin.requests,
        "origin_bytes": origin.bytes_served,
    }


def make_bundle(root: Path, size_mb: float) -> Bundle:
    src = root / "env"
    (src / "data").mkdir(parents=True)
    (src / "env.py").write_text("class Env:\n    pass\n")
    # incompressible, so the tarball is as big as asked
    (src / "data" / "weights.bin").write_bytes(random.Random(0).randbytes(int(size_mb * 2**20)))
    return build_bundle(src)


def node_cache(root: Path, origin_url: str) -> TieredCache:
    return TieredCache(
        [
            DiskTier(DiskTierConfig(path=root / "l1")),
            HttpTier(OriginTierConfig(url=origin_url, max_connections=128)),
        ],
        unpack_dir=root / "unpacked",
        retry=RETRY,
    )


async def timed_gets(caches: list[TieredCache], digest: str) -> list[float]:
    start = asyncio.Event()

    async def one(cache: TieredCache) -> float:
        await start.wait()
        t0 = time.perf_counter()
        await cache.get(digest)
        return time.perf_counter() - t0

    tasks = [asyncio.create_task(one(c)) for c in caches]
    await asyncio.sleep(0)  # every task is parked on the event: release them together
    start.set()
    return list(await asyncio.gather(*tasks))


async def run(concurrency: int, size_mb: float, bandwidth_mbps: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="image-cache-bench-") as tmp:
        root = Path(tmp)
        bundle = make_bundle(root, size_mb)
        blobs = {bundle.digest: bundle.data}
        bps = bandwidth_mbps * 1e6

        with FakeOrigin(blobs, bandwidth_bps=bps) as origin:
            async with node_cache(root / "tiered", origin.url) as cache:
                tiered = await timed_gets([cache] * concurrency, bundle.digest)
                warm = await timed_gets([cache] * concurrency, bundle.digest)
                metrics = cache.metrics()
            tiered_summary = summary(tiered, origin)

        with FakeOrigin(blobs, bandwidth_bps=bps) as origin:
            caches = [node_cache(root / f"solo-{i}", origin.url) for i in range(concurrency)]
            try:
                await asyncio.gather(*(c.start() for c in caches))
                independent = await timed_gets(caches, bundle.digest)
            finally:
                await asyncio.gather(*(c.aclose() for c in caches))
            independent_summary = summary(independent, origin)

    return {
        "benchmark": "image_cache_cold_reset",
        "concurrency": concurrency,
        "bundle_bytes": bundle.size,
        "origin_bandwidth_MBps": bandwidth_mbps,
        "tiered": tiered_summary | {"outcomes": metrics["outcomes"]},
        "independent": independent_summary,
        "p50_ratio": round(pct(independent, 0.50) / pct(tiered, 0.50), 1),
        "p99_ratio": round(pct(independent, 0.99) / pct(tiered, 0.99), 1),
        "warm_get_p50_ms": round(pct(warm, 0.50) * 1e3, 3),
        "ideal_one_download_s": round(bundle.size / bps, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--size-mb", type=float, default=8.0)
    ap.add_argument("--bandwidth-mbps", type=float, default=40.0, help="origin link, MB/s (10^6 bytes)")
    args = ap.parse_args()
    print(json.dumps(asyncio.run(run(args.concurrency, args.size_mb, args.bandwidth_mbps)), indent=2))


if __name__ == "__main__":
    main()
