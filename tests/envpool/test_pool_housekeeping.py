"""EnvPool housekeeping with real containers: failed, hung and leaked stops, liveness
probes, warm images let go (idle, gone, past capacity) and the bundles pinned for them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from echo_bundle import IMAGE, DirImages, write_bundle
from pool_util import alive, pool, swap_runtime, wait_for

from envpool.errors import InfraError
from envpool.images import DiskTier, DiskTierConfig, TieredCache, build_bundle
from envpool.images.errors import ImageNotFound
from envpool.pool import EnvPool, SessionLost
from envpool.runtimes.base import Container
from envpool.runtimes.process import ProcessRuntime


class _FlakyProbeRuntime(ProcessRuntime):
    """A runtime whose first liveness probe fails (a k8s API 500, an engine hiccup)."""

    probes = 0

    async def _alive(self, c: Container) -> bool:
        self.probes += 1
        if self.probes == 1:
            raise InfraError("kubernetes: read pod envpool-x: 500 InternalError")
        return await super()._alive(c)


async def test_a_failing_liveness_probe_does_not_lose_the_idle_container(images):
    # the claim had already taken the idle container when the probe raised: it was then
    # neither idle nor claimed, and held the only slot (max_containers=1) until the pool closed
    p = pool(images, min_warm=1, max_containers=1, claim_timeout_s=2)
    await swap_runtime(p, _FlakyProbeRuntime(p.config.runtime))
    async with p:
        await p.prewarm(IMAGE, 1)
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1"
        stats = p.stats()
        assert stats["claim_retries"] == 1 and stats["claims_warm"] == 1 and stats["containers"] == 1


class _FlakyStopRuntime(ProcessRuntime):
    """A runtime whose first stop fails (a docker engine or Kubernetes API hiccup)."""

    stops = 0

    async def _stop(self, c: Container) -> None:
        self.stops += 1
        if self.stops == 1:
            raise InfraError("docker: the engine refused to remove a container: 500")
        await super()._stop(c)


async def test_a_failed_stop_neither_fails_the_session_nor_forgets_the_container(images):
    # the stop once raised out of the finished session's block, and the runtime had already
    # forgotten the container: nothing ever tried to stop it again
    p = pool(images, min_warm=0, max_episodes=1)  # recycled (stopped) when released
    await swap_runtime(p, _FlakyStopRuntime(p.config.runtime))
    async with p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            pid = s.container.pid
        stats = p.stats()
        assert stats["stop_failed:InfraError"] == 1 and stats["containers"] == 1 and alive(pid)
    await asyncio.sleep(0.1)
    assert not alive(pid)  # the pool's close stopped it


class _StuckStopRuntime(ProcessRuntime):
    """A runtime whose stops fail until told otherwise (an engine refusing every removal)."""

    refuse = True

    async def _stop(self, c: Container) -> None:
        if self.refuse:
            raise InfraError("docker: the engine refused to remove a container: 500")
        await super()._stop(c)


async def test_a_container_whose_stop_keeps_failing_gives_its_slot_back(images, caplog):
    # it stayed in the runtime's live set, which is what max_containers counts: with one slot,
    # every later claim waited claim_timeout_s and failed, for the rest of the run
    stop_retry = {"attempts": 3, "initial_backoff_s": 0.01, "max_backoff_s": 0.05}
    p = pool(images, min_warm=0, max_containers=1, max_episodes=1, claim_timeout_s=5, stop_retry=stop_retry)
    rt = await swap_runtime(p, _StuckStopRuntime(p.config.runtime))
    async with p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            first = s.container
        t0 = time.monotonic()
        async with p.session("bundle-echo-v0", image=IMAGE) as s:  # needs the only slot
            assert (await s.reset(seed=2))[0].text == "ready 2"
        assert time.monotonic() - t0 < 3
        stats = p.stats()
        assert first.id in rt.leaked and stats["containers_leaked"] >= 1 and stats["leaked"] >= 1
        assert stats["stop_failed:InfraError"] >= 3  # the first try and two retries, then given up
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(f"gave up stopping container {first.id}" in m and f"pid {first.pid}" in m for m in warned)
        rt.refuse = False  # the engine recovers: the pool's close removes what leaked
    await asyncio.sleep(0.1)
    assert not alive(first.pid) and not rt.leaked and not rt.live


async def test_a_leaked_container_is_stopped_once_the_engine_recovers(images):
    # a leaked container was only tried again at the pool's close: a remote one held its
    # node (a CPU, a GPU) for the rest of a long run
    stop_retry = {"attempts": 2, "initial_backoff_s": 0.01, "max_backoff_s": 0.02}
    p = pool(images, min_warm=0, max_episodes=1, stop_retry=stop_retry, leaked_retry_s=0.3)
    rt = await swap_runtime(p, _StuckStopRuntime(p.config.runtime))
    async with p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            first = s.container
        await wait_for(lambda: first.id in rt.leaked)
        # tried again while the engine still refuses: stays leaked. Waited for, not slept: the
        # retry comes leaked_retry_s (0.3 s) after the leak on the housekeeping tick, which a
        # loaded machine delays (a fixed 0.5 s failed 1 run in 5 beside other jobs)
        await wait_for(lambda: p.stats().get("leaked_stop_failed:InfraError", 0) >= 1)
        assert first.id in rt.leaked
        assert alive(first.pid)
        rt.refuse = False  # the engine recovers: the pool stops it while it runs
        # (the runtime forgets it as its stop ends, the pool counts it a few loop turns later,
        # once its stop returns: both waited for, or a poll in between read no count)
        await wait_for(lambda: first.id not in rt.leaked and p.stats().get("leaked_stopped") == 1)
        assert not alive(first.pid)
        assert first.id not in p._stopper.pinned  # its bundle may be evicted again


class _HungStopRuntime(ProcessRuntime):
    """A runtime whose stops hang until released (an engine that never answers a removal)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release = asyncio.Event()

    async def _stop(self, c: Container) -> None:
        await self.release.wait()
        await super()._stop(c)


