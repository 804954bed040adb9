"""The sandbox zygote: ``python -m functions.verifiers.zygote BASE_UID SPARES CGROUPS [CPUS]``.

Started once per worker with an empty environment. It imports what user programs commonly
import, builds the read-only jail and ``pivot_root``s into it, then keeps warm sandboxes
ready: for each, a fresh PID namespace whose PID 1 is a tiny exec'd init (see
``functions.verifiers.init``) and whose PID 2 is a fork of this warm interpreter, the
program, which sets up the rest itself (``functions.verifiers.program``). A fork of a warm
interpreter costs about a millisecond where starting ``python`` costs tens. It stays
single-threaded so forking it is safe, and gives every run that is in flight its own uid
(``BASE_UID + slot``) so one run's process limit or files never touch another's.

Its channel (fd 0) is one end of a ``SOCK_SEQPACKET`` pair: it says ``{"ready": ...}``
once, then sends one message per warm sandbox, ``{"slot": N}`` with the descriptors of
``program.SPARE_FDS`` (or ``{"error": ...}`` if it could not make one). The client sends
``b"u"`` for each spare it starts using (a replacement is made) and ``b"f<slot>"`` once its
supervisor is done with a slot. As the programs' parent the zygote reaps them and forwards
each one's exit status and rusage to its supervisor; a slot is free again once its
program, its init and its supervisor are all done with it.
"""

from __future__ import annotations

# What model-written programs commonly import, loaded once here and inherited by every run.
# Every import here is address space of every run's processes too, which their RLIMIT_AS
# (``memory_mb`` unless ``address_space_mb``) counts: 22 MB of a 64 MB limit as it is,
# 41 MB with ``functions.verifiers.sandbox`` (pydantic, subprocess) imported. That leaves a
# run less room but never turns its memory cgroup off (each run checks it is in force,
# ``cgroups.Slot.check``); it did make a test that counted sleeping MemoryError children
# as resident read "240 MB under a 72 MB budget".
import bisect  # noqa: F401
import collections  # noqa: F401
import contextlib
import copy  # noqa: F401
import dataclasses  # noqa: F401
import decimal  # noqa: F401
import errno
import fractions  # noqa: F401
import functools  # noqa: F401
import gc
import heapq  # noqa: F401
import itertools  # noqa: F401
import json
import math  # noqa: F401
import os
import random  # noqa: F401
import re  # noqa: F401
import resource
import selectors
import signal
import socket
import statistics  # noqa: F401
import string  # noqa: F401
import sys
import time
import typing  # noqa: F401

from functions.verifiers import _linux as lx
from functions.verifiers import jail
from functions.verifiers.cgroups import RunCgroups
from functions.verifiers.init import image as init_image
from functions.verifiers.program import SETUP_FAILED, SPARE_FDS, make_slot_namespaces, program

MAX_SLOTS = 1024
#: Each run's PID 1, the first there is: it reads a pipe its supervisor holds, and EOF ends
#: the namespace (``functions.verifiers.init``, or ``cat`` where that has no build).
INITS = (jail.INIT, "/usr/bin/cat", "/bin/cat")


