"""``code-repair-v1``'s limits on a test run's memory and processes: a module that hogs
memory or forks without end fails its run with a line that says which limit, and the
container (this process) is untouched."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair_limits, code_repair_runner
from envpool.envs.code_repair import CodeRepairEnv

MiB = 2**20


def edit_action(file: str, search: str, replace: str) -> str:
    return f"edit {file}\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


def _running_in(root: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")).is_relative_to(root):
                    found.append(int(entry.name))
            except OSError:  # gone, or a zombie
                continue
    return found


def _none_left_in(work: Path, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while _running_in(work) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _running_in(work)


@contextlib.contextmanager
def _repair(tmp_path: Path, **kwargs):
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make("code-repair-v1", workdir_root=str(work), **kwargs)
    try:
        env.reset(options={"task": "mathutils"})
        yield env, work
    finally:
        for pid in _running_in(work):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        env.close()


HOG = "    return len(bytearray(256 * 2**20)) + a + b"


@pytest.mark.parametrize("where", ["call", "import"])
def test_a_memory_hog_fails_its_run_saying_the_memory_limit(tmp_path, where):
    # a run had CPU and file-size limits only: a module that allocated without end took the
    # container's memory (a dead container, or the OOM killer's pick of a neighbour)
    with _repair(tmp_path, test_timeout_s=10, memory_limit_bytes=64 * MiB) as (env, work):
        if where == "call":
            env.step(edit_action("mathutils.py", "    return a - b", HOG))
        else:
            env.step(edit_action("mathutils.py", "def add", "_hog = bytearray(256 * 2**20)\n\ndef add"))
        res = env.step("run_tests")
        text = res.obs.text
        assert "MemoryError" in text, text
        assert "ran out of memory: at most 64 MiB of address space per process (memory_limit_bytes)" in text
        assert not res.info["all_passed"] and res.info["outcome"] == "test_failure"
        assert _none_left_in(work, 3)


def test_the_memory_limit_leaves_an_honest_run_alone(tmp_path):
    with _repair(tmp_path, test_timeout_s=10, memory_limit_bytes=64 * MiB) as (env, _):
        env.step(edit_action("mathutils.py", "    return a - b", "    return a + b"))
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert "limit" not in res.obs.text


needs_pids_cgroup = pytest.mark.skipif(
    not code_repair_limits.pids_cgroup_available(),
    reason="no pids cgroup can be made here (cgroup v1's pids hierarchy, writable): no process cap",
)

FORK_TILL_REFUSED = (
    "    import os\n"
    "    r, w = os.pipe()\n"
    "    n = 0\n"
    "    while n < 200:\n"
    "        try:\n"
    "            pid = os.fork()\n"
    "        except OSError:\n"
    "            break\n"
    "        if pid == 0:\n"
    "            os.read(r, 1)\n"
    "            os._exit(0)\n"
    "        n += 1\n"
    "    return n"
)

FORK_BOMB = (
    "    import os\n"
    "    while True:\n"
    "        try:\n"
    "            os.fork()\n"
    "        except OSError:\n"
    "            pass"
)


@needs_pids_cgroup
def test_a_module_that_forks_without_end_is_capped_saying_the_process_limit(tmp_path):
    # RLIMIT_NPROC does not bind root (a container's usual user): the forks went on until the
    # container's own pid limit, or the node's, ran out
    with _repair(tmp_path, test_timeout_s=10, max_processes=8) as (env, work):
        env.step(edit_action("mathutils.py", "    return a - b", FORK_TILL_REFUSED))
        res = env.step("run_tests")
        text = res.obs.text
        # add(2, 3) forked 5 (with the run's own 3: the cap), add(-4, 1) none more
        assert "add(-4, 1) returned 0, expected -3" in text, text
        assert "hit its process limit: at most 8 processes and threads at once (max_processes)" in text
        assert _none_left_in(work, 3)


@needs_pids_cgroup
def test_a_fork_bomb_ends_as_a_failed_run_and_takes_nothing_else_down(tmp_path):
    with _repair(tmp_path, test_timeout_s=1.5, max_processes=8) as (env, work):
        env.step(edit_action("mathutils.py", "    return a - b", FORK_BOMB))
        res = env.step("run_tests")
        assert res.info["outcome"] == "timeout" and "hit its process limit" in res.obs.text, res.obs.text
        assert _none_left_in(work, 3)
        env.step(edit_action("mathutils.py", FORK_BOMB, "    return a + b"))
        assert env.step("run_tests").info["all_passed"]  # the env (the container) goes on


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"memory_limit_bytes": 1000}, "memory_limit_bytes"),
        ({"max_processes": 2}, "max_processes"),
        ({"max_processes": 2.5}, "max_processes"),
    ],
)
def test_limits_that_cannot_work_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        CodeRepairEnv(**kwargs)


def test_the_defaults():
    env = CodeRepairEnv()
    assert env.memory_limit_bytes == 2**30 and env.max_processes == 64


def _cgroup_of_a_dead_server() -> Path:
    """A run cgroup, made beside where this server's go, named for a server that has exited."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    probe = code_repair_limits.PidsCgroup.make(8)
    assert probe is not None
    left = probe.path.parent / f"{code_repair_limits.owner_prefix(dead.pid)}abandoned"
    probe.remove()
    left.mkdir()
    return left


