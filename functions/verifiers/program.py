"""The program of one sandboxed run: forked by the zygote, it sets up its own sandbox.

The zygote makes a fresh PID namespace for every run: its PID 1 is a tiny exec'd init
(``functions.verifiers.init``, or ``cat``, reading a pipe the run's supervisor holds) and
the program, a fork of the zygote's warm interpreter, is PID 2. Ahead of any request (a
*spare*), still root but inside the zygote's read-only jail, the program joins its uid
slot's cgroups and its network and UTS namespaces, takes fresh mount and IPC namespaces,
mounts a size-limited tmpfs at ``/sandbox`` (also seen as ``/tmp``) and at ``/dev/shm``, and
the namespace's ``/proc``, hands its supervisor (``functions.verifiers.supervisor``, in the client) a
descriptor of ``/sandbox`` and of its stdin, becomes the run's unprivileged uid (clearing
every capability), enters a user namespace of its own, drops what that namespace granted,
sets ``no_new_privs`` and waits.

Meanwhile the supervisor writes the run's files and stdin through those descriptors and
sends the start message; the program takes its rlimits, scrubs its environment, says
(out of band) that its set-up worked, and either ``exec``s a command or, for Python, runs
the source in this already-initialised interpreter (the point of the zygote: no
interpreter start-up).

Why a separate PID 1 and not the program: the kernel drops the signals a PID 1 sends
itself without a handler, so as PID 1 a program's ``abort()`` or ``kill(getpid(), ...)``
would not end it. The init installs no handler, so nothing in the namespace can signal it
either, and it runs as root, so nothing there can trace it. When the supervisor closes
the pipe (the run is over, or the supervisor died), or kills the init, the kernel kills
everything left in the namespace. Why an exec'd init and not a fork of Python: the
zygote starts it with ``posix_spawn`` (a vfork: no copy of the interpreter's page tables),
and its exit unmaps almost nothing; a forked interpreter costs both, on every run.

Stdlib only, like everything the zygote imports.
"""

from __future__ import annotations

import atexit
import bisect
import builtins
import fcntl
import io
import json
import os
import resource
import select
import signal
import socket
import sys
import traceback
import types
from typing import Any

from functions.verifiers import _linux as lx
from functions.verifiers import jail, rpc_harness, rpc_server

#: Fresh for every run, with the PID namespace the zygote makes for it. Network
#: and UTS namespaces are the uid slot's (``make_slot_namespaces``).
RUN_NAMESPACES = lx.CLONE_NEWNS | lx.CLONE_NEWIPC
SLOT_NAMESPACES = lx.CLONE_NEWNET | lx.CLONE_NEWUTS
WORK = "/sandbox"
#: Environment of every run: nothing inherited, so no credential can leak in.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORK,
    # the run's uid has no entry in /etc/passwd: getpass.getuser() takes its name from these
    "USER": "sandbox",
    "LOGNAME": "sandbox",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
    # one thread for the math libraries, not one per core of the host: OpenBLAS starts them
    # all as numpy is imported, and where the host has more cores than the run has processes
    # (``nproc``) the import died. The run's CPU limit counts all its threads anyway
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # glibc gives each new thread a malloc arena of its own (up to 8 per core), 64 MiB of
    # address space reserved apiece, and RLIMIT_AS (memory_mb) counts reservations: at
    # memory_mb=256 a sixth live thread could not start. Two arenas, shared by all threads.
    # (Each thread's stack, 8 MiB by glibc's default from RLIMIT_STACK, counts too: about
    # twenty threads at 256. Kept: a smaller default would end recursion through C code, as
    # lru_cache's, in a thread at a fraction of a host's depth, 2,000 calls a MiB, with a
    # SIGSEGV; an exec'd program's default could only come from a lower RLIMIT_STACK, which
    # is also its main thread's bound)
    "MALLOC_ARENA_MAX": "2",
}
#: The descriptors of a spare the zygote sends its supervisor, in this order: the start
#: message goes in ``go``; ``out``/``err`` are the program's; ``ok`` its socket; ``status``
#: the exit status the zygote forwards; closing ``hold`` ends the namespace (a death link);
#: ``pidfd`` and ``init`` are the program's and the init's process descriptors.
SPARE_FDS = ("go", "out", "err", "ok", "status", "hold", "pidfd", "init")
EXEC_FAILED = 127
#: Exit code of a program whose sandbox set-up failed (with a message on stderr).
SETUP_FAILED = 125
#: The run's tmpfs, sized ahead of time (a request for another size remounts it).
DEFAULT_DISK_MB = 64
INODES = 4096
#: The run's ``/dev/shm``: POSIX semaphores (every lock and queue of ``multiprocessing``) and
#: shared memory are files there. A fixed size: its pages count against the run's memory
#: cgroup like any other, and this bounds them where there is none.
SHM_MB = 32
SHM_INODES = 1024


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


