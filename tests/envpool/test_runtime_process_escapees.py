"""What an environment starts outside its container's process group (a database or a
browser in a session of its own, a daemon) is stopped with the container: at its stop, at the
pool's close, and when the driver dies (zygote or not)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
from echo_bundle import IMAGE, write_env_bundle
from pool_util import pool, wait_for

from envpool import escapees
from envpool.runtimes import process
from envpool.runtimes.base import ProcessRuntimeConfig
from envpool.runtimes.process import ProcessRuntime

_ESCAPER = '''
import os
import subprocess
import time

import envpool


class EscapeEnv(envpool.Env):
    """Starts a helper that leaves the container's process group and writes its pid to the
    file named: 'exec PATH' a program in a session of its own (Popen(start_new_session=True));
    'daemon PATH' a daemon the python-daemon way (fork, setsid, fork, no exec), orphaned."""

    example_actions = ()

    def reset(self, *, seed=None, options=None):
        return "ready", {}

    def step(self, action):
        kind, path = action.split(" ", 1)
        if kind == "exec":
            helper = subprocess.Popen(["sleep", "60"], start_new_session=True).pid
        else:
            r, w = os.pipe()
            first = os.fork()
            if first == 0:
                os.setsid()
                daemon = os.fork()
                if daemon == 0:
                    time.sleep(60)
                    os._exit(0)
                os.write(w, str(daemon).encode())
                os._exit(0)
            os.close(w)
            helper = int(os.read(r, 64))
            os.close(r)
            os.waitpid(first, 0)
        with open(path, "w") as f:
            f.write(str(helper))
        return envpool.StepResult(obs=envpool.Observation(text=str(helper)))
'''

_BORN: dict[int, str] = {}


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat``'s fields from the state on (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(") ")[2].split()
    except OSError:
        return None


def _seen(pid: int) -> int:
    """``pid``, known from now on as the process under it now (a helper's pid just learnt, the
    helper alive): for ``_alive``. It replaces what an earlier test of the worker recorded for
    the pid: a full run wraps pids, and another test's dead helper once had this one."""
    fields = _stat(pid)
    assert fields is not None, f"helper {pid} is gone already"
    _BORN[pid] = fields[19]  # starttime (field 22)
    return pid


def _alive(pid: int) -> bool:
    """The process lives (no zombie) and is the one seen under ``pid`` (``_seen``, or else the
    first ``_alive``): a full run forks enough to wrap pids (32768 here), and a helper's pid
    taken by a new process read alive."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z" and _BORN.setdefault(pid, fields[19]) == fields[19]


def _left(pid: int, container: object, stats: dict) -> str:
    """What a helper the stop of ``container`` should have killed is doing (state, parent,
    the mark it bears against the container's), and what the pool did meanwhile (a session
    replayed on a fresh container runs its steps again, a helper of its own included)."""
    fields = _stat(pid)
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            marks = [e.decode() for e in f.read().split(b"\0") if e.startswith(escapees.MARK.encode())]
    except OSError as e:
        marks = [f"unreadable: {e}"]
    endpoint = getattr(container, "endpoint", None)
    expected = escapees.token(Path(endpoint).parent) if endpoint else None
    state = f"state {fields[0]}, parent {fields[1]}" if fields else "gone"
    return (
        f"helper {pid} still alive ({state}); its marks {marks}, the stopped container's "
        f"{expected} ({getattr(container, 'id', container)}); pool stats {stats}"
    )


#: How long a helper may take to be gone: it bounds a failure only. A sweep reads every
#: /proc/PID/environ, which a loaded machine (a full run beside other jobs) made take over 5 s.
GONE_S = 30.0

MODES = pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "fresh-interpreter"])
KINDS = pytest.mark.parametrize("kind", ["exec", "daemon"])


@contextlib.contextmanager
def _killed_at_end(pid_file: Path):
    """A helper that survived a failing test is killed by the pid it wrote."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError, ValueError):
            helper = int(pid_file.read_text())
            if _alive(helper):
                os.kill(helper, signal.SIGKILL)


