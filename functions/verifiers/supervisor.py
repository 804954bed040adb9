"""The supervisor of one sandboxed run, in the client (the worker process), not in the sandbox.

A spare (``Spare``) is what the zygote hands over for each warm sandbox: the program's
pipes, descriptors of its process and of its namespace's init, the pipe that init reads
(closed, by us or by this process's death, it ends the namespace), and the pipe on which
the zygote (the program's parent) forwards its exit status. The program sends the
descriptors of its ``/sandbox`` and its stdin itself, as soon as its namespaces are set up.

``supervise`` writes the run's files and stdin through those descriptors (as root, before
any user code ran there, so nothing can race it), sizes the run's tmpfs and memory cgroup,
starts the program, reads stdout up to its cap and stderr to its end (keeping its start
and end) and enforces the wall-clock and CPU limits. When the program ends (or is killed)
it kills the init, which ends the namespace, waits for the status and for the namespace to
be gone, and collects the files the caller asked for. It reports exactly what happened;
judging the output is ``functions.verifiers.verify``'s.

``supervise_pair`` does the same for two runs at once, a program and its
assert-style tests (``Sandbox.run_pair``), in one select loop: each run's stdout is relayed
to the other's fd 3, which stays open after the start message (``functions.verifiers.rpc``
is what travels there; the supervisor only moves bytes, bounded each way).

Why not a supervisor process per run: it would be a fork of the zygote's interpreter, and
the copy-on-write faults, page-table copies and unmapping of that fork cost more CPU than a
short run itself. Here supervision is a few system calls in a thread of the client.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import socket
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from functions.verifiers import _linux as lx
from functions.verifiers.cgroups import Slot, SlotCgroups
from functions.verifiers.errors import SandboxError
from functions.verifiers.program import DEFAULT_DISK_MB, SETUP_FAILED, SPARE_FDS


class _SetupFailed(Exception):
    """The sandbox (not the program) failed: reported as ``sandbox_error``."""


@dataclass
class Spare:
    """One warm sandbox: its uid slot, its program and the descriptors to run it (see
    ``program.SPARE_FDS``), and the zygote it came from."""

    slot: int
    uid: int
    go: int  # the start message goes in here
    out: int
    err: int
    ok: socket.socket  # the program's /sandbox and stdin descriptors, then b"1" once set up
    status: int  # the zygote writes the program's exit status here
    hold: int  # the init reads it: closed, by us or by our death, the namespace ends
    pidfd: int  # readable once the program has ended
    init: int  # readable once the whole namespace has ended
    chan: socket.socket  # to the zygote that made it (not a newer one's)
    cgroups: SlotCgroups  # of that zygote
    fds: list[int] = field(default_factory=list)  # work dir, stdin, once the program sent them

    @classmethod
    def from_message(
        cls, msg: bytes, fds: list[int], base_uid: int, chan: socket.socket, cgroups: SlotCgroups
    ) -> Spare:
        head = json.loads(msg)
        if len(fds) != len(SPARE_FDS):
            raise ValueError(f"{len(fds)} descriptors instead of {len(SPARE_FDS)}")
        go, out, err, ok, status, hold, pidfd, init = fds
        slot = int(head["slot"])
        sock = socket.socket(fileno=ok)
        return cls(slot, base_uid + slot, go, out, err, sock, status, hold, pidfd, init, chan, cgroups)

    def end(self) -> None:
        """End the run's namespace: kill its init, and the kernel kills the rest. (Closing
        ``hold`` alone would not do while a fork of this process holds a copy of it.)"""
        if self.hold >= 0:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.init, signal.SIGKILL)
            os.close(self.hold)
            self.hold = -1

    def close(self) -> None:
        self.end()
        for name in ("go", "out", "err", "status", "pidfd", "init"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.ok.close()

    def done(self) -> None:
        """Tell the zygote the slot is free as far as we are concerned (after ``close``)."""
        with contextlib.suppress(OSError):
            self.chan.send(b"f%d" % self.slot)


class _Capture:
    """stdout: its first ``cap`` bytes; a run that writes more is killed (it is the answer,
    and one that long is wrong or a flood)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> bool:
        """Keep up to the cap; True once the program wrote past it."""
        self.total += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
        return self.total > self.cap

    def kept(self) -> bytes:
        return bytes(self.data)