def _read_exactly(fd: int, n: int) -> bytes:
    """``n`` bytes of ``fd`` and not one more; EOF first means the supervisor gave up on
    this spare."""
    data = b""
    while len(data) < n:
        chunk = os.read(fd, n - len(data))
        if not chunk:
            os._exit(0)
        data += chunk
    return data


def _marker_line(fd: int) -> bytes:
    """The marker line the supervisor left in ``fd`` (empty if the program took it or closed
    the descriptor: then the run cannot pass)."""
    line = b""
    try:
        while not line.endswith(b"\n"):
            chunk = os.read(fd, 64)
            if not chunk:
                return b""
            line += chunk
    except OSError:
        return b""
    return line


def _run_python(source: str, entry: str, marker_fd: int | None = None, role: str | None = None) -> int:
    """Run ``source`` as ``__main__`` in this (forked, pristine) interpreter. With
    ``marker_fd``, print the marker line read from it once the source ran to its end (read
    only then, so no frame or object of this process holds it while user code runs).

    ``role``: one of a pair of runs for assert-style tests (``functions.verifiers.rpc``).
    ``"serve"``: run the program, then answer the tests' requests; ``"test"``: run the
    tests against it. Requests come in on fd 3 and leave by the run's stdout; fd 1 is
    pointed at stderr first, so nothing printed can be mistaken for a frame."""
    channel = -1
    if role is not None:
        channel = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 10)
        os.dup2(2, 1)
        os.set_inheritable(3, False)
    sys.argv = [entry]
    sys.path[:] = [WORK] + [p for p in sys.path if p.startswith(sys.base_prefix) or p.startswith(sys.prefix)]
    # buffered, as python's own: over a bare descriptor, sys.stdin.buffer.readline (the fast
    # input of competitive programming) read one byte per system call, 4x python's CPU
    sys.stdin = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="replace"
    )
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=role is not None,  # it shares a pipe with stderr: keep them in order
    )
    sys.stderr = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    # and the originals (sys.__stdout__...) too, as in python: they were the zygote's own,
    # on the same descriptors, and what a program printed there was never flushed
    for name in ("stdin", "stdout", "stderr"):
        setattr(sys, f"__{name}__", getattr(sys, name))
    if role is None:
        atexit._clear()  # the zygote's, inherited through the fork: not the program's to run
        # what python sets at its start (the spare has the kernel's defaults, right for an
        # exec'd program): SIGINT raises KeyboardInterrupt, and a write to a closed pipe
        # raises BrokenPipeError instead of killing the program. (Not for a pair's runs:
        # there a program still writing to a channel its tests closed dies quietly)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    code = 0
    try:
        if role == "test":
            code = rpc_harness.run_tests(source, entry, 3, channel)
        else:
            compiled = compile(source, entry, "exec", dont_inherit=True)  # its own __future__ flags
            # a real __main__ module, as Python's: pickle, doctest, typing's string annotations
            # find the program's names through sys.modules (the sandbox's own module, before)
            main = types.ModuleType("__main__")
            namespace = main.__dict__
            namespace.update(__builtins__=builtins, __file__=os.path.abspath(entry))
            sys.modules["__main__"] = main
            exec(compiled, namespace)
            if role == "serve":
                sys.stdout.flush()  # what the top-level code printed comes first
                code = rpc_server.serve(namespace, 3, channel)
            if marker_fd is not None:  # the source ran to its end: assert-style tests all ran
                sys.stdout.flush()
                os.write(1, b"\n" + _marker_line(marker_fd))
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
    if role is None:
        _finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            if not getattr(stream, "closed", False):  # (Python skips a closed one at exit too)
                stream.flush()
        except BaseException:
            code = code or 1
    return code


def _finalize() -> None:
    """What Python does between the end of ``__main__`` and its exit: wait for the threads
    that are not daemons, then run the ``atexit`` handlers. A run ended at once, which lost
    the output of competitive programming's idiom for deep recursion (``main()`` in a
    thread with a large stack, the main thread done as soon as it started it)."""
    threading = sys.modules.get("threading")  # (not imported: no thread of its to wait for)
    try:
        if threading is not None:
            threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # (a KeyboardInterrupt of its own making): the exit goes on
        pass
    atexit._run_exitfuncs()  # each handler's exception is printed, and the next one runs