@needs_pids_cgroup
def test_the_cgroup_of_a_run_whose_server_died_is_removed_by_the_next_run():
    # a container killed mid-run (an aborted trajectory) never removed its run's cgroup: one
    # empty cgroup left per such run, for as long as the node ran
    left = _cgroup_of_a_dead_server()
    try:
        fresh = code_repair_limits.PidsCgroup.make(8)
        assert fresh is not None
        fresh.remove()
        assert not left.exists()
    finally:
        with contextlib.suppress(OSError):
            left.rmdir()


needs_memory_cgroup = pytest.mark.skipif(
    not code_repair_limits.memory_cgroup_available(),
    reason="no memory cgroup can be made here (cgroup v1's memory hierarchy writable, or v2's "
    "memory controller handed down to this process's cgroup): no cap on a run's total memory",
)


def _fork_and_hold(children: int, mib: int) -> str:
    """A body for ``add`` that forks ``children`` that each allocate ``mib`` MiB, touch every
    page of it (so that it counts, not only maps) and hold it until all of them have, then
    returns a + b."""
    return (
        "    import os\n"
        "    ready_r, ready_w = os.pipe()\n"
        "    go_r, go_w = os.pipe()\n"
        "    kids = []\n"
        f"    for _ in range({children}):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        f"            held = b'x' * ({mib} * 2**20)  # every byte written: every page touched\n"
        "            os.write(ready_w, b'r')\n"
        "            os.read(go_r, 1)\n"
        "            os._exit(len(held) == 0)\n"
        "        kids.append(pid)\n"
        f"    for _ in range({children}):\n"
        "        os.read(ready_r, 1)  # a child killed before it wrote: this waits for good\n"
        f"    os.write(go_w, b'g' * {children})\n"
        "    for pid in kids:\n"
        "        os.waitpid(pid, 0)\n"
        "    return a + b"
    )


def _memory_cgroups_left() -> list[str]:
    found = code_repair_limits._memory_parent()
    assert found is not None
    mine = code_repair_limits.owner_prefix(os.getpid())
    return [name for name in os.listdir(found[0]) if name.startswith(mine)]


@needs_memory_cgroup
@pytest.mark.parametrize("pid_namespace", [True, False], ids=["pid_namespace", "fallback"])
def test_children_that_together_pass_the_memory_limit_stop_the_run_saying_so(
    tmp_path, monkeypatch, pid_namespace
):
    # RLIMIT_AS binds each process, not the run: 6 children of 48 MiB each were within a
    # 160 MiB limit one by one, and took 288 MiB of the container's memory together (60 of
    # 1 GiB each, under the defaults)
    monkeypatch.setattr(code_repair_runner, "PID_NAMESPACE", pid_namespace)
    with _repair(tmp_path, test_timeout_s=20, memory_limit_bytes=160 * MiB) as (env, work):
        env.step(edit_action("mathutils.py", "    return a - b", _fork_and_hold(6, 48)))
        t0 = time.monotonic()
        res = env.step("run_tests")
        text = res.obs.text
        assert "stopped at its memory limit: its processes together reached 160 MiB" in text, text
        assert not res.info["all_passed"] and res.info["outcome"] == "test_failure"
        assert time.monotonic() - t0 < 15  # ended at the OOM kill, not at the timeout
        assert _none_left_in(work, 3)
        assert _memory_cgroups_left() == []
        # the env (the container) goes on
        env.step(edit_action("mathutils.py", _fork_and_hold(6, 48), "    return a + b"))
        assert env.step("run_tests").info["all_passed"]