class _Drain:
    """stderr: read to its end, never a reason to kill. Past its cap, its first and last
    halves are kept, with a line between them saying how much was cut (``cut_marker``): it
    killed the run, and a right program that logged its progress scored 0, where judges
    ignore stderr. A flood is bounded by the run's CPU and wall limits, like a loop."""

    def __init__(self, cap: int) -> None:
        self.cap = cap // 2  # the head's
        self.tail_cap = cap - self.cap
        self.data = bytearray()  # the head
        self.tail = bytearray()  # what came after the head, its last tail_cap..2*tail_cap bytes
        self.total = 0

    def feed(self, chunk: bytes) -> bool:
        self.total += len(chunk)
        room = self.cap - len(self.data)
        if room > 0:
            self.data += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > 2 * self.tail_cap:  # trimmed now and then, not on every read
                del self.tail[: -self.tail_cap]
        return False

    def kept(self) -> bytes:
        if self.total <= self.cap + self.tail_cap:
            return bytes(self.data + self.tail)
        head = _whole_utf8_prefix(bytes(self.data))
        tail = _whole_utf8_suffix(bytes(self.tail[-self.tail_cap :]))
        cut = self.total - len(head) - len(tail)
        return head + cut_marker(cut, at_line_start=not head or head.endswith(b"\n")) + tail


def kept_stderr(data: bytes, cap: int) -> bytes:
    """What the sandbox keeps of ``data`` written to stderr under ``cap`` (``_Drain``)."""
    drain = _Drain(cap)
    drain.feed(data)
    return drain.kept()


def cut_marker(cut: int, at_line_start: bool = True) -> bytes:
    """The line that stands for the ``cut`` bytes of stderr dropped from its middle."""
    return (b"" if at_line_start else b"\n") + b"[... %d bytes of stderr cut]\n" % cut


def _whole_utf8_prefix(data: bytes) -> bytes:
    """``data`` less a UTF-8 character its end cuts in two (so a cut shows no U+FFFD)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte < 0x80:
            return data
        if byte >= 0xC0:  # the lead byte: whole if its sequence fits in what is there
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data if need <= back else data[:-back]
    return data


def _whole_utf8_suffix(data: bytes) -> bytes:
    """``data`` less the end of a UTF-8 character its start cuts in two."""
    skip = 0
    while skip < min(3, len(data)) and 0x80 <= data[skip] < 0xC0:
        skip += 1
    return data[skip:]


def supervise(
    spare: Spare, req: dict[str, Any], slot: Slot | None, setup_timeout: float, grace: float
) -> dict[str, Any]:
    """Run ``req`` in ``spare`` and report (a ``RunOutcome``'s fields). Closes the spare."""
    return _supervise([spare], [req], [slot], setup_timeout, grace)[0]


def supervise_pair(
    spares: list[Spare],
    reqs: list[dict[str, Any]],
    slots: list[Slot | None],
    setup_timeout: float,
    grace: float,
) -> list[dict[str, Any]]:
    """Run a program and its tests side by side (``Sandbox.run_pair``; in that order) and
    report both. Each one's stdout is relayed to the other's fd 3, which stays open after
    the start message; the pair ends when the tests end. Closes the spares."""
    return _supervise(spares, reqs, slots, setup_timeout, grace, pair=True)


def _supervise(
    spares: list[Spare],
    reqs: list[dict[str, Any]],
    slots: list[Slot | None],
    setup_timeout: float,
    grace: float,
    pair: bool = False,
) -> list[dict[str, Any]]:
    try:
        try:
            works = [_prepare(*args, setup_timeout) for args in zip(spares, reqs, slots, strict=True)]
        except _SetupFailed as e:
            return [{"status": "sandbox_error", "error": str(e)} for _ in spares]
        for spare, req in zip(spares, reqs, strict=True):
            _start(spare, req, keep_open=pair)
        runs = [_Run(*args) for args in zip(spares, reqs, works, slots, strict=True)]
        if pair:
            program, tests = runs
            program.peer, tests.peer = tests, program
        try:
            return _watch(runs, grace)
        except OSError as e:  # ours, not the program's (a cgroup gone with its zygote, say)
            error = f"supervising the run: {type(e).__name__}: {e}"
            return [{"status": "sandbox_error", "error": error} for _ in spares]
    finally:
        for spare in spares:
            spare.close()


def _start(spare: Spare, req: dict[str, Any], keep_open: bool) -> None:
    """Say go: the start message, length-prefixed, so the program reads exactly that and
    leaves what follows in the pipe (the marker line, or a pair's requests)."""
    start = {k: req.get(k) for k in ("mode", "entry", "argv", "env", "limits")}
    start["marker"] = bool(req.get("marker"))
    if req.get("rpc"):
        start["rpc"] = req["rpc"]
    body = json.dumps(start).encode()
    try:
        # the marker goes after it: the test harness reads it from fd 3 only once the tests
        # ran, and it never sits in the program's memory before that
        _write_all(spare.go, b"%08x" % len(body) + body)
        if req.get("marker"):
            _write_all(spare.go, req["marker"].encode() + b"\n")
    except BrokenPipeError:
        keep_open = False  # the program died during its set-up: its status and stderr say why
    if keep_open:
        os.set_blocking(spare.go, False)  # relayed into without ever blocking the supervisor
    else:
        os.close(spare.go)
        spare.go = -1


def _prepare(spare: Spare, req: dict[str, Any], slot: Slot | None, timeout: float) -> int:
    """Wait for the program's descriptors, then write the run's files and stdin."""
    spare.ok.settimeout(timeout)
    try:
        msg, fds, _, _ = socket.recv_fds(spare.ok, 16, 2)
        for fd in fds:  # see sandbox._close_on_exec
            os.set_inheritable(fd, False)
    except OSError as e:
        msg, fds = b"", []
        why = str(e)
    else:
        why = "it exited"
    spare.fds = fds
    if msg != b"d" or len(fds) != 2:
        raise _SetupFailed(f"preparing the sandbox: {_early_stderr(spare.err) or why}")
    work, stdin = fds
    limits = req["limits"]
    try:
        if limits["disk_mb"] != DEFAULT_DISK_MB:
            lx.reconfigure(work, "size", f"{limits['disk_mb']}m")
        for name, data in req["files"].items():
            mode = 0o755 if name in req["executable"] else 0o644
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=work)
            try:
                _write_all(fd, data)
                os.fchown(fd, spare.uid, spare.uid)
            finally:
                os.close(fd)
        _write_all(stdin, req["stdin"])
        os.lseek(stdin, 0, os.SEEK_SET)  # the program's fd 0 shares this offset
        if slot is not None:
            slot.begin_run()
            # pages in its tmpfs and memfds are the run's memory too
            memory = (limits["memory_mb"] + limits["disk_mb"]) << 20
            slot.limit(memory)
            # checked, not assumed: the program joined its cgroups by itself, elsewhere
            # (see ``Slot.check``); a run that would not be held to its limit is not run
            pid = lx.pidfd_pid(spare.pidfd)  # -1: it died in its set-up, as its status says
            problem = slot.check(pid, memory) if pid > 0 else None
            if problem is not None:
                raise _SetupFailed(
                    f"the run's memory limit is not in force ({problem}): refusing to run it; "
                    "this is a sandbox fault, not the program's (restart the sandbox)"
                )
    except OSError as e:
        raise _SetupFailed(f"starting the run: {type(e).__name__}: {e}") from e
    return work


