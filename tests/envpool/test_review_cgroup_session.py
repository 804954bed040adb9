"""Review of the sweep of leftover run cgroups (``code_repair_limits._sweep``): it never
signals what it cannot see (a member of another PID namespace, which a v2 ``cgroup.procs``
lists as pid 0: a kill of pid 0 is one of this server's own process group), and it reads a
name's pid in ASCII digits only (``str.isdigit`` takes other scripts' digits, and
superscripts that ``int`` refuses). And code-repair's report never tells an import that
failed of an OOM kill that the kill came after its results."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair_limits

_REPO = str(Path(__file__).resolve().parents[2])
_SWEEP = (
    "import sys; from pathlib import Path; from envpool.envs import code_repair_limits as l; "
    "l._sweep(Path(sys.argv[1]))"
)


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _old_name(pid: int) -> str:
    return f"envpool-run-{pid}-0123456789ab"


def _sweep_in_own_session(argv_head: list[str], parent: Path) -> subprocess.Popen[bytes]:
    # a session of its own: a kill of "pid 0" from it reaches its own group, never this test's
    return subprocess.Popen(
        [*argv_head, sys.executable, "-c", _SWEEP, str(parent)],
        env={**os.environ, "PYTHONPATH": _REPO},
        start_new_session=True,
    )


def _exited_or_stopped(proc: subprocess.Popen[bytes], watch: int, within_s: float = 30) -> str:
    """ "exited" once ``proc`` ends, "stopped" once ``watch`` (``proc`` or its child) is stopped
    (a SIGSTOP to its own process group); a bounded poll."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return "exited"
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{watch}/stat").read_bytes().rpartition(b")")[2].split()[0]
            if state in (b"T", b"t"):
                return "stopped"
        time.sleep(0.01)
    return "neither"