@needs_memory_cgroup
def test_children_within_the_memory_limit_together_are_left_alone(tmp_path):
    with _repair(tmp_path, test_timeout_s=20, memory_limit_bytes=160 * MiB) as (env, _):
        env.step(edit_action("mathutils.py", "    return a - b", _fork_and_hold(2, 24)))
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert "limit" not in res.obs.text
        assert _memory_cgroups_left() == []


@pytest.mark.parametrize("parent", ["missing", "not_a_cgroup", "v2_without_memory"])
def test_where_no_memory_cgroup_can_be_made_a_run_keeps_its_per_process_limit(tmp_path, monkeypatch, parent):
    # no memory cgroup (a read-only /sys/fs/cgroup, v2 that does not hand the memory
    # controller down): each process's RLIMIT_AS still holds, and a run goes on without one
    if parent == "v2_without_memory":
        v2 = code_repair_limits._v2_parent()
        if v2 is None or not os.access(v2, os.W_OK):
            pytest.skip("no writable cgroup v2 hierarchy here to make a child in")
        if (v2 / "cgroup.subtree_control").read_text().split().count("memory"):
            pytest.skip("this cgroup v2 hierarchy hands the memory controller down")
        found: tuple[Path, int] = (v2, 2)
    else:
        where = tmp_path / ("missing/deeper" if parent == "missing" else "plain")
        if parent == "not_a_cgroup":
            where.mkdir()
        found = (where, 1)
    monkeypatch.setattr(code_repair_limits, "_memory_parent", lambda: found)
    before = set(os.listdir(found[0])) if found[0].exists() else set()
    made = code_repair_limits.MemoryCgroup.make(64 * MiB)
    if made is not None:  # removed even when the check below fails
        made.remove()
    assert made is None
    assert (set(os.listdir(found[0])) if found[0].exists() else set()) == before  # nothing left there
    with _repair(tmp_path, test_timeout_s=10, memory_limit_bytes=64 * MiB) as (env, _):
        env.step(edit_action("mathutils.py", "    return a - b", HOG))
        text = env.step("run_tests").obs.text
        assert "at most 64 MiB of address space per process (memory_limit_bytes)" in text, text
        env.step(edit_action("mathutils.py", HOG, "    return a + b"))
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text


@needs_memory_cgroup
def test_a_memory_hog_alone_still_gets_a_memory_error_not_an_oom_kill(tmp_path):
    # the per-process limit comes first for one process: a MemoryError the run reports,
    # clearer than the kernel's kill
    with _repair(tmp_path, test_timeout_s=10, memory_limit_bytes=64 * MiB) as (env, _):
        env.step(edit_action("mathutils.py", "    return a - b", HOG))
        text = env.step("run_tests").obs.text
        assert "MemoryError" in text and "of address space per process" in text, text
        assert "stopped at its memory limit" not in text
        assert _memory_cgroups_left() == []


@needs_memory_cgroup
def test_the_memory_cgroup_of_a_run_whose_server_died_is_removed_by_the_next_run():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    probe = code_repair_limits.MemoryCgroup.make(64 * MiB)
    assert probe is not None
    left = probe.path.parent / f"{code_repair_limits.owner_prefix(dead.pid)}abandoned"
    probe.remove()
    left.mkdir()
    try:
        fresh = code_repair_limits.MemoryCgroup.make(64 * MiB)
        assert fresh is not None
        fresh.remove()
        assert not left.exists()
    finally:
        with contextlib.suppress(OSError):
            left.rmdir()


