"""The sweep of leftover run cgroups also takes those of the naming before the PID namespace
was in the name (``envpool-run-PID-HEX12``, made by code-repair before 3945455), so that a
host upgraded in place does not keep them for good; strictly that naming, and only where
what is inside is of this PID namespace (that naming says nothing of the owner's)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from envpool.envs import code_repair_limits

needs_pids_cgroup = pytest.mark.skipif(
    not code_repair_limits.pids_cgroup_available(),
    reason="no pids cgroup can be made here (cgroup v1's pids hierarchy, writable)",
)
needs_memory_cgroup = pytest.mark.skipif(
    not code_repair_limits.memory_cgroup_available(),
    reason="no memory cgroup can be made here",
)

_KINDS = {
    "pids": (lambda: code_repair_limits.PidsCgroup.make(8), needs_pids_cgroup),
    "memory": (lambda: code_repair_limits.MemoryCgroup.make(64 * 2**20), needs_memory_cgroup),
}


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _old_name(pid: int) -> str:
    """The name the code before 3945455 gave a run cgroup of the server ``pid``."""
    return f"envpool-run-{pid}-0123456789ab"


@contextlib.contextmanager
def _waiter(argv: list[str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A process that waits on its stdin until this test ends it."""
    proc = subprocess.Popen(
        argv or [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


@contextlib.contextmanager
def _old_cgroup(kind: str, owner: int) -> Iterator[Path]:
    """A cgroup of the old naming for ``owner``, beside where this server's runs' go."""
    probe = _KINDS[kind][0]()
    assert probe is not None
    left = probe.path.parent / _old_name(owner)
    probe.remove()
    left.mkdir()
    try:
        yield left
    finally:
        code_repair_limits._RunCgroup(left).remove()


def _next_run(kind: str) -> None:
    fresh = _KINDS[kind][0]()
    assert fresh is not None
    fresh.remove()


@pytest.mark.parametrize("kind", [pytest.param(k, marks=m) for k, (_, m) in _KINDS.items()])
def test_a_leftover_cgroup_of_the_old_naming_is_swept_with_what_is_in_it(kind):
    # a server of the version before (envpool-run-PID-RANDOM) killed mid-run left its run's
    # cgroup, and in it a daemon of the run; the sweep read the name as NS-PID and passed
    # over it: both stayed for as long as the host ran, upgraded in place
    with _old_cgroup(kind, _dead_pid()) as left, _waiter() as daemon:
        (left / "cgroup.procs").write_text(str(daemon.pid))
        _next_run(kind)
        assert daemon.wait(5) == -signal.SIGKILL
        assert not left.exists()


@needs_pids_cgroup
def test_an_empty_leftover_of_the_old_naming_is_removed():
    with _old_cgroup("pids", _dead_pid()) as left:
        _next_run("pids")
        assert not left.exists()


@needs_pids_cgroup
def test_a_cgroup_of_the_old_naming_whose_owner_lives_stays():
    with _waiter() as owner, _old_cgroup("pids", owner.pid) as mine, _waiter() as run:
        (mine / "cgroup.procs").write_text(str(run.pid))
        _next_run("pids")
        assert run.poll() is None and mine.exists()


def _inner_pid(unshare: subprocess.Popen[bytes]) -> int:
    """The pid (here) of ``unshare --fork``'s child, pid 1 of its new namespace."""
    children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
    deadline = time.monotonic() + 10
    while not (found := children.read_text().split()):
        assert time.monotonic() < deadline, "unshare --fork started no child"
        time.sleep(0.01)
    return int(found[0])


@needs_pids_cgroup
@pytest.mark.skipif(shutil.which("unshare") is None, reason="no unshare(1) here")
def test_a_cgroup_of_the_old_naming_holding_a_process_of_another_pid_namespace_stays():
    # the old naming says nothing of its owner's namespace: a dead pid here may be a live
    # server of another, whose run this is; only what is of this namespace is judged
    argv = ["unshare", "--pid", "--fork", sys.executable, "-c", "import sys; sys.stdin.read()"]
    try:
        probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pytest.skip("unshare --pid does not work here")
    if probe.returncode != 0:
        pytest.skip(f"unshare --pid does not work here: {probe.stderr.decode()[:200]}")
    with _old_cgroup("pids", _dead_pid()) as theirs, _waiter(argv) as unshare:
        inner = _inner_pid(unshare)
        (theirs / "cgroup.procs").write_text(str(inner))
        _next_run("pids")
        assert Path(f"/proc/{inner}").exists() and unshare.poll() is None
        assert theirs.exists()


@pytest.mark.parametrize(
    "name",
    [
        "envpool-run-{pid}-0123456789a",  # 11 hex digits
        "envpool-run-{pid}-0123456789abc",  # 13
        "envpool-run-{pid}-0123456789AB",  # upper case: uuid4().hex never is
        "envpool-run-{pid}-0123456789ag",
        "envpool-run-0{pid}-0123456789ab",  # a pid is never written with a leading zero
        "envpool-run-{pid}-0123456789ab.bak",
        "envpool-run-{pid}-0123456789ab-x",
        "xenvpool-run-{pid}-0123456789ab",
        "envpool-run--{pid}-0123456789ab",
        "envpool-run-{pid}x-0123456789ab",
        "envpool-run-99999999999-0123456789ab",  # past any pid
    ],
)
def test_only_the_old_naming_exactly_is_swept(tmp_path, name):
    # the positive control: the exact old name of the same dead owner goes
    pid = _dead_pid()
    odd, old = tmp_path / name.format(pid=pid), tmp_path / _old_name(pid)
    odd.mkdir()
    old.mkdir()
    code_repair_limits._sweep(tmp_path)
    assert odd.exists() and not old.exists()
