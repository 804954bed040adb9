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
the mark. A sweep costs a scan of ``/proc`` (one read per process of the machine: ~27 ms at
5,000 processes), so a runtime's sweeps go through :class:`Sweeps`: off its event loop, one at
a time, the stops under way together in one scan."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Collection, Iterator
from pathlib import Path

__all__ = ["MARK", "PLACEHOLDER", "Sweeps", "mark_self", "marked", "sweep", "token"]

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
            env = _read(entry.name, "environ")
            if not env and _in_exec(entry.name):
                env = _after_exec(entry.name)
        except OSError:  # gone meanwhile, or another user's: not ours to read (nor to kill)
            continue
        if not wanted.isdisjoint(env.split(b"\0")):
            found.append(int(entry.name))
    return found


def _read(pid: str, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


_PF_KTHREAD = 0x00200000
EXEC_WAIT_S = 0.5
"""How long a scan waits for a process caught inside its ``execve`` to show its environment."""


def _in_exec(pid: str) -> bool:
    """Whether a process whose environment reads empty is inside its ``execve``: past the
    switch to its new memory, before its arguments and environment are laid out there (both
    read empty until then). ``Popen`` returns its pid in that window (its error pipe closes
    at the switch), so a helper an environment started just before its container's stop was
    missed by the sweep if the scan came while the exec was descheduled (a loaded machine),
    and ran on under init. Not a kernel thread (both empty for ever), a zombie or a process
    exiting (its memory gone), nor one started with no environment (its command line shows)."""
    fields = _read(pid, "stat").rpartition(b")")[2].split()
    if fields[0] in (b"Z", b"X", b"x") or int(fields[6]) & _PF_KTHREAD:
        return False
    return not _read(pid, "cmdline")


def _after_exec(pid: str) -> bytes:
    """The environment of a process inside its ``execve`` once it shows (``_in_exec``), or
    empty if it does not within ``EXEC_WAIT_S`` (it exited, or was never exec-ing)."""
    deadline = time.monotonic() + EXEC_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.001)
        env = _read(pid, "environ")
        if env or not _in_exec(pid):
            return env
    return b""


_ONE_AT_A_TIME = threading.RLock()
"""Held by a sweep: where no pidfd can be had a process is killed by pid, and a sweep of the
same mark at once (a runtime's and the orphan reaper's) could kill the process that was given
the pid of one the other killed. Reentrant: a signal handler's sweep (the zygote's end, on
SIGTERM) may interrupt one of its own thread, which would never release it."""


def sweep(tokens: Collection[str]) -> None:
    """SIGKILL every process marked with any of ``tokens`` (blocking: a scan of ``/proc``, or
    a few if it finds some), after any other sweep of this process has ended."""
    if tokens:
        # imported here: a runtime's import does not load the built-in environments' package
        from envpool.envs.code_repair_kill import stop_and_kill

        with _ONE_AT_A_TIME:
            stop_and_kill(lambda: marked(tokens))


GATHER_S = 2.0
"""How long a sweep waits for the stops killing their containers' groups as it starts (a few ms
each) to join it: it bounds one that hangs, whose neighbours' sweeps would wait on it."""


class Sweeps:
    """A runtime's sweeps, on its event loop: each runs in a thread (the loop, and a zygote's
    forks, go on meanwhile), one at a time; the marks asked for while one runs are swept by the
    next, all together (one scan of ``/proc`` where it finds nothing). It starts once the stops
    killing their containers' groups as it was asked for (``killing``) have ended, or
    ``GATHER_S`` has passed: a close that stops N containers sweeps once, not N times. A stop
    that begins meanwhile joins the next sweep, not this one's wait."""

    def __init__(self) -> None:
        self._killing: set[asyncio.Future[None]] = set()
        """One per stop killing its container's group, resolved as its kill ends."""
        self._next: set[str] = set()
        self._done: asyncio.Future[None] | None = None
        """Resolved when the sweep of ``_next`` has ended."""
        self._worker: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def killing(self) -> Iterator[None]:
        """Around a stop's kill of its container's group: its sweep, asked for next, joins
        the one the others are about to start."""
        kill: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._killing.add(kill)
        try:
            yield
        finally:
            self._killing.discard(kill)
            kill.set_result(None)

    def ask(self, marks: Collection[str]) -> asyncio.Future[None]:
        """Have every process marked with one of ``marks`` killed; the future resolves once
        they are (asked for now, in this step, so a sweep that starts later includes them)."""
        loop = asyncio.get_running_loop()
        if not marks:
            done = loop.create_future()
            done.set_result(None)
            return done
        self._next.update(marks)
        if self._done is None:
            self._done = loop.create_future()
            # read whoever waits: a caller cancelled meanwhile leaves a failure unread
            self._done.add_done_callback(lambda f: f.cancelled() or f.exception())
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._run())
        return self._done

    async def sweep(self, marks: Collection[str]) -> None:
        """``ask``, and wait for it (a cancelled caller does not interrupt it)."""
        await asyncio.shield(self.ask(marks))

    async def _run(self) -> None:
        done: asyncio.Future[None] | None = None
        try:
            while self._next:
                # the stops under way now, not any that begin meanwhile (they join the next
                # sweep): waiting until none was killing, a sweep under a churn of overlapping
                # stops waited its whole GATHER_S, and every stop with it
                under_way = set(self._killing)
                if under_way:
                    await asyncio.wait(under_way, timeout=GATHER_S)
                marks, done = self._next, self._done
                self._next, self._done = set(), None
                assert done is not None
                try:
                    await asyncio.to_thread(sweep, marks)
                except Exception as e:
                    done.set_exception(e)
                else:
                    done.set_result(None)
                done = None
        finally:  # cancelled (the loop is ending): its callers hear of it, and a later ask starts anew
            # an error, not the worker's cancellation: a caller that nothing cancelled (a stop
            # begun in the loop's teardown) would take a CancelledError for its own, and so
            # would everything that awaits it
            for f in (done, self._done):
                if f is not None and not f.done():
                    f.set_exception(
                        RuntimeError(
                            "the sweep of what containers started outside their groups was "
                            "cancelled before it ended (its event loop is ending): what bears "
                            "their marks may still run, left to the runtime's exit backstop"
                        )
                    )
            if self._done is not None and self._done.done():
                self._next, self._done = set(), None

    async def wait(self) -> None:
        """Until the sweeps asked for have ended."""
        while self._worker is not None and not self._worker.done():
            await asyncio.wait((self._worker,))
