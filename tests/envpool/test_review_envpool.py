"""Found in an adversarial review of the pool and the image cache: each test pins a bug
that was demonstrated, then fixed."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import struct
import tarfile
from pathlib import Path

import pytest
from echo_bundle import IMAGE
from pool_util import pool, swap_runtime, wait_for
from pydantic import ValidationError

from envpool.connection import Connection
from envpool.errors import InfraError, PoolClosed
from envpool.images import (
    Bundle,
    DiskTier,
    DiskTierConfig,
    ImageFetchError,
    S3Tier,
    S3TierConfig,
    TieredCache,
    UnsafeBundle,
    digest_of,
    make_tier,
    unpack,
)
from envpool.pool import EnvPool
from envpool.pool_config import PoolConfig
from envpool.protocol import encode
from envpool.runtimes.base import Container
from envpool.runtimes.process import ProcessRuntime


def _tar_gz(*members: tuple[str, bytes, str, bytes | None]) -> bytes:
    """(name, type, linkname, data) members, as a tar.gz."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, type_, linkname, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode = type_, linkname, 0o644
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


REG, DIR, SYM, LNK = tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
MALFORMED = {
    # a file, then a member under it: NotADirectoryError (an OSError: retried as infra)
    "under-a-file": [("a", REG, "", b"x"), ("a/b", REG, "", b"y")],
    # a directory, then a file of the same name: IsADirectoryError
    "file-over-dir": [("a", DIR, "", None), ("a", REG, "", b"x")],
    # a hard link to a member the archive does not have: a bare KeyError
    "dangling-hardlink": [("h", LNK, "nothere", None)],
    # a symlink to itself, then a member through it: FileExistsError
    "self-link": [("l", SYM, "l", None), ("l/x", REG, "", b"x")],
}


async def test_an_episode_replayed_on_a_fresh_container_counts_toward_its_recycling(images):
    # the replay ran the episode's reset on the new container without counting it: with
    # max_episodes=1 (a fresh container per episode) that container went back to the idle
    # pool with 0 episodes and the next trajectory ran in the state the replay left
    async with pool(images, min_warm=0, max_episodes=1) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            await s.step("a")
            os.killpg(s.container.pid, signal.SIGKILL)
            assert (await s.step("b")).obs.text == "b #2"  # replayed on a new container
            replayed = s.container
            assert replayed.episodes == 1
        async with p.session("bundle-echo-v0", image=IMAGE) as s2:
            await s2.reset(seed=2)
            assert s2.container.id != replayed.id
        assert p.stats()["recycled"] == 2


