"""Defects a review of the pool and the process runtime found: idle containers that died and
were never replaced, an environment's processes that outlived a dead zygote, a close during
a cold claim's image fetch that left a zygote behind, a cancelled prewarm's containers that
nothing pruned, a zygote's stray output line that stopped its reader, and a second close that
returned before the first had ended."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
from pathlib import Path

import pytest
from echo_bundle import IMAGE, DirImages, write_bundle, write_env_bundle
from pool_util import alive, pool, swap_runtime, wait_for

from envpool.errors import ContainerStartError, PoolClosed
from envpool.runtimes import process
from envpool.runtimes.base import Container, ProcessRuntimeConfig, Runtime
from envpool.runtimes.process import ProcessRuntime

# -- idle containers that die are dropped and replaced ----------------------------------------


async def test_idle_containers_that_die_are_replaced_before_a_claim_needs_one(images):
    # housekeeping never looked at idle containers: both still counted as warm (and held their
    # slots) after they died, and the next claim found them dead and started cold
    async with pool(images, min_warm=2) as p:
        await p.prewarm(IMAGE, 2)
        dead = list(p._idle[IMAGE])
        for c in dead:
            os.kill(c.pid, signal.SIGKILL)  # OOM-killed while idle, say
        gone = {c.id for c in dead}

        def replaced() -> bool:
            idle = list(p._idle[IMAGE])
            return len(idle) == 2 and all(c.id not in gone and alive(c.pid) for c in idle)

        await wait_for(replaced, timeout_s=10)
        assert p.stats()["idle_died"] == 2
        await wait_for(lambda: not gone & set(p.runtime.live))  # and stopped
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            assert (await s.reset(seed=1))[0].text == "ready 1"
        stats = p.stats()
        assert stats["claims_warm"] == 1 and stats.get("claims_cold", 0) == 0


class _RemoteLikeRuntime(ProcessRuntime):
    """A runtime that learns of a death only by asking (an API call): a probe tells, on the
    pool's schedule; containers named in ``dead`` probe dead, and a probe may fail."""

    idle_probe_s = 0.2

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.dead: set[str] = set()
        self.fail_probes = False
        self.probes = 0

    def known_dead(self, c: Container) -> bool:
        return False

    async def _alive(self, c: Container) -> bool:
        self.probes += 1
        if self.fail_probes:
            raise ContainerStartError("kubernetes: read pod envpool-x: 500 InternalError")
        return c.id not in self.dead and await super()._alive(c)


async def test_a_remote_runtimes_idle_containers_are_probed_on_its_schedule(images):
    p = pool(images, min_warm=2)
    rt = await swap_runtime(p, _RemoteLikeRuntime(p.config.runtime))
    async with p:
        await p.prewarm(IMAGE, 2)
        first, second = list(p._idle[IMAGE])
        rt.fail_probes = True  # a probe that fails says nothing: both stay idle
        probes = rt.probes
        await wait_for(lambda: rt.probes >= probes + 2)
        assert list(p._idle[IMAGE]) == [first, second] and p.stats().get("idle_died", 0) == 0
        assert p.stats()["idle_probe_failed:ContainerStartError"] >= 1
        rt.fail_probes = False
        rt.dead.add(first.id)
        await wait_for(lambda: len(p._idle[IMAGE]) == 2 and first not in p._idle[IMAGE], timeout_s=10)
        assert second in p._idle[IMAGE] and p.stats()["idle_died"] == 1


# -- a dead zygote's containers leave nothing running ---------------------------------------

_SPAWN_ENV = """
import subprocess, envpool
class SpawnEnv(envpool.Env):
    example_actions = ("x",)
    def reset(self, *, seed=None, options=None):
        self.p = subprocess.Popen(["sleep", "%d"])
        return f"child {self.p.pid}", {}
    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text="ok"))
"""


async def test_an_environments_processes_die_with_the_zygote(tmp_path: Path):
    # the zygote's death killed each container's server (PDEATHSIG), not its process group:
    # what an environment had started ran on under init after the pool had closed
    images = write_env_bundle(
        tmp_path / "b", "spawn_env", _SPAWN_ENV % (700 + os.getpid() % 100), {"spawn-v0": "SpawnEnv"}
    )
    child = None
    try:
        async with pool(images, min_warm=0) as p:
            async with p.session("spawn-v0", image=IMAGE) as s:
                obs, _ = await s.reset(seed=1)
                child = int(obs.text.split()[1])
                assert alive(child)
                zygote = p.runtime._zygote
                assert zygote is not None and zygote.proc is not None
                os.kill(zygote.proc.pid, signal.SIGKILL)  # OOM-killed, say
                await wait_for(lambda: zygote.reader is not None and zygote.reader.done())
                await wait_for(lambda: not alive(child))
    finally:
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


# -- a close during a cold claim leaves nothing behind ------------------------------------------