def _move_fds(fds: list[int]) -> None:
    """Make ``fds`` this process's 0, 1, 2... and close every other descriptor (the other
    runs' pipes and the namespace descriptors the zygote holds)."""
    # above 0..N first, so no dup2 below overwrites a source it still needs
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 64) for fd in fds]
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(len(fds), 65536)


def _die_with_zygote(zygote_pidfd: int) -> None:
    """Arm the parent-death signal (the zygote is the parent); if the zygote already died,
    nothing would ever send it, so exit now."""
    lx.prctl(lx.PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([zygote_pidfd], [], [], 0)[0]:
        os._exit(1)


def _join_own_group(init: str) -> None:
    """Join a process group of the run's own that this process does not lead, as a program
    a judge starts with subprocess is in its judge's group.

    Not the init's group (PID 1, which nothing in the namespace can signal): its number is
    1, and ``killpg(1, sig)`` is ``kill(-1, sig)``, every process but the caller, so a
    program's ``killpg(getpgrp(), SIGTERM)`` left the program itself running (or, alone,
    failed with ESRCH). Not a group of its own either: its leader may not call ``setsid()``
    (nor ``setpgid(0, 0)`` once it leads a session). So a throwaway child (``init``, whose
    stdin is ``/dev/null``: it exits at once) starts the group, and the program joins it;
    the group outlives its leader, and the kernel gives its number to no other process while
    the group lasts. ``kill(0, ...)`` and ``killpg(getpgrp(), ...)`` reach the program and
    its children, as on a host. The cost, off the run's latency (the spare is made ahead):
    a vfork and the exec of the init (181 bytes on x86-64: some 60 us of CPU)."""
    leader = os.posix_spawn(
        init,
        ["rlfabric-group"],
        {},
        file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)],
        setpgroup=0,
    )
    # (it may have exited already: unreaped, it is still in its group)
    os.setpgid(0, leader)
    os.waitpid(leader, 0)


