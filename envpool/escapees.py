"""What a container started outside its process group, found by a mark in its environment.

A container is stopped by killing its process group, but an environment may start a helper
in a session of its own (``Popen(start_new_session=True)``; a database or a browser that
daemonizes with setsid), which no group kill reaches and which would run on, owned by init.
So every container's processes carry ``ENVPOOL_CONTAINER=<token>`` in their environment
(set before the environment's code runs, inherited by all it starts, across fork and exec),
and a stop ends with a sweep: every process whose ``/proc/<pid>/environ`` holds the token
is stopped and killed (:func:`envpool.envs.code_repair_kill.stop_and_kill`: each pinned by
a pidfd and listed again before its signal, so a pid passed on meanwhile to another process
is never signalled; the caller itself is never listed).

Why a mark, not the alternatives: a cgroup per container (``cgroup.kill``) needs cgroup v2
delegated to us (root, or a systemd delegation), absent on many hosts and for most users,
so it would need this fallback anyway; a walk of the container's process tree misses what
was reparented to init (a double fork) once its parent has gone; making each container a
child subreaper keeps the tree whole but leaves it zombies to reap behind the environment's
own ``Popen`` objects. The environment needs nothing but ``/proc``, readable for processes of
one's own user (all of them as root).

Its limits: a process that clears or replaces its environment at exec (``env={}``, ``env -i``)
or changes its user (its environment is no longer ours to read, unless we are root) escapes
the mark. Every stop costs a scan of ``/proc`` (one read per process of the machine)."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Collection
from pathlib import Path

__all__ = ["MARK", "PLACEHOLDER", "mark_self", "marked", "sweep", "token"]

MARK = "ENVPOOL_CONTAINER"
_WIDTH = 32
PLACEHOLDER = "-" * _WIDTH
"""The zygote's own value, overwritten in place in each child (no token has a dash)."""


def token(cdir: Path) -> str:
    """A container's mark, from its directory (unique while its runtime lives): known to
    whoever stops it without more bookkeeping, and of a fixed width (``mark_self``)."""
    return hashlib.sha256(os.fsencode(cdir)).hexdigest()[:_WIDTH]


def mark_self(tok: str) -> None:
    """Mark this process (a container the zygote forked) with ``tok``, for all it starts.

    ``os.environ`` reaches what it execs, not ``/proc/self/environ``: that shows the
    environment block the process was exec'd with, inherited as is by every fork, so a child
    it forks (a daemon forked without exec, or one caught between its fork and its exec)
    would show the zygote's. The zygote was started with ``PLACEHOLDER`` as the mark's value,
    of the width of a token: it is overwritten where it lies, in this process's own memory.
    Where that fails (no ``/proc``), what it execs is marked all the same."""
    os.environ[MARK] = tok
    entry = f"{MARK}={PLACEHOLDER}\0".encode()
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50, 51
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            at = (b"\0" + mem.read(end - start)).find(b"\0" + entry)
            if at >= 0:
                mem.seek(start + at + len(MARK) + 1)
                mem.write(tok.encode())


def marked(tokens: Collection[str]) -> list[int]:
    """The pids of the processes marked with any of ``tokens``, the caller never."""
    wanted = {f"{MARK}={t}".encode() for t in tokens}
    me = os.getpid()
    found: list[int] = []
    try:
        entries = list(os.scandir("/proc"))
    except OSError:  # no /proc (not Linux): nothing to find
        return found
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
        except OSError:  # gone meanwhile, or another user's: not ours to read (nor to kill)
            continue
        if not wanted.isdisjoint(env.split(b"\0")):
            found.append(int(entry.name))
    return found


def sweep(tokens: Collection[str]) -> None:
    """SIGKILL every process marked with any of ``tokens`` (blocking: a scan of ``/proc``)."""
    if tokens:
        # imported here: a runtime's import does not load the built-in environments' package
        from envpool.envs.code_repair_kill import stop_and_kill

        stop_and_kill(lambda: marked(tokens))
