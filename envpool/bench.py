"""``envpool bench``: the pool's figures, each against a baseline measured in the same run.

* ``latency``: warm claim p50 and step round trip p50 over the session protocol (echo-v0);
  the baseline is the same step called in-process (``envpool.make``).
* ``resets``: N resets from C concurrent sessions with injected image-fetch errors and
  container crashes; every reset is accounted for (ok after retries, or infra_failed).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from envpool.api import make
from envpool.errors import InfraError
from envpool.pool import EnvPool, SessionLost

Progress = Callable[[str, int, int], None]
T = TypeVar("T")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else 0.0


async def _term_as_interrupt(run: Callable[[], Awaitable[T]]) -> T:
    """SIGTERM stops a bench as Ctrl-C does: its pool closes and its temp dirs go (left
    alone, the signal ended the process on the spot, leaving containers' dirs behind)."""
    from fabric._sigterm import term_as_interrupt

    return await term_as_interrupt(lambda _: run())


async def latency(n_claims: int = 200, n_steps: int = 2000) -> dict[str, Any]:
    return await _term_as_interrupt(lambda: _latency(n_claims, n_steps))


async def _latency(n_claims: int, n_steps: int) -> dict[str, Any]:
    import envpool.envs  # noqa: F401

    env = make("echo-v0")
    env.reset()
    direct = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        env.step("hi")
        direct.append((time.perf_counter() - t0) * 1e3)
    async with EnvPool({"min_warm": 2}) as pool:
        await pool.prewarm(None, 2)
        claims, steps = [], []
        for _ in range(n_claims):
            t0 = time.perf_counter()
            async with pool.session("echo-v0") as s:
                claims.append((time.perf_counter() - t0) * 1e3)
                await s.reset()
        async with pool.session("echo-v0") as s:
            await s.reset()
            for _ in range(n_steps):
                t0 = time.perf_counter()
                await s.step("hi")
                steps.append((time.perf_counter() - t0) * 1e3)
    return {
        "warm_claim_p50_ms": _pct(claims, 50),
        "warm_claim_p99_ms": _pct(claims, 99),
        "step_rtt_p50_ms": _pct(steps, 50),
        "step_rtt_p99_ms": _pct(steps, 99),
        "direct_step_p50_ms": _pct(direct, 50),
    }


class FlakyImages:
    """An image resolver whose fetches fail ``rate`` of the time (a retryable InfraError)."""

    def __init__(self, rate: float, seed: int = 0):
        self.rate = rate
        self.rng = random.Random(seed)
        self.failures = 0
        # the built-ins need no files: every "fetch" resolves to one empty bundle directory
        self.root = Path(tempfile.mkdtemp(prefix="envpool-bench-"))

    async def get(self, digest: str) -> Path:
        await asyncio.sleep(0)
        if self.rng.random() < self.rate:
            self.failures += 1
            from envpool.images.errors import ImageFetchError

            raise ImageFetchError(f"injected fetch failure of {digest}")
        return self.root


async def resets(
    n: int = 10_000,
    concurrency: int = 32,
    fetch_error_rate: float = 0.05,
    crash_rate: float = 0.01,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """``n`` resets (claim, reset, one step, release) with faults injected."""
    images = FlakyImages(fetch_error_rate)
    try:
        return await _term_as_interrupt(lambda: _resets(images, n, concurrency, crash_rate, progress))
    finally:  # Ctrl-C or SIGTERM included
        shutil.rmtree(images.root, ignore_errors=True)


async def _resets(
    images: FlakyImages, n: int, concurrency: int, crash_rate: float, progress: Progress | None
) -> dict[str, Any]:
    image = "builtin@sha256:" + "0" * 64
    cfg = {
        "min_warm": concurrency,
        "max_containers": concurrency + 8,
        "max_episodes": 20,  # recycled often, so image fetches (and their injected errors) keep happening
        "runtime": {"faults": {"crash_rate": crash_rate}, "heartbeat_s": 0.2},
        "retry": {"attempts": 6, "initial_backoff_s": 0.02, "max_backoff_s": 0.5},
    }
    ok = lost = 0
    lat: list[float] = []
    issued = 0
    async with EnvPool(cfg, images=images) as pool:
        await pool.prewarm(image, concurrency)

        async def worker() -> None:
            nonlocal ok, lost, issued
            while issued < n:
                issued += 1
                t0 = time.perf_counter()
                try:
                    async with pool.session("echo-v0", image=image) as s:
                        await s.reset(seed=issued)
                        await s.step("hello")
                    ok += 1
                    lat.append((time.perf_counter() - t0) * 1e3)
                except (SessionLost, InfraError):
                    lost += 1
                if progress is not None and (ok + lost) % 250 == 0:
                    progress("resets", ok + lost, n)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
        stats = pool.stats()
    return {
        "resets": n,
        "ok": ok,
        "infra_failed": lost,
        "success_rate": ok / n,
        "accounted": ok + lost == n,
        "injected_fetch_errors": images.failures,
        "container_crashes": stats.get("infra:ConnectionLost", 0) + stats.get("infra:container_died", 0),
        "reset_retries": stats.get("reset_retries", 0),
        "step_retries": stats.get("step_retries", 0),
        "replays": stats.get("replays", 0),
        "containers_started": stats["runtime"].get("started", 0),
        "throughput_per_s": n / elapsed,
        "p50_ms": statistics.median(lat) if lat else 0.0,
        "p99_ms": _pct(lat, 99),
        "pool": stats,
    }


_COLD_ENV = '''
import envpool


class Weighted(envpool.Env):
    """Loads its data file at reset, as a real environment loads its assets."""

    def reset(self, *, seed=None, options=None):
        with open("data/weights.bin", "rb") as f:
            size = len(f.read(1 << 16))
        return f"loaded {size}", {}

    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text=action), terminated=True)
'''


class _OwnFetch:
    """The baseline: every container pulls the image on its own (its own empty cache)."""

    def __init__(self, root: Path, origin_url: str):
        self.root = root
        self.url = origin_url
        self.n = 0

    async def get(self, digest: str) -> Path:
        from envpool.images import (
            DiskTier,
            DiskTierConfig,
            HttpTier,
            OriginTierConfig,
            RetryPolicy,
            TieredCache,
        )

        self.n += 1
        own = self.root / f"own-{self.n}"
        tiers = [DiskTier(DiskTierConfig(path=own / "l1")), HttpTier(OriginTierConfig(url=self.url))]
        async with TieredCache(tiers, unpack_dir=own / "unpacked", retry=RetryPolicy(attempts=3)) as cache:
            return await cache.get(digest)


async def cold_image(
    sessions: int = 64, size_mb: float = 8.0, bandwidth_mbps: float = 40.0, progress: Progress | None = None
) -> dict[str, Any]:
    """``sessions`` sessions claim a container and reset at once, on an image no node has:
    through one tiered cache with single-flight, vs every container fetching on its own.
    ``progress`` hears of each session reset, as ("tiered" or "own fetch", done, sessions)."""
    return await _term_as_interrupt(lambda: _cold_image(sessions, size_mb, bandwidth_mbps, progress))


def _write_weights(path: Path, size: int) -> None:
    # in chunks: randbytes takes fewer than 2**31 bits at once (--size-mb 256 was an
    # OverflowError); chunks of whole 32-bit words continue the one stream, so a size that
    # fitted in one call gets the same bytes as before
    rng, chunk = random.Random(0), 2**27
    with path.open("wb") as f:
        for start in range(0, size, chunk):
            f.write(rng.randbytes(min(chunk, size - start)))


async def _cold_image(
    sessions: int, size_mb: float, bandwidth_mbps: float, progress: Progress | None
) -> dict[str, Any]:
    from envpool.images import DiskTier, DiskTierConfig, HttpTier, OriginTierConfig, TieredCache, build_bundle
    from envpool.images.fake_origin import FakeOrigin

    with tempfile.TemporaryDirectory(prefix="envpool-cold-") as tmp:
        root = Path(tmp)
        src = root / "src"
        (src / "data").mkdir(parents=True)
        (src / "weighted_env.py").write_text(_COLD_ENV)
        manifest = '{"register": [{"id": "weighted-v0", "entry_point": "weighted_env:Weighted"}]}'
        (src / "envpool.json").write_text(manifest)
        _write_weights(src / "data" / "weights.bin", int(size_mb * 2**20))
        bundle = build_bundle(src)
        image = str(bundle.ref("weighted"))
        cfg = {"min_warm": 0, "max_containers": sessions + 4, "reset_timeout_s": 300, "claim_timeout_s": 300}

        async def storm(resolver: Any, label: str) -> list[float]:
            async with EnvPool(cfg, images=resolver) as pool:
                go = asyncio.Event()
                done = 0

                async def one() -> float:
                    await go.wait()
                    t0 = time.perf_counter()
                    async with pool.session("weighted-v0", image=image) as s:
                        await s.reset()
                    took = time.perf_counter() - t0
                    nonlocal done
                    done += 1
                    if progress is not None:
                        progress(label, done, sessions)
                    return took

                tasks = [asyncio.create_task(one()) for _ in range(sessions)]
                await asyncio.sleep(0)
                go.set()
                return list(await asyncio.gather(*tasks))

        out: dict[str, Any] = {
            "sessions": sessions,
            "bundle_bytes": bundle.size,
            "origin_MBps": bandwidth_mbps,
        }
        with FakeOrigin({bundle.digest: bundle.data}, bandwidth_bps=bandwidth_mbps * 1e6) as origin:
            tiers = [
                DiskTier(DiskTierConfig(path=root / "node" / "l1")),
                HttpTier(OriginTierConfig(url=origin.url)),
            ]
            async with TieredCache(tiers, unpack_dir=root / "node" / "unpacked") as cache:
                shared = await storm(cache, "tiered")
            out["tiered"] = {
                "p50_s": _pct(shared, 50),
                "p99_s": _pct(shared, 99),
                "origin_gets": origin.requests,
            }
        with FakeOrigin({bundle.digest: bundle.data}, bandwidth_bps=bandwidth_mbps * 1e6) as origin:
            alone = await storm(_OwnFetch(root / "own", origin.url), "own fetch")
            out["own_fetch"] = {
                "p50_s": _pct(alone, 50),
                "p99_s": _pct(alone, 99),
                "origin_gets": origin.requests,
            }
    out["p99_ratio"] = out["own_fetch"]["p99_s"] / out["tiered"]["p99_s"]
    return out
