"""The process runtime's own bookkeeping, with real containers: what it kills (never a pid
the kernel may have given to another process, a dead leader's whole group, a frozen container
at once) and what a given-up or cancelled start leaves behind. The zygote dying and a
container's output: test_runtime_process_zygote.py; the runtime's directory and socket
paths: test_runtime_process_dirs.py."""

from __future__ import annotations

import asyncio
import contextlib
import errno
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
from envpool import escapees
from envpool.runtimes import process
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


async def test_a_start_whose_ready_line_cannot_be_read_leaves_no_process(tmp_path, monkeypatch):
    # only a garbled line or a cancellation stopped the fresh interpreter: any other error of
    # the read (out of file descriptors for its pipe's transport) left it running, in no
    # record of the runtime's (not live: its start had failed), until the driver's exit
    async def unreadable(pipe):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(process, "_read_line", unreadable)
    rt = ProcessRuntime(ProcessRuntimeConfig(zygote=False, network_namespace=False, root=tmp_path / "r"))
    try:
        with pytest.raises(OSError, match="Too many open files"):
            await rt.start(None, None, timeout_s=30.0)
        mark = escapees.token(rt.root.absolute() / "1")
        await wait_for(lambda: not escapees.marked({mark}))
        assert not rt.live
    finally:
        await rt.aclose()


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
