"""The process runtime's directory: made at the first start and removed at the close,
locked before the reaper can read its name, dead owners' directories reaped; and the
containers' socket paths under it (a deep temp dir, the Unix limit, a relative root)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import sys
import time
from pathlib import Path

import pytest

from envpool.pool import EnvPool
from envpool.runtimes.base import ProcessRuntimeConfig
from envpool.runtimes.process import ProcessRuntime

# -- the runtime's directory ----------------------------------------------------------------


async def test_the_runtime_makes_its_directory_at_its_first_start_and_removes_it(tmp_path, monkeypatch):
    # made in the constructor, it stayed in /tmp for every pool made and never entered
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    EnvPool({"min_warm": 0})
    p = EnvPool({"min_warm": 0, "runtime": {"heartbeat_s": 0.2}})
    assert list(tmp_path.iterdir()) == []
    async with p, p.session("echo-v0") as s:
        await s.reset()
        assert [d.name for d in tmp_path.iterdir()] == [p.runtime.root.name]
        assert p.runtime.root.name.startswith(f"envpool-p{os.getpid()}-")
    assert list(tmp_path.iterdir()) == []


def test_a_runtimes_root_is_locked_before_it_bears_a_name_the_reaper_reads(tmp_path, monkeypatch):
    # made as envpool-p<pid>-* and locked a moment later: a reaper in another process took
    # the free lock in between for a dead owner's and removed the live directory
    from envpool.runtimes._process_root import ROOT_NAME
    from envpool.runtimes.process import ProcessRuntime

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    seen: list[str] = []
    real_rename = os.rename

    def rename(src, dst):  # what a reaper would find just before the name is ours
        seen.extend(p.name for p in tmp_path.iterdir() if ROOT_NAME.fullmatch(p.name))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    rt = ProcessRuntime()
    root = rt.root
    assert seen == [] and ROOT_NAME.fullmatch(root.name)
    fd = os.open(root / ".owner", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by the runtime
    finally:
        os.close(fd)
        asyncio.run(rt.aclose())
    assert not root.exists()


async def test_entering_a_pool_removes_the_directories_of_dead_owners_only(tmp_path, monkeypatch):
    # a driver SIGKILLed leaves its containers' directories for good: nothing of its close ran
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await gone.wait()
    live = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    try:
        (tmp_path / f"envpool-p{gone.pid}-abc_123" / f"p{gone.pid}-1").mkdir(parents=True)
        # a root from before the owner's lock: reaped by its pid, once over a minute old
        old = time.time() - 120
        os.utime(tmp_path / f"envpool-p{gone.pid}-abc_123", (old, old))
        # a root whose owner's lock is free (its owner died): reaped whatever its age
        unlocked = tmp_path / f"envpool-p{gone.pid}-unlocked"
        unlocked.mkdir()
        (unlocked / ".owner").touch()
        # a root whose lock is held: its owner lives, though its pid is none we can see (a
        # driver in another pid namespace sharing the temp dir)
        held = tmp_path / f"envpool-p{gone.pid}-held"
        held.mkdir()
        lock = os.open(held / ".owner", os.O_CREAT | os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX)
        # a root just made, its lock file not yet there: too young to tell
        (tmp_path / f"envpool-p{gone.pid}-young").mkdir()
        keep = [
            held.name,
            f"envpool-p{gone.pid}-young",
            f"envpool-p{live.pid}-abc_123",  # a live owner's
            f"envpool-p{os.getpid()}-abc_123",  # ours
            "envpool-bench-abc_123",  # another kind of directory
            "envpool-x7f3k2a9",  # no owner to tell (the old naming)
            f"envpool-p{gone.pid}",  # not quite the runtime's name
        ]
        for name in keep:
            (tmp_path / name).mkdir(exist_ok=True)
        async with EnvPool({"min_warm": 0}) as p:
            assert p.metrics["orphans_reaped"] == 2
        assert sorted(d.name for d in tmp_path.iterdir()) == sorted(keep)
    finally:
        with contextlib.suppress(NameError):
            os.close(lock)
        live.kill()
        await live.wait()


# -- the containers' sockets under the runtime's root ----------------------------------


async def test_a_deep_temp_dir_leaves_room_for_the_containers_socket(tmp_path, monkeypatch):
    # the container's directory repeated the root's pid (p<pid>-<n>/s): under a deep TMPDIR
    # (pytest's own, under xdist in CI) the socket path passed 107 bytes and every start
    # failed with "AF_UNIX path too long". A TMPDIR that leaves the socket 104 bytes:
    root_name = len(f"/envpool-p{os.getpid()}-") + 8  # mkdtemp's random part
    deep = tmp_path / ("d" * (104 - len("/1/s") - root_name - len(str(tmp_path)) - 1))
    deep.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    p = EnvPool({"min_warm": 0, "runtime": {"heartbeat_s": 0.2}})
    async with p, p.session("echo-v0") as s:
        await s.reset()
        assert len(os.fsencode(p.runtime.root / "1" / "s")) == 104


async def test_a_socket_path_over_the_unix_limit_is_refused_saying_what_to_change(tmp_path):
    from envpool.errors import ContainerStartError
    from envpool.runtimes.process import ProcessRuntime, ProcessRuntimeConfig

    root = tmp_path / ("d" * 120)
    rt = ProcessRuntime(ProcessRuntimeConfig(root=root))
    try:
        too_long = r"over the 107 a Unix socket allows; give runtime.root"
        with pytest.raises(ContainerStartError, match=too_long):
            await rt.start(None, None, timeout_s=10)
        assert not root.exists() or list(root.iterdir()) == []  # nothing made for it
    finally:
        await rt.aclose()


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "fresh-interpreter"])
async def test_a_relative_root_is_the_drivers_directorys(tmp_path, monkeypatch, zygote):
    # runtime.root as a relative path: the container's socket path was given relative, and
    # read from the container's own directory (its cwd) it named no directory there: no
    # container ever started ("FileNotFoundError" at its bind). Relative paths also made two
    # drivers' container directories, and their marks (envpool.escapees), the same string
    monkeypatch.chdir(tmp_path)
    rt = ProcessRuntime(ProcessRuntimeConfig(root="rel", zygote=zygote, heartbeat_s=0.1))
    try:
        c = await rt.start(None, None, timeout_s=20)
        assert Path(c.endpoint).is_absolute() and Path(c.endpoint).parent.parent == tmp_path / "rel"
        assert await rt.alive(c)
        await rt.stop(c)
    finally:
        await rt.aclose()
