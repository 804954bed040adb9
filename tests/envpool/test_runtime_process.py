"""The process runtime's own bookkeeping, with real containers: what it kills (never a pid
the kernel may have given to another process), what a cancelled start leaves behind, and
a container's output once it is ready (zygote or not)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import alive, pool, wait_for

import envpool
from envpool.pool import EnvPool
from envpool.runtimes.base import ProcessRuntimeConfig
from envpool.runtimes.process import ProcessRuntime

# -- a dead container's pid, reused by the kernel ---------------------------------------------

# Runs in a pid namespace of its own (``unshare -p -f --mount-proc``), where the next pid can
# be set (ns_last_pid) without touching the host: an idle container dies, the kernel gives its
# pid to another session's container at once (a pid wrap, made to land), and a claim that
# finds the dead one stops it.
_PID_REUSE = r"""
import asyncio, json, os, signal, sys, tempfile
from pathlib import Path
from echo_bundle import IMAGE, DirImages, write_bundle
from pool_util import alive
from envpool.pool import EnvPool


async def main(zygote):
    images = DirImages(write_bundle(Path(tempfile.mkdtemp()) / "b"))
    cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1, "zygote": zygote}}
    async with EnvPool(cfg, images=images) as p:
        await p.prewarm(IMAGE, 1)
        (dead,) = p._idle[IMAGE]
        os.kill(dead.pid, signal.SIGKILL)  # the idle container dies (OOM, a crash)
        while await p.runtime.alive(dead):
            await asyncio.sleep(0.01)
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(dead.pid - 1))
        async with p.session("echo-v0") as s1:  # another image's container: gets the pid if free
            await s1.reset(seed=1)
            other = s1.container
            async with p.session("bundle-echo-v0", image=IMAGE) as s2:  # finds the dead one first
                await s2.reset(seed=2)
            survived = alive(other.pid)
            text = (await s1.step("x")).obs.text
            out = {"reused": other.pid == dead.pid, "survived": survived, "text": text,
                   "same_container": s1.container is other, "replays": p.stats().get("replays", 0)}
    print(json.dumps(out), flush=True)


