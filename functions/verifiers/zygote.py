"""The sandbox zygote: ``python -m functions.verifiers.zygote BASE_UID SPARES``.

Started once per worker with an empty environment. It imports what user programs commonly
import, builds the read-only jail and ``pivot_root``s into it, then forks one supervisor per
run request, each as PID 1 of a PID namespace of its own: a fork of a warm interpreter
costs about a millisecond where starting ``python`` costs tens. It stays single-threaded
so forking it is safe, and gives every run that is in flight its own uid
(``BASE_UID + slot``) so one run's process limit or files never touch another's.

Its channel (fd 0) is one end of a ``SOCK_SEQPACKET`` pair: it says ``{"ready": ...}``
once, then sends ``b"spare"`` with two file descriptors per warm sandbox (write a request
to the first, read the report from the second); the client sends one byte per spare it
starts using.
"""

from __future__ import annotations

# What model-written programs commonly import, loaded once here and inherited by every run.
import bisect  # noqa: F401
import collections  # noqa: F401
import contextlib
import copy  # noqa: F401
import dataclasses  # noqa: F401
import decimal  # noqa: F401
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
from functions.verifiers.supervisor import finish, make_slot_namespaces, spare

MAX_SLOTS = 1024


class _Spares:
    """Forks warm sandboxes and hands each one's two pipe ends to the client.

    The client then talks to the sandbox directly (request in, report out), so the zygote
    is off every run's path: it only forks replacements and frees uid slots.
    """

    def __init__(
        self, chan: socket.socket, base_uid: int, target: int, cgroups: RunCgroups, pid_ns: int
    ) -> None:
        self.chan = chan
        self.pid_ns = pid_ns  # our own PID namespace, to come back to after each fork
        self.cgroups = cgroups
        self.base_uid = base_uid
        self.target = target
        self.unused = 0  # spares the client holds and has not used yet
        self.slot_of: dict[int, int] = {}  # supervisor pid -> uid slot
        self.free = list(range(MAX_SLOTS - 1, -1, -1))
        self.netns: dict[int, list[int]] = {}  # uid slot -> its network and UTS namespaces

    def refill(self) -> None:
        while self.unused < self.target and self.free:
            slot = self.free.pop()
            # in the zygote, before the fork: a child's cache would die with it
            namespaces = self._slot_namespaces(slot)
            req_r, req_w = os.pipe()
            res_r, res_w = os.pipe()
            # the next child is PID 1 of a namespace of its own: the run's supervisor
            pid = -1
            lx.unshare(lx.CLONE_NEWPID)
            try:
                pid = os.fork()
            finally:
                if pid != 0:  # (not in the child) our later children are ours again
                    lx.setns(self.pid_ns, lx.CLONE_NEWPID)
            if pid == 0:
                _supervisor(
                    self.base_uid + slot,
                    slot,
                    self.cgroups,
                    namespaces,
                    req_r,
                    res_w,
                    [self.chan.fileno(), self.pid_ns, req_w, res_r],
                )
            os.close(req_r)
            os.close(res_w)
            self.slot_of[pid] = slot
            try:
                socket.send_fds(self.chan, [b"spare"], [req_w, res_r])
            except OSError:  # the client is gone: so are we
                self.shutdown()
            os.close(req_w)  # the client has its own copies now
            os.close(res_r)
            self.unused += 1

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
            self.netns[slot] = fds
        return self.netns[slot]

    def shutdown(self) -> None:
        """End every run (its processes die with their supervisor), then remove our cgroups
        once they are empty. Never returns."""
        for pid in self.slot_of:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while self.slot_of and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.005)
        while time.monotonic() < deadline and not self.cgroups.remove():
            time.sleep(0.01)  # the runs' own processes are still dying
        os._exit(0)

    def reap(self) -> None:
        # a slot is free again only once its supervisor (and so its whole run) is gone
        while self.slot_of:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            self.free.append(self.slot_of.pop(pid))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _supervisor(
    uid: int,
    slot: int,
    cgroups: RunCgroups,
    namespaces: list[int],
    req_r: int,
    result_w: int,
    inherited: list[int],
) -> None:
    try:
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)  # fd 0 was the zygote's channel: replaced, so no fd below 3 is free
        os.dup2(null, 1)
        os.close(null)
        for fd in inherited:  # ends of this sandbox's own pipes the zygote keeps
            if fd > 2:
                os.close(fd)
        reply = spare(uid, req_r, cgroups.slot(slot) if cgroups.dirs else None, namespaces)
        if reply is not None:
            _write_all(result_w, json.dumps(reply).encode() + b"\n")
        finish()
    except BaseException as e:  # the client turns a missing report into a SandboxError
        os.write(2, f"rl-fabric sandbox supervisor failed: {type(e).__name__}: {e}\n".encode())
    finally:
        os._exit(0)


def main() -> None:
    base_uid, spares, use_cgroups = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] != ["0"]
    chan = socket.socket(fileno=0)  # a SOCK_SEQPACKET pair end: one message per spare
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cgroups = RunCgroups(enabled=use_cgroups)  # before the jail: no cgroup tree inside it
    pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)  # before the jail too: no /proc there
    # two namespace descriptors kept per uid slot, plus the pipes of the spares
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * MAX_SLOTS if hard == resource.RLIM_INFINITY else min(hard, 4 * MAX_SLOTS)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        shared = jail.enter()
    except OSError as e:
        chan.send(json.dumps({"ready": False, "error": f"cannot build the sandbox jail: {e}"}).encode())
        os._exit(2)
    chan.send(
        json.dumps({"ready": True, "shared": shared, "cgroups": cgroups.names, "pid": os.getpid()}).encode()
    )
    # what the zygote allocated will never be collected: keep the collector of every run
    # from walking (and so copying, page by page) the inherited heap
    gc.freeze()
    pool = _Spares(chan, base_uid, spares, cgroups, pid_ns)
    sel = selectors.DefaultSelector()
    sel.register(chan, selectors.EVENT_READ)
    while True:
        pool.refill()
        if sel.select(timeout=0.5):
            msg = chan.recv(64)
            if not msg:
                pool.shutdown()  # the client went away
            pool.unused -= len(msg)  # one byte per spare the client started using
        pool.reap()


if __name__ == "__main__":
    main()
