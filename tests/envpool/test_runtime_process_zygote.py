"""The process runtime with real containers around its zygote: a zygote that dies during a
start, after its output closed, or as it forks a container; and a container's output, which
without the zygote goes through a pipe nobody reads once the container is ready."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import alive, wait_for

import envpool
from envpool.pool import EnvPool

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


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "fresh-interpreter"])
async def test_a_bundle_that_prints_as_it_is_imported_starts(tmp_path, zygote):
    # a fresh interpreter imported the bundle before it printed its ready line to the pipe the
    # runtime reads it from: a module's print at import came first, and every start failed with
    # "JSONDecodeError: Expecting value", not even a ContainerStartError (the zygote's ran)
    source = 'print("loading the print env", flush=True)\n' + _PRINTER
    source += '\nenvpool.register("print-v0", entry_point="print_env:PrintEnv")\n'
    images = write_env_bundle(tmp_path / "b", "print_env", source, {})
    (tmp_path / "b" / "envpool.json").write_text(json.dumps({"modules": ["print_env"]}))  # imported at load
    async with EnvPool({"min_warm": 0, "runtime": {"zygote": zygote}}, images=images) as p:
        async with p.session("print-v0", image=IMAGE) as s:
            assert (await s.reset(seed=0))[0].text == "ready"


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
