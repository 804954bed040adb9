"""Per-run cgroups: one memory, CPU and process budget for a run as a whole.

rlimits bound each *process*: six children of one run may each hold ``memory_mb``, each
burn ``cpu_s``, and memory a program keeps in a memfd or its tmpfs is not address space at
all. A cgroup per run closes that: ``memory.limit_in_bytes`` covers every page the run
charges (tmpfs and memfd included) and ``cpuacct.usage`` the CPU of all its processes,
which the supervisor polls. cgroup v1 controllers, created *under the
zygote's own cgroup* so whatever limits the host put on the worker still hold.

The zygote opens the controllers' directories before it enters the jail (which shows no
``/sys``) and each program joins its uid slot's cgroups (``RunCgroups.procs``); the
supervisors, in the client outside the jail, open the same directories by path
(``SlotCgroups``) to set a run's limit and read what it used. Where a controller is missing
or read-only the sandbox falls back to rlimits alone and says so in ``Sandbox.cgroups``.
Where the zygote made one, no run goes without it: before any user code, each run checks
that its program is in the slot's memory cgroup and that the limit reads back as written
(``Slot.check``), and is refused (a ``sandbox_error``) if not.

Stdlib only (the zygote imports it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

# no ``pids``: every run has a uid of its own, so RLIMIT_NPROC already counts the run as a
# whole, and each controller costs a task migration per run
CONTROLLERS = ("memory", "cpuacct")
_PREFIX = "rlfabric-"


def _mount_points() -> dict[str, str]:
    """Controller -> where its v1 hierarchy is mounted."""
    found: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, (fstype, _src, super_opts) = left.split(), right.split()[:3]
            if fstype != "cgroup":
                continue
            for opt in super_opts.split(","):
                if opt in CONTROLLERS:
                    found[opt] = fields[4]
    return found


def _own_paths() -> dict[str, str]:
    """Controller -> this process's cgroup in it."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(","):
                paths[name] = path
    return paths


class RunCgroups:
    """The zygote's cgroup directories, one per controller (``<own cgroup>/rlfabric-<pid>``)."""

    def __init__(self, enabled: bool = True) -> None:
        self.dirs: dict[str, int] = {}
        self.paths: dict[str, str] = {}  # on the host, for the supervisors
        self._procs: dict[int, list[int]] = {}  # uid slot -> its cgroup.procs, one per controller
        self._parents: dict[str, int] = {}  # to remove our own directory from inside the jail
        self._name = f"{_PREFIX}{os.getpid()}"
        mounts, own = (_mount_points(), _own_paths()) if enabled else ({}, {})
        for ctl in CONTROLLERS:
            if ctl not in mounts or ctl not in own:
                continue
            parent = os.path.join(mounts[ctl], own[ctl].lstrip("/"))
            _remove_stale(parent)
            try:
                # taken already: only by a process with our pid, so a dead one (pids come
                # round again, often within 32768), that could not remove it (SIGKILL, runs
                # still dying at its shutdown). Ours now: giving up here turned the memory
                # limit of every run off, with nothing but ``Sandbox.cgroups`` to say so
                with contextlib.suppress(FileExistsError):
                    os.mkdir(os.path.join(parent, self._name))
                self._parents[ctl] = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
                self.dirs[ctl] = os.open(self._name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=self._parents[ctl])
                self.paths[ctl] = os.path.join(parent, self._name)
            except OSError:
                continue  # not ours to create (read-only, no permission): rlimits only

    def procs(self, slot: int) -> list[int]:
        """The slot's ``cgroup.procs`` files, one per controller (kept open: every run's
        program writes ``0`` to each, joining them, before it runs any user code; a
        migration can wait for an RCU grace period, which must not stall the zygote)."""
        fds = self._procs.get(slot)
        if fds is None:
            fds = []
            for parent in self.dirs.values():
                with contextlib.suppress(FileExistsError):
                    os.mkdir(f"s{slot}", dir_fd=parent)
                fds.append(os.open(f"s{slot}/cgroup.procs", os.O_WRONLY, dir_fd=parent))
            self._procs[slot] = fds
        return fds

    def remove(self) -> bool:
        """Remove the slot cgroups and our own; False while some are busy (a zygote that
        could not wait for that leaves empty directories the next one removes)."""
        done = True
        for fds in self._procs.values():
            for fd in fds:
                os.close(fd)
        self._procs = {}
        for ctl, fd in self.dirs.items():
            for name in os.listdir(fd):
                if name.startswith("s") and name[1:].isdigit():
                    try:
                        os.rmdir(name, dir_fd=fd)
                    except OSError:
                        done = False
            try:
                os.rmdir(self._name, dir_fd=self._parents[ctl])
            except FileNotFoundError:
                pass  # already gone: that is what we wanted
            except OSError:
                done = False
        return done