class _GatedImages(DirImages):
    """The echo bundle, each fetch held until ``go`` is set (a slow registry)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.go = asyncio.Event()
        self.fetching = asyncio.Event()

    async def get(self, digest: str) -> Path:
        self.fetching.set()
        await self.go.wait()
        return await super().get(digest)


async def test_a_close_during_a_cold_claims_image_fetch_starts_nothing(tmp_path: Path):
    # the claim checked for a closed pool before the fetch, not after: its start, after the
    # close, spawned a new zygote and made the runtime's directory again (without its lock)
    images = _GatedImages(write_bundle(tmp_path / "b"))
    p = pool(images, min_warm=0)
    await p.__aenter__()
    try:
        async with p.session("echo-v0") as s:  # the zygote and the runtime's directory exist
            await s.reset(seed=1)
        root = p.runtime._root
        assert root is not None and root.exists()
        claim = asyncio.ensure_future(p._claim(IMAGE))
        await images.fetching.wait()
        await p.aclose()
        images.go.set()
        with pytest.raises(PoolClosed):
            await claim
        zygote = p.runtime._zygote
        assert zygote is not None and (zygote.proc is None or zygote.proc.returncode is not None)
        assert not root.exists() and not p.runtime.live
    finally:
        images.go.set()
        await p.aclose()
        await p.runtime.aclose()  # (what the old code started: stopped, whatever it was)


async def test_a_closed_process_runtime_starts_nothing():
    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1))
    await rt.aclose()
    try:
        with pytest.raises(ContainerStartError, match="closed"):
            await rt.start(None, None, timeout_s=30)
        assert rt._root is None and rt._zygote is not None and rt._zygote.proc is None
    finally:
        await rt.aclose()


class _GatedRuntime(Runtime):
    """Containers are records; a start waits for ``go`` (a pod being scheduled)."""

    kind = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()
        self.starting = asyncio.Event()
        self.stopped: list[str] = []
        self.ids = itertools.count(1)

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        self.starting.set()
        await self.go.wait()
        return Container(
            id=f"g{next(self.ids)}", endpoint="tcp://127.0.0.1:9", image=image, runtime=self.kind
        )

    async def _stop(self, c: Container) -> None:
        self.stopped.append(c.id)

    async def _alive(self, c: Container) -> bool:
        return c.id not in self.stopped


async def test_a_start_that_ends_after_its_runtimes_close_is_stopped():
    # every runtime, not only the pool: what started after the close had stopped everything
    # it knew was returned live, owned by nobody
    rt = _GatedRuntime()
    start = asyncio.ensure_future(rt.start(None, None, timeout_s=30))
    await rt.starting.wait()
    await rt.aclose()
    rt.go.set()
    with pytest.raises(ContainerStartError, match="closed"):
        await start
    assert rt.stopped == ["g1"] and not rt.live


# -- a cancelled prewarm's containers are pruned --------------------------------------------------


class _FirstFastImages(DirImages):
    """The first fetch returns at once; the rest wait (a registry that stalls)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.stall = asyncio.Event()

    async def get(self, digest: str) -> Path:
        if self.gets:
            await self.stall.wait()
        return await super().get(digest)


async def test_a_cancelled_prewarm_leaves_no_container_unpruned(tmp_path: Path):
    # the image was kept warm only once all of the prewarm's starts had ended: cancelled
    # after one, its container stayed idle, of an image no prune looked at, until the close
    images = _FirstFastImages(write_bundle(tmp_path / "b"))
    async with pool(images, min_warm=1, warm_idle_s=0.3) as p:
        prewarm = asyncio.ensure_future(p.prewarm(IMAGE, 3))
        await wait_for(lambda: len(p._idle.get(IMAGE, ())) == 1, timeout_s=10)
        prewarm.cancel()
        await asyncio.gather(prewarm, return_exceptions=True)
        await wait_for(lambda: IMAGE not in p._wanted and not p._idle.get(IMAGE) and not p.runtime.live)
        assert p.stats()["warm_dropped:idle"] == 1
        images.stall.set()


# -- a zygote's stray output --------------------------------------------------------------------


async def test_a_zygote_that_prints_a_stray_line_still_starts_containers(tmp_path, monkeypatch):
    # a module the zygote imports printed to its stdout: the reader raised on the line and
    # died, and every start waited out start_timeout_s for answers nobody read
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("print('hello from an import')\nprint(7)\n")
    child_env = process._child_env

    def noisy_env(cdir: Path, mark: str) -> dict[str, str]:
        env = child_env(cdir, mark)
        env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
        return env

    monkeypatch.setattr(process, "_child_env", noisy_env)
    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1))
    try:
        c = await rt.start(None, None, timeout_s=20)
        assert await rt.alive(c)
        await rt.stop(c)
    finally:
        await rt.aclose()


# -- a second close ----------------------------------------------------------------------------


async def test_a_second_close_returns_once_the_first_has_ended(images):
    # the second returned at once, while the first still stopped the containers
    p = pool(images, min_warm=1)
    await p.__aenter__()
    await p.prewarm(IMAGE, 1)
    [c] = p._idle[IMAGE]
    first = asyncio.ensure_future(p.aclose())
    await asyncio.sleep(0)  # under way: it waits for the background tasks
    await p.aclose()
    assert first.done() and not p.runtime.live and not alive(c.pid)
    await first


async def test_a_close_after_a_cancelled_one_stops_the_containers(images):
    # a first close cancelled while the runtime stopped its containers stopped nothing for
    # sure; the second returned at once all the same, the containers running on
    p = pool(images, min_warm=1)
    await p.__aenter__()
    await p.prewarm(IMAGE, 1)
    [c] = p._idle[IMAGE]
    entered = asyncio.Event()
    runtime_close = p.runtime.aclose

    async def slow_close() -> None:
        entered.set()
        await asyncio.sleep(3600)  # cancelled here, before it stops anything

    p.runtime.aclose = slow_close  # type: ignore[method-assign]
    first = asyncio.ensure_future(p.aclose())
    await entered.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert alive(c.pid)
    p.runtime.aclose = runtime_close  # type: ignore[method-assign]
    await p.aclose()
    assert not p.runtime.live and not alive(c.pid)


def _zygotes() -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"envpool.zygote {os.getpid()}$"], capture_output=True, text=True)
    return out.stdout.split()


@pytest.fixture(autouse=True)
def _no_zygote_left():
    yield
    with contextlib.suppress(FileNotFoundError):  # (no pgrep: the tests' own checks stand)
        assert _zygotes() == [], "a zygote outlived its test"