async def test_a_container_whose_stop_hangs_gives_its_slot_back(images):
    # a stop that never returned (rather than failed) held its slot for the rest of the run
    stop_retry = {"attempts": 2, "initial_backoff_s": 0.01, "max_backoff_s": 0.05}
    p = pool(
        images,
        min_warm=0,
        max_containers=1,
        max_episodes=1,
        claim_timeout_s=5,
        stop_retry=stop_retry,
        stop_timeout_s=0.2,
    )
    rt = await swap_runtime(p, _HungStopRuntime(p.config.runtime))
    async with p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            first = s.container
        async with p.session("bundle-echo-v0", image=IMAGE) as s:  # needs the only slot
            assert (await s.reset(seed=2))[0].text == "ready 2"
        stats = p.stats()
        assert first.id in rt.leaked and stats["containers_leaked"] >= 1
        # the first attempt timed out; the retry found that stop still hanging and did not
        # wait stop_timeout_s on it again
        assert stats["stop_failed:InfraError"] >= 1 and stats["stop_failed:still_stopping"] >= 1
        rt.release.set()  # the engine answers at last: the stop still under way ends it
        await wait_for(lambda: first.id not in rt.leaked)
    assert not alive(first.pid) and not rt.leaked and not rt.live


async def test_a_stop_that_hangs_does_not_hang_the_close(images, caplog):
    p = pool(images, min_warm=1, stop_timeout_s=0.3)
    rt = await swap_runtime(p, _HungStopRuntime(p.config.runtime))
    async with p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            c = s.container
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3  # it waited forever
    assert c.id in rt.live  # not stopped: left to the exit hook, and said so
    assert rt.metrics["close_stop_timeouts"] >= 1
    assert any("did not stop within 0.3 s of closing" in r.getMessage() for r in caplog.records)
    rt.release.set()
    await ProcessRuntime._stop(rt, c)  # the process runtime's own stop, to leave nothing running


async def test_an_image_nobody_asks_for_is_no_longer_kept_warm(images):
    # every image a run ever used was kept warm (min_warm idle containers, and its entry)
    # until the pool closed
    async with pool(images, min_warm=1, warm_idle_s=0.5) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            await asyncio.sleep(0.8)  # an open session keeps its image warm past the window
            assert p.stats()["warm_images"] == 1
        assert p.stats()["idle"] >= 1  # kept warm while the window runs
        await wait_for(lambda: p.stats()["warm_images"] == 0)
        await wait_for(lambda: p.stats()["containers"] == 0)
        assert p.stats()["warm_dropped:idle"] == 1
        async with p.session("bundle-echo-v0", image=IMAGE) as s:  # asked again: a cold start
            assert (await s.reset(seed=2))[0].text == "ready 2"
        assert p.stats()["claims_cold"] == 2 and p.stats()["warm_images"] == 1