# what each controller bounds for the run as a whole, and what is left of it without one
_WITHOUT = {
    "memory": (
        "memory_mb bounds each process's address space (RLIMIT_AS), not the run: its processes "
        "together, and what it keeps in its tmpfs or memfds, may hold more, and no OOM kill is seen"
    ),
    "cpuacct": (
        "cpu_s bounds each process's CPU time (RLIMIT_CPU), not the run: its processes together may "
        "spend more, up to the wall limit"
    ),
}


def missing_note(paths: dict[str, str]) -> str | None:
    """What a sandbox whose zygote made only ``paths`` does not bound, for a warning at its
    start (None: it has every controller). Only ``Sandbox.cgroups`` said so before: a host
    with cgroup v2 alone, the default of current distributions, ran every run that way."""
    missing = [ctl for ctl in CONTROLLERS if ctl not in paths]
    if not missing:
        return None
    return (
        f"the code sandbox runs without the cgroup v1 controllers {', '.join(missing)} (none it "
        "could make under its own cgroup: cgroup v2 alone, or a read-only /sys/fs/cgroup), so "
        + "; ".join(_WITHOUT[ctl] for ctl in missing)
    )


def _remove_stale(parent: str) -> None:
    """Directories of zygotes that died without cleaning up (SIGKILL): remove the empty ones."""
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            if not name.startswith(_PREFIX) or not name[len(_PREFIX) :].isdigit():
                continue
            pid = int(name[len(_PREFIX) :])
            if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
                continue
            path = os.path.join(parent, name)
            for sub in os.listdir(path):
                if sub.startswith("s"):
                    with contextlib.suppress(OSError):
                        os.rmdir(os.path.join(path, sub))
            with contextlib.suppress(OSError):
                os.rmdir(path)


class SlotCgroups:
    """The supervisors' side: the zygote's cgroup directories, opened by path, and one
    ``Slot`` per uid slot, kept for the slot's next runs."""

    def __init__(self, paths: dict[str, str]) -> None:
        #: what the zygote made: every run must be limited by each of them, or not run
        self.expected = frozenset(paths)
        self.parents: dict[str, int] = {}
        for ctl, path in paths.items():
            with contextlib.suppress(OSError):  # missed by every run's check (``Slot.check``)
                self.parents[ctl] = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        self._slots: dict[int, Slot] = {}
        self._lock = threading.Lock()  # no Slot is made from a parent descriptor being closed
        self._closed = False

    def slot(self, slot: int) -> Slot | None:
        """The slot's cgroups; None only where the sandbox has none (rlimits alone)."""
        with self._lock:
            if self._closed and self.expected:  # not None: its run would have no memory limit
                raise OSError(
                    f"the cgroups of uid slot {slot} are closed (the sandbox was closed or restarted)"
                )
            if not self.expected:
                return None
            found = self._slots.get(slot)
            if found is None:
                found = self._slots[slot] = Slot(self.parents, f"s{slot}", self.expected)
            return found

    def close(self) -> None:
        """Forget the slots: each one's descriptors close once no run in flight holds it (a
        run still polling a descriptor closed under it could read, or write a limit into,
        whatever file took its number next)."""
        with self._lock:
            for fd in self.parents.values():
                os.close(fd)
            self._slots, self.parents = {}, {}
            self._closed = True