def _pin(cpus: int) -> None:
    """Run on ``cpus`` of the cores this process may use, so ``sched_getaffinity`` (``nproc``,
    Node's ``availableParallelism``, Go's ``GOMAXPROCS``, Python 3.13's ``process_cpu_count``)
    counts what ``os.cpu_count()`` says (``jail.CPUS``), not every core of the host; its
    children inherit the mask. Called as the run starts: the core the kernel just woke the
    program on, an idle one where there was one, and the next ones after it. (Cores given
    out in turn would ignore which are busy, and the zygotes of a host's workers, each
    counting on its own, would pile runs onto the same few while others idle; the kernel
    knows.) The price: the kernel cannot move a pinned run to a core that frees up later.
    The mask bounds no hostile program (it may widen its own); ``cpu_s`` bounds its CPU."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= cpus:
        return
    start = bisect.bisect_left(cores, lx.sched_getcpu())
    os.sched_setaffinity(0, [cores[(start + i) % len(cores)] for i in range(cpus)])


def program(
    uid: int,
    namespaces: list[int],
    cgroup_procs: list[int],
    zygote_pidfd: int,
    go_r: int,
    out_w: int,
    err_w: int,
    ok: int,
    init: str,
    cpus: int,
) -> None:
    """The program (PID 2 of the run's namespace): set up, lock itself down, wait for the run,
    run it. Never returns.

    Everything up to the wait happens while the sandbox is a spare, off the run's latency;
    the rlimits come with the run. ``ok`` is a ``SOCK_SEQPACKET`` socket: the descriptors of
    ``/sandbox`` and stdin go out on it at once, ``b"1"`` once the run's own set-up worked.
    ``init``: the namespace's init program (``_join_own_group``); ``cpus``: the cores a run
    runs on (``_pin``).
    """
    try:
        signal.set_wakeup_fd(-1)  # the zygote's: a handler the program installs must not write there
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _die_with_zygote(zygote_pidfd)
        for fd in cgroup_procs:  # the run's cgroups, before any user code: all it starts counts
            os.write(fd, b"0")
        if os.getpid() != 2:
            raise RuntimeError("the program must be PID 2 of the run's own PID namespace")
        lx.setns(namespaces[0], lx.CLONE_NEWNET)
        lx.setns(namespaces[1], lx.CLONE_NEWUTS)
        _move_fds([os.memfd_create("stdin"), out_w, err_w, go_r, ok, zygote_pidfd])
        for fd in (1, 2):  # the run's, as a pipe is its maker's: /dev/stdout opens it again
            os.fchown(fd, uid, uid)
        lx.unshare(RUN_NAMESPACES)
        opts = f"size={DEFAULT_DISK_MB}m,nr_inodes={INODES},mode=0700,uid={uid},gid={uid}"
        lx.mount("tmpfs", WORK, "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, opts)
        lx.mount(WORK, "/tmp", None, lx.MS_BIND)
        # the run's own, not the host's: nothing of it outlives the run or reaches another
        shm = f"size={SHM_MB}m,nr_inodes={SHM_INODES},mode=1777"
        lx.mount("tmpfs", "/dev/shm", "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, shm)
        jail.restore_relocated()
        lx.mount("proc", "/proc", "proc", lx.MS_NOSUID | lx.MS_NODEV | lx.MS_NOEXEC)
        _join_own_group(init)
        work = os.open(WORK, os.O_PATH | os.O_DIRECTORY)
        chan = socket.socket(fileno=4)
        socket.send_fds(chan, [b"d"], [work, 0])
        os.close(work)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(WORK)
        _become_unprivileged(uid)
        # the uid change cleared the parent-death signal: a spare must not outlive its zygote
        # (a new zygote hands out the same uids)
        _die_with_zygote(5)
        os.close(5)
        # warm until here: the run arrives length-prefixed (not "until EOF": a fork of the
        # worker may hold a copy of the pipe's other end for as long as it lives), and only
        # its own bytes are read: an assert-style run's marker line, or the requests of a
        # run of a pair (``rpc``), follow it in the pipe
        run = json.loads(_read_exactly(3, int(_read_exactly(3, 8), 16)))
        marker_fd = 3 if run.pop("marker", False) else None
        role = run.get("rpc")
        if marker_fd is None and role is None:
            os.close(3)
        _pin(cpus)
        _rlimits(run["limits"])
        env = {**BASE_ENV, **(run.get("env") or {})}
        os.environ.clear()
        os.environ.update(env)
        # set-up succeeded: said out of band, so no program can fake a sandbox failure
        chan.send(b"1")
        chan.close()
    except BaseException as e:
        os.write(2, f"rl-fabric sandbox setup failed: {type(e).__name__}: {e}\n".encode())
        os._exit(SETUP_FAILED)
    if run["mode"] == "python":
        with open(run["entry"], encoding="utf-8", errors="replace") as f:
            source = f.read()
        os._exit(_run_python(source, run["entry"], marker_fd=marker_fd, role=role))
    # an exec'd test harness (verify.with_tests) reads the marker from fd 3 itself. An
    # exec'd run of a pair (JavaScript's program or tests) reads requests from fd 3 and
    # writes frames to fd 4, the run's stdout; its fd 1 is its stderr, as in Python's
    argv = run["argv"]
    try:
        if role is not None:
            os.dup2(1, 4)
            os.dup2(2, 1)
        os.execve(argv[0], argv, env)
    except OSError as e:
        os.write(2, f"cannot execute {argv[0]}: {e.strerror}\n".encode())
    os._exit(EXEC_FAILED)


def main() -> None:
    """``python -m functions.verifiers.program serve|test FILE``: one run of a pair, with no
    sandbox at all (the benchmark's subprocess baseline, ``functions.verifiers.cold``): fd 3
    and stdout are the channel, as in the sandbox."""
    role, entry = sys.argv[1], sys.argv[2]
    with open(entry, encoding="utf-8", errors="replace") as f:
        source = f.read()
    os._exit(_run_python(source, entry, role=role))


def make_slot_namespaces(chan: socket.socket) -> None:
    """In a throwaway child of the zygote: make a network namespace (no interface up, so no
    network at all, loopback included) and a UTS namespace named "sandbox", and send them."""
    lx.unshare(SLOT_NAMESPACES | lx.CLONE_NEWNS)
    lx.sethostname("sandbox")
    lx.mount("none", "/", None, lx.MS_REC | lx.MS_PRIVATE)
    lx.mount("proc", "/proc", "proc", lx.MS_NOSUID | lx.MS_NODEV | lx.MS_NOEXEC)  # to open the two
    fds = [os.open(f"/proc/self/ns/{ns}", os.O_RDONLY) for ns in ("net", "uts")]
    socket.send_fds(chan, [b"ns"], fds)


if __name__ == "__main__":
    main()
