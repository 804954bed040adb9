"""What the sandbox suites share: limits and snippets for hostile programs, and probes that
look at the host from outside (processes left in a uid range, run inits, orphans), a
sandbox of one's own for attacks that may leave debris, and ptrace helpers.

Not a test module: ``test_sandbox_attacks_*.py`` (through ``attack_box``) and
``test_sandbox_lifecycle.py`` import it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from functions.verifiers.sandbox import Limits, RunOutcome, Sandbox, SandboxConfig
from functions.verifiers.verify import Verifier

#: sandboxes of their own (one per hole test), each with its own 1024-uid range. The count
#: restarts in every pytest process, and `make test`'s two workers can run two modules that
#: use it at once (the lifecycle and the holes tests): each worker counts in a region of its
#: own, or both would hand out 342_000 and check each other's processes as leftovers
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
OWN_BASES = itertools.count(500_000 + 100_000 * _WORKER, 1_100)
MB = 1 << 20
FAST = Limits(
    cpu_s=1,
    wall_s=2,
    memory_mb=128,
    nproc=16,
    disk_mb=8,
    fsize_mb=4,
    nofile=32,
    stdout_bytes=64 << 10,
    stderr_bytes=16 << 10,
)
GOOD = "print(sum(map(int, input().split())))"
PIPE_WAITS = ("pipe_read", "pipe_wait", "anon_pipe_read")
ZYGOTE = b"functions.verifiers.zygote"
INIT_TAG = b"rlfabric-init-"  # argv[0] of every run's init

# ctypes preamble of the programs that call the kernel directly
LIBC = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.syscall.restype = ctypes.c_long\n"
    "def err():\n"
    "    return ctypes.get_errno()\n"
)
# enter a user namespace of one's own (full capabilities in it) plus the given namespaces
NEST = (
    "def nest(extra):\n"
    "    uid = os.getuid()\n"
    "    if libc.unshare(0x10000000 | extra) != 0:\n"
    "        return False\n"
    "    open('/proc/self/setgroups', 'w').write('deny')\n"
    "    open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')\n"
    "    open('/proc/self/gid_map', 'w').write(f'0 {uid} 1')\n"
    "    return True\n"
)


# -- looking at the host from outside --------------------------------------------------------
def _proc(pid: str) -> dict[str, str]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def is_zygote_family(pid: str) -> bool:
    """The zygote or a run's init (``cat``, PID 1 of the run's namespace): the live
    processes that hold a run's zombies."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        return (ZYGOTE in cmdline or cmdline.startswith(INIT_TAG)) and _proc(pid)["State"][0] != "Z"
    except OSError:
        return False


def leftovers(base: int) -> list[str]:
    """What of the runs of the sandbox with uids ``base..base+1023`` is still on the host.

    A warm spare (blocked reading its start message) is expected. A zombie already handed to
    the host's reaper is harmless (this VM's PID 1 reaps slowly); one whose parent is still
    the zygote or a run's init is a leak (its run's namespace is stuck with it).
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            st = _proc(entry.name)
            uid = int(st["Uid"].split()[0])
            if not base <= uid < base + 1024:
                continue
            if st["State"][0] == "Z":
                if is_zygote_family(st["PPid"]):
                    found.append(f"{entry.name}: zombie held by {st['PPid']}")
                continue
            if (entry / "wchan").read_text() in PIPE_WAITS:
                continue  # a warm spare
            found.append(f"{entry.name}: {st['State']} {(entry / 'cmdline').read_bytes()[:60]!r}")
        except (OSError, KeyError, ValueError):
            continue  # gone while we looked
    return found


def wait_clean(base: int, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    left = leftovers(base)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = leftovers(base)
    return left


def _live_processes() -> Iterator[tuple[Path, dict[str, str]]]:
    """``(/proc/PID, its status fields)`` of every process that is not a zombie."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                st = _proc(entry.name)
            except OSError:
                continue  # gone while we looked
            if st.get("State", "Z")[0] != "Z":
                yield entry, st


def live_in_range(base: int) -> list[int]:
    """Every non-zombie process with a uid of the range (spares included)."""
    return [
        int(entry.name) for entry, st in _live_processes() if base <= int(st["Uid"].split()[0]) < base + 1024
    ]


def run_inits(zygote_pid: int) -> list[int]:
    """The zygote's live children that are a run's PID 1: one per spare or run in flight."""
    kids = []
    for entry, st in _live_processes():
        if st["PPid"] == str(zygote_pid):
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().startswith(INIT_TAG):
                    kids.append(int(entry.name))
    return kids