class _DeletedImages(DirImages):
    """An image resolver whose one image can be deleted upstream (ImageNotFound from then on)."""

    deleted = False

    async def get(self, digest: str) -> Path:
        if self.deleted:
            raise ImageNotFound(digest, ["origin"])
        return await super().get(digest)


async def test_an_image_that_is_gone_for_good_is_no_longer_kept_warm(images):
    # it was retried in the background, backing off to every 30 s, for as long as the pool ran
    images = _DeletedImages(images.root)
    # max_containers 1: no replacement is warmed while the session holds the one slot. With
    # two, one could start (and fetch the image) before the deletion below when the reset
    # was slow, and the image stayed warm without ever failing (seen under pytest-xdist)
    async with pool(images, min_warm=1, max_episodes=1, max_containers=1) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            images.deleted = True  # its container is recycled at the end: a new one is wanted
        await wait_for(lambda: p.stats()["warm_images"] == 0)
        await asyncio.sleep(1.0)  # a retry would have come (0.4 s, then 0.8 s)
        stats = p.stats()
        assert stats["prestart_failed:ImageNotFound"] == 1 and stats["warm_dropped:ImageNotFound"] == 1


async def test_warm_images_are_bounded_by_the_pool_size(images):
    # two images wanting two idle containers each cannot both be kept warm in two slots:
    # the least recently asked one is let go instead of fighting over the slots
    async with pool(images, min_warm=2, max_containers=2) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
        async with p.session("echo-v0") as s:  # the built-ins: another image
            await s.reset(seed=1)
        stats = p.stats()
        assert stats["warm_images"] == 1 and stats["warm_dropped:capacity"] == 1


