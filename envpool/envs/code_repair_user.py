"""The user a ``code-repair-v1`` test run's module runs as: where the env process is root, an
unprivileged uid of the run's own, with a group of its own and no supplementary groups.

Why: the module is the policy's code. Run as root (a container's usual user, and the
``process`` runtime's on a machine where the server runs as root, with no container around
it), it could write its own cgroups' limits (``pids.max`` to ``max``, then fork past
``max_processes``), move itself out of them, write any root-owned file and signal or
``ptrace`` the env process. As a uid of its own it can do none of that: cgroupfs and root's
files are root's, and a process may signal or trace only processes of its own uid.

Which uid: ``run_uid_base + the keeper's pid`` (the keeper is the run's first process, in the
env process's PID namespace; ``RUNNER``). A live pid is unique in its namespace, so two runs
alive at once never share a uid, whichever env, server or tenant started them, and without
any lock or registry: where a run has no PID namespace of its own (no ``CAP_SYS_ADMIN``, or
the fallback), runs under one uid could signal each other, which this rules out (runs in
other PID namespaces, another container's, cannot see each other's pids anyway). Pids stay
below ``RUN_UID_SPAN`` (the kernel's ``PID_MAX_LIMIT``, 2**22), so a run's uid lies in
``[run_uid_base, run_uid_base + 2**22)``. The default base, 1_900_000_000, is far from real
users (below 65536, or an LDAP's few millions), from the code verifier's sandbox
(``functions/verifiers/sandbox.py``: 200_000 .. 201_023 by default, the tests' ranges up to
about 510_000), from systemd's container ranges (524288 .. 1879048191) and below 2**31, which
some tools read as a negative uid. A uid need not exist in ``/etc/passwd`` to be set.

Where the env process is root but cannot take that uid (no ``CAP_SETUID``; a user namespace
whose map lacks it), a run refuses to start (``EnvUsageError``, saying to pass a
``run_uid_base`` inside the map, or ``None``): never the module silently as root.
``run_uid_base=None`` runs the module as the env process's user, the old behaviour, for a
deployment whose container is itself the sandbox. A non-root env process cannot change its
uid: its runs run as it, as before.

The work dir is handed to the run's uid before each run (``hand_over``): the module reads its
files and writes what it likes there, as before; the env process (root) reads and restores
them whatever their owner. Once the run has ended the work dir's top is root's again, mode 0700
(``take_back``): a run's uid is its own only while the run lives (a later run, of any env,
whose first process gets the same pid takes the same uid), and what the old uid left in the
work dir must not be that one's to read or change. ``hand_over`` walks at most ``MAX_HANDED``
entries, ``MAX_DEPTH`` deep: what a module left beyond stays its old uid's, out of every run's
reach but root's. What else a run relies on: ``/dev/shm`` (its own tmpfs, mode 1777,
or the container's) and ``/tmp`` are every user's; ``HOME`` is the work dir; ``TMPDIR`` is not
set. The runner reaches the work dir by its cwd, should a dir above it be root's alone (a
``workdir_root`` under pytest's ``/tmp/pytest-of-root``); but the module's own use of an
absolute path there (``tempfile``'s, ``os.path.abspath``) fails then, as does a file it writes
outside its work dir where its uid may not, and '..' from its cwd reaches what lies below that
root-only dir (other tests' dirs, there): give ``workdir_root`` dirs above it that every user
may search and that hold nothing else (``/tmp``, the default, is so). The interpreter's
library, where a dir above it is root's alone (a pyenv under ``/root``), is bind-mounted by the
runner, as root, on ``/dev/shm/.envpool-lib/<n>`` in the run's own mount namespace and tmpfs,
and ``sys.path`` points there: never an fd or a ``/proc/self/fd`` path to it, from which '..'
climbs to all that the root-only dir holds below it (``/root/.pyenv``, a project's files
beside its venv). A root without ``CAP_SYS_ADMIN`` cannot mount it, and refuses the run then
(install Python where every user may read it).

What this does not cover (limits): the module writes the results file and the done fd it
inherits, so it can forge results (which pass only with the right values: answers fitted to
the visible tests, as ``code_repair`` says). Its process is dumpable again after the change
of uid, as it is under a non-root env: ``/proc/self`` is its own, and only processes of its
uid (its run's) may trace it; a crash writes a core file (``kernel.core_pattern`` a plain
name) into its work dir as its uid, up to the ``RLIMIT_CORE`` it inherits, like the files it
may write (16 MiB each, no bound on their number): no disk quota binds a run, so give the
server ``ulimit -c 0`` and a ``workdir_root`` on a file system of its own where that matters.
Where a run has no PID and mount namespace of its own (``RUNNER``), ``/proc`` is the
container's: the module sees every process of the server's PID namespace and its command line
(not its environment, fds or memory, which are root's): keep secrets off command lines, or
mount ``/proc`` with ``hidepid=2``. Uids are unique among the live runs of
one PID namespace: servers in two (two containers of the host's root, with one user
namespace and the same base) can give two live runs one uid; neither sees the other's pids,
but a file system both mount (a shared ``workdir_root``, the host's ``/dev/shm``) is open
between them: give each its own ``run_uid_base`` (``RUN_UID_SPAN`` apart). Nothing of a run
outlives it (its PID namespace, or the keeper's tree and cgroups, and the kills after every
run), but where the env process itself is killed (SIGKILL) without a PID namespace, what the
module forked loses its keeper and lives on, as the uid that still owns the work dir: the
container's kill is what takes it then.
"""