@pytest.fixture
def memory_parent_of_its_own(monkeypatch):
    """A v1 memory cgroup of the test's own, capped at 96 MiB, under which runs make theirs
    (as under a container's cgroup with a memory limit); removed, with anything left in it,
    even when the test fails."""
    found = code_repair_limits._memory_parent()
    if found is None or found[1] != 1:
        pytest.skip("no cgroup v1 memory hierarchy here (a run's OOM eventfd is v1's)")
    parent = found[0] / f"envpool-test-{os.getpid()}-parent"
    try:
        parent.mkdir()
        (parent / "memory.limit_in_bytes").write_text(str(96 * MiB))
    except OSError as e:
        with contextlib.suppress(OSError):
            parent.rmdir()
        pytest.skip(f"no memory cgroup can be made here ({e})")
    monkeypatch.setattr(code_repair_limits, "_memory_parent", lambda: (parent, 1))
    try:
        yield parent
    finally:
        for cg in [*(p for p in parent.iterdir() if p.is_dir()), parent]:
            code_repair_limits._RunCgroup(cg).remove()


_WAITER = """
import os, time

def wait():
    open("started", "w").close()
    deadline = time.monotonic() + 20
    while not os.path.exists("go") and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.path.exists("go")
"""


@needs_memory_cgroup
def test_an_oom_of_the_container_outside_a_run_does_not_end_the_run(tmp_path, memory_parent_of_its_own):
    # the OOM eventfd of a v1 memory cgroup fires for an OOM of any cgroup above it too: a
    # process outside the run that ran the container out of memory ended an innocent run at
    # once, said to have 'reached its memory limit' (1 GiB here, where the run held a few MiB)
    (tmp_path / "waiter.py").write_text(_WAITER)
    procs = str(memory_parent_of_its_own / "cgroup.procs")
    spec = {"module": "waiter", "imports": ["wait"], "calls": ["wait()"]}
    out: list[code_repair_runner.RunOutput] = []
    run = threading.Thread(target=lambda: out.append(code_repair_runner.run_checks(tmp_path, spec, 30.0)))
    run.start()
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "started").exists() and run.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "started").exists(), out
        hog = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import os; open({procs!r}, 'w').write(str(os.getpid())); "
                "open('/proc/self/oom_score_adj', 'w').write('1000'); held = b'x' * (200 * 2**20)",
            ],
            check=False,
        )
        assert hog.returncode == -signal.SIGKILL  # the container's OOM kill took the hog
    finally:
        (tmp_path / "go").touch()
        run.join(30)
    [result] = out
    assert not result.memory_limit_hit and not result.timed_out, result
    assert '"value": true' in result.results, result


@needs_memory_cgroup
def test_a_run_killed_for_the_containers_memory_is_not_said_to_have_reached_its_own_limit(
    tmp_path, memory_parent_of_its_own
):
    # a run's process the kernel killed for the container's memory (96 MiB here) was said to
    # have 'reached 1 GiB' together, its own limit, which the policy would then look for in
    # vain: it held 200 MiB
    with _repair(tmp_path, test_timeout_s=20, memory_limit_bytes=2**30) as (env, work):
        env.step(
            edit_action("mathutils.py", "    return a - b", "    return len(b'x' * (200 * 2**20)) + a + b")
        )
        text = env.step("run_tests").obs.text
        assert "reached 1 GiB" not in text, text
        assert "killed one of its processes for the memory of its container" in text, text
        assert _none_left_in(work, 3)


@needs_pids_cgroup
def test_what_a_run_whose_server_died_left_running_is_killed_with_its_cgroup():
    # a server killed mid-run (its container's process, by the pool) without a PID namespace
    # left what the run had set running in a session of its own alive, in its cgroup: the
    # sweep's rmdir failed on it, and both stayed for as long as the node ran
    left = _cgroup_of_a_dead_server()
    daemon = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (left / "cgroup.procs").write_text(str(daemon.pid))
        fresh = code_repair_limits.PidsCgroup.make(8)
        assert fresh is not None
        fresh.remove()
        assert daemon.wait(5) == -signal.SIGKILL
        assert not left.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            daemon.kill()
        daemon.wait()
        code_repair_limits._RunCgroup(left).remove()


@needs_pids_cgroup
def test_the_sweep_leaves_the_run_cgroups_of_another_pid_namespace_alone():
    # a server of another PID namespace under the same cgroup (its pid means nothing here,
    # and reads as dead) is not judged by this one's sweep: its live run is left running
    probe = code_repair_limits.PidsCgroup.make(8)
    assert probe is not None
    other = probe.path.parent / f"envpool-run-1-{2**22 + 7}-theirs"  # (no pid that high here)
    probe.remove()
    other.mkdir()
    theirs = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        (other / "cgroup.procs").write_text(str(theirs.pid))
        fresh = code_repair_limits.PidsCgroup.make(8)
        assert fresh is not None
        fresh.remove()
        assert theirs.poll() is None and other.exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            theirs.kill()
        theirs.wait()
        code_repair_limits._RunCgroup(other).remove()


