"""The end of a code-repair run signals processes through pidfds (``stop_and_kill``): a pid
listed as the run's, whose process is gone by the time it is signalled, may be another
process's by then, and a kill by pid would land on it."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from envpool.envs.code_repair_kill import stop_and_kill
from envpool.envs.code_repair_limits import PidsCgroup


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return stat.rpartition(b")")[2].split()[0].decode()


def _untouched(p: subprocess.Popen) -> bool:
    """Whether ``p`` is alive and running (not stopped) a moment later: a signal sent lands
    when the process is next scheduled, not before the sender returns."""
    try:
        p.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return _state(p.pid) != "T"
    return False


def _listed_once(pid: int):
    # listed by the first scan only: the process the scan saw is gone and its pid is
    # another's (here: a process that was never the run's) when the scan runs again
    calls = []

    def find() -> list[int]:
        calls.append(1)
        return [pid] if len(calls) == 1 else []

    return find


def test_a_pid_no_longer_listed_when_pinned_is_not_signalled(sleeper):
    stop_and_kill(_listed_once(sleeper.pid))
    assert _untouched(sleeper)


def test_a_cgroups_kill_all_signals_no_pid_that_left_its_member_list(sleeper, monkeypatch):
    # (kill_all by pid stopped and killed it: SIGKILL, -9)
    cgroup = PidsCgroup(Path("/nonexistent-cgroup"))
    monkeypatch.setattr(cgroup, "_members", _listed_once(sleeper.pid))
    cgroup.kill_all()
    assert _untouched(sleeper)


def test_a_process_listed_again_is_killed(sleeper):
    stop_and_kill(lambda: [sleeper.pid])
    assert sleeper.wait(timeout=10) == -9


def test_without_pidfds_the_kill_goes_by_pid(sleeper, monkeypatch):
    monkeypatch.delattr(os, "pidfd_open")
    stop_and_kill(lambda: [sleeper.pid])
    assert sleeper.wait(timeout=10) == -9


def test_pid_zero_is_never_signalled(monkeypatch):
    # cgroup v2 lists a member this PID namespace cannot see as 0: a kill of 0 is this
    # process's own group
    sent: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(pid))
    stop_and_kill(lambda: [0])
    assert sent == []


def test_no_fd_is_left_open(sleeper):
    before = len(os.listdir("/proc/self/fd"))
    stop_and_kill(_listed_once(sleeper.pid))
    other = subprocess.Popen(["sleep", "60"])
    try:
        stop_and_kill(lambda: [other.pid])
        assert other.wait(timeout=10) == -9
    finally:
        other.kill()
        other.wait()
    assert len(os.listdir("/proc/self/fd")) == before


def test_no_fd_is_left_open_when_a_scan_or_a_signal_fails(sleeper, monkeypatch):
    before = len(os.listdir("/proc/self/fd"))
    calls = []

    def find_then_fail() -> list[int]:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the member list went away")
        return [sleeper.pid]

    with pytest.raises(RuntimeError):
        stop_and_kill(find_then_fail)
    assert len(os.listdir("/proc/self/fd")) == before

    def refuse(fd: int, sig: int) -> None:
        raise PermissionError(1, "not yours")

    monkeypatch.setattr(signal, "pidfd_send_signal", refuse)
    stop_and_kill(lambda: [sleeper.pid])  # a process it may not signal: skipped, not raised
    assert len(os.listdir("/proc/self/fd")) == before
    assert _untouched(sleeper)