@MODES
@KINDS
async def test_a_helper_outside_the_containers_group_is_stopped_with_the_container(tmp_path, zygote, kind):
    images = write_env_bundle(tmp_path / "b", "escape_env", _ESCAPER, {"escape-v0": "EscapeEnv"})
    pid_file = tmp_path / "helper.pid"
    runtime = {"heartbeat_s": 0.1, "zygote": zygote}
    with _killed_at_end(pid_file):
        async with pool(images, min_warm=0, max_episodes=1, runtime=runtime) as p:
            async with p.session("escape-v0", image=IMAGE) as s:  # stopped at its end (max_episodes)
                await s.reset(seed=0)
                helper = _seen(int((await s.step(f"{kind} {pid_file}")).obs.text))
                assert _alive(helper)
                c = s.container
            assert c.id not in p.runtime.live
            await wait_for(lambda: not _alive(helper), timeout_s=GONE_S)


@MODES
async def test_a_helper_outside_the_containers_group_is_stopped_when_the_pool_closes(tmp_path, zygote):
    images = write_env_bundle(tmp_path / "b", "escape_env", _ESCAPER, {"escape-v0": "EscapeEnv"})
    pid_file = tmp_path / "helper.pid"
    runtime = {"heartbeat_s": 0.1, "zygote": zygote}
    with _killed_at_end(pid_file):
        async with pool(images, min_warm=0, runtime=runtime) as p:
            async with p.session("escape-v0", image=IMAGE) as s:
                await s.reset(seed=0)
                helper = _seen(int((await s.step(f"exec {pid_file}")).obs.text))
            assert p.runtime.live and _alive(helper)  # idle again: still warm
        await wait_for(lambda: not _alive(helper), timeout_s=GONE_S)


_DRIVER_KILLED = r"""
import asyncio, json, sys
from pathlib import Path
from echo_bundle import IMAGE, DirImages
from envpool.pool import EnvPool


async def main():
    cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1, "zygote": sys.argv[3] == "zygote"}}
    images = DirImages(Path(sys.argv[1]))
    async with EnvPool(cfg, images=images) as p, p.session("escape-v0", image=IMAGE) as s:
        await s.reset(seed=0)
        helper = int((await s.step(f"exec {sys.argv[2]}")).obs.text)
        print(json.dumps({"helper": helper}), flush=True)
        await asyncio.sleep(60)  # SIGKILLed here: nothing of the pool's close runs


asyncio.run(main())
"""


@contextlib.contextmanager
def _driver_killed(tmp_path: Path, mode: str) -> Iterator[int]:
    """A driver SIGKILLed with a helper of its container's running; the helper's pid."""
    write_env_bundle(tmp_path / "b", "escape_env", _ESCAPER, {"escape-v0": "EscapeEnv"})
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER_KILLED)
    pid_file = tmp_path / "helper.pid"
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(here), str(here.parents[1])]),
        "TMPDIR": str(tmp_path),
    }
    cmd = [sys.executable, str(script), str(tmp_path / "b"), str(pid_file), mode]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    with _killed_at_end(pid_file):
        try:
            assert driver.stdout is not None
            helper = _seen(json.loads(driver.stdout.readline())["helper"])
            assert _alive(helper)
            driver.kill()
            driver.wait()
            yield helper
        finally:
            driver.kill()
            driver.wait()


def test_a_driver_killed_leaves_no_helper_outside_its_containers_groups(tmp_path):
    # the zygote dies of the driver's death and kills its children's groups as it goes: a
    # helper in a session of its own was no member of any
    with _driver_killed(tmp_path, "zygote") as helper:
        deadline = time.monotonic() + GONE_S
        while _alive(helper) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _alive(helper), _what_is(helper)