async def test_the_pool_pins_the_bundle_its_containers_run_from(tmp_path):
    # with an eviction budget the cache must not delete a bundle a live container runs from
    def other_bundle(name: str):
        root = tmp_path / name
        root.mkdir()
        (root / "data.bin").write_bytes(name.encode() * 1000)
        return build_bundle(root)

    echo, other, third = build_bundle(write_bundle(tmp_path / "echo")), other_bundle("o"), other_bundle("t")
    tiers = [DiskTier(DiskTierConfig(path=tmp_path / "l1"))]
    async with TieredCache(tiers, unpack_dir=tmp_path / "unpacked", unpacked_budget_bytes=1) as cache:
        image = await cache.publish(echo, name="echo")
        for b in (other, third):
            await cache.publish(b)
        async with EnvPool({"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}, images=cache) as p:
            async with p.session("bundle-echo-v0", image=image) as s:
                await s.reset(seed=1)
                await cache.get(other.digest)  # over the budget: only what is not in use goes
                assert cache.path_of(image).is_dir() and cache.metrics()["unpacked"]["pinned"] == 1
            async with p.session("bundle-echo-v0", image=image) as s:  # the idle container: still pinned
                assert (await s.reset(seed=2))[0].text == "ready 2"
        assert cache.metrics()["unpacked"]["pinned"] == 0  # its containers stopped with the pool
        await cache.get(third.digest)
        assert not cache.path_of(image).exists()


class _SlowProbeRuntime(ProcessRuntime):
    """A remote-like runtime: a liveness probe is an API round trip, a stop has a grace
    period during which the container still runs. The probe of a container in ``held``
    lasts until ``answer`` is set (``probing`` says it began)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.dead: set[str] = set()
        self.held: set[str] = set()
        self.probing, self.answer = asyncio.Event(), asyncio.Event()

    async def _alive(self, c: Container) -> bool:
        if c.id in self.held:
            self.probing.set()
            await self.answer.wait()
        await asyncio.sleep(0.05)
        return c.id not in self.dead and await super()._alive(c)

    async def _stop(self, c: Container) -> None:
        if c.id not in self.dead:
            await asyncio.sleep(1.0)
        await super()._stop(c)


async def test_a_claim_never_gets_a_container_its_image_was_let_go_with(images):
    # the image was let go (past max_containers) while a claim probed its first idle
    # container: the claim still held the same idle deque and handed out the next container,
    # whose stop was already under way. The probe lasts until the image is let go (image B's
    # cold start, which lets go of A only once it has started: a loaded machine's took longer
    # than a fixed probe, and the claim took a2 before A was let go, as it may)
    image_a, image_b = "other@sha256:" + "e" * 64, "echo@sha256:" + "e" * 64
    p = pool(images, min_warm=2, max_containers=3, warm_idle_s=3600)
    rt = await swap_runtime(p, _SlowProbeRuntime(p.config.runtime))
    async with p:
        await p.prewarm(image_a)
        a1, a2 = list(p._idle[image_a])
        rt.dead.add(a1.id)  # died while idle: the claim probes it, finds it dead, goes on
        rt.held.add(a1.id)
        claim = asyncio.create_task(p._claim(image_a))
        async with asyncio.timeout(60):  # bounds a hang only
            await rt.probing.wait()
        b = await p._claim(image_b)  # a cold start past max_containers lets go of image A
        assert image_a not in p._wanted  # (a2's stop is under way, in the background)
        rt.answer.set()
        got = await claim
        assert got is not a2 and got.id not in rt._stopping and got.id in rt.live
        await p._release(got, healthy=True)
        await p._release(b, healthy=True)


async def test_the_reaper_takes_only_idle_sessions(images):
    async with pool(images, session_ttl_s=0.5) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset()
        for _ in range(10):  # busy for 1 s, one request every 0.1 s: never idle for 0.5 s
            await s.step("x")
            await asyncio.sleep(0.1)
        assert p.stats().get("reaped", 0) == 0
        await asyncio.sleep(1.0)
        with pytest.raises(SessionLost, match="reaper"):
            await s.step("x")


class _DeadAndStuckRuntime(ProcessRuntime):
    """Containers named in ``dead`` probe dead, and their stops hang until ``gate`` is set
    (a remote engine slow to remove what died)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.dead: set[str] = set()
        self.gate = asyncio.Event()

    async def _alive(self, c: Container) -> bool:
        return c.id not in self.dead and await super()._alive(c)

    async def _stop(self, c: Container) -> None:
        if c.id in self.dead:
            await self.gate.wait()
        await super()._stop(c)


async def test_a_claim_does_not_wait_for_the_stop_of_an_idle_container_found_dead(images):
    # the claim stopped the dead one inline before it probed the next idle container: a stop
    # that hangs (up to stop_timeout_s) held a claim that had a live container to take
    p = pool(images, min_warm=2, stop_timeout_s=60)
    rt = await swap_runtime(p, _DeadAndStuckRuntime(p.config.runtime))
    async with p:
        await p.prewarm(IMAGE, 2)
        dead, live = list(p._idle[IMAGE])
        rt.dead.add(dead.id)
        claim = asyncio.ensure_future(p._claim(IMAGE))
        try:
            await asyncio.wait({claim}, timeout=10)
            assert claim.done(), "the claim waited for the dead container's stop"
            assert claim.result() is live and rt.stopping(dead)
            await p._release(live, healthy=True)
        finally:
            claim.cancel()
            rt.gate.set()
        await wait_for(lambda: dead.id not in rt.live)


async def test_a_claim_does_not_wait_for_the_stop_of_the_container_it_evicted(images):
    # at max_containers a claim evicts another image's idle container and waited for its stop
    # inline: when a container of its own image came back idle meanwhile, it still waited
    # for that stop (up to stop_timeout_s) before it looked again
    p = pool(images, min_warm=0, max_containers=2, stop_timeout_s=60, claim_timeout_s=30)
    rt = await swap_runtime(p, _DeadAndStuckRuntime(p.config.runtime))
    async with p:
        await p.prewarm(None, 1)  # the built-ins: another image's idle container
        [other] = p._idle[None]
        rt.dead.add(other.id)  # (alive: only its stop hangs, as it is evicted)
        held = p.session("bundle-echo-v0", image=IMAGE)
        s = await held.__aenter__()
        claim = None
        try:
            await s.reset(seed=1)
            mine = s.container
            claim = asyncio.ensure_future(p._claim(IMAGE))  # no room: evicts the other image's
            await wait_for(lambda: rt.stopping(other), timeout_s=10)
            await held.__aexit__(None, None, None)  # its own image's container comes back idle
            held = None
            await asyncio.wait({claim}, timeout=10)
            assert claim.done(), "the claim waited for the evicted container's stop"
            assert claim.result() is mine
            await p._release(mine, healthy=True)
        finally:
            if held is not None:
                await held.__aexit__(None, None, None)
            if claim is not None:
                claim.cancel()
            rt.gate.set()
        await wait_for(lambda: other.id not in rt.live)
