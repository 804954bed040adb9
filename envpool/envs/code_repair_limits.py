"""The limits of a ``code-repair-v1`` test run besides its timeout, CPU and file size: the
address space of each of its processes (``RLIMIT_AS``), and how many processes and threads
it may have at once (a pids cgroup of its own, where one can be made).

Why these: the policy's module runs in the container beside the server. A module that
allocates without end took the container's memory (the server died with it, or the kernel's
OOM killer picked a neighbour), and one that forked without end took the container's pids
(or the node's). ``RLIMIT_NPROC`` would not do for the second: it does not bind root (a
container's usual user), and it counts every process of the user, the server's included. A
pids cgroup counts the run's processes only, binds root, and its member list finds every
process the run started, wherever it moved.

Where no pids cgroup can be made (cgroup v2, whose rules forbid a child cgroup with
controllers under one that holds processes, as the server's does; a read-only
``/sys/fs/cgroup``; not Linux) a run has no process cap of its own: it still ends at its
timeout with everything it started (``kill_tree``, the PID namespace), and what it forks
meanwhile is bounded by the container's own pids limit (``docker run --pids-limit``, a
pod's pid limit), which a deployment should set.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import time
import uuid
from pathlib import Path

__all__ = [
    "DEFAULT_MAX_PROCESSES",
    "DEFAULT_MEMORY_BYTES",
    "MIN_MAX_PROCESSES",
    "MIN_MEMORY_BYTES",
    "PidsCgroup",
    "describe_bytes",
    "pids_cgroup_available",
    "set_memory_limit",
]

DEFAULT_MEMORY_BYTES = 2**30
"""``RLIMIT_AS`` of each process of a run: an allocation past it is a ``MemoryError``."""
MIN_MEMORY_BYTES = 32 * 2**20
"""Below this the interpreter itself cannot start (it maps about 15 MiB)."""
DEFAULT_MAX_PROCESSES = 64
"""Processes and threads of a run at once, its own two or three included (the keeper, the
PID namespace's init, the runner)."""
MIN_MAX_PROCESSES = 4


def describe_bytes(n: int) -> str:
    return (
        f"{n / 2**30:g} GiB" if n % 2**30 == 0 else f"{n / 2**20:g} MiB" if n % 2**20 == 0 else f"{n} bytes"
    )


def set_memory_limit(pid: int, limit: int) -> None:
    """``RLIMIT_AS`` of ``pid`` (inherited by all it starts), lowered to ``limit``; never
    raised past a hard limit set from outside (the server's own ``as_bytes``)."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    value = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.prlimit(pid, resource.RLIMIT_AS, (value, value))


def _pids_parent() -> Path | None:
    """This process's cgroup in cgroup v1's pids hierarchy, where a child can be made."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        groups = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    mount = None
    for line in mounts:
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] == "cgroup" and "pids" in tail[2].split(","):
            mount = fields[4]
            break
    if mount is None:
        return None
    for line in groups:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return Path(mount) / path.lstrip("/")
    return None


def pids_cgroup_available() -> bool:
    """Whether runs here get a process cap (a pids cgroup of their own can be made)."""
    probe = PidsCgroup.make(MIN_MAX_PROCESSES)
    if probe is None:
        return False
    probe.remove()
    return True


_PREFIX = "envpool-run-"


def _sweep(parent: Path) -> None:
    """Remove the cgroups of runs whose server died mid-run (killed with its container:
    its own cleanup never ran). Empty by then (the container's kill took their processes);
    one of a live server, or still holding a process, stays."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            owner = entry.name.removeprefix(_PREFIX).partition("-")[0]
            if entry.name == owner or not owner.isdigit() or int(owner) == os.getpid():
                continue
            try:
                os.kill(int(owner), 0)
                continue  # its server is alive (or the pid was reused: swept later)
            except ProcessLookupError:
                pass  # its server is gone: the cgroup is a leftover, swept below
            except OSError:
                continue
            with contextlib.suppress(OSError):
                os.rmdir(entry.path)


class PidsCgroup:
    """A pids cgroup of one test run: ``pids.max`` caps its processes and threads at once;
    a fork or a thread start past it fails (``EAGAIN``), which ``pids.events`` counts."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def make(cls, max_tasks: int) -> PidsCgroup | None:
        """A fresh one capped at ``max_tasks``, or None where none can be made."""
        parent = _pids_parent()
        if parent is None:
            return None
        _sweep(parent)
        path = parent / f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError:
            return None
        cg = cls(path)
        try:
            (path / "pids.max").write_text(str(max_tasks))
        except OSError:
            cg.remove()
            return None
        return cg

    def add(self, pid: int) -> bool:
        """Move ``pid`` in (before it forks: what it starts later is born inside)."""
        try:
            (self.path / "cgroup.procs").write_text(str(pid))
        except OSError:
            return False
        return True

    def hit_limit(self) -> bool:
        """Whether a fork or a thread start was refused for the cap."""
        try:
            for line in (self.path / "pids.events").read_text().splitlines():
                key, _, count = line.partition(" ")
                if key == "max" and int(count) > 0:
                    return True
        except (OSError, ValueError):
            pass  # the cgroup is gone or unreadable: no refused fork is on record
        return False

    def _members(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self) -> None:
        """SIGKILL every process in it, each stopped first so none forks past the scan (a
        process that left its tree, reparented to the container's init, is still here)."""
        stopped: set[int] = set()
        for _ in range(100):
            found = [pid for pid in self._members() if pid not in stopped]
            if not found:
                break
            for pid in found:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            stopped.update(found)
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        """Kill what is left in it, and remove it once its processes are gone (a SIGKILL
        lands when each is next scheduled: a bounded wait)."""
        self.kill_all()
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # left behind, empty soon: a few bytes of the kernel's
                self.kill_all()
                time.sleep(0.01)
