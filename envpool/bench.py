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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envpool.api import make
from envpool.errors import InfraError
from envpool.pool import EnvPool, SessionLost

Progress = Callable[[str, int, int], None]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else 0.0


async def latency(n_claims: int = 200, n_steps: int = 2000) -> dict[str, Any]:
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
    image = "builtin@sha256:" + "0" * 64
    cfg = {
        "min_warm": concurrency,
        "max_containers": concurrency + 8,
        "max_episodes": 1_000_000,
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
    shutil.rmtree(images.root, ignore_errors=True)
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
