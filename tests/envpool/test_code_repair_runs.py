"""``code-repair-v1``'s test runner: its timeout, and nothing a run started outlives it
(helpers, daemons in a session of their own, a run that kills its ancestors or keeper, its
/dev/shm files, its container's death), with and without a PID namespace; stdin, unflushed
output, and a module that damages its work dir."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import socket
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from code_repair_helpers import edit_action
from pool_util import wait_for

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair_limits, code_repair_runner
from envpool.pool import EnvPool


def test_code_repair_test_timeout():
    env = envpool.make("code-repair-v1", test_timeout_s=0.5)
    try:
        env.reset(options={"task": "mathutils"})
        env.step(edit_action("mathutils.py", "    return a - b", "    while True:\n        pass"))
        res = env.step("run_tests")
        assert "The test run timed out after 0.5 s" in res.obs.text
        assert res.info == {"passed": 0, "failed": 3, "all_passed": False, "outcome": "timeout"}
        assert env.step("submit").reward == 0.0
    finally:
        env.close()


def _running_in(root: Path) -> list[int]:
    """Processes whose working directory is under ``root`` (a test run in a work dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:  # gone, or a zombie
                continue
            if cwd.is_relative_to(root):
                found.append(int(entry.name))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _repair_in(tmp_path: Path, test_timeout_s: float, **kw: Any):
    """A code-repair env on the mathutils task whose work dirs are under ``tmp_path/work``
    (what runs there is found by its cwd), and every process left there killed at the end."""
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make("code-repair-v1", test_timeout_s=test_timeout_s, workdir_root=str(work), **kw)
    try:
        env.reset(options={"task": "mathutils"})
        yield env, work
    finally:
        _kill_all(_running_in(work))
        env.close()


def _none_left_in(work: Path, within_s: float) -> bool:
    """Whether no process runs in ``work`` within ``within_s`` (a SIGKILL lands when each
    is next scheduled)."""
    deadline = time.monotonic() + within_s
    while _running_in(work) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _running_in(work)


@pytest.fixture(params=[True, False], ids=["pid_namespace", "fallback"])
def pid_namespace(request, monkeypatch):
    """Each test run in a PID namespace of its own where the kernel allows it, and in the
    fallback (the keeper, a child subreaper) everywhere."""
    monkeypatch.setattr(code_repair_runner, "PID_NAMESPACE", request.param)
    return request.param


LOOP = "    while True:\n        pass"


# a test run that starts a helper process of its own, then loops
SPAWN_AND_LOOP = '    import subprocess\n    subprocess.Popen(["sleep", "60"])\n' + LOOP


def test_code_repair_test_timeout_kills_what_the_run_started(tmp_path, pid_namespace):
    with _repair_in(tmp_path, 0.5) as (env, work):
        env.step(edit_action("mathutils.py", "    return a - b", SPAWN_AND_LOOP))
        res = env.step("run_tests")
        assert "The test run timed out after 0.5 s" in res.obs.text
        assert _none_left_in(work, 2)  # the runner and the helper it started


# the fix, plus helpers the module starts at import and leaves behind: a child that sleeps, and
# a daemon (a child that forks a sleeper and exits, so the sleeper's parent is gone)
FIX_AND_FORKS = (
    "    return a + b\n"
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    time.sleep(60)\n"
    "    os._exit(0)\n"
    "if os.fork() == 0:\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(60)\n"
    "    os._exit(0)"
)


@pytest.mark.parametrize("early_exit", [False, True])
def test_code_repair_a_run_that_ends_takes_what_it_started_with_it(tmp_path, pid_namespace, early_exit):
    # the runner returned normally and its module's forked helpers, reparented to pid 1, ran
    # on for good: only a timeout killed the tree. Now the runner stays alive past its
    # results, a subreaper, and its parent kills it with all it started
    with _repair_in(tmp_path, 10) as (env, work):
        body = FIX_AND_FORKS + ("\nos.close(int(sys.argv[3]))" if early_exit else "")
        if early_exit:  # the module closes the done pipe: the runner's end must still be seen
            body = "import sys\n" + body.replace("    return a + b\n", "", 1)
            env.step(edit_action("mathutils.py", "    return a - b", "    return a + b"))
            env.step(edit_action("mathutils.py", "def add", body + "\ndef add"))
        else:
            env.step(edit_action("mathutils.py", "    return a - b", FIX_AND_FORKS))
        t0 = time.monotonic()
        res = env.step("run_tests")
        assert time.monotonic() - t0 < 8  # ended by the runner, not at the timeout
        assert res.info["all_passed"] and res.info["failed"] == 0, res.obs.text
        assert "timed out" not in res.obs.text
        assert _none_left_in(work, 3)  # the sleeper and the daemon's child too (they sleep 60 s)


def test_code_repair_a_runner_that_ends_after_its_done_byte_is_swept(tmp_path, pid_namespace, monkeypatch):
    # the runner's wait on its parent can be cut short by the module (it puts /dev/null where
    # the runner waits): the runner wrote its done byte, then ended by itself; its parent,
    # scheduled after that end (slowed here), took the run for one that waited, killed the
    # runner's tree (empty: its daemon had left it) and never swept the work dir
    kill_tree = code_repair_runner.kill_tree

    def late_kill_tree(pid: int) -> None:
        time.sleep(0.5)
        kill_tree(pid)

    monkeypatch.setattr(code_repair_runner, "kill_tree", late_kill_tree)
    with _repair_in(tmp_path, 10) as (env, work):
        cut = "import __main__\nos.dup2(os.open(os.devnull, os.O_RDONLY), __main__.stdin_fd)"
        env.step(edit_action("mathutils.py", "    return a - b", FIX_AND_FORKS + "\n" + cut))
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert _none_left_in(work, 3)


def _daemon(shared: Path, chdir: bool, end: str) -> str:
    """The fix, then a daemon started at import: a child that calls setsid() (a session and
    process group of its own), maybe moves to /, and forks a grandchild that connects to the
    test's socket ``shared/daemon.sock`` (its pid, as the test sees it, is the connection's
    peer: a run with a /proc of its own PID namespace cannot tell it), marks itself up
    (``shared/daemon.up``) and sleeps; then the runner goes on (``end="returns"``), ends the
    interpreter (``"exits"``) or kills its parent and the parent's parent it finds in /proc
    (``"kills_ancestors"``)."""
    ends = {
        "returns": "",
        "exits": "os._exit(0)\n",
        "kills_ancestors": (
            "pid = os.readlink('/proc/self')\n"
            "for _ in range(2):  # the runner's parent and grandparent (never the test's process)\n"
            "    pid = open(f'/proc/{pid}/stat').read().rpartition(')')[2].split()[1]\n"
            # (0, where its namespace's init has no parent there: kill(0) is its own group)
            f"    for target in {{int(pid), os.getppid()}} - {{0, {os.getpid()}}}:\n"
            "        try:\n"
            "            os.kill(target, signal.SIGKILL)\n"
            "        except OSError:\n"
            "            pass\n"
            "time.sleep(0.5)\n"
        ),
    }
    up = str(shared / "daemon.up")
    return (
        "    return a + b\n"
        "import os, signal, socket, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n" + ("    os.chdir('/')\n" if chdir else "") + "    if os.fork() == 0:\n"
        "        held = socket.socket(socket.AF_UNIX)\n"
        f"        held.connect({str(shared / 'daemon.sock')!r})\n"
        f"        open({up!r}, 'w').close()\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "for _ in range(500):  # until the daemon is up\n"
        f"    if os.path.exists({up!r}):\n"
        "        break\n"
        "    time.sleep(0.01)\n" + ends[end]
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _run_and_await_the_daemon(tmp_path: Path, chdir: bool, end: str, passes: bool = True, **kw: Any) -> None:
    # the socket and the mark in a dir the run's own uid may reach (code_repair_user: as root
    # the module runs as a uid of its own, and pytest's tmp_path is under a dir of root's alone)
    shared = Path(tempfile.mkdtemp())
    shared.chmod(0o1777)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(shared / "daemon.sock"))
            (shared / "daemon.sock").chmod(0o777)
            listener.listen(4)
            _await_the_daemon(tmp_path, shared, listener, chdir, end, passes, **kw)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _peer_pid(listener: socket.socket) -> int:
    """The pid, in this process's PID namespace, of the daemon that connected to ``listener``
    (the kernel took it at the connect: the daemon may be gone by now)."""
    listener.settimeout(5)
    conn, _ = listener.accept()
    with conn:
        pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return int(pid)


def _await_the_daemon(
    tmp_path: Path, shared: Path, listener: socket.socket, chdir: bool, end: str, passes: bool, **kw: Any
) -> None:
    with _repair_in(tmp_path, 10, **kw) as (env, _):
        env.step(edit_action("mathutils.py", "    return a - b", _daemon(shared, chdir, end)))
        res = env.step("run_tests")
        pid = _peer_pid(listener)
        try:
            if end != "exits" and passes:
                assert res.info["all_passed"], res.obs.text
            deadline = time.monotonic() + 3
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not _alive(pid), f"the daemon {pid} outlived its run"
        finally:
            _kill_all([pid])


@pytest.mark.parametrize("chdir", [False, True], ids=["setsid", "setsid_chdir"])
@pytest.mark.parametrize("end", ["returns", "exits"])
def test_code_repair_a_daemon_in_a_session_of_its_own_goes_with_the_run(tmp_path, pid_namespace, chdir, end):
    # a daemon (setsid, maybe chdir away) left the runner's process group, and the work dir:
    # when the runner ended by itself, the daemon, reparented out of its tree, escaped both
    # the tree's kill and the sweep of the group's processes in the work dir, for good
    _run_and_await_the_daemon(tmp_path, chdir, end)


@functools.cache
def _pid_namespaces_here() -> bool:
    """Whether a test run gets a PID namespace of its own here (its runner is pid 2 there)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o1777)  # the run's own uid writes its pid there
        env = envpool.make("code-repair-v1", workdir_root=tmp)
        try:
            env.reset(options={"task": "mathutils"})
            out = Path(tmp) / "pid"
            code = f"import os\nopen({str(out)!r}, 'w').write(str(os.getpid()))\n"
            env.step(edit_action("mathutils.py", "def add", code + "def add"))
            env.step("run_tests")
            return out.read_text() == "2"
        finally:
            env.close()


def test_code_repair_a_daemon_whose_run_kills_its_ancestors_goes_with_the_run(tmp_path):
    # the fallback's limit (the runner's parent, the keeper, is the module's to kill): in a
    # PID namespace the runner's parent is the namespace's init, which ignores what comes from
    # inside, and nothing outside has a pid there
    if not _pid_namespaces_here():
        pytest.skip("no PID namespace for a test run here (no CAP_SYS_ADMIN, no user namespaces)")
    _run_and_await_the_daemon(tmp_path, chdir=True, end="kills_ancestors")


@pytest.mark.parametrize("reader", ["module", "helper"])
def test_code_repair_a_module_that_reads_stdin_reads_nothing(tmp_path, pid_namespace, reader):
    # the runner kept its stdin (the pipe its parent fed the spec on) open past the spec, to
    # wait on it once done: a module (or a helper it ran) that read stdin, which found it at
    # its end when the parent closed it after the spec, then blocked until test_timeout_s
    # and the run read "timed out"
    with _repair_in(tmp_path, 5) as (env, _):
        if reader == "module":
            read = "import sys\n_ = sys.stdin.read()"
        else:
            read = 'import subprocess\nsubprocess.run(["cat"], stdout=subprocess.DEVNULL)'
        env.step(edit_action("mathutils.py", "    return a - b", "    return a + b\n" + read))
        t0 = time.monotonic()
        res = env.step("run_tests")
        assert time.monotonic() - t0 < 4
        assert res.info["all_passed"], res.obs.text


@pytest.mark.parametrize("how", ["aborted", "leader_killed"])
async def test_a_test_run_dies_with_its_container(tmp_path, how):
    # the runner had a session of its own: killing the container's process group (an aborted
    # trajectory, EnvHung, a recycle) missed it, and a policy's infinite loop ran on outside
    # every container until test_timeout_s, or forever once its env was gone
    work = tmp_path / "work"
    work.mkdir()
    kwargs = {"workdir_root": str(work), "test_timeout_s": 30}
    runtime = {"heartbeat_s": 0.1, "zygote": how == "aborted"}
    try:
        async with EnvPool({"min_warm": 0, "runtime": runtime}) as p:
            started = asyncio.Event()
            pids: list[int] = []

            async def rollout() -> None:
                async with p.session("code-repair-v1", env_kwargs=kwargs) as s:
                    await s.reset(seed=0, options={"task": "mathutils"})
                    await s.step(edit_action("mathutils.py", "    return a - b", LOOP))
                    pids.append(s.container.pid)
                    started.set()
                    await s.step("run_tests")

            t = asyncio.create_task(rollout())
            await started.wait()
            await wait_for(lambda: bool(_running_in(work)))  # the test run is going
            if how == "aborted":
                t.cancel()  # the trajectory is aborted: its container is killed
            else:
                # the server alone is killed (the OOM killer): its test run goes with it
                os.kill(pids[0], signal.SIGKILL)
            await wait_for(lambda: not _running_in(work), 3.0)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    finally:
        _kill_all(_running_in(work))


@pytest.mark.parametrize("then", ["returns", "loops"])
def test_code_repair_shows_what_the_module_printed(tmp_path, then):
    # the runner waits to be killed once its results are in (or loops until the timeout):
    # what the module printed without a flush sat in the buffer of its stdout, and was lost
    with _repair_in(tmp_path, 1) as (env, _):
        body = "    print('debug', a, b)\n" + ("    return a - b" if then == "returns" else LOOP)
        env.step(edit_action("mathutils.py", "    return a - b", body))
        text = env.step("run_tests").obs.text
        assert text.endswith(
            "Output of the run:\ndebug 2 3" + ("\ndebug -4 1" if then == "returns" else "")
        ), text


@pytest.mark.parametrize(
    "damage",
    [
        "shutil.rmtree(os.getcwd())",
        "os.remove('test_mathutils.py')\nos.mkdir('test_mathutils.py')\nopen('test_mathutils.py/x', 'w')",
        "os.remove('test_mathutils.py')\nos.symlink(OUTSIDE, 'test_mathutils.py')",
        "root = os.getcwd()\nos.rename(root, root + '.moved')\nos.symlink(os.path.dirname(OUTSIDE), root)",
    ],
    ids=["work_dir_removed", "test_file_a_dir", "test_file_a_symlink_out", "work_dir_a_symlink_out"],
)
def test_code_repair_a_module_that_damages_its_work_dir_gets_answers(tmp_path, damage):
    # the module runs in its work dir as this process's user: it can remove the dir, or put
    # a directory or a symlink where the env writes the tests back. The next step raised
    # (FileNotFoundError, IsADirectoryError: an infra failure, the work dir in its message),
    # or wrote the tests through the symlink, outside the work dir, or viewed files there
    outside = tmp_path / "outside.txt"
    outside.write_text("SECRET\n")
    with _repair_in(tmp_path, 10) as (env, work):
        code = f"import os, shutil\nOUTSIDE = {str(outside)!r}\n{damage}\ndef add"
        env.step(edit_action("mathutils.py", "def add", code))
        env.step("run_tests")  # the damage is done
        for action in ("run_tests", "view mathutils.py", "view outside.txt", "view nope.py"):
            res = env.step(action)
            assert str(work) not in res.obs.text
            assert "SECRET" not in res.obs.text, (action, res.obs.text)
        assert outside.read_text() == "SECRET\n"
        res = env.step("submit")
        assert res.terminated and res.reward == 0.0
    for moved in work.glob("*.moved"):
        shutil.rmtree(moved)


@pytest.mark.parametrize("cgroup", ["pids", "memory"])
def test_code_repair_without_a_pid_namespace_a_daemon_whose_run_kills_its_keeper_goes_with_the_run(
    tmp_path, monkeypatch, cgroup
):
    # the fallback's hole: the module kills its keeper (its parent), and its daemon (setsid,
    # chdir /), reparented to the container's init, is in neither the keeper's tree nor the
    # process group's work-dir sweep. The member list of either cgroup of the run finds it
    # (each alone here: the other's lookup finds none)
    if cgroup == "pids":
        if not code_repair_limits.pids_cgroup_available():
            pytest.skip("no pids cgroup can be made here (cgroup v1's pids hierarchy, writable)")
        monkeypatch.setattr(code_repair_limits, "_memory_parent", lambda: None)
    else:
        if not code_repair_limits.memory_cgroup_available():
            pytest.skip("no memory cgroup can be made here (cgroup v1's memory hierarchy, writable)")
        monkeypatch.setattr(code_repair_limits, "_pids_parent", lambda: None)
    monkeypatch.setattr(code_repair_runner, "PID_NAMESPACE", False)
    # the keeper's death ends the run (its results cut short): what matters is the daemon.
    # As the env process's own user (run_uid_base=None): under a uid of its own (as root) the
    # module cannot kill its keeper, the hole this sweep covers where the env is not root
    _run_and_await_the_daemon(tmp_path, chdir=True, end="kills_ancestors", passes=False, run_uid_base=None)


def test_code_repair_a_runs_shared_memory_files_go_with_the_run(tmp_path):
    # files a run wrote to /dev/shm (a tmpfs: memory, charged to the run's memory cgroup)
    # outlived it: still charged after the cgroup was removed, so that run after run filled
    # the container's memory past every run's cap, and the next episode (another
    # trajectory's, maybe) could read what the last one left there
    if not _pid_namespaces_here():
        pytest.skip("no PID namespace for a test run here (no CAP_SYS_ADMIN, no user namespaces)")
    left = Path("/dev/shm") / f"envpool-test-{os.getpid()}-{tmp_path.name}"
    try:
        with _repair_in(tmp_path, test_timeout_s=10) as (env, _):
            write = f"open({str(left)!r}, 'wb').write(b'x' * 2**20)\n"
            env.step(edit_action("mathutils.py", "def add", write + "def add"))
            env.step(edit_action("mathutils.py", "    return a - b", "    return a + b"))
            res = env.step("run_tests")
            assert res.info["all_passed"], res.obs.text  # it could write there
            assert not left.exists()
    finally:
        with contextlib.suppress(OSError):
            left.unlink()