@pytest.mark.parametrize("owner", ["9" * 30, str(2**63)])
def test_the_sweep_passes_over_a_name_whose_owner_is_no_pid(tmp_path, owner):
    # a server of another version of the naming (envpool-run-PID-..., read here as NS-PID) or
    # a hand-made directory gave an "owner" past any pid: os.kill raised OverflowError out of
    # the sweep, and with it out of every run's cgroup set-up (seen: make test's collection of
    # this module failed while a newer server's cgroups were there)
    ns = code_repair_limits._pid_namespace()
    odd = tmp_path / f"{code_repair_limits._PREFIX}{ns}-{owner}-x"
    odd.mkdir()
    code_repair_limits._sweep(tmp_path)  # raised OverflowError
    assert odd.exists()  # not judged: left alone


@pytest.mark.parametrize("version", [1, 2])
def test_a_cgroup_mount_of_a_subtree_is_read_from_its_root(monkeypatch, version):
    # a container that shares the host's cgroup namespace (Docker's default on cgroup v1)
    # sees its own cgroup mounted at /sys/fs/cgroup/memory while /proc/self/cgroup names it
    # from the hierarchy's root: the run's cgroup was sought at .../memory/docker/abc, which is
    # not there, and no run got a memory cap
    own = "/docker/abc"
    if version == 1:
        mount = f"35 31 0:32 {own} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
        group = f"4:memory:{own}"
    else:
        mount = f"41 31 0:38 {own} /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw"
        group = f"0::{own}"
    monkeypatch.setattr(code_repair_limits, "_mounts_and_groups", lambda: ([mount], [group]))
    found = code_repair_limits._memory_parent()
    assert found is not None
    assert found[0] == Path("/sys/fs/cgroup/memory" if version == 1 else "/sys/fs/cgroup")
    # a cgroup outside what is mounted is not there to make a child in
    monkeypatch.setattr(
        code_repair_limits, "_mounts_and_groups", lambda: ([mount], [group.replace(own, "/other")])
    )
    assert code_repair_limits._memory_parent() is None


def test_a_run_that_only_says_memoryerror_is_not_said_to_run_out_of_memory(tmp_path):
    # the word anywhere in the run's output or results (a print, a returned string) read as
    # the run out of memory, and the policy was told of an address-space limit it never met
    with _repair(tmp_path, test_timeout_s=10) as (env, _):
        body = "    print('no MemoryError here')\n    return a + b"
        env.step(edit_action("mathutils.py", "    return a - b", body))
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert "no MemoryError here" in res.obs.text  # the print is shown, as output
        assert "ran out of memory" not in res.obs.text, res.obs.text


@pytest.mark.parametrize("use_hierarchy", ["0", "1"])
def test_no_memory_cgroup_under_a_v1_parent_that_does_not_account_its_children(
    tmp_path, monkeypatch, use_hierarchy
):
    # cgroup v1 with memory.use_hierarchy 0 in the server's cgroup (older kernels): a child's
    # charges stop at the child, so a run moved into one no longer counted toward the
    # container's memory limit (each run could take its memory_limit_bytes past it), and an
    # OOM of the container could not be told from the run's own. (A temp directory stands in
    # for the server's cgroup, its use_hierarchy a plain file: this kernel always has 1)
    (tmp_path / "memory.use_hierarchy").write_text(f"{use_hierarchy}\n")
    mount = f"35 31 0:32 / {tmp_path} rw,relatime - cgroup cgroup rw,memory"
    monkeypatch.setattr(code_repair_limits, "_mounts_and_groups", lambda: ([mount], ["4:memory:/"]))
    found = code_repair_limits._memory_parent()
    if use_hierarchy == "0":
        assert found is None
        assert code_repair_limits.MemoryCgroup.make(64 * MiB) is None
        assert [p.name for p in tmp_path.iterdir()] == ["memory.use_hierarchy"]  # nothing made there
    else:
        assert found == (tmp_path, 1)  # (the check refuses only a 0)