def _early_stderr(fd: int) -> str:
    """What a program whose set-up failed said (it has exited, so this does not block)."""
    os.set_blocking(fd, False)
    with contextlib.suppress(OSError):
        return os.read(fd, 4096).decode(errors="replace").strip()
    return ""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


#: Bytes relayed to a run's fd 3 that may wait in the supervisor; past it, the other run's
#: stdout is not read until they drain (that run then blocks on its own pipe).
RELAY_BUFFER = 1 << 20
#: How often the CPU use of a run's cgroup is read (it is also read whenever the loop wakes
#: after that, and the loop wakes at least every 50 ms).
CPU_POLL_S = 0.01
#: How long a program whose channel ended may take to exit once its tests did (``_await_exit``).
EXIT_GRACE_S = 0.5


class _Run:
    """What the supervisor tracks of one run while it watches it."""

    def __init__(self, spare: Spare, req: dict[str, Any], work: int, slot: Slot | None) -> None:
        limits = req["limits"]
        self.spare, self.req, self.work, self.slot = spare, req, work, slot
        self.out = _Capture(limits["stdout_bytes"])
        self.err = _Drain(limits["stderr_bytes"])
        self.cpu_budget_ns = limits["cpu_s"] * 1e9
        # with a cgroup, the CPU of all the run's processes is polled (rlimits see one each)
        self.poll_cpu = slot is not None and "cpuacct" in slot.fds
        self.channel_bytes = limits.get("channel_bytes", 64 << 20)
        self.open = {spare.out, spare.err, spare.pidfd}  # until EOF / until the program ends
        self.killed_for: str | None = None
        self.peer: _Run | None = None  # of a pair: our stdout goes to the peer's fd 3
        self.inbox = bytearray()  # relayed from the peer, waiting for our fd 3

    @property
    def ended(self) -> bool:
        return self.spare.pidfd not in self.open

    def kill(self, why: str) -> None:
        """End the run now (a limit, or its pair is over); what it still writes is dropped."""
        self.killed_for = self.killed_for or why
        self.spare.end()
        self.open.clear()
        self.inbox.clear()

    def relay_done(self) -> bool:
        """Whether nothing more will come for our fd 3 (the peer's stdout ended)."""
        return self.peer is not None and self.peer.spare.out not in self.peer.open