def test_a_sigterm_during_the_zygotes_end_does_not_cut_its_sweep_short():
    # the pool's death reaches the zygote twice at once (stdin's end, PR_SET_PDEATHSIG's
    # SIGTERM): the signal ran a second _exit inside the first one's sweep, and its os._exit
    # ended the process with the first sweep half done (seen in full runs: a helper ran on)
    root = Path(__file__).resolve().parents[2]
    code = """
import os, signal
from envpool import escapees, zygote

def sweep(tokens):
    print("sweep", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the pool's other death notice, mid-sweep
    for _ in range(100_000):  # bytecode boundaries, where a handler runs
        pass
    print("swept", flush=True)

escapees.sweep = sweep
signal.signal(signal.SIGTERM, lambda *_: zygote._exit({}, {1: "m"}))
zygote._exit({}, {1: "m"})
"""
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert (out.returncode, out.stdout) == (0, "sweep\nswept\n"), out.stdout + out.stderr[-2000:]


def _what_is(pid: int) -> str:
    """What a process that should be gone is doing (its state, its mark), and what is left of
    the runtime's processes, for a failure to say."""
    said = []
    for name in ("status", "environ", "wchan"):
        with contextlib.suppress(OSError):
            text = Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace")
            if name == "status":
                text = " ".join(ln for ln in text.splitlines() if ln.split(":")[0] in ("State", "PPid"))
            elif name == "environ":
                text = " ".join(e for e in text.split("\0") if e.startswith("ENVPOOL_"))
            said.append(f"{name}: {text}")
    ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,args"], capture_output=True, text=True).stdout
    said += [ln for ln in ps.splitlines() if "zygote" in ln or "driver.py" in ln]
    return "\n".join(said)


async def test_the_orphan_reaper_kills_what_a_dead_drivers_containers_left(tmp_path, monkeypatch):
    # a fresh interpreter's container dies of its driver's death at once (PR_SET_PDEATHSIG,
    # SIGKILL), with no time for a sweep: what it started ran on until the machine's next
    # pool removed the dead driver's directories, and after
    with _driver_killed(tmp_path, "exec") as helper:
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        (root,) = tmp_path.glob("envpool-p*")
        assert await ProcessRuntime().reap_orphans() == [str(root)]
        await wait_for(lambda: not _alive(helper), timeout_s=GONE_S)


@MODES
async def test_a_containers_stop_kills_no_other_containers_helper(tmp_path, zygote):
    images = write_env_bundle(tmp_path / "b", "escape_env", _ESCAPER, {"escape-v0": "EscapeEnv"})
    first, second = tmp_path / "first.pid", tmp_path / "second.pid"
    runtime = {"heartbeat_s": 0.1, "zygote": zygote}
    with _killed_at_end(first), _killed_at_end(second):
        async with pool(images, min_warm=0, runtime=runtime) as p:
            async with p.session("escape-v0", image=IMAGE) as s1, p.session("escape-v0", image=IMAGE) as s2:
                await s1.reset(seed=0)
                await s2.reset(seed=0)
                helpers = [
                    _seen(int((await s.step(f"exec {f}")).obs.text)) for s, f in ((s1, first), (s2, second))
                ]
                container = s1.container
                # (a stop of a container no longer live returns at once, sweeping nothing; and
                # a step replayed on a fresh container is in the session's failures)
                before = {"live": container.id in p.runtime.live, "s1_failures": s1.failures}
                await p.runtime.stop(container)
                try:
                    await wait_for(lambda: not _alive(helpers[0]), timeout_s=GONE_S)
                except AssertionError:  # failed once in a loaded full run: say what is left
                    raise AssertionError(
                        f"{_left(helpers[0], container, p.stats())}; before the stop {before}"
                    ) from None
                assert _alive(helpers[1])
        await wait_for(lambda: not _alive(helpers[1]), timeout_s=GONE_S)


