"""One sandboxed run: the supervisor (forked by the zygote) and the processes it starts.

The supervisor is PID 1 of a fresh PID namespace (the zygote forks it right after
``unshare(CLONE_NEWPID)``). Ahead of any request (a *spare*), still root but inside the
zygote's read-only jail, it joins its uid slot's network and UTS namespaces, takes fresh
mount and IPC namespaces, mounts a size-limited tmpfs at ``/sandbox`` (also seen as
``/tmp``) and forks the program (PID 2), which mounts the namespace's ``/proc``, becomes
the run's unprivileged uid (clearing every capability), enters a user namespace of its
own, drops what that namespace granted, sets ``no_new_privs`` and waits.

When the request comes, the supervisor writes the run's files and stdin, and sends the
program its start message; the program takes its rlimits, scrubs its environment and
either ``exec``s a command or, for Python, runs the source in this already-initialised
interpreter (the point of the zygote: no interpreter start-up). The supervisor reads
stdout/stderr up to their caps and enforces the wall-clock limit; when the program ends
(or is killed) it kills every other process of its namespace (``kill(-1)`` from PID 1
reaches exactly those), and if the supervisor itself dies the kernel ends the namespace.
It reports exactly what happened; judging the output is ``functions.verifiers.verify``'s.

Why the supervisor is PID 1 and not the program: the kernel drops the signals a PID 1
sends itself without a handler, so as PID 1 a program's ``abort()`` or
``kill(getpid(), ...)`` would not end it. The supervisor installs no handler, so nothing
in the namespace can signal it either. (A separate placeholder PID 1 cost a fork and an
exit of the whole interpreter image per run.)

Stdlib only, like everything the zygote imports.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import io
import json
import os
import resource
import select
import selectors
import signal
import socket
import stat
import sys
import time
import traceback
from typing import Any

from functions.verifiers import _linux as lx
from functions.verifiers import jail
from functions.verifiers.cgroups import Slot

#: Fresh for every run, with the PID namespace the zygote makes for the supervisor. Network
#: and UTS namespaces are the uid slot's (``make_slot_namespaces``).
RUN_NAMESPACES = lx.CLONE_NEWNS | lx.CLONE_NEWIPC
SLOT_NAMESPACES = lx.CLONE_NEWNET | lx.CLONE_NEWUTS
WORK = "/sandbox"
#: Environment of every run: nothing inherited, so no credential can leak in.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORK,
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}
EXEC_FAILED = 127
#: Exit code of a program whose sandbox set-up failed (with a message on stderr).
SETUP_FAILED = 125
#: The run's tmpfs, sized ahead of time (a request for another size remounts it).
DEFAULT_DISK_MB = 64
INODES = 4096


def _rlimits(limits: dict[str, Any]) -> None:
    """Lower this process's limits (the program sets its own: lowering needs no privilege,
    while setting another process's needs CAP_SYS_RESOURCE, which containers often lack)."""
    mb = 1024 * 1024
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    # soft == hard: the kernel sends SIGKILL at the limit (a SIGXCPU could be caught)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    address_space = limits.get("address_space_mb") or limits["memory_mb"]
    resource.setrlimit(resource.RLIMIT_AS, (address_space * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["fsize_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["nofile"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _become_unprivileged(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)  # root -> non-root clears all capabilities
    # a uid change makes /proc/self root-owned; the maps below are written through it
    lx.prctl(lx.PR_SET_DUMPABLE, 1)
    lx.unshare(lx.CLONE_NEWUSER)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{uid} {uid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    # no nested user namespaces: inside one, a program would hold every capability again
    # (mount an unsized tmpfs, configure netfilter in its own network namespace)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    lx.drop_all_capabilities()  # a new user namespace starts with a full set inside it
    lx.prctl(lx.PR_SET_NO_NEW_PRIVS, 1)


def _run_python(source: str, entry: str, marker: str | None = None) -> int:
    """Run ``source`` as ``__main__`` in this (forked, pristine) interpreter."""
    sys.argv = [entry]
    sys.path[:] = [WORK] + [p for p in sys.path if p.startswith(sys.base_prefix) or p.startswith(sys.prefix)]
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
    )
    code = 0
    try:
        compiled = compile(source, entry, "exec")
        exec(compiled, {"__name__": "__main__", "__builtins__": builtins, "__file__": os.path.abspath(entry)})
        if marker:  # the source ran to its end (no exit on the way): assert-style tests all ran
            sys.stdout.write(f"\n{marker}\n")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            sys.stderr.write(f"{e.code}\n")
            code = 1
    except BaseException as e:
        try:  # from the program's own frames down: ours would only confuse a reader
            traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        except BaseException:
            os.write(2, b"Traceback unavailable (out of memory?)\nMemoryError\n")
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 1
    return code


_SUPERVISOR_PIDFD = -1


def _exit_if_orphaned() -> None:
    """The parent-death signal is armed only after the fork: if the supervisor died in
    between, nothing would ever kill this process. Its pidfd says whether it already did."""
    if select.select([_SUPERVISOR_PIDFD], [], [], 0)[0]:
        os._exit(1)


def _program(uid: int, go_r: int, stdin_fd: int, out_w: int, err_w: int, ok_w: int) -> None:
    """The program (PID 2): mount ``/proc``, lock itself down, wait for the run, run it.

    Everything up to the wait happens while the sandbox is a spare, off the run's latency;
    the rlimits come with the run.
    """
    try:
        lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)
        _exit_if_orphaned()
        lx.mount("proc", "/proc", "proc", lx.MS_NOSUID | lx.MS_NODEV | lx.MS_NOEXEC)
        lx.sethostname("sandbox")
        os.setsid()  # a group of its own: kill(0, ...) reaches only the program's processes
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(go_r, 3)
        os.dup2(ok_w, 4)
        os.closerange(5, 65536)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(WORK)
        _become_unprivileged(uid)
        raw = b""
        while chunk := os.read(3, 65536):  # warm until here: the run arrives as one message
            raw += chunk
        os.close(3)
        if not raw:
            os._exit(0)  # the supervisor gave up on this spare
        run = json.loads(raw)
        _rlimits(run["limits"])
        env = {**BASE_ENV, **(run.get("env") or {})}
        os.environ.clear()
        os.environ.update(env)
        # set-up succeeded: said out of band, so no program can fake a sandbox failure
        os.write(4, b"1")
        os.close(4)
    except BaseException as e:
        os.write(2, f"rl-fabric sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    if run["mode"] == "python":
        with open(run["entry"], encoding="utf-8", errors="replace") as f:
            source = f.read()
        os._exit(_run_python(source, run["entry"], run.get("marker")))
    argv = run["argv"]
    try:
        os.execve(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"cannot execute {argv[0]}: {e.strerror}\n".encode())
    os._exit(EXEC_FAILED)


def _write_files(req: dict[str, Any], uid: int, stdin: int) -> None:
    limits = req["limits"]
    if limits["disk_mb"] != DEFAULT_DISK_MB:
        lx.mount(
            "tmpfs", WORK, None, lx.MS_REMOUNT | lx.MS_NOSUID | lx.MS_NODEV, f"size={limits['disk_mb']}m"
        )
    for name, blob in (req.get("files") or {}).items():
        path = os.path.join(WORK, name)
        mode = 0o755 if name in req.get("executable", ()) else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.write(fd, base64.b64decode(blob))
        finally:
            os.close(fd)
        os.chown(path, uid, uid)
    os.write(stdin, base64.b64decode(req.get("stdin") or ""))
    os.lseek(stdin, 0, os.SEEK_SET)


class _Capture:
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


def _collect(name: str, limit: int) -> bytes | None:
    """A regular file the run left in ``/sandbox``, or None (absent, not a plain file, a
    link, or over ``limit``: a truncated binary must not be run). Read as root, so never
    through a link or anything that could block (a FIFO)."""
    if "/" in name or name in ("", ".", ".."):
        return None
    try:
        fd = os.open(os.path.join(WORK, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
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


def end_namespace() -> None:
    """Kill every process of the run's PID namespace but this one (PID 1).

    One call is enough: a fork that races the kill fails (the kernel refuses to finish a
    fork once a signal is pending for the parent), so no child slips through."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


def finish() -> None:
    """End and reap everything in the run's PID namespace (call after sending the report:
    the zygote frees the run's uid only once this process has exited). Every process there
    descends from us and orphans are re-parented to us, so nothing left to wait for means
    nothing left at all; the kill is repeated anyway, for anything started since."""
    while True:
        end_namespace()
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    if _SLOT is not None:
        _SLOT.close()


def _read_request(fd: int) -> dict[str, Any] | None:
    raw = bytearray()
    while not raw.endswith(b"\n"):
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return None
        raw += chunk
    return json.loads(raw)  # type: ignore[no-any-return]


_SLOT: Slot | None = None


def make_slot_namespaces(chan: socket.socket) -> None:
    """In a throwaway child of the zygote: make a network namespace (no interface up, so no
    network at all, loopback included) and a UTS namespace named "sandbox", and send them."""
    lx.unshare(SLOT_NAMESPACES | lx.CLONE_NEWNS)
    lx.sethostname("sandbox")
    lx.mount("none", "/", None, lx.MS_REC | lx.MS_PRIVATE)
    lx.mount("proc", "/proc", "proc", lx.MS_NOSUID | lx.MS_NODEV | lx.MS_NOEXEC)  # to open the two
    fds = [os.open(f"/proc/self/ns/{ns}", os.O_RDONLY) for ns in ("net", "uts")]
    socket.send_fds(chan, [b"ns"], fds)


def spare(uid: int, req_fd: int, slot: Slot | None, namespaces: list[int]) -> dict[str, Any] | None:
    """Prepare a warm sandbox, wait for a request on ``req_fd``, run it, report. Call as
    PID 1 of a fresh PID namespace (the zygote forks us into one).

    Everything before the request (namespaces, the ``/sandbox`` tmpfs, the program with its
    ``/proc``, already unprivileged) happens ahead of time, off the run's latency.
    ``None``: no request came.
    """
    try:
        lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getpid() != 1:
            raise RuntimeError("the supervisor must be PID 1 of the run's own PID namespace")
        lx.setns(namespaces[0], lx.CLONE_NEWNET)
        lx.setns(namespaces[1], lx.CLONE_NEWUTS)
        lx.unshare(RUN_NAMESPACES)
        opts = f"size={DEFAULT_DISK_MB}m,nr_inodes={INODES},mode=0700,uid={uid},gid={uid}"
        lx.mount("tmpfs", WORK, "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, opts)
        lx.mount(WORK, "/tmp", None, lx.MS_BIND)
        jail.restore_relocated()
        stdin = os.memfd_create("stdin")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        go_r, go_w = os.pipe()
        ok_r, ok_w = os.pipe()
        global _SUPERVISOR_PIDFD
        _SUPERVISOR_PIDFD = os.pidfd_open(os.getpid())
        pid = os.fork()  # PID 2 of our namespace
        if pid == 0:
            for fd in (req_fd, out_r, err_r, go_w, ok_r):
                os.close(fd)
            _program(uid, go_r, stdin, out_w, err_w, ok_w)
        for fd in (out_w, err_w, go_r, ok_w):
            os.close(fd)
        global _SLOT
        _SLOT = slot
        if slot is not None:  # before any user code: every process it makes is counted
            slot.add(pid)  # (not us: one task migration per run, and our work is not the run's)
    except BaseException as e:
        req = _read_request(req_fd)
        return (
            None
            if req is None
            else {"status": "sandbox_error", "error": f"preparing the sandbox: {type(e).__name__}: {e}"}
        )
    req = _read_request(req_fd)
    if req is None:
        return None  # finish() ends the spare's program
    try:
        _write_files(req, uid, stdin)
        if slot is not None:
            lim = req["limits"]
            # pages in its tmpfs and memfds are the run's memory too
            slot.limit((lim["memory_mb"] + lim["disk_mb"]) << 20)
        os.write(
            go_w,
            json.dumps(
                {k: req.get(k) for k in ("mode", "entry", "argv", "env", "limits", "marker")}
            ).encode(),
        )
    except BrokenPipeError:
        pass  # the program died during its set-up: its exit status and stderr say why
    except BaseException as e:
        end_namespace()
        return {"status": "sandbox_error", "error": f"starting the run: {type(e).__name__}: {e}"}
    finally:
        os.close(go_w)
    return _supervise(req, pid, out_r, err_r, ok_r, slot)


def _supervise(
    req: dict[str, Any], pid: int, out_r: int, err_r: int, ok_r: int, slot: Slot | None
) -> dict[str, Any]:
    limits = req["limits"]
    started = time.monotonic()
    deadline = started + limits["wall_s"]
    captures = {out_r: _Capture(limits["stdout_bytes"]), err_r: _Capture(limits["stderr_bytes"])}
    exited = os.pidfd_open(pid)
    sel = selectors.DefaultSelector()
    for fd in (out_r, err_r, exited):
        sel.register(fd, selectors.EVENT_READ)
    status = None
    killed_for = None
    # until the program has ended and the pipes are drained
    while sel.get_map() and not killed_for:
        left = deadline - time.monotonic()
        if left <= 0:
            killed_for = "timeout"
            break
        cpu_budget_ns = limits["cpu_s"] * 1e9
        # with a cgroup, the CPU of all the run's processes is polled (rlimits see one each)
        if slot is not None and "cpuacct" in slot.fds:
            used = slot.cpu_ns() or 0
            if used > cpu_budget_ns:
                killed_for = "cpu_limit"
                break
            left = min(left, 0.05)
        for key, _ in sel.select(timeout=left):
            if key.fd == exited:
                sel.unregister(exited)
                # the namespace ends first: whatever the program left dies (a tracer that
                # holds the program's exit status included), then its status can be had
                end_namespace()
                _, status, usage = os.wait4(pid, 0)
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
            elif captures[key.fd].feed(chunk):
                killed_for = "output_limit"
                break
    if killed_for:
        end_namespace()
        if status is None:
            _, status, usage = os.wait4(pid, 0)
    assert status is not None  # the loop ends only once the program has been waited for
    # the rest is killed already; finish() reaps it once the report is out
    for fd in (out_r, err_r, exited):
        os.close(fd)
    wall = time.monotonic() - started
    out, err = captures[out_r], captures[err_r]
    reply: dict[str, Any] = {
        "status": killed_for or ("signaled" if os.WIFSIGNALED(status) else "exited"),
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "stdout": base64.b64encode(bytes(out.data)).decode(),
        "stderr": base64.b64encode(bytes(err.data)).decode(),
        "stdout_total": out.total,
        "stderr_total": err.total,
        "wall_ms": wall * 1000,
        "cpu_ms": (usage.ru_utime + usage.ru_stime) * 1000,
        "maxrss_kb": usage.ru_maxrss,
        "oom_killed": slot.oom_killed() if slot is not None else False,
    }
    if slot is not None and "cpuacct" in slot.fds:
        reply["cpu_ms"] = (slot.cpu_ns() or 0) / 1e6  # every process of the run, not just one
    os.set_blocking(ok_r, False)
    try:
        set_up = os.read(ok_r, 1) == b"1"
    except BlockingIOError:
        set_up = False
    os.close(ok_r)
    if not set_up and reply["exit_code"] == SETUP_FAILED and err.data.startswith(b"rl-fabric"):
        reply.update(status="sandbox_error", error=err.data.decode(errors="replace").strip())
    files = {}
    for name in req.get("collect") or ():
        data = _collect(name, limits["collect_bytes"])
        if data is not None:
            files[name] = base64.b64encode(data).decode()
    reply["files"] = files
    return reply