def _watch(runs: list[_Run], grace: float) -> list[dict[str, Any]]:
    """Watch every run with one select loop until the last of them (a pair's tests, or the
    only run) has ended and its pipes are drained, or a limit ends it first."""
    started = time.monotonic()
    deadline = started + runs[-1].req["limits"]["wall_s"]
    last = runs[-1]
    next_poll = started
    with selectors.DefaultSelector() as sel:
        while last.open and not last.killed_for:
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                for run in runs:
                    if not run.ended:
                        run.kill("timeout")
                break
            # at most every CPU_POLL_S: a pair wakes this loop twice per request of its
            # tests, and reading a cgroup's usage costs more than relaying a small frame
            polling, next_poll = (True, now + CPU_POLL_S) if now >= next_poll else (False, next_poll)
            for run in runs:
                if polling and run.poll_cpu and run.open and not run.killed_for:
                    assert run.slot is not None
                    if (run.slot.cpu_ns() or 0) > run.cpu_budget_ns:
                        run.kill("cpu_limit")
                if run.peer is last and run.killed_for:
                    _close_go(last)  # the tests get EOF: the program is gone
            if last.killed_for:
                break
            if any(run.poll_cpu for run in runs):
                left = min(left, max(next_poll - now, 0.0) + 0.04)
            _register(sel, runs)
            for key, _ in sel.select(timeout=left):
                run, what = key.data
                if what == "go":
                    _flush(run)
                elif what == "pidfd":
                    run.open.discard(key.fd)
                    # the namespace ends first: whatever the program left dies (a tracer that
                    # holds the program's exit status included), then its status can be had
                    run.spare.end()
                    if run is last:  # the pair is over: its program goes too
                        for other in runs[:-1]:
                            if not other.ended and other.spare.out not in other.open:
                                _await_exit(other)
                            if not other.ended:
                                other.kill("stopped")
                else:
                    _read(run, key.fd, what)
            # the tests see EOF once the program's answers are all theirs (it ended). Never
            # the other way: a program that saw EOF could exit 0 of its own before its
            # tests' end is noticed, and that would read as the program's early exit
            if last.peer is not None and not last.inbox and last.relay_done():
                _close_go(last)
    for run in runs[:-1]:
        if not run.ended:  # its tests hit a limit: the program did nothing wrong by itself
            run.kill("stopped")
    give_up = time.monotonic() + grace
    for run in runs:
        run.spare.end()
    return [_report(run, started, give_up) for run in runs]


def _await_exit(run: _Run) -> None:
    """A program whose channel ended (the EOF its tests stopped on) is exiting: it closed
    its stdout as it died (a crash of its top-level code, an ``exit()``), and its pidfd is
    readable a moment later than that EOF. Give it that moment, so the verdict is its own
    (``exited with code 1`` and its traceback) and not "stopped" by the tests' end (the
    tests' "the program closed the channel", in about 1 case in 9). One that closed its
    stdout and lives on is stopped after ``EXIT_GRACE_S``; its stderr is read meanwhile."""
    spare = run.spare
    deadline = time.monotonic() + EXIT_GRACE_S
    while (left := deadline - time.monotonic()) > 0:
        fds = [fd for fd in (spare.err, spare.pidfd) if fd in run.open]
        ready, _, _ = select.select(fds, [], [], left)
        if spare.pidfd in ready:
            run.open.discard(spare.pidfd)
            spare.end()
            break
        for fd in ready:
            _read(run, fd, "err")
    while spare.err in run.open and select.select([spare.err], [], [], 0)[0]:
        _read(run, spare.err, "err")  # what it wrote as it died (its traceback) is its verdict's


def _register(sel: selectors.BaseSelector, runs: list[_Run]) -> None:
    """Watch what each run needs now: its open pipes (a relayed stdout only while the peer's
    buffer has room), its exit, and its fd 3 while relayed bytes wait for it."""
    want: dict[int, tuple[int, tuple[_Run, str]]] = {}
    for run in runs:
        spare = run.spare
        if spare.out in run.open and (run.peer is None or len(run.peer.inbox) < RELAY_BUFFER):
            want[spare.out] = (selectors.EVENT_READ, (run, "out"))
        if spare.err in run.open:
            want[spare.err] = (selectors.EVENT_READ, (run, "err"))
        if spare.pidfd in run.open:
            want[spare.pidfd] = (selectors.EVENT_READ, (run, "pidfd"))
        if run.inbox and spare.go >= 0:
            want[spare.go] = (selectors.EVENT_WRITE, (run, "go"))
    for fd in [fd for fd in sel.get_map() if fd not in want]:
        sel.unregister(fd)
    for fd, (events, data) in want.items():
        key = sel.get_map().get(fd)
        if key is None:
            sel.register(fd, events, data)
        elif key.events != events or key.data != data:
            sel.modify(fd, events, data)