from __future__ import annotations

import contextlib
import functools
import grp
import os
import pwd
import stat
from pathlib import Path

__all__ = [
    "DEFAULT_RUN_UID_BASE",
    "MAX_DEPTH",
    "MAX_HANDED",
    "RUN_UID_SPAN",
    "check_run_uid_base",
    "hand_over",
    "remove_tree",
    "run_uid_base_for",
    "take_back",
]

DEFAULT_RUN_UID_BASE = 1_900_000_000
RUN_UID_SPAN = 2**22
"""A run's uid is the base plus its keeper's pid, which is below the kernel's PID_MAX_LIMIT."""
_MIN_BASE = 1000
_MAX_UID = 2**31 - 1  # (above, some tools read a uid as negative)


def check_run_uid_base(base: object) -> int | None:
    """``base`` as validated for ``CodeRepairEnv(run_uid_base=...)``, or ValueError."""
    if base is None:
        return None
    if type(base) is not int or not _MIN_BASE <= base <= _MAX_UID - RUN_UID_SPAN + 1:
        raise ValueError(
            f"run_uid_base must be None (run the module as this process's user) or an int from "
            f"{_MIN_BASE} to {_MAX_UID - RUN_UID_SPAN + 1}: runs take uids base .. base + "
            f"{RUN_UID_SPAN - 1} (base + the pid of the run's first process), which should be "
            f"no real user's; got {base!r}"
        )
    taken = _named_ids_in(base, base + RUN_UID_SPAN - 1)
    if taken:
        raise ValueError(
            f"run_uid_base {base} gives runs uids {base} .. {base + RUN_UID_SPAN - 1}, which hold "
            f"{', '.join(taken[:3])}{' and more' if len(taken) > 3 else ''}: a run taking one would "
            f"be that user or group and reach what is theirs; pick a base above every uid and gid "
            f"in use (the default, {DEFAULT_RUN_UID_BASE}, is)"
        )
    return base


@functools.cache
def _named_ids_in(lo: int, hi: int) -> list[str]:
    """The users and groups of this host's databases (``/etc/passwd``, ``/etc/group``, or
    what NSS serves) whose id lies in ``lo .. hi``: a base from ``_MIN_BASE`` passes the range
    check, yet may reach real users (1000 up, ``nobody`` at 65534). Read once per range (an
    NSS that enumerates a directory service is slow; envs are made per container)."""
    found = [f"user {u.pw_name!r} (uid {u.pw_uid})" for u in pwd.getpwall() if lo <= u.pw_uid <= hi]
    return found + [f"group {g.gr_name!r} (gid {g.gr_gid})" for g in grp.getgrall() if lo <= g.gr_gid <= hi]


def run_uid_base_for(base: int | None) -> int | None:
    """The base a run takes its uid from here: None where no uid is dropped (a base of None,
    or an env process that is not root, which cannot change its uid)."""
    return base if base is not None and os.geteuid() == 0 else None


MAX_HANDED = 100_000
"""Entries of the work dir handed to a run at most (an honest module makes a few): a module
that made millions would slow every later run's start, its own episode's."""
MAX_DEPTH = 64
"""Dirs below this depth of the work dir are not handed over (nor walked: a tree thousands
deep broke a recursive walk). What is left is the old uid's, out of its reach (``take_back``)
and unwritable by the new: the module's own clutter."""


