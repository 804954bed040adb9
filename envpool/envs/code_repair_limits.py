"""The limits of a ``code-repair-v1`` test run besides its timeout, CPU and file size: its
memory (``RLIMIT_AS`` on each of its processes, and a memory cgroup of its own on all of them
together, where one can be made), and how many processes and threads it may have at once (a
pids cgroup of its own, where one can be made).

Why these: the policy's module runs in the container beside the server. A module that
allocates without end took the container's memory (the server died with it, or the kernel's
OOM killer picked a neighbour), and one that forked without end took the container's pids
(or the node's). ``RLIMIT_AS`` alone bounds each process, not the run: 60 forked children of
1 GiB each were 60 GiB. The memory cgroup bounds their sum (what they touch, the page cache
and a tmpfs's files they write included) at the same ``memory_limit_bytes``; ``RLIMIT_AS``
stays, as a process that asks for more than that gets a ``MemoryError`` it can report, which
says more than the kernel's OOM kill the cgroup answers with. ``RLIMIT_NPROC`` would not do
for the forks: it does not bind root (a container's usual user), and it counts every process
of the user, the server's included. A pids cgroup counts the run's processes only, binds
root, and the member list of either cgroup finds every process the run started, wherever it
moved (a daemon in a session of its own whose run killed its keeper, say).

Where no cgroup can be made (a read-only ``/sys/fs/cgroup``; not Linux; cgroup v2 for the
pids cgroup, and for the memory cgroup one whose server's cgroup does not hand the memory
controller to its children: v2's rules forbid a child cgroup with controllers under one that
holds processes, as the server's does, so in a container only a server in the hierarchy's
root gets one; cgroup v1 whose server's memory cgroup has ``memory.use_hierarchy`` 0, older
kernels, where a run's cgroup would not count toward the container's limit) a run has each
process's ``RLIMIT_AS`` and no cap on its processes or its total: it still ends at its
timeout with everything it started (``kill_tree``, the PID namespace), and what it takes
meanwhile is bounded by the container's own limits (``docker run --memory --pids-limit``, a
pod's), which a deployment should set.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import time
import uuid
from pathlib import Path, PurePosixPath

from envpool.envs.code_repair_kill import stop_and_kill

__all__ = [
    "DEFAULT_MAX_PROCESSES",
    "DEFAULT_MEMORY_BYTES",
    "MIN_MAX_PROCESSES",
    "MIN_MEMORY_BYTES",
    "MemoryCgroup",
    "PidsCgroup",
    "describe_bytes",
    "memory_cgroup_available",
    "pids_cgroup_available",
    "set_memory_limit",
]

DEFAULT_MEMORY_BYTES = 2**30
"""The memory of a run: ``RLIMIT_AS`` of each of its processes (an allocation past it is a
``MemoryError``) and, where a memory cgroup can be made, the memory of all of them together
(past it the kernel's OOM killer kills one, and the run is ended)."""
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


def _mounts_and_groups() -> tuple[list[str], list[str]] | None:
    try:
        return (
            Path("/proc/self/mountinfo").read_text().splitlines(),
            Path("/proc/self/cgroup").read_text().splitlines(),
        )
    except OSError:
        return None


def _under(mount: str, root: str, path: str) -> Path | None:
    """Where the cgroup ``path`` (as ``/proc/self/cgroup`` names it, from the hierarchy's
    root) is, under a mount of the hierarchy's subtree ``root`` (mountinfo's fourth field: not
    "/" in a container that shares the host's cgroup namespace, where the container's own
    cgroup is what is mounted); None where it is outside what is mounted."""
    if not (path.startswith("/") and root.startswith("/")):
        return None  # (never so in /proc: not a cgroup path to trust)
    rel = PurePosixPath(path).relative_to("/")
    base = PurePosixPath(root).relative_to("/")
    if base.parts != rel.parts[: len(base.parts)]:
        return None
    return Path(mount).joinpath(*rel.parts[len(base.parts) :])


def _own_cgroup(fstype: str, controller: str | None) -> Path | None:
    """This process's cgroup, where a child can be made, in the first hierarchy mounted with
    filesystem type ``fstype``: cgroup v1's ("cgroup") that holds ``controller``, or cgroup
    v2's ("cgroup2", ``controller`` None: the one hierarchy, numbered 0 in /proc/self/cgroup).
    None where no such hierarchy is mounted, or this process's cgroup is outside the mount."""
    found = _mounts_and_groups()
    if found is None:
        return None
    mounts, groups = found
    for line in mounts:
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or not tail or tail[0] != fstype:
            continue
        if controller is not None and (len(tail) < 3 or controller not in tail[2].split(",")):
            continue  # (its super options, tail[2], name v1's controllers)
        root, mount = fields[3], fields[4]
        break
    else:
        return None
    for line in groups:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" if controller is None else controller in controllers.split(","):
            return _under(mount, root, path)
    return None


def _v1_parent(controller: str) -> Path | None:
    """This process's cgroup in cgroup v1's ``controller`` hierarchy, where a child can be made."""
    return _own_cgroup("cgroup", controller)


def _v2_parent() -> Path | None:
    """This process's cgroup in the cgroup v2 hierarchy, if one is mounted."""
    return _own_cgroup("cgroup2", None)


def _pids_parent() -> Path | None:
    """Where a run's pids cgroup is made: v1's pids hierarchy (see the module's docstring)."""
    return _v1_parent("pids")


def _memory_parent() -> tuple[Path, int] | None:
    """Where a run's memory cgroup is made, and the cgroup version: v1's memory hierarchy
    (None there where the server's cgroup does not count its children's memory), else v2's (a
    child there has the memory controller only where the server's cgroup hands it down, which
    ``MemoryCgroup.make`` checks)."""
    v1 = _v1_parent("memory")
    if v1 is not None:
        # None where the server's cgroup keeps use_hierarchy 0 (cgroup v1 of older kernels;
        # 1 always since 5.11): there a child's charges stop at the child, not counted toward
        # the container's memory limit, so a run moved into one would escape it (each run
        # could take its own memory_limit_bytes on top of the container's: the node's memory).
        # The run stays in the server's cgroup, under the container's limit, with RLIMIT_AS.
        # (Only a 0 refuses: a file absent or unreadable leaves the writes in ``make`` to tell.
        # The hierarchy's root, no limit to escape, is refused too: in a cgroup namespace a
        # container's own cgroup reads as "/" as well, so the two cannot be told apart.)
        with contextlib.suppress(OSError):
            if (v1 / "memory.use_hierarchy").read_text().strip() == "0":
                return None
        return v1, 1
    v2 = _v2_parent()
    return None if v2 is None else (v2, 2)


def pids_cgroup_available() -> bool:
    """Whether runs here get a process cap (a pids cgroup of their own can be made)."""
    probe = PidsCgroup.make(MIN_MAX_PROCESSES)
    if probe is None:
        return False
    probe.remove()
    return True


def memory_cgroup_available() -> bool:
    """Whether runs here get a cap on their total memory (a memory cgroup of their own)."""
    probe = MemoryCgroup.make(MIN_MEMORY_BYTES)
    if probe is None:
        return False
    probe.remove()
    return True


_PREFIX = "envpool-run-"


def _pid_namespace() -> str:
    """This process's PID namespace (its inode), so that a sweep judges only owners whose
    pids it can see: a pid of another namespace reads as dead here."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def owner_prefix(pid: int) -> str:
    """The start of the names of the run cgroups of the server ``pid`` (of this PID
    namespace): ``envpool-run-NS-PID-``."""
    return f"{_PREFIX}{_pid_namespace()}-{pid}-"


_OLD_NAME = re.compile(r"envpool-run-([1-9][0-9]{0,6})-[0-9a-f]{12}")
"""The names the code before the PID namespace was in them gave a run cgroup
(``envpool-run-PID-`` and 12 hex digits of a uuid4): a host upgraded in place may still hold
some, which the sweep takes too (see ``_sweep``). Exactly that: anything else is not ours."""
_PID_MAX = 2**22
"""The kernel's highest pid (``PID_MAX_LIMIT`` on 64-bit)."""


def _owner(name: str) -> tuple[int, bool] | None:
    """The server pid a run cgroup named ``name`` is of, and whether the name is of the old
    naming (no PID namespace in it); None where it is no run cgroup of ours to judge: not
    ours, of another PID namespace, or no pid at all."""
    old = _OLD_NAME.fullmatch(name)
    if old is not None:
        pid = int(old[1])
        return (pid, True) if pid <= _PID_MAX else None
    ns, owner, rest = [*name.removeprefix(_PREFIX).split("-", 2), "", ""][:3]
    if (
        not name.startswith(_PREFIX)
        or ns != _pid_namespace()  # another namespace's: its owner is not ours to see
        or not (owner.isascii() and owner.isdigit())  # (isdigit alone takes "١٢" and "²")
        or not rest
        or int(owner) > _PID_MAX  # no pid at all (another naming's)
    ):
        return None
    return int(owner), False


def _of_this_namespace(pids: list[int]) -> bool:
    """Whether each of ``pids`` (gone meanwhile, or) is of this process's PID namespace."""
    ours = _pid_namespace()
    for pid in pids:
        if pid <= 0:  # (cgroup v2 lists a member of a namespace this one cannot see as 0)
            return False
        try:
            if str(os.stat(f"/proc/{pid}/ns/pid").st_ino) != ours:
                return False
        except FileNotFoundError:
            continue  # gone meanwhile
        except OSError:
            return False  # not ours to read: not ours to judge
    return True


def _sweep(parent: Path) -> None:
    """Remove the cgroups of runs whose server died mid-run (killed with its container:
    its own cleanup never ran), with what is left in them: most often nothing (the
    container's kill took it), but a server killed alone left what its run set running
    outside its tree (no PID namespace: a daemon in a session of its own) alive there, and
    its cgroup with it. One of a live server stays.

    The old naming (``_OLD_NAME``: no namespace in it) says nothing of whose namespace its
    pid is of: a pid dead here may be a live server of another namespace under the same
    cgroup. Such a cgroup is emptied only where all it holds is of this namespace (which is
    what a server of this namespace left: a run in a PID namespace of its own ends with its
    keeper); an empty one is only removed (an rmdir, which fails once a process is in)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            found = _owner(entry.name)
            if found is None or found[0] == os.getpid():
                continue
            owner, old = found
            try:
                os.kill(owner, 0)
                continue  # its server is alive (or the pid was reused: swept later)
            except ProcessLookupError:
                pass  # its server is gone: the cgroup is a leftover, swept below
            except OSError:
                continue  # not ours to judge
            cgroup = _RunCgroup(Path(entry.path))
            if old:
                members = cgroup._members()
                if not members:
                    with contextlib.suppress(OSError):
                        os.rmdir(entry.path)
                    continue
                if not _of_this_namespace(members):
                    continue
            # (briefly: one that will not go, a process stuck in the kernel, is tried again
            # at the next run rather than hold up every run for long)
            cgroup.remove(wait_s=0.2)


def _write(path: Path, text: str) -> None:
    """Write a cgroup's control file, never creating one: a plain directory taken for a
    cgroup (a lookup gone wrong) fails here rather than pass for a limit."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _counters(path: Path) -> dict[str, int]:
    """``key value`` lines (``pids.events``, ``memory.oom_control``, ``memory.events``); {}
    where the cgroup is gone or unreadable (then nothing is on record)."""
    found: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return found  # gone or unreadable: nothing on record
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        with contextlib.suppress(ValueError):
            found[key] = int(value)
    return found


def _number(path: Path) -> int:
    """A control file of one number; 0 where it is absent or unreadable."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0


class _RunCgroup:
    """A cgroup of one test run, made fresh under this process's own and removed after."""

    def __init__(self, path: Path):
        self.path = path

    @classmethod
    def _make_under(cls, parent: Path | None) -> Path | None:
        if parent is None:
            return None
        _sweep(parent)
        path = parent / f"{owner_prefix(os.getpid())}{uuid.uuid4().hex[:12]}"
        try:
            path.mkdir()
        except OSError:
            return None
        return path

    def add(self, pid: int) -> bool:
        """Move ``pid`` in (before it forks: what it starts later is born inside)."""
        try:
            _write(self.path / "cgroup.procs", str(pid))
        except OSError:
            return False
        return True

    def _members(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self) -> None:
        """SIGKILL every process in it, each stopped first so none forks past the scan (a
        process that left its tree, reparented to the container's init, is still here), and
        each pinned by a pidfd, as the init reaps what it adopts at once (``stop_and_kill``).
        Never pid 0, which cgroup v2 lists for a member this PID namespace cannot see: a kill
        of 0 is one of this process's own group, the server's."""
        stop_and_kill(self._members)

    def remove(self, wait_s: float = 2.0) -> None:
        """Kill what is left in it, and remove it once its processes are gone (a SIGKILL
        lands when each is next scheduled: a wait of at most ``wait_s``)."""
        self.kill_all()
        deadline = time.monotonic() + wait_s
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


class PidsCgroup(_RunCgroup):
    """A pids cgroup of one test run: ``pids.max`` caps its processes and threads at once;
    a fork or a thread start past it fails (``EAGAIN``), which ``pids.events`` counts."""

    @classmethod
    def make(cls, max_tasks: int) -> PidsCgroup | None:
        """A fresh one capped at ``max_tasks``, or None where none can be made."""
        path = cls._make_under(_pids_parent())
        if path is None:
            return None
        cg = cls(path)
        try:
            _write(path / "pids.max", str(max_tasks))
        except OSError:
            cg.remove()
            return None
        return cg

    def hit_limit(self) -> bool:
        """Whether a fork or a thread start was refused for the cap."""
        return _counters(self.path / "pids.events").get("max", 0) > 0


class MemoryCgroup(_RunCgroup):
    """A memory cgroup of one test run: the memory its processes use together (what they
    touch, the page cache and tmpfs files they write, the kernel's memory on their behalf) is
    capped; past the cap, and past what the kernel can reclaim, its OOM killer kills one of
    them (never a process outside), which ``oom_killed`` reads and ``oom_eventfd`` tells at
    once. Swap is capped with it, so that the cap is not a slow spill to disk."""

    def __init__(self, path: Path, version: int):
        super().__init__(path)
        self.version = version

    @classmethod
    def make(cls, limit_bytes: int) -> MemoryCgroup | None:
        """A fresh one capped at ``limit_bytes``, or None where none can be made."""
        found = _memory_parent()
        if found is None:
            return None
        parent, version = found
        path = cls._make_under(parent)
        if path is None:
            return None
        cg = cls(path, version)
        try:
            if version == 1:
                _write(path / "memory.limit_in_bytes", str(limit_bytes))
                # memory and swap together; absent where swap accounting is off (no swap to cap)
                if (path / "memory.memsw.limit_in_bytes").exists():
                    _write(path / "memory.memsw.limit_in_bytes", str(limit_bytes))
            else:
                # a v2 child has memory.max only where its parent hands the controller down
                _write(path / "memory.max", str(limit_bytes))
                if (path / "memory.swap.max").exists():
                    _write(path / "memory.swap.max", "0")
                # the OOM killer takes the whole run, not its biggest process
                if (path / "memory.oom.group").exists():
                    _write(path / "memory.oom.group", "1")
        except OSError:
            cg.remove()
            return None
        return cg

    def oom_killed(self, within_s: float = 0.0) -> bool:
        """Whether the kernel's OOM killer killed a process of it (for the cap, or for the
        container's memory where the victim was one of the run's); waits up to ``within_s``
        for the kill to be counted."""
        counters = self.path / ("memory.oom_control" if self.version == 1 else "memory.events")
        deadline = time.monotonic() + within_s
        while _counters(counters).get("oom_kill", 0) == 0:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def limit_reached(self) -> bool:
        """Whether its processes together reached its own cap (a charge failed at it), as
        against a kill for the memory of a cgroup above it (the container's)."""
        if self.version == 1:
            # a failcnt, where the kernel keeps it (some leave it 0), else the high-water mark
            # at the cap (as the kernel rounded it: to pages)
            for kind in ("memory", "memory.memsw"):
                if _number(self.path / f"{kind}.failcnt") > 0:
                    return True
                limit = _number(self.path / f"{kind}.limit_in_bytes")
                if limit > 0 and _number(self.path / f"{kind}.max_usage_in_bytes") >= limit:
                    return True
            return False
        return _counters(self.path / "memory.events").get("max", 0) > 0

    def oom_eventfd(self) -> int | None:
        """An eventfd (the caller closes it and reads it to reset it) that turns readable
        when the run runs out of memory (or a cgroup above it does: then ``oom_killed`` tells
        whether the kill was the run's), so that the run is ended then rather than at its
        timeout (the OOM killer took one process; the others may wait on it for good); None
        where there is none (cgroup v2: ``memory.oom.group`` ends the whole run, its keeper
        included, by itself)."""
        if self.version != 1:
            return None
        try:
            efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except (AttributeError, OSError):
            return None
        try:
            control = os.open(self.path / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            os.close(efd)
            return None
        try:
            _write(self.path / "cgroup.event_control", f"{efd} {control}")
        except OSError:
            os.close(efd)
            return None
        finally:
            os.close(control)  # the kernel holds its own reference
        return efd