def _end(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.mark.parametrize("naming", ["old", "current"])
def test_a_member_listed_as_pid_0_is_never_signalled(tmp_path, naming):
    # cgroup v2 lists a member of a PID namespace the reader cannot see as "0": the old
    # naming's guard (all members of this namespace) took 0 for "gone meanwhile", and
    # kill_all sent SIGSTOP, then SIGKILL, to pid 0: the server's own process group. (The
    # current naming's: where two namespaces' servers read theirs alike, "0" where
    # /proc/self/ns/pid cannot be read)
    pid = _dead_pid()
    ns = code_repair_limits._pid_namespace()
    left = tmp_path / (_old_name(pid) if naming == "old" else f"envpool-run-{ns}-{pid}-0123456789ab")
    left.mkdir()
    (left / "cgroup.procs").write_text("0\n")
    sweep = _sweep_in_own_session([], tmp_path)
    try:
        assert _exited_or_stopped(sweep, sweep.pid) == "exited"  # was "stopped"
        assert sweep.returncode == 0
    finally:
        _end(sweep)


def _v2_parent_writable() -> Path | None:
    parent = code_repair_limits._v2_parent()
    if parent is None or os.geteuid() != 0:
        return None
    probe = parent / f"review-probe-{os.getpid()}"
    try:
        probe.mkdir()
    except OSError:
        return None
    probe.rmdir()
    return parent


def _unshare_pid_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    try:
        return (
            subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True, timeout=10).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(
    _v2_parent_writable() is None or not _unshare_pid_works(),
    reason="needs a writable cgroup v2 hierarchy and unshare --pid (root)",
)
def test_a_server_in_a_child_pid_namespace_leaves_a_run_it_cannot_see_alone():
    # the real kernel: a live run of a server of the parent namespace, in a cgroup of the
    # old naming whose pid is dead in the child namespace; the sweep of a server in the
    # child namespace reads its member as 0
    parent = _v2_parent_writable()
    assert parent is not None
    theirs = parent / _old_name(_dead_pid())
    theirs.mkdir()
    run = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    sweep = None
    try:
        (theirs / "cgroup.procs").write_text(str(run.pid))
        sweep = _sweep_in_own_session(["unshare", "--pid", "--fork"], parent)
        children = Path(f"/proc/{sweep.pid}/task/{sweep.pid}/children")
        deadline = time.monotonic() + 10
        inner = None
        while inner is None and sweep.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                found = children.read_text().split()
                inner = int(found[0]) if found else None
        outcome = _exited_or_stopped(sweep, inner if inner is not None else sweep.pid)
        assert outcome == "exited" and sweep.returncode == 0, outcome  # was "stopped"
        assert run.poll() is None and theirs.exists()
    finally:
        if sweep is not None:
            _end(sweep)
        run.kill()
        run.wait()
        code_repair_limits._RunCgroup(theirs).remove()


_DIGITS = {
    "arabic-indic": "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669",
    "fullwidth": "\uff10\uff11\uff12\uff13\uff14\uff15\uff16\uff17\uff18\uff19",
}


@pytest.mark.parametrize("script", sorted(_DIGITS))
@pytest.mark.parametrize("naming", ["current", "old"])
def test_a_pid_in_other_digits_is_no_owner(tmp_path, script, naming):
    # int() reads "١٢٣" as 123: a name no server of ours ever made was judged by that pid,
    # and swept with what was in it
    pid = _dead_pid()
    other = str(pid).translate(str.maketrans("0123456789", _DIGITS[script]))
    ns = code_repair_limits._pid_namespace()
    name = f"envpool-run-{ns}-{{}}-0123456789ab" if naming == "current" else "envpool-run-{}-0123456789ab"
    odd, exact = tmp_path / name.format(other), tmp_path / name.format(pid)
    odd.mkdir()
    exact.mkdir()
    code_repair_limits._sweep(tmp_path)
    assert odd.exists() and not exact.exists()


def test_a_superscript_pid_does_not_break_the_sweep(tmp_path):
    # "²".isdigit() is True and int("²") raises ValueError: out of the sweep, out of every
    # later run's cgroup set-up (a policy's module running as root could plant the name)
    ns = code_repair_limits._pid_namespace()
    pid = _dead_pid()
    odd, exact = (
        tmp_path / f"envpool-run-{ns}-\u00b2-0123456789ab",
        tmp_path / f"envpool-run-{ns}-{pid}-0123456789ab",
    )
    odd.mkdir()
    exact.mkdir()
    code_repair_limits._sweep(tmp_path)  # raised ValueError
    assert odd.exists() and not exact.exists()


# -- code-repair: an import that failed for an OOM kill is no result the kill came after

MiB = 2**20

# at import: forks helpers that together pass the run's memory limit, and fails once the
# kernel's OOM killer took one (the import's failure is the kill's doing, after it)
_IMPORT_DIES_OF_OOM = """
import os as _os

def _helpers_past_limit(children, mib):
    go_r, go_w = _os.pipe()
    for _ in range(children):
        if _os.fork() == 0:
            held = b"x" * (mib * 2**20)  # every page touched
            _os.read(go_r, 1)
            _os._exit(len(held) == 0)
    _, status = _os.wait()  # the first to end: one the OOM killer took
    raise ImportError(f"a helper died: {_os.waitstatus_to_exitcode(status)}")

_helpers_past_limit(6, 48)
"""


def _code_repair_edit(search: str, replace: str) -> str:
    return f"edit mathutils.py\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


@pytest.mark.skipif(
    not code_repair_limits.memory_cgroup_available(), reason="no memory cgroup can be made here"
)
def test_an_import_that_failed_for_an_oom_kill_is_not_told_the_kill_came_after(tmp_path, monkeypatch):
    # no OOM event (cgroup v2 without memory.oom.group, or no eventfd): the run goes on past
    # the kill, and the import fails of it; the report said "After all its results were in,
    # ... the kernel killed one of them; the results stand" above the import's error
    monkeypatch.setattr(code_repair_limits.MemoryCgroup, "oom_eventfd", lambda self: None)
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make(
        "code-repair-v1", workdir_root=str(work), test_timeout_s=20, memory_limit_bytes=160 * MiB
    )
    try:
        env.reset(options={"task": "mathutils"})
        clamp = "    return max(lo, min(x, hi))"
        assert env.step(_code_repair_edit(clamp, clamp + "\n" + _IMPORT_DIES_OF_OOM)).info["valid"]
        res = env.step("run_tests")
        text = res.obs.text
        assert "ERROR test_mathutils.py: ImportError: a helper died: -9" in text, text
        assert res.info["outcome"] == "test_failure", text
        assert "Every check reported its result" not in text and "the results stand" not in text, text
        assert "its processes together reached 160 MiB" in text, text
    finally:
        env.close()
