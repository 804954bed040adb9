"""The end of a ``code-repair-v1`` test run: every process it started is killed, found by
parent (``kill_tree``: the runner's tree) or by process group and working directory
(``kill_left_in``: what left the tree), each stopped first so that none forks past the walk.
(:mod:`envpool.envs.code_repair_runner` calls both after every run; the run's cgroups' member
lists, :mod:`envpool.envs.code_repair_limits`, find the rest. A run in a PID namespace of its
own is not found by group, its runner being in a session of its own, and need not be: nothing
of it outlives the namespace's init, which ``kill_tree`` kills.)"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

__all__ = ["kill_left_in", "kill_tree", "stop_and_kill"]


def kill_left_in(root: Path) -> None:
    """SIGKILL every process of this process group whose working directory is under ``root``
    (an episode's work dir, this process's own never), each stopped first so none forks past
    the scan. What a run without a PID namespace left (its keeper and all it starts stay in
    this group: ``RUNNER``'s comment says why)."""
    me, group, root = os.getpid(), os.getpgid(0), root.resolve()

    def left() -> set[int]:
        found: set[int] = set()
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc"):
                if not entry.name.isdigit() or (pid := int(entry.name)) == me:
                    continue
                try:
                    cwd = Path(os.readlink(f"/proc/{pid}/cwd"))
                    if os.getpgid(pid) == group and cwd.is_relative_to(root):
                        found.add(pid)
                except OSError:  # gone meanwhile, or not ours to read
                    continue
        return found

    stop_and_kill(left)


def stop_and_kill(find: Callable[[], Iterable[int]]) -> None:
    """SIGKILL every process ``find`` lists (listed again until it lists no new one), each
    stopped first so that none forks past the scan.

    Each is pinned by a pidfd before it is signalled, and signalled through it once ``find``
    lists it again: a process listed, then gone and reaped (by an init outside the run, as what
    left its tree is), may leave its pid to an unrelated process before a kill by pid lands;
    the pidfd names the process, not the number, and one that still has its pid when listed
    again is the listed one. Where pidfds are missing (before Linux 5.3) or the fds run out,
    the signal goes by pid, as before."""
    pinned: dict[int, int] = {}  # pid -> the pidfd of the process stopped under it
    opened: list[int] = []  # every pidfd, closed at the end whatever happens meanwhile
    try:
        for _ in range(100):  # a fork bomb outruns no scan for long: each pass stops what it saw
            new: dict[int, int | None] = {}
            for pid in find():
                if pid > 0 and pid not in pinned:
                    new[pid] = fd = _pin(pid)
                    if fd is not None and fd != _BY_PID:
                        opened.append(fd)
            if not new:
                break
            again = set(find())
            for pid, fd in new.items():
                # gone, or its pid another's by now (found again if that one is a member)
                if fd is not None and pid in again and _signal(fd, pid, signal.SIGSTOP):
                    pinned[pid] = fd
        for pid, fd in pinned.items():
            _signal(fd, pid, signal.SIGKILL)
    finally:
        for fd in opened:
            os.close(fd)


_BY_PID = -1
"""What ``_pin`` gives where no pidfd can be had: the signal goes by pid."""


def _pin(pid: int) -> int | None:
    """A pidfd of ``pid``'s process; None where it is gone; ``_BY_PID`` where no pidfd can be
    had (no pidfd_open: an older kernel, not Linux; out of fds)."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    except (AttributeError, OSError):
        return _BY_PID


def _signal(fd: int, pid: int, sig: int) -> bool:
    """Send ``sig`` to the pinned process (by pid where ``fd`` is ``_BY_PID``); whether it was
    there to take it."""
    try:
        if fd == _BY_PID:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)
    except (ProcessLookupError, PermissionError):  # gone; or not this process's to signal
        return False
    return True


def _children_by_parent() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    try:
        entries = list(os.scandir("/proc"))
    except OSError:  # no /proc (not Linux): only the runner itself is killed
        return found
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # past the command name (which may hold spaces or parentheses): state, then ppid
        ppid = int(stat.rpartition(b")")[2].split()[1])
        found.setdefault(ppid, []).append(int(entry.name))
    return found


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` (a child of this process) and every process it started. Not by
    process group: a run's keeper shares its caller's (a group of its own would escape a
    container's kill), but the runner under a PID namespace's init has a session of its own
    (its module cannot signal the caller's group), and a module's process may take one. So
    they are found by parent; each is stopped first so that none forks behind the walk, and
    a stopped parent reaps nothing, so no pid found can pass to another process before the
    kill. (One that left the tree, reparented when its parent exited, is not found: the
    container's own kill takes it.)"""
    stopped: set[int] = set()
    todo = [root]
    while todo:
        for pid in todo:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped.update(todo)
        tree = _children_by_parent()
        found: set[int] = set()
        frontier = [root]
        while frontier:
            for child in tree.get(frontier.pop(), ()):
                if child not in found:
                    found.add(child)
                    frontier.append(child)
        todo = sorted(found - stopped)
    for pid in stopped:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