def hand_over(root: Path, uid: int) -> None:
    """Make ``root`` (the work dir, a directory of this process's: ``_repair_workdir``) and
    everything in it ``uid``'s (and group ``uid``'s), each readable and writable by its owner,
    so that the run's module reads its files and writes there as before (an earlier run's
    files were another uid's). Race-free against what an earlier run left there: no symlink
    is followed (each entry, dirs too, is opened with ``O_NOFOLLOW`` relative to its dir's fd
    and checked on its open file); only directories and regular files are changed, never a
    file with another link (one that may be a file outside, linked in), never a symlink's
    target. At most ``MAX_HANDED`` entries, ``MAX_DEPTH`` deep."""
    top = _take(None, str(root), uid)
    if top is not None:
        try:
            _hand_over_in(top, uid, 1, [MAX_HANDED])
        finally:
            os.close(top)


def take_back(root: Path) -> None:
    """``root`` (the work dir) this process's again, mode 0700, once a run has ended: between
    runs no uid reaches what it holds. (Its uid was the run's alone only while the run lived:
    a later run, of any env, whose first process gets the same pid takes the same uid.)"""
    with contextlib.suppress(OSError):  # the module put something else there: _repair_workdir
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchown(fd, os.geteuid(), os.getegid())
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)


def _hand_over_in(dir_fd: int, uid: int, depth: int, left: list[int]) -> None:
    with contextlib.suppress(OSError), os.scandir(dir_fd) as entries:
        for entry in entries:
            if left[0] <= 0:
                return
            left[0] -= 1
            fd = _take(dir_fd, entry.name, uid)
            if fd is not None:
                try:
                    if depth < MAX_DEPTH:
                        _hand_over_in(fd, uid, depth + 1, left)
                finally:
                    os.close(fd)


def _take(dir_fd: int | None, name: str, uid: int) -> int | None:
    """Take one entry; an fd of it where it is a directory, to walk (the caller closes it)."""
    with contextlib.suppress(OSError):  # gone meanwhile, or not a file to take: left as it is
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            return None  # (never opened: a fifo would block, a device may act)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        fd = os.open(name, flags, dir_fd=dir_fd)
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                return None  # a hard link: maybe to a file outside the work dir
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                return None
            if st.st_uid != uid or st.st_gid != uid:
                os.fchown(fd, uid, uid)
            need = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
            if st.st_mode & need != need:
                os.fchmod(fd, stat.S_IMODE(st.st_mode) | need)
            if stat.S_ISDIR(st.st_mode):
                fd, kept = -1, fd
                return kept
        finally:
            if fd >= 0:
                os.close(fd)
    return None


def remove_tree(root: Path) -> None:
    """Remove the dir ``root`` and all below it, however deep (``shutil.rmtree`` recurses, and
    a module's tree thousands deep raised ``RecursionError`` from it), never following a
    symlink: each dir found is moved up into ``root`` under a fresh name, then emptied."""
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(root)  # a symlink or a file in its place
        return
    try:
        todo: list[str] = []
        fresh = 0
        with contextlib.suppress(OSError), os.scandir(top) as entries:
            todo = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        _empty(top)
        while todo:
            name = todo.pop()
            with contextlib.suppress(OSError):
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
                try:
                    with os.scandir(fd) as entries:
                        subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
                    for sub in subdirs:
                        fresh = _unused(top, fresh)  # (the module may have made one so named)
                        moved = f".envpool-rm-{fresh}"
                        with contextlib.suppress(OSError):
                            os.rename(sub, moved, src_dir_fd=fd, dst_dir_fd=top)
                            todo.append(moved)
                    _empty(fd)
                finally:
                    os.close(fd)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def _unused(top: int, after: int) -> int:
    """The first n past ``after`` that names nothing in ``top`` as ``.envpool-rm-n``: a rename
    onto a dir the module made so would fail (or replace it), and leave the tree behind."""
    n = after + 1
    while True:
        try:
            os.stat(f".envpool-rm-{n}", dir_fd=top, follow_symlinks=False)
        except OSError:  # (FileNotFoundError: free; any other: the rename says)
            return n
        n += 1


def _empty(dir_fd: int) -> None:
    """Unlink every entry of ``dir_fd`` but its dirs."""
    names: list[str] = []
    with contextlib.suppress(OSError), os.scandir(dir_fd) as entries:
        names = [e.name for e in entries if not e.is_dir(follow_symlinks=False)]
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