_FREEZER = _ESCAPER.replace(
    """        with open(path, "w") as f:
            f.write(str(helper))
""",
    """        with open(path, "w") as f:
            f.write(str(helper))
        if not os.path.exists(path + ".first"):  # the first attempt: frozen, as if its heartbeats were lost
            with open(path + ".first", "w") as f:
                f.write(str(helper))
            os.kill(os.getpid(), 19)  # SIGSTOP
""",
)


@MODES
async def test_a_step_replayed_on_a_fresh_container_reports_the_helper_its_container_stops(tmp_path, zygote):
    # for the test above, which failed once under load: a step whose container missed its
    # heartbeats is replayed on a fresh one, and the session, the helper the step reports and
    # the container its stop kills stay the replay's; the first attempt's helper dies with its own
    images = write_env_bundle(tmp_path / "b", "escape_env", _FREEZER, {"escape-v0": "EscapeEnv"})
    pid_file = tmp_path / "helper.pid"
    first = tmp_path / "helper.pid.first"
    with _killed_at_end(pid_file), _killed_at_end(first):
        async with pool(images, min_warm=0, runtime={"heartbeat_s": 0.1, "zygote": zygote}) as p:
            async with p.session("escape-v0", image=IMAGE) as s:
                await s.reset(seed=0)
                helper = _seen(int((await s.step(f"exec {pid_file}")).obs.text))
                assert p.stats()["replays"] == 1
                await wait_for(lambda: not _alive(int(first.read_text())), timeout_s=GONE_S)
                await p.runtime.stop(s.container)
                await wait_for(lambda: not _alive(helper), timeout_s=GONE_S)


def test_a_sweep_never_kills_its_caller(tmp_path):
    # the caller may bear the mark it sweeps (a pool run inside a container of another)
    root = Path(__file__).resolve().parents[2]
    mark = "0" * 32
    code = f"from envpool import escapees; escapees.sweep({{{mark!r}}}); print('alive')"
    env = {**os.environ, "PYTHONPATH": str(root), "ENVPOOL_CONTAINER": mark}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert (out.returncode, out.stdout) == (0, "alive\n"), out.stderr[-2000:]


# -- what a sweep costs, and whom it holds up --------------------------------------------------

_SITE = """
import os, time
from envpool import escapees

_scans, _hold = os.environ.get("ESCAPEES_TEST_SCANS"), os.environ.get("ESCAPEES_TEST_HOLD")
if _scans:  # each scan of /proc, a line
    _marked = escapees.marked

    def _counted(tokens):
        with open(_scans, "a") as f:
            f.write(f"{os.getpid()}\\n")
        return _marked(tokens)

    escapees.marked = _counted
if _hold:  # a sweep held until the test lets it go (the bound only ends a failing test)
    _sweep = escapees.sweep

    def _held(tokens):
        if tokens:
            open(_hold + ".entered", "w").close()
            deadline = time.monotonic() + 60
            while not os.path.exists(_hold + ".release") and time.monotonic() < deadline:
                time.sleep(0.01)
        return _sweep(tokens)

    escapees.sweep = _held
"""


@pytest.fixture
def hooked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runtime's children (the zygote, a fresh interpreter) load ``_SITE``: they count
    their scans of /proc, and hold their sweeps, where the test's environment says so."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITE)
    child_env = process._child_env

    def hooked_env(cdir: Path, mark: str) -> dict[str, str]:
        env = child_env(cdir, mark)
        env["PYTHONPATH"] = os.pathsep.join((str(site), env["PYTHONPATH"]))
        return env

    monkeypatch.setattr(process, "_child_env", hooked_env)
    return tmp_path