@pytest.mark.parametrize("members", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_bundle_is_refused_as_unsafe_not_a_raw_os_error(tmp_path: Path, members: list) -> None:
    # these raised NotADirectoryError, IsADirectoryError, FileExistsError (OSErrors, which a
    # session retries as infrastructure faults: five fetches and unpacks of a bundle that can
    # never unpack, then "infra_failed") or a bare KeyError naming no bundle
    with pytest.raises(UnsafeBundle, match="bundle"):
        unpack(_tar_gz(*members), tmp_path / "dest")


async def test_the_cache_refuses_a_malformed_bundle_once_and_leaves_nothing_unpacked(tmp_path: Path) -> None:
    data = _tar_gz(*MALFORMED["under-a-file"])
    digest = digest_of(data)
    async with TieredCache(
        [DiskTier(DiskTierConfig(path=tmp_path / "l1"))], unpack_dir=tmp_path / "unpacked"
    ) as cache:
        await cache.publish(Bundle(digest=digest, data=data))
        with pytest.raises(UnsafeBundle):
            await cache.get(digest)
        assert cache.metrics()["outcomes"].get("retries", 0) == 0
    assert list((tmp_path / "unpacked" / "sha256").iterdir()) == []


class _RefusingStopRuntime(ProcessRuntime):
    """Stops fail until told otherwise (an engine or API refusing removals for a while)."""

    refuse = True

    async def _stop(self, c: Container) -> None:
        if self.refuse:
            raise InfraError("docker: the engine refused to remove a container: 500")
        await super()._stop(c)


async def test_a_reaped_container_is_never_handed_to_another_session(images):
    # the reaper took the container of a slow (not leaked) session and its stop failed: the
    # container still ran, and when the session ended with a clean goodbye it went back to
    # the idle pool, where the next session claimed a container the pool was still stopping
    stop_retry = {"attempts": 100, "initial_backoff_s": 0.05, "max_backoff_s": 0.1}
    p = pool(images, min_warm=0, session_ttl_s=0.3, stop_retry=stop_retry)
    rt = await swap_runtime(p, _RefusingStopRuntime(p.config.runtime))
    async with p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            reaped = s.container
            await wait_for(lambda: reaped.reaped, timeout_s=10)
        assert all(c.id != reaped.id for q in p._idle.values() for c in q)
        async with p.session("bundle-echo-v0", image=IMAGE) as s2:
            await s2.reset(seed=2)
            assert s2.container.id != reaped.id
        rt.refuse = False
        await wait_for(lambda: reaped.id not in rt.live, timeout_s=10)


async def test_the_reaper_does_not_take_a_container_in_the_middle_of_a_slow_step(images):
    # the reaper measured the time since the last request *started*: a step that ran longer
    # than session_ttl_s (a test suite in a code environment, with a generous step_timeout_s)
    # had its container stopped under it, and the session ended infra_failed, "reaped"
    async with pool(images, min_warm=0, session_ttl_s=0.5, step_timeout_s=30) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            r = await s.step("sleep 1.5")
            assert r.obs.text == "sleep 1.5 #1" and s.status == "ok"
        assert p.stats().get("reaped", 0) == 0


async def test_a_session_that_runs_many_episodes_still_recycles_its_container(images):
    # max_episodes was only looked at when a session gave its container back: a session that
    # reset its container over and over (an evaluation loop, a multi-episode trajectory) ran
    # every episode on it, however many, with max_episodes=1 included
    async with pool(images, min_warm=0, max_episodes=2) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            ids = []
            for seed in range(5):
                obs, _ = await s.reset(seed=seed)
                assert obs.text == f"ready {seed}"
                assert (await s.step("a")).obs.text == "a #1"
                ids.append(s.container.id)
            assert ids[0] == ids[1] != ids[2] == ids[3] != ids[4]
            assert s.container.episodes == 1
        assert p.stats()["recycled"] == 2  # during the session (the last one has an episode left)


@pytest.mark.parametrize("key", ["as_bytes", "nofile", "fsize_bytes", "cpu_s"])
def test_a_negative_resource_limit_is_refused_by_the_config(key):
    # setrlimit took -5 as RLIM_INFINITY: the container ran with no limit at all, silently
    with pytest.raises(ValidationError, match=key):
        PoolConfig.model_validate({"runtime": {"limits": {key: -5}}})


def test_one_heartbeat_miss_is_refused_by_the_config():
    # with heartbeat_misses=1 the pool waited exactly one heartbeat period: any jitter in the
    # container's heartbeat thread read as a frozen container, so every step slower than a
    # period (a 1.5 s sleep at heartbeat_s=0.1) was replayed 5 times and the session lost
    with pytest.raises(ValidationError, match="heartbeat_misses"):
        PoolConfig.model_validate({"heartbeat_misses": 1})
    assert PoolConfig.model_validate({"heartbeat_misses": 2}).heartbeat_misses == 2


async def test_a_blob_evicted_while_it_is_read_is_not_counted_again(tmp_path: Path, monkeypatch):
    # the read found the blob gone from the LRU when it came back and took it for one another
    # process wrote: it was counted again (its file deleted), which evicted a good blob to
    # make room for one that was not there
    import threading

    from envpool.images.tiers import disk

    blobs = [bytes([i]) * 100 for i in range(3)]
    a, b, c = (digest_of(x) for x in blobs)
    read, go = threading.Event(), threading.Event()
    real = disk._read_and_touch

    def slow_read(path: Path) -> bytes:
        data = real(path)
        if path.name == a[7:]:
            read.set()
            assert go.wait(30)
        return data

    monkeypatch.setattr(disk, "_read_and_touch", slow_read)
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1", max_bytes=250)) as l1:
        await l1.put(a, blobs[0])
        await l1.put(b, blobs[1])
        reading = asyncio.ensure_future(l1.get(a))
        await asyncio.to_thread(read.wait, 30)
        await l1.put(c, blobs[2])  # evicts a, the least recently used, mid-read
        go.set()
        assert await reading == blobs[0]  # what was read is good all the same
        on_disk = {p.name for p in (tmp_path / "l1" / "sha256").iterdir()}
        assert on_disk == {b[7:], c[7:]}  # b, the good blob, is still there
        assert l1.total_bytes == 200 and a not in l1


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:9000", "ftp://mirror/blobs", "", "http://"])
def test_an_http_tier_url_that_is_not_http_is_refused_by_the_config(url):
    # it was accepted, and every fetch failed with httpx's UnsupportedProtocol, which the
    # cache took for a transport fault: retried with backoff on every get of every session
    with pytest.raises(ValidationError, match="url"):
        make_tier({"type": "origin", "url": url})
    assert make_tier({"type": "mirror", "url": "https://mirror.example:8443/v2/"}).name == "mirror"


@pytest.mark.parametrize("kind", ["docker", "kubernetes", "modal"])
def test_a_remote_runtimes_image_source_that_is_not_http_is_refused_by_the_config(kind):
    # checked nowhere on the driver: each container's server failed to fetch its bundle from
    # it and exited, a start failure the pool retried on every claim of every session
    with pytest.raises(ValidationError, match="image_source"):
        PoolConfig.model_validate({"runtime": {"type": kind, "image_source": "mirror:5000"}})
    cfg = PoolConfig.model_validate({"runtime": {"type": kind, "image_source": "http://mirror:5000"}})
    assert cfg.runtime.image_source == "http://mirror:5000"


async def test_a_cancellation_that_lands_with_the_reply_is_not_lost(tmp_path: Path):
    # asyncio.wait_for (Python 3.11) returns the result of an inner future that completed in
    # the loop turn its caller was cancelled, and swallows the cancellation: an aborted
    # trajectory whose step reply arrived just then went on running as if never aborted
    got, gone = asyncio.Event(), asyncio.Event()

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(struct.unpack("!I", await r.readexactly(4))[0])
        got.set()
        await r.read()  # never answers; returns once the pool hangs up
        w.close()
        gone.set()

    server = await asyncio.start_unix_server(silent, str(tmp_path / "s"))
    async with server:
        conn = await Connection.open(str(tmp_path / "s"), heartbeat_s=5, misses=4, tool_caller=None)
        task = asyncio.ensure_future(conn.request({"op": "step", "token": "t", "id": 7}, 30))
        await asyncio.wait_for(got.wait(), 30)
        conn.data_received(encode({"id": 7, "ok": True, "result": {"obs": "late"}}))
        task.cancel()  # in the same loop turn as the reply
        with pytest.raises(asyncio.CancelledError):
            await task
        conn.close()
        await asyncio.wait_for(gone.wait(), 30)


class _GatedRuntime(ProcessRuntime):
    """Starts a (fake) container when told to."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        self.waiting.set()
        await self.gate.wait()
        return Container(id="fake-1", endpoint="/nonexistent", image=image, runtime=self.kind)

    async def _stop(self, c: Container) -> None:
        pass


async def test_a_start_cancelled_in_the_loop_turn_it_finished_is_cancelled():
    # as in a session request: asyncio.wait_for (Python 3.11) returned the container and
    # swallowed the cancellation, so an aborted claim went on to run its trajectory
    rt = _GatedRuntime()
    await _cancel_as_it_finishes(rt)
    await rt.aclose()


async def _cancel_as_it_finishes(rt: _GatedRuntime) -> None:
    """Cancel a start of ``rt`` in the loop turn it finishes; the cancellation must stand."""
    task = asyncio.ensure_future(rt.start(None, None, timeout_s=30))
    await asyncio.wait_for(rt.waiting.wait(), 30)
    rt.gate.set()
    task.cancel()  # in the same loop turn as the start's end
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_claim_cancelled_in_the_loop_turn_capacity_frees_up_is_cancelled(images):
    # as in a session request: the claim's wait for capacity (asyncio.wait_for on Python
    # 3.11) swallowed a cancellation that landed with a wake-up, and the aborted claim went
    # on waiting for a container (and took one, or failed as "no container free")
    async with pool(images, min_warm=0, max_containers=1, claim_timeout_s=3) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            claim = asyncio.ensure_future(p._claim(IMAGE))
            await wait_for(lambda: p._changed is not None)  # waiting for capacity
            await asyncio.sleep(0.01)
            p._notify_changed()
            claim.cancel()  # in the same loop turn as the wake-up
            with pytest.raises(asyncio.CancelledError):
                await claim


class _GatedStopRuntime(ProcessRuntime):
    """Stops return when told to (once done)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.gate = asyncio.Event()
        self.waiting = asyncio.Event()

    async def stop(self, c: Container) -> None:
        await super().stop(c)
        self.waiting.set()
        await self.gate.wait()


async def test_a_release_cancelled_in_the_loop_turn_its_stop_ends_is_cancelled(images):
    # as in a session request: the pool's bounded stop (asyncio.wait_for on Python 3.11)
    # swallowed a cancellation that landed as the stop ended, and the cancelled task (an
    # aborted trajectory leaving its session block) went on as if never cancelled
    p = pool(images, min_warm=0, max_episodes=1)  # released = stopped
    rt = await swap_runtime(p, _GatedStopRuntime(p.config.runtime))
    async with p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            c = s.container
            s.container = s.conn = None  # the test releases it instead (its goodbye was said)
        release = asyncio.ensure_future(p._release(c, healthy=True))
        await asyncio.wait_for(rt.waiting.wait(), 30)
        rt.gate.set()
        await asyncio.sleep(0)  # the gated stop returns in this turn, its caller not woken yet
        release.cancel()
        with pytest.raises(asyncio.CancelledError):
            await release
        await wait_for(lambda: c.id not in rt.live, timeout_s=10)


async def test_a_container_that_finishes_starting_after_the_pool_closed_is_stopped():
    # a prewarm (or a claim) whose start was under way when the pool closed: the runtime's
    # close had stopped everything it knew, then the start landed and the container went
    # idle in a closed pool; a remote one (a pod, a sandbox) ran on with nothing to stop it
    p = EnvPool({"min_warm": 0})
    rt = await swap_runtime(p, _GatedRuntime())
    async with p:
        warming = asyncio.ensure_future(p.prewarm(None, 1))
        await asyncio.wait_for(rt.waiting.wait(), 30)
    rt.gate.set()
    with pytest.raises(PoolClosed):
        await warming
    assert not rt.live and not any(p._idle.values())


class _HangingStopRuntime(ProcessRuntime):
    """The stop of the containers named in ``hang`` hangs until ``gate`` is set."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.hang: set[str] = set()
        self.gate = asyncio.Event()

    async def _stop(self, c: Container) -> None:
        if c.id in self.hang:
            await self.gate.wait()
        await super()._stop(c)


async def test_a_reaped_container_whose_stop_hangs_does_not_stall_the_pools_housekeeping(images):
    # the reaper awaited each stop inside the maintenance loop: a stop that hangs (an engine
    # or API that does not answer; up to stop_timeout_s, 120 s by default) stopped the warm
    # containers' replenishment (and all other housekeeping) for that long
    p = pool(images, min_warm=1, session_ttl_s=0.3, stop_timeout_s=30)
    rt = await swap_runtime(p, _HangingStopRuntime(p.config.runtime))
    async with p:
        await p.prewarm(IMAGE, 1)
        block = p.session("bundle-echo-v0", image=IMAGE)  # (held: its exit waits for the gate)
        s = await block.__aenter__()
        try:
            await s.reset(seed=1)
            reaped = s.container
            rt.hang.add(reaped.id)
            await wait_for(lambda: reaped.reaped, timeout_s=10)
            async with p.session("bundle-echo-v0", image=IMAGE) as s2:  # takes the idle one
                await s2.reset(seed=2)
                # the pool warms a replacement while the reaped container's stop hangs
                await wait_for(lambda: len(p._idle[IMAGE]) >= 1, timeout_s=10)
        finally:
            rt.gate.set()
            await block.__aexit__(None, None, None)


@pytest.mark.parametrize("bucket", ["", "Bad_Bucket!"])
async def test_an_invalid_s3_bucket_name_is_a_config_error_not_a_retried_transport_fault(bucket, monkeypatch):
    # botocore refuses the request before sending it (ParamValidationError, a BotoCoreError):
    # it was reported as "S3 transport error" and retried with backoff on every get
    pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    async with S3Tier(S3TierConfig(bucket=bucket, endpoint_url="http://127.0.0.1:9")) as tier:
        with pytest.raises(ImageFetchError, match="bucket") as e:
            await tier.get("sha256:" + "a" * 64)
    assert not e.value.retryable and "transport" not in str(e.value)


def test_min_warm_above_max_containers_is_refused_or_fitted():
    # the maintenance loop tried to start the missing warm containers every tick, forever
    from envpool.pool_config import PoolConfig

    assert PoolConfig(max_containers=1).min_warm == 1  # the default 2 fitted under the cap
    with pytest.raises(ValueError, match=r"min_warm \(3\) is more than max_containers \(2\)"):
        PoolConfig(min_warm=3, max_containers=2)
    assert PoolConfig(min_warm=2, max_containers=2).min_warm == 2


async def test_a_second_call_of_a_session_while_one_is_under_way_is_refused():
    # two steps at once ran in either order on the container, and a replay could not rebuild
    # the episode; the first one still completes
    from envpool import EnvPool
    from envpool.errors import EnvOrderError

    async with (
        EnvPool({"min_warm": 0}) as p,
        p.session("latency-v0", env_kwargs={"mu_s": 0.3, "turns": 10}) as s,
    ):
        await s.reset(seed=0)
        first = asyncio.ensure_future(s.step("go"))
        await asyncio.sleep(0)  # the first is under way
        with pytest.raises(EnvOrderError, match=r"step\(\) while this session's step\(\) is under way"):
            await s.step("go")
        with pytest.raises(EnvOrderError, match=r"reset\(\) while"):
            await s.reset(seed=1)
        res = await first
        assert res.obs is not None
        await s.step("go")  # one after another, as before


class _GatedRuntimeStopFailsOnce(_GatedRuntime):
    def __init__(self) -> None:
        super().__init__()
        self.stops = 0

    async def _stop(self, c: Container) -> None:
        self.stops += 1
        if self.stops == 1:
            raise OSError("the engine refused the stop")


async def test_a_start_cancelled_as_it_finished_stays_cancelled_when_its_stop_fails():
    # the container that ended just as its start was cancelled is stopped; a stop that
    # failed raised its OSError in place of the cancellation, which a session's recovery
    # takes for an infra fault and retries: the aborted claim went on
    rt = _GatedRuntimeStopFailsOnce()
    await _cancel_as_it_finishes(rt)
    assert rt.stops == 1
    await rt.aclose()  # the failed stop is tried again there
    assert rt.stops == 2 and not rt.live