def settled_runs(zygote_pid: int, want: int, timeout: float = 3.0) -> int:
    """How many run namespaces are alive, once that is ``want`` (or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    n = len(run_inits(zygote_pid))
    while n != want and time.monotonic() < deadline:
        time.sleep(0.05)
        n = len(run_inits(zygote_pid))
    return n


def orphaned_inits(base: int) -> list[int]:
    """PID 1s of run namespaces of the sandbox ``base`` whose zygote is gone. They run as
    root (outside the uid range): one that outlived its sandbox would hold its namespace,
    and whatever runs in it, forever."""
    tag = INIT_TAG + b"%d\0" % base
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "cmdline").read_bytes() != tag:
                continue
            st = _proc(entry.name)
            nspid = st["NSpid"].split()
            if st["State"][0] == "Z" or len(nspid) < 2 or nspid[-1] != "1":
                continue
            if not is_zygote_family(st["PPid"]):
                found.append(int(entry.name))
        except (OSError, KeyError):
            continue
    return found


def kill_orphaned_inits(base: int) -> list[int]:
    """Kill (by pid) the orphaned PID 1s of this suite's own sandbox ``base``, so the suite
    leaves nothing behind even if that ever happens (see the race test at the end)."""
    pids = orphaned_inits(base)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def wait_no_live(base: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while live_in_range(base) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live_in_range(base) == []


@contextlib.contextmanager
def own_sandbox(**config) -> Iterator[Sandbox]:
    """A sandbox for one attack that may leave debris; closing it must clear everything."""
    base = next(OWN_BASES)
    cfg = {"base_uid": base, "spares": 1, "grace_s": 1.0, **config}
    box = Sandbox(SandboxConfig(**cfg))
    box.start()
    try:
        yield box
    finally:
        box.close()
        kill_orphaned_inits(base)
        assert wait_no_live(base), f"close() left processes running: {live_in_range(base)}"


def py(box: Sandbox, code: str, limits: Limits = FAST, **kw) -> RunOutcome:
    return box.run_python(code, limits=limits, **kw)


def lines(out: RunOutcome) -> list[str]:
    return out.stdout.decode(errors="replace").splitlines()


# -- leaks and lifecycle -----------------------------------------------------------------------
def jail_dirs() -> set[Path]:
    return set(Path("/tmp").glob("rlfabric-jail-*"))


def stale_jail_dirs(before: set[Path]) -> list[Path]:
    """Jail dirs that appeared since ``before`` and stay (another suite's zygote that is
    starting right now has one for a few milliseconds)."""
    new = jail_dirs() - before
    if new:
        time.sleep(0.5)
    return sorted(d for d in new if d.exists())


# -- ptrace, to freeze a process at a chosen point ----------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_CONT, PTRACE_DETACH, PTRACE_GETEVENTMSG, PTRACE_SEIZE = 7, 17, 0x4201, 0x4206
PTRACE_O_TRACEFORK, PTRACE_EVENT_FORK = 0x2, 1
WALL = 0x40000000


def ptrace(request: int, pid: int, data: int = 0) -> int:
    ret = _libc.ptrace(request, pid, None, ctypes.c_void_p(data))
    if ret < 0:
        raise OSError(ctypes.get_errno(), f"ptrace {request} {pid}")
    return ret


def stop_at_fork(pid: int) -> int:
    """Let traced ``pid`` run until it forks; return the child (born stopped, traced too)."""
    while True:
        _, status = os.waitpid(pid, WALL)
        if status >> 8 == signal.SIGTRAP | (PTRACE_EVENT_FORK << 8):
            msg = ctypes.c_ulong()
            _libc.ptrace(PTRACE_GETEVENTMSG, pid, None, ctypes.byref(msg))
            return msg.value
        # anything else: go on, passing a signal on (the zygote's SIGCHLD wakes its loop)
        plain_signal = os.WIFSTOPPED(status) and status >> 16 == 0
        ptrace(PTRACE_CONT, pid, os.WSTOPSIG(status) if plain_signal else 0)


def stop_at_program_fork(zygote: int) -> int:
    """Let the traced zygote run until it forks a program (PID 2 of a new namespace; the
    init before it is a vfork, not traced); a helper it forks for a new slot's namespaces
    is let go. The program is returned frozen at birth."""
    while True:
        child = stop_at_fork(zygote)
        os.waitpid(child, WALL)  # born stopped
        if len(_proc(str(child))["NSpid"].split()) > 1:
            return child
        ptrace(PTRACE_DETACH, child)
        ptrace(PTRACE_CONT, zygote)


def pair_sandbox(base: int) -> Iterator[Sandbox]:
    """A module's sandbox for Python's assert-style pairs (skipped where sandboxes cannot
    run); once closed, nothing of it survives in its uid range."""
    from functions.verifiers import _linux

    if _linux.supported() is not None:
        import pytest

        pytest.skip(str(_linux.supported()))
    with Sandbox(SandboxConfig(base_uid=base, spares=2)) as sb:
        yield sb
    assert wait_clean(base) == []


def checked_verifier(sandbox: Sandbox, base: int, limits: Limits) -> Iterator[Verifier]:
    """A verifier for one test; after it, nothing of either run survives, and every uid slot
    came back (only the two warm spares' namespaces are alive)."""
    yield Verifier(sandbox, limits)
    # a leak stays; a pair killed at its wall limit on a loaded machine (the full suite on
    # two workers) took over 5 s to be gone in CI-like runs, so the bound is generous
    left = wait_clean(base, timeout=20.0)
    assert left == [], f"processes of a finished pair survived: {left}"
    assert sandbox._zygote is not None
    assert settled_runs(sandbox._zygote.pid, 2) == 2, "a run's namespace is stuck (uid slot leaked)"