class Slot:
    """The cgroups of one uid slot (one per controller), reused by the slot's runs one after
    another: creating and removing a memory cgroup per run costs more CPU than the run
    itself. Each run starts from zeroed counters (and the OOM-kill count it found)."""

    def __init__(self, parents: dict[str, int], name: str, expected: frozenset[str]) -> None:
        self.expected = expected  # the controllers the zygote made: each run must have them all
        self.fds: dict[str, int] = {}
        for ctl, parent in parents.items():
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, dir_fd=parent)
            try:
                self.fds[ctl] = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=parent)
            except OSError:
                continue
        # kept open (closed when the Slot is collected): a slot runs many runs, and each
        # reads or writes these
        self._usage = self._open("cpuacct", "cpuacct.usage")  # also polled every 50 ms
        self._limit = self._open("memory", "memory.limit_in_bytes")
        self._oom = self._open("memory", "memory.oom_control")
        self._ooms_before = 0
        fds = [*self.fds.values(), self._usage, self._limit, self._oom]
        self._finalizer = weakref.finalize(self, _close_all, [fd for fd in fds if fd >= 0])

    def _open(self, ctl: str, key: str) -> int:
        if ctl not in self.fds:
            return -1
        mode = os.O_RDONLY if key == "memory.oom_control" else os.O_RDWR
        return os.open(key, mode, dir_fd=self.fds[ctl])

    def begin_run(self) -> None:
        """Zero the counters for the run about to start (before its program runs user code)."""
        if self._usage >= 0:
            os.pwrite(self._usage, b"0", 0)
        self._ooms_before = self._oom_kills()

    def limit(self, memory_bytes: int) -> None:
        if self._limit >= 0:
            os.pwrite(self._limit, str(memory_bytes).encode(), 0)

    def check(self, pid: int, memory_bytes: int) -> str | None:
        """Why the run of program ``pid`` would not be held to ``memory_bytes`` (None: it
        would). Asked before the program runs any user code, as the limit does not follow
        from anything else: the program joins the slot's cgroups by itself, in the zygote's
        fork, writing into descriptors the zygote opened, while this process writes the
        limit into the cgroup it opened by path. A program that ended up in some other
        cgroup (an attach that failed or went elsewhere, a slot's directory made again
        under it), or a slot whose memory controller could not be opened here, ran with
        no memory limit but the per-process RLIMIT_AS, and no error: six children held
        240 MB under a 72 MB budget. (Its children inherit its cgroup, and it can no longer
        leave it: it is unprivileged from here on, in a jail with no ``/sys``.)"""
        missing = sorted(self.expected - set(self.fds))
        if missing:
            return f"its {', '.join(missing)} cgroup could not be opened"
        if self._limit < 0:
            return None  # no memory controller on this machine: rlimits alone, said at start
        limit = int(os.pread(self._limit, 64, 0))
        if limit > memory_bytes:  # the kernel rounds down to a page
            return f"memory.limit_in_bytes is {limit}, not {memory_bytes}"
        # opened afresh: cgroup v1 keeps a descriptor's pid list for a second after each
        # read, and one kept open read a run's program as its predecessor's list
        fd = os.open("cgroup.procs", os.O_RDONLY, dir_fd=self.fds["memory"])
        try:
            members = os.read(fd, 1 << 20).split()
        finally:
            os.close(fd)
        if str(pid).encode() not in members:
            return f"its program (pid {pid}) is not in its memory cgroup"
        return None

    def cpu_ns(self) -> int | None:
        return int(os.pread(self._usage, 64, 0)) if self._usage >= 0 else None

    def _oom_kills(self) -> int:
        if self._oom < 0:
            return 0
        for line in os.pread(self._oom, 4096, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def oom_killed(self) -> bool:
        return self._oom_kills() > self._ooms_before


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
