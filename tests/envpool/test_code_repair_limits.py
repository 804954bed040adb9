"""``code-repair-v1``'s limits on a test run's memory and processes: a module that hogs
memory or forks without end fails its run with a line that says which limit, and the
container (this process) is untouched."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair_limits
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


@needs_pids_cgroup
def test_the_cgroup_of_a_run_whose_server_died_is_removed_by_the_next_run():
    # a container killed mid-run (an aborted trajectory) never removed its run's cgroup: one
    # empty cgroup left per such run, for as long as the node ran
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    probe = code_repair_limits.PidsCgroup.make(8)
    assert probe is not None
    left = probe.path.parent / f"envpool-run-{dead.pid}-abandoned"
    probe.remove()
    left.mkdir()
    try:
        fresh = code_repair_limits.PidsCgroup.make(8)
        assert fresh is not None
        fresh.remove()
        assert not left.exists()
    finally:
        with contextlib.suppress(OSError):
            left.rmdir()