@MODES
async def test_a_close_scans_proc_once_for_all_its_containers(hooked, monkeypatch, zygote):
    # each container's stop swept its own mark: a close of N containers read every process's
    # environment N times (in the zygote's loop, or in N threads of the driver)
    scans = hooked / "scans"
    monkeypatch.setenv("ESCAPEES_TEST_SCANS", str(scans))
    marked = escapees.marked

    def counted(tokens: Collection[str]) -> list[int]:
        with open(scans, "a") as f:
            f.write(f"{os.getpid()}\n")
        return marked(tokens)

    monkeypatch.setattr(escapees, "marked", counted)
    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1, zygote=zygote))
    try:
        cs = [await rt.start(None, None, timeout_s=20) for _ in range(3)]
        assert all([await rt.alive(c) for c in cs])
        before = scans.read_text().count("\n") if scans.exists() else 0
    finally:
        await rt.aclose()
    assert not rt.live
    assert scans.read_text().count("\n") - before == 1


async def test_the_zygote_answers_a_fork_while_a_containers_escapees_are_swept(hooked, monkeypatch):
    # the zygote swept a container's mark in its own loop, between its reap and its report:
    # every fork and reap of the other containers waited behind a scan of /proc (~27 ms at
    # 5,000 processes, seconds on a loaded machine)
    hold = hooked / "hold"
    monkeypatch.setenv("ESCAPEES_TEST_HOLD", str(hold))
    entered, release = threading.Event(), threading.Event()
    sweep = escapees.sweep

    def held(tokens: Collection[str]) -> None:  # this process's sweeps, held the same way
        if tokens:
            entered.set()
            release.wait(60)
        sweep(tokens)

    monkeypatch.setattr(escapees, "sweep", held)
    rt = ProcessRuntime(ProcessRuntimeConfig(heartbeat_s=0.1, zygote=True))
    stop: asyncio.Future[None] | None = None
    try:
        first = await rt.start(None, None, timeout_s=20)
        stop = asyncio.ensure_future(rt.stop(first))
        await wait_for(lambda: entered.is_set() or Path(f"{hold}.entered").exists(), timeout_s=30)
        second = await rt.start(None, None, timeout_s=15)  # a fork, while the sweep goes on
        assert await rt.alive(second)
        assert not stop.done()  # a stop returns once its container's escapees are swept
    finally:
        release.set()
        await asyncio.to_thread(Path(f"{hold}.release").touch)
        if stop is not None:
            await stop
        await rt.aclose()
    assert not rt.live


async def test_the_zygotes_end_sweeps_a_reaped_containers_mark_the_driver_had_not(tmp_path, monkeypatch):
    # the driver sweeps a container's mark once the zygote reports it reaped: should the driver
    # die before its sweep has run, the zygote (ended by its death) must still sweep that mark
    images = write_env_bundle(tmp_path / "b", "escape_env", _ESCAPER, {"escape-v0": "EscapeEnv"})
    pid_file = tmp_path / "helper.pid"
    entered, release = threading.Event(), threading.Event()
    sweep = escapees.sweep

    def held(tokens: Collection[str]) -> None:
        if tokens:
            entered.set()
            release.wait(60)
        sweep(tokens)

    stop: asyncio.Future[None] | None = None
    with _killed_at_end(pid_file):
        async with pool(images, min_warm=0, runtime={"heartbeat_s": 0.1, "zygote": True}) as p:
            try:
                async with p.session("escape-v0", image=IMAGE) as s:
                    await s.reset(seed=0)
                    helper = _seen(int((await s.step(f"exec {pid_file}")).obs.text))
                    monkeypatch.setattr(escapees, "sweep", held)
                    stop = asyncio.ensure_future(p.runtime.stop(s.container))
                    await wait_for(entered.is_set, timeout_s=30)
                    assert _alive(helper)  # reaped by the zygote, its mark not swept yet
                    zygote = p.runtime._zygote
                    assert zygote is not None and zygote.proc is not None
                    os.kill(zygote.proc.pid, signal.SIGTERM)  # what the driver's death sends it
                    await wait_for(lambda: not _alive(helper), timeout_s=GONE_S)
                    release.set()  # (before the session's end: it joins the stop)
                    await stop
            finally:
                release.set()