asyncio.run(main(sys.argv[1] == "zygote"))
"""


def _unshare_or_skip() -> list[str]:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux) for a pid namespace of its own")
    cmd = ["unshare", "-p", "-f", "--mount-proc"]
    probe = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a pid namespace here (needs root): {probe.stderr.strip()}")
    return cmd


@pytest.mark.parametrize("mode", ["zygote", "exec"])
def test_stopping_a_dead_container_never_kills_the_process_that_got_its_pid(tmp_path, mode):
    cmd = _unshare_or_skip()
    script = tmp_path / "pid_reuse.py"
    script.write_text(_PID_REUSE)
    root = Path(envpool.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(Path(__file__).parent)])}
    out = subprocess.run(
        [*cmd, sys.executable, str(script), mode], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if mode == "zygote" and not got["reused"]:
        pytest.skip(f"the kernel did not hand the dead container's pid over: {got}")
    # the other session's container lives on: no replay, the same container, its own count
    assert got["survived"] and got["same_container"] and got["replays"] == 0, got
    assert got["text"] == "x", got


async def test_the_zygote_keeps_records_of_live_containers_only(images):
    async with pool(images, min_warm=0, max_episodes=1) as p:
        z = p.runtime._zygote
        for seed in range(3):  # recycled after each episode (max_episodes=1)
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset(seed=seed)
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=9)
            os.kill(s.container.pid, signal.SIGKILL)  # one dies on its own
            await wait_for(lambda: s.container.handle.exited)
        # each record goes once the zygote has reaped its container
        await wait_for(lambda: not p.runtime.live and not z.children)


_SPAWNER = '''
import subprocess
import envpool


class SpawnEnv(envpool.Env):
    """Starts a helper process (in the container's process group) and names its pid."""

    example_actions = ("spawn",)

    def reset(self, *, seed=None, options=None):
        return "ready", {}

    def step(self, action):
        p = subprocess.Popen(["sleep", "60"])
        return envpool.StepResult(obs=envpool.Observation(text=str(p.pid)))
'''


async def test_a_container_whose_leader_died_loses_its_whole_group_at_once(tmp_path):
    # the pool never kills the group of a leader reported dead (its pid may be another's by
    # then); the zygote kills it before it reaps the leader, while the group's id is still its own
    images = write_env_bundle(tmp_path / "b", "spawn_env", _SPAWNER, {"spawn-v0": "SpawnEnv"})
    async with pool(images, min_warm=0) as p, p.session("spawn-v0", image=IMAGE) as s:
        await s.reset(seed=0)
        helper = int((await s.step("spawn")).obs.text)
        assert alive(helper)
        os.kill(s.container.pid, signal.SIGKILL)
        await wait_for(lambda: not alive(helper))


_FORKS_AT_IMPORT = """
import os
import time

import envpool

helper = os.fork()
if helper == 0:  # a helper forked at import (multiprocessing's default start does the same)
    time.sleep(60)
    os._exit(0)
with open(PIDFILE, "w") as f:  # (not in its image: its writes there are its own)
    f.write(str(helper))


class QuietEnv(envpool.Env):
    example_actions = ("x",)

    def reset(self, *, seed=None, options=None):
        return "ready", {}

    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text="ok"), terminated=True)


envpool.register("forks-v0", entry_point="forks_env:QuietEnv")
"""


async def test_a_helper_forked_at_import_holds_up_no_zygote_start(tmp_path):
    # the helper inherits the container's end of its ready pipe: a zygote that took the
    # message for complete only at the pipe's end waited for the helper's exit, and the
    # start timed out though the container was listening
    pidfile = tmp_path / "helper.pid"
    source = _FORKS_AT_IMPORT.replace("PIDFILE", repr(str(pidfile)))
    images = write_env_bundle(tmp_path / "b", "forks_env", source, {})
    (tmp_path / "b" / "envpool.json").write_text(json.dumps({"modules": ["forks_env"]}))  # imported at start
    runtime = {"heartbeat_s": 0.1, "zygote": True, "start_timeout_s": 5.0}
    async with pool(images, min_warm=0, runtime=runtime) as p, p.session("forks-v0", image=IMAGE) as s:
        assert (await s.reset(seed=0))[0].text == "ready"
    helper = int(pidfile.read_text())
    await wait_for(lambda: not alive(helper))  # in the container's group: stopped with it


_HANGS_AT_IMPORT = """
import os
import time

helper = os.fork()
if helper == 0:
    time.sleep(60)
    os._exit(0)
with open(PIDFILE + ".tmp", "w") as f:  # (not in its image: its writes there are its own)
    f.write(str(helper))
os.replace(PIDFILE + ".tmp", PIDFILE)
time.sleep(60)  # the import hangs: the container never reports in
"""


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "fresh-interpreter"])
async def test_a_start_given_up_before_its_container_reports_leaves_nothing(tmp_path, zygote):
    # the zygote killed a container whose start was given up (a claim cancelled, a start
    # timed out) only once it reported in: one that never does (its import hangs) ran on,
    # with what it started, for as long as the pool
    bundle, pidfile = tmp_path / "b", tmp_path / "helper.pid"
    write_env_bundle(bundle, "hangs_env", _HANGS_AT_IMPORT.replace("PIDFILE", repr(str(pidfile))), {})
    (bundle / "envpool.json").write_text(json.dumps({"modules": ["hangs_env"]}))
    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1, zygote=zygote, network_namespace=False))
    helper = 0
    try:
        start = asyncio.ensure_future(rt.start(IMAGE, bundle, timeout_s=60.0))
        await wait_for(pidfile.exists, timeout_s=30.0)
        helper = int(pidfile.read_text())
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        await wait_for(lambda: not alive(helper))
        await wait_for(lambda: [d.name for d in rt.root.iterdir()] == [".owner"])  # its directory went
        assert not rt.live
    finally:
        await rt.aclose()
        if helper and alive(helper):
            os.kill(helper, signal.SIGKILL)


_DRIVER_KILLED = r"""
import asyncio, json, sys
from pathlib import Path
from echo_bundle import IMAGE, DirImages
from envpool.pool import EnvPool


async def main():
    cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1, "zygote": True, "network_namespace": False}}
    images = DirImages(Path(sys.argv[1]))
    async with EnvPool(cfg, images=images) as p, p.session("spawn-v0", image=IMAGE) as s:
        await s.reset(seed=0)
        helper = int((await s.step("spawn")).obs.text)
        print(json.dumps({"helper": helper}), flush=True)
        await asyncio.sleep(60)  # SIGKILLed here: nothing of the pool's close runs


asyncio.run(main())
"""


def test_a_driver_killed_leaves_no_process_its_containers_started(tmp_path):
    # the zygote died of the driver's death at once (PR_SET_PDEATHSIG, SIGKILL), and each
    # container of the zygote's death: but not what a container had started in its group,
    # which ran on under init, owned by nobody (the driver's close would have killed it)
    write_env_bundle(tmp_path / "b", "spawn_env", _SPAWNER, {"spawn-v0": "SpawnEnv"})
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER_KILLED)
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])]),
        "TMPDIR": str(tmp_path),
    }
    driver = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "b")], stdout=subprocess.PIPE, env=env
    )
    helper = 0
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        helper = json.loads(line)["helper"]
        assert alive(helper)
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 5
        while alive(helper) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(helper)
    finally:
        driver.kill()
        driver.wait()
        if helper and alive(helper):
            os.kill(helper, signal.SIGKILL)


# -- a start cancelled as its container reports ready -----------------------------------------


async def test_a_claim_cancelled_as_its_container_reports_ready_leaves_no_container(images):
    async with pool(images, min_warm=0, max_episodes=1) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:  # the zygote is up
            await s.reset(seed=0)
        z = p.runtime._zygote
        zpid = z.proc.pid
        claimer: asyncio.Task[None] | None = None

        class Waiting(dict):
            def pop(self, key, default=None):
                # the reader is about to hand the ready message to the start's future: the
                # trajectory is aborted in this same loop iteration
                if claimer is not None and not claimer.done():
                    claimer.cancel()
                return super().pop(key, default)

        z.waiting = Waiting(z.waiting)

        async def one() -> None:
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                await s.reset(seed=1)

        claimer = asyncio.create_task(one())
        with contextlib.suppress(asyncio.CancelledError):
            await claimer
        assert claimer.cancelled()

        def children() -> list[int]:
            return [int(x) for x in Path(f"/proc/{zpid}/task/{zpid}/children").read_text().split()]

        # nothing runs that the runtime does not track, and its directory is gone
        await wait_for(lambda: not [c for c in children() if alive(c)])
        assert not p.runtime.live
        assert not [d for d in p.runtime.root.iterdir() if d.is_dir()]


# -- what a container prints ------------------------------------------------------------------

_PRINTER = '''
import envpool


class PrintEnv(envpool.Env):
    """Prints 100 kB of debug output per step."""

    example_actions = ("a",)

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return "ready", {}

    def step(self, action):
        self.n += 1
        print("debug output\\n" * 8000, end="", flush=True)
        return envpool.StepResult(obs=envpool.Observation(text=str(self.n)))
'''


async def test_an_environment_that_prints_runs_on_without_the_zygote(tmp_path):
    # a fresh interpreter's stdout was the pipe its ready line came through, never read
    # again: ~200 kB of prints filled it and the step hung (EnvHung), then stopping the
    # container waited on that pipe for stop_timeout_s
    images = write_env_bundle(tmp_path / "b", "print_env", _PRINTER, {"print-v0": "PrintEnv"})
    runtime = {"heartbeat_s": 0.1, "zygote": False}
    cfg = {"min_warm": 0, "step_timeout_s": 3.0, "stop_timeout_s": 3.0, "runtime": runtime}
    p = EnvPool(cfg, images=images)
    async with p:
        async with p.session("print-v0", image=IMAGE) as s:
            await s.reset(seed=0)
            for n in range(1, 5):
                assert (await s.step("a")).obs.text == str(n)
            pid = s.container.pid
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2.0  # the close did not wait on the pipe
    assert not p.runtime.live and not alive(pid)


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
    from envpool.runtimes.process import _ROOT_NAME, ProcessRuntime

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    seen: list[str] = []
    real_rename = os.rename

    def rename(src, dst):  # what a reaper would find just before the name is ours
        seen.extend(p.name for p in tmp_path.iterdir() if _ROOT_NAME.fullmatch(p.name))
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    rt = ProcessRuntime()
    root = rt.root
    assert seen == [] and _ROOT_NAME.fullmatch(root.name)
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


# -- the zygote dying -------------------------------------------------------------------------

_BLOCKER = """
import os
import time

open(os.path.join(os.environ["HOME"], "importing"), "w").close()  # HOME: its directory
time.sleep(120)  # a slow import: the container is still starting when the zygote dies
"""


async def test_a_start_the_zygote_dies_in_fails_and_leaves_no_directory(tmp_path):
    """The zygote died while it forked a container: the start failed, and the container's
    directory stayed until the runtime closed (a pool runs for days). It goes before the
    start fails now."""
    from envpool.errors import ContainerStartError
    from envpool.runtimes.base import ProcessRuntimeConfig
    from envpool.runtimes.process import ProcessRuntime

    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "blocker.py").write_text(_BLOCKER)
    (bundle / "envpool.json").write_text(json.dumps({"modules": ["blocker"]}))
    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1))
    try:
        start = asyncio.ensure_future(rt.start(IMAGE, bundle, timeout_s=60))
        await wait_for(lambda: any((d / "importing").exists() for d in rt.root.iterdir() if d.is_dir()))
        assert rt._zygote is not None and rt._zygote.proc is not None
        os.kill(rt._zygote.proc.pid, signal.SIGKILL)
        with pytest.raises(ContainerStartError, match="zygote"):
            await start
        assert not [d for d in rt.root.iterdir() if d.is_dir()], "the failed start's directory stayed"
    finally:
        await rt.aclose()


class _NotReapedYet:
    """A zygote's process as the loop may still see it after its output closed: no exit
    code yet (asyncio sets it when it has reaped the process, in a later turn)."""

    returncode = None

    def __init__(self, proc):
        self._proc = proc

    def __getattr__(self, name):
        return getattr(self._proc, name)


async def test_a_start_after_the_zygote_output_closed_gets_a_new_zygote_at_once(images):
    """The zygote was restarted only once asyncio had set its exit code: a start between its
    output closing and then wrote to the dead one and waited for an answer that never came,
    start_timeout_s long. The end of its output is its death now."""
    from envpool.runtimes.base import ProcessRuntimeConfig
    from envpool.runtimes.process import ProcessRuntime

    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1))
    try:
        await rt.stop(await rt.start(IMAGE, images.root, timeout_s=30))  # the zygote is up
        z = rt._zygote
        assert z is not None and z.proc is not None and z.reader is not None
        dead = z.proc
        os.kill(dead.pid, signal.SIGKILL)
        await wait_for(z.reader.done)  # its output is read to its end
        z.proc = _NotReapedYet(dead)
        c = await rt.start(IMAGE, images.root, timeout_s=10)  # the old code: 10 s, then failed
        assert z.proc.pid != dead.pid
        await rt.stop(c)
    finally:
        await rt.aclose()


# -- a frozen container ----------------------------------------------------------------------


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(") ")[2][:1]


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "fresh-interpreter"])
async def test_a_stopped_container_is_stopped_at_once(images, zygote):
    # a container frozen by SIGSTOP (the hang fault, a frozen host process) runs no SIGTERM
    # handler: a stop that asked politely first would wait out its whole grace before the
    # SIGKILL. The runtime sends SIGKILL straight away, which a stopped process obeys
    cfg = {"heartbeat_s": 0.1, "zygote": zygote}
    async with pool(images, min_warm=0, runtime=cfg) as p:
        await p.prewarm(IMAGE, 1)
        (c,) = p._idle[IMAGE]
        os.kill(c.pid, signal.SIGSTOP)
        await wait_for(lambda: _state(c.pid) == "T")
        t0 = time.monotonic()
        await p.runtime.stop(c)
        assert time.monotonic() - t0 < 1.0
        assert not alive(c.pid) and c.id not in p.runtime.live


# -- a zygote that dies as it forks ----------------------------------------------------------

# A stand-in zygote forks a container and exits at once; the container reaches
# ``zygote._child`` (its setsid and PR_SET_PDEATHSIG) only once its zygote is gone: the
# window between the fork and the prctl, made to land. This script is a child subreaper, so
# the orphan comes to it (not to init) and it can tell whether the container died with its
# zygote (exit code) or lived on to serve (its ready message).
_ORPHANED_AT_FORK = r"""
import ctypes, json, os, select, signal, sys, time
import envpool.zygote as zygote

ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
sock, cwd = sys.argv[1], sys.argv[2]
r, w = os.pipe()
stand_in = os.fork()
if stand_in == 0:
    me = os.getpid()
    if os.fork() == 0:
        os.close(r)
        deadline = time.monotonic() + 10
        while os.getppid() == me:  # until the zygote has died (bounded)
            if time.monotonic() > deadline:
                os._exit(5)
            time.sleep(0.005)
        req = {"opts": {"sock": sock, "netns": False, "heartbeat_s": 1.0}, "cwd": cwd, "env": {}}
        zygote._child(req, w, [], me)
    os._exit(0)
os.close(w)
os.waitpid(stand_in, 0)
deadline, got = time.monotonic() + 20, b""
while time.monotonic() < deadline:
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
        break
    if select.select([r], [], [], 0.05)[0]:
        got += os.read(r, 65536)
        if got.endswith(b"}"):
            info = json.loads(got)
            os.killpg(info["pid"], signal.SIGKILL)
            os.waitpid(info["pid"], 0)
            print(json.dumps({"served": info}), flush=True)
            break
else:
    print(json.dumps({"neither": True}), flush=True)
"""


def test_a_container_whose_zygote_died_before_its_prctl_dies_too(tmp_path):
    # it checked it still had its zygote with os.getppid() read in the child, the reaper's pid
    # already when the zygote had died first: the orphan lived on, owned by nobody
    script = tmp_path / "orphan.py"
    script.write_text(_ORPHANED_AT_FORK)
    root = Path(envpool.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(script), str(tmp_path / "s"), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"exit": 1}, out.stdout


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