class _Spares:
    """Makes warm sandboxes and hands each one's descriptors to the client, reaps their
    programs and inits, and frees a uid slot once its namespace is gone.

    The client then supervises the run itself (``functions.verifiers.supervisor``), so the
    zygote is off every run's path: it forks replacements, forwards exit statuses and
    frees uid slots.
    """

    def __init__(
        self,
        chan: socket.socket,
        base_uid: int,
        target: int,
        cgroups: RunCgroups,
        pid_ns: int,
        init: str,
        cpus: int,
    ) -> None:
        self.chan = chan
        self.pid_ns = pid_ns  # our own PID namespace, to come back to after each spare
        self.init = init
        self.cpus = cpus  # each run's cores
        self.cgroups = cgroups
        self.base_uid = base_uid
        self.target = target
        self.unused = 0  # spares the client holds and has not used yet
        self.programs: dict[int, tuple[int, int]] = {}  # program pid -> (uid slot, status pipe)
        self.inits: dict[int, int] = {}  # init pid -> uid slot
        self.alive: dict[int, int] = {}  # uid slot -> its holders: program, init, client
        self.handed: set[int] = set()  # slots whose spare the client has and is not done with
        self.free = list(range(MAX_SLOTS - 1, -1, -1))
        self.netns: dict[int, list[int]] = {}  # uid slot -> its network and UTS namespaces
        self.pidfd = os.pidfd_open(os.getpid())  # a program whose parent-death signal came late checks it
        self.null = os.open(os.devnull, os.O_RDWR)
        # where a spare's hold pipe waits while its program is forked (see ``_spare``)
        self.stash, self.stash_out = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)

    def refill(self) -> None:
        while self.unused < self.target and self.free:
            self.reap()  # first: a supervisor waiting for a status waits on us
            slot = self.free.pop()
            try:
                self._spare(slot)
            except OSError as e:  # said to the client in the spare's place
                error = {"error": f"preparing a sandbox: {type(e).__name__}: {e}"}
                if not self._send([json.dumps(error).encode()], []):
                    return
            self.unused += 1

    def _spare(self, slot: int) -> None:
        """Make one warm sandbox in uid ``slot`` and send it to the client. On a failure,
        whatever was started is killed (and reaped as usual) and nothing stays open."""
        fds: dict[str, int] = {}  # the client's ends under their SPARE_FDS names, the rest "_"
        init = pid = -1
        try:
            # in the zygote, before the fork: a child's cache would die with it
            namespaces = self._slot_namespaces(slot)
            cgroup_procs = self.cgroups.procs(slot)  # the program joins them itself
            fds["_go"], fds["go"] = os.pipe()
            fds["out"], fds["_out"] = os.pipe()
            fds["err"], fds["_err"] = os.pipe()
            ok, ok_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            fds["ok"], fds["_ok"] = ok.detach(), ok_theirs.detach()
            fds["status"], fds["_status"] = os.pipe()
            fds["_hold"], hold = os.pipe()
            stashed = False
            # the next two children are PID 1 and PID 2 of a namespace of their own
            lx.unshare(lx.CLONE_NEWPID)
            try:
                init = os.posix_spawn(
                    self.init,
                    [f"rlfabric-init-{self.base_uid}"],
                    {},
                    file_actions=[
                        (os.POSIX_SPAWN_DUP2, fds["_hold"], 0),
                        (os.POSIX_SPAWN_DUP2, self.null, 1),
                        (os.POSIX_SPAWN_DUP2, self.null, 2),
                    ],
                    setpgroup=0,  # the run's process group, which the program joins
                )
                self.inits[init] = slot
                self.alive[slot] = 1
                # the program must not inherit the write end of its init's pipe: frozen
                # before it closes what it inherited (by a tracer, say), it would keep its
                # own namespace alive after its supervisor is gone. So the end waits in a
                # socket of ours across the fork (a descriptor in flight is no one's)
                try:
                    socket.send_fds(self.stash, [b"h"], [hold])
                finally:
                    os.close(hold)
                stashed = True
                pid = os.fork()
            finally:
                if pid != 0:  # (not in the child) our later children are ours again
                    lx.setns(self.pid_ns, lx.CLONE_NEWPID)
                    if stashed:
                        fds["hold"] = socket.recv_fds(self.stash_out, 1, 1)[1][0]
            if pid == 0:
                try:
                    program(
                        self.base_uid + slot,
                        namespaces,
                        cgroup_procs,
                        self.pidfd,
                        fds["_go"],
                        fds["_out"],
                        fds["_err"],
                        fds["_ok"],
                        self.init,
                        self.cpus,
                    )
                finally:
                    os._exit(SETUP_FAILED)
            self.programs[pid] = (slot, fds.pop("_status"))
            self.alive[slot] = 2
            fds["pidfd"] = os.pidfd_open(pid)
            fds["init"] = os.pidfd_open(init)
        except BaseException:
            # killing the init ends the namespace, the program (if any) with it; both are
            # reaped as usual and the slot is freed then
            if init > 0:
                os.kill(init, signal.SIGKILL)
            else:
                self.free.append(slot)
            for fd in fds.values():
                os.close(fd)
            raise
        for name in [n for n in fds if n.startswith("_")]:  # the children's ends
            os.close(fds.pop(name))
        ours = [fds[name] for name in SPARE_FDS]
        sent = self._send([json.dumps({"slot": slot}).encode()], ours)
        for fd in ours:  # the client has its own copies now
            os.close(fd)
        if sent:  # and the slot is the client's until it says it is done
            self.alive[slot] += 1
            self.handed.add(slot)

    def done(self, slot: int) -> None:
        """The client's supervisor is done with the slot (it holds nothing of the run now)."""
        if slot in self.handed:
            self.handed.remove(slot)
            self._release(slot)

    def _send(self, msg: list[bytes], fds: list[int]) -> bool:
        try:
            socket.send_fds(self.chan, msg, fds)
            return True
        except OSError:  # the client is gone: so are we
            self.shutdown()
            return False

    def _slot_namespaces(self, slot: int) -> list[int]:
        """The slot's network and UTS namespaces, made on its first run and reused by its runs
        one after another: a run cannot configure them (no capability over them) and its
        sockets die with its processes, so nothing carries over, and making and tearing
        down a network namespace per run costs more CPU than a short run itself."""
        if slot not in self.netns:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            pid = os.fork()
            if pid == 0:
                try:
                    make_slot_namespaces(theirs)
                finally:
                    os._exit(0)
            theirs.close()
            _, fds, _, _ = socket.recv_fds(ours, 16, 2)
            ours.close()
            os.waitpid(pid, 0)
            if len(fds) != 2:
                raise OSError(errno.EIO, "could not make the uid slot's network namespace")
            self.netns[slot] = fds
        return self.netns[slot]

    def shutdown(self) -> None:
        """End every run (killing its init ends its namespace), then remove our cgroups once
        they are empty. Never returns."""
        # first, so no run killed here is reported as the program's own death
        for pid, (slot, status_w) in self.programs.items():
            os.close(status_w)
            self.programs[pid] = (slot, -1)
        for pid in (*self.inits, *self.programs):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while (self.inits or self.programs) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.005)
        while time.monotonic() < deadline and not self.cgroups.remove():
            time.sleep(0.01)  # the runs' own processes are still dying
        os._exit(0)

    def reap(self) -> None:
        while True:
            try:
                pid, status, usage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.programs:
                slot, status_w = self.programs.pop(pid)
                report = {
                    "status": status,
                    "cpu_ms": (usage.ru_utime + usage.ru_stime) * 1000,
                    "maxrss_kb": usage.ru_maxrss,
                }
                if status_w >= 0:
                    with contextlib.suppress(OSError):  # a supervisor that gave up closed its end
                        _write_all(status_w, json.dumps(report).encode() + b"\n")
                    os.close(status_w)
            elif pid in self.inits:
                slot = self.inits.pop(pid)
            else:
                continue
            self._release(slot)

    def _release(self, slot: int) -> None:
        """One holder of the slot less: its program, its init (which exits only after every
        other process of its namespace has been reaped) and its supervisor. When all three
        are gone, nothing of the run is left, and the slot is free again."""
        self.alive[slot] -= 1
        if not self.alive[slot]:
            del self.alive[slot]
            self.free.append(slot)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def main() -> None:
    base_uid, spares, use_cgroups = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:4] != ["0"]
    cpus = int(sys.argv[4]) if len(sys.argv) > 4 else jail.CPUS
    chan = socket.socket(fileno=0)  # a SOCK_SEQPACKET pair end: one message per spare
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cgroups = RunCgroups(enabled=use_cgroups)  # before the jail: no cgroup tree inside it
    pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)  # before the jail too: no /proc there
    # four descriptors kept per uid slot (namespaces, cgroups), plus the runs' status pipes
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 6 * MAX_SLOTS if hard == resource.RLIM_INFINITY else min(hard, 6 * MAX_SLOTS)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        shared = jail.enter(extra_ro=jail.prepare_pch_dir(), init=init_image(), cpus=cpus)
    except OSError as e:
        chan.send(json.dumps({"ready": False, "error": f"cannot build the sandbox jail: {e}"}).encode())
        os._exit(2)
    init = next((p for p in INITS if os.access(p, os.X_OK)), None)
    if init is None:
        chan.send(
            json.dumps(
                {"ready": False, "error": f"no init for the runs' namespaces: none of {INITS}"}
            ).encode()
        )
        os._exit(2)
    hello = {"ready": True, "shared": shared, "cgroups": cgroups.paths, "pid": os.getpid()}
    chan.send(json.dumps(hello).encode())
    # what the zygote allocated will never be collected: keep the collector of every run
    # from walking (and so copying, page by page) the inherited heap
    gc.freeze()
    pool = _Spares(chan, base_uid, spares, cgroups, pid_ns, init, cpus)
    # a program's exit wakes the loop at once: its supervisor is waiting for the status
    child_r, child_w = os.pipe()
    os.set_blocking(child_r, False)
    os.set_blocking(child_w, False)
    signal.set_wakeup_fd(child_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(chan, selectors.EVENT_READ)
    sel.register(child_r, selectors.EVENT_READ)
    while True:
        pool.refill()
        for key, _ in sel.select(timeout=0.5):
            if key.fd == child_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(child_r, 4096)
                continue
            try:
                msg = chan.recv(64)
            except OSError:
                # ECONNRESET: a client that died with spares unread in its queue (killed, not
                # closed) is gone all the same; it must not cost the runs' cgroups a traceback
                msg = b""
            if not msg:
                pool.shutdown()  # the client went away
            elif msg.startswith(b"f"):  # b"f<slot>": a run's supervisor is done with its slot
                pool.done(int(msg[1:]))
            else:
                pool.unused -= len(msg)  # one byte per spare the client started using
        pool.reap()


if __name__ == "__main__":
    main()