def _read(run: _Run, fd: int, what: str) -> None:
    chunk = os.read(fd, 65536)
    if not chunk:
        run.open.discard(fd)
        return
    if what == "out" and run.peer is not None:
        run.out.total += len(chunk)
        if run.out.total > run.channel_bytes:
            run.kill("output_limit")
        elif not run.peer.ended and run.peer.spare.go >= 0:
            run.peer.inbox += chunk
            _flush(run.peer)
    elif (run.out if what == "out" else run.err).feed(chunk):
        run.kill("output_limit")


def _flush(run: _Run) -> None:
    """Write what waits for the run's fd 3, as much as its pipe takes now."""
    try:
        while run.inbox:
            n = os.write(run.spare.go, run.inbox[:65536])
            del run.inbox[:n]
    except BlockingIOError:
        pass  # its pipe is full: the rest waits in the inbox for the next writable event
    except OSError:  # it closed its fd 3, or died: nothing more reaches it
        run.inbox.clear()
        _close_go(run)


def _close_go(run: _Run) -> None:
    run.inbox.clear()
    if run.spare.go >= 0:
        os.close(run.spare.go)
        run.spare.go = -1


def _report(run: _Run, started: float, give_up: float) -> dict[str, Any]:
    spare, slot, limits = run.spare, run.slot, run.req["limits"]
    exit_ = _read_status(spare.status, give_up)
    # collect only once the namespace is gone, so no survivor is still writing a file
    select.select([spare.init], [], [], max(0.0, give_up - time.monotonic()))
    status = exit_["status"]
    wall = time.monotonic() - started
    out, err = run.out, run.err
    reply: dict[str, Any] = {
        "status": run.killed_for or ("signaled" if os.WIFSIGNALED(status) else "exited"),
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "stdout": out.kept() if run.peer is None else b"",  # a pair's stdout is the channel
        "stderr": err.kept(),
        "stdout_total": out.total,
        "stderr_total": err.total,
        "wall_ms": wall * 1000,
        "cpu_ms": exit_["cpu_ms"],
        "maxrss_kb": exit_["maxrss_kb"],
        "oom_killed": slot.oom_killed() if slot is not None else False,
    }
    if run.poll_cpu:
        assert slot is not None
        # every process of the run, not just one; but never less than the program's own rusage:
        # the cgroup does not see what the process ran before it joined it (~70 ms), and a run
        # killed by its RLIMIT_CPU at exactly cpu_s read as 0.93 s, under load below the 0.9 s
        # that tells a CPU-limit kill from any other SIGKILL (it was then "killed by SIGKILL")
        reply["cpu_ms"] = max(exit_["cpu_ms"], (slot.cpu_ns() or 0) / 1e6)
    spare.ok.setblocking(False)
    try:
        set_up = spare.ok.recv(1) == b"1"
    except BlockingIOError:
        set_up = False
    if not set_up and reply["exit_code"] == SETUP_FAILED and err.data.startswith(b"rl-fabric"):
        reply.update(status="sandbox_error", error=err.data.decode(errors="replace").strip())
    files = {}
    for name in run.req.get("collect") or ():
        data = _collect(run.work, name, limits["collect_bytes"])
        if data is not None:
            files[name] = data
    reply["files"] = files
    return reply


def _read_status(fd: int, deadline: float) -> dict[str, Any]:
    """The program's exit status and rusage, as its parent (the zygote) forwards them."""
    raw = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while not raw.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                raise SandboxError("the sandbox did not report the program's exit in time")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise SandboxError("the sandbox zygote died during the run")
            raw += chunk
    return json.loads(raw)  # type: ignore[no-any-return]


def _collect(work: int, name: str, limit: int) -> bytes | None:
    """A regular file the run left in ``/sandbox``, or None (absent, not a plain file, a
    link, or over ``limit``: a truncated binary must not be run). Read as root, so never
    through a link or anything that could block (a FIFO)."""
    if "/" in name or name in ("", ".", ".."):
        return None
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=work)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)[:limit]
    finally:
        os.close(fd)
