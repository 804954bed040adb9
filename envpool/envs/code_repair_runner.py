"""The sandboxed test runner of ``code-repair-v1``: a subprocess that imports the policy's
module in its work dir, evaluates each check's call and reports the values, never the
verdict (that is :mod:`envpool.envs.code_repair_judge`'s), and is killed with everything it
started after every run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envpool.envs.code_repair_kill import kill_left_in, kill_tree
from envpool.envs.code_repair_limits import (
    DEFAULT_MAX_PROCESSES,
    DEFAULT_MEMORY_BYTES,
    MemoryCgroup,
    PidsCgroup,
    set_memory_limit,
)
from envpool.envs.code_repair_script import RUNNER  # the program a run runs (how: its comment)
from envpool.envs.code_repair_user import hand_over, take_back
from envpool.errors import EnvUsageError

__all__ = [
    "ISOLATION",
    "MAX_FILE_BYTES",
    "MAX_RESULTS_BYTES",
    "PID_NAMESPACE",
    "RUNNER",
    "RunOutput",
    "kill_left_in",
    "kill_tree",
    "run_checks",
]

MAX_RESULTS_BYTES = 2_000_000
"""What is read of the subprocess's results file (each value is capped at 100 kB)."""
MAX_RAW_OUTPUT_BYTES = 1_000_000
"""What is read of the end of the run's stdout and stderr (the env shows the end of that)."""
_OOM_KILL_WAIT_S = 0.5
"""How long an OOM event waits for a kill in the run's own cgroup (the kernel counts it right
after the event; none comes where the OOM was the container's, its victim outside the run)."""
MAX_FILE_BYTES = 16 * 2**20
"""RLIMIT_FSIZE of a test run: a module writing without end is killed, not the disk filled."""


PID_NAMESPACE = True
"""Run each test run in a PID namespace of its own where the kernel allows it (see
``RUNNER``); False runs the fallback everywhere (for the tests)."""


@dataclass(frozen=True)
class RunOutput:
    output: str
    """The end of the run's stdout and stderr (the module's prints), decoded: its last
    ``MAX_RAW_OUTPUT_BYTES``."""
    output_bytes: int
    """How many bytes the run wrote there in all."""
    results: str
    """The runner's JSON lines (see ``RUNNER``), at most ``MAX_RESULTS_BYTES``."""
    timed_out: bool
    out_of_memory: bool = False
    """A ``MemoryError`` was raised in the run (its address-space limit, most likely)."""
    memory_limit_hit: bool = False
    """The run's processes together reached its memory cgroup's cap: the kernel's OOM killer
    killed one of them, and the run was ended there."""
    container_memory_kill: bool = False
    """The kernel's OOM killer killed a process of the run for the memory of its container (a
    cgroup above the run's), the run's own cap not reached."""
    process_limit_hit: bool = False
    """A fork or a thread start was refused for the run's process cap."""
    isolation: dict[str, bool] | None = None
    """What the run's module was cut off by (``ISOLATION``: each True where it got it), as the
    runner reported it before the module ran; None where it never did (it ended before)."""


ISOLATION = ("pid_ns", "mount_ns", "net_ns", "own_proc", "own_shm", "caps_dropped")
"""The parts of a run's isolation, in the order of the bits of the runner's report (``RUNNER``):
a PID namespace, a mount namespace and a network namespace of its own, a ``/proc`` of its PID
namespace, a ``/dev/shm`` of its own, and no capability held by the module."""


def _isolation_of(report: int | None) -> dict[str, bool] | None:
    """``RunOutput.isolation`` from the runner's first byte on its done pipe (its high bit set),
    or None where it sent none."""
    if report is None:
        return None
    return {name: bool(report >> i & 1) for i, name in enumerate(ISOLATION)}


def run_checks(
    root: Path,
    spec: dict[str, Any],
    timeout_s: float,
    *,
    memory_bytes: int = DEFAULT_MEMORY_BYTES,
    max_processes: int = DEFAULT_MAX_PROCESSES,
    run_uid_base: int | None = None,
) -> RunOutput:
    """Run ``RUNNER`` in ``root`` on ``spec`` (the module's name, the names the tests import
    and the checks' calls; never the expected values) for at most ``timeout_s``, each of its
    processes in ``memory_bytes`` of address space and, where cgroups can be made
    (``code_repair_limits``), all of them in ``memory_bytes`` of memory together and at most
    ``max_processes`` processes and threads at once; then kill it with everything it
    started. With ``run_uid_base`` (where this process is root: ``code_repair_user``) the
    module runs as uid ``run_uid_base`` + the run's keeper's pid, which takes the work dir;
    ``EnvUsageError`` where that uid cannot be taken (the module never runs then)."""
    pids = PidsCgroup.make(max_processes)
    try:
        memory = MemoryCgroup.make(memory_bytes)
        try:
            return _run(root, spec, _Limits(timeout_s, memory_bytes, pids, memory, run_uid_base))
        finally:
            if memory is not None:
                memory.remove()
    finally:
        if pids is not None:
            pids.remove()


#: the runner's refusals to run the module, each its own first line on the results fd
_REFUSALS = {
    "caps_error": (
        "code-repair: a test run's module, run as this process's user (run_uid_base=None, or a "
        "server that is not root), could not be stripped of its capabilities ({why}): it never "
        "runs with them, as they reach past the run (the server's process group, the "
        "container's /proc and network)"
    ),
    "uid_error": (
        "code-repair: this process is root, and a test run could not take a uid of its own "
        "({why}): the policy's module is never run as root. Pass run_uid_base= a range of uids "
        "this process may take (in a user namespace: inside its map), or None to run it as this "
        "process's user where the container is the sandbox"
    ),
}


def _run(root: Path, spec: dict[str, Any], limits: _Limits) -> RunOutput:
    env = {"PATH": os.defpath, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "HOME": str(root)}
    uid_base = "-" if limits.run_uid_base is None else str(limits.run_uid_base)
    done_r, done_w = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as results:
        # in this process's group, not a session of its own: a container is killed as a
        # whole (its process group), and a test run must go with it (in a PID namespace only
        # the runner takes a session of its own: the init stays here, and its death ends it)
        argv = [sys.executable, "-I", "-B", "-u", "-c", RUNNER, str(os.getpid()), str(results.fileno())]
        try:
            proc = subprocess.Popen(
                [*argv, str(done_w), "1" if PID_NAMESPACE else "0", str(limits.memory_bytes), uid_base],
                cwd=root,
                env=env,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(results.fileno(), done_w),
            )
        finally:
            os.close(done_w)
        try:
            timed_out, oom_ended, report = _await_runner(
                proc, done_r, json.dumps(spec).encode() + b"\n", root, limits
            )
        finally:
            os.close(done_r)
        size = out.seek(0, os.SEEK_END)
        out.seek(max(0, size - MAX_RAW_OUTPUT_BYTES))  # the end is what is shown
        raw = out.read(MAX_RAW_OUTPUT_BYTES).decode("utf-8", errors="replace")
        results.seek(0)
        reported = results.read(MAX_RESULTS_BYTES).decode("utf-8", errors="replace")
    for key, refusal in _REFUSALS.items():
        if reported.startswith(f'{{"{key}"'):  # the runner's own line, before the module ran
            raise EnvUsageError(refusal.format(why=json.loads(reported.partition("\n")[0])[key]))
    killed = oom_ended or (limits.memory is not None and limits.memory.oom_killed())
    own_cap = limits.memory is not None and limits.memory.limit_reached()
    return RunOutput(
        output=raw,
        output_bytes=size,
        results=reported,
        timed_out=timed_out,
        out_of_memory=_ran_out_of_memory(reported, raw),
        memory_limit_hit=killed and own_cap,
        container_memory_kill=killed and not own_cap,
        process_limit_hit=limits.pids is not None and limits.pids.hit_limit(),
        isolation=_isolation_of(report),
    )


_MEMORY_ERROR_LINE = re.compile(r"^(?:Fatal Python error: .*(?i:memory).*|MemoryError\b.*)$", re.MULTILINE)


def _ran_out_of_memory(reported: str, raw: str) -> bool:
    """Whether a ``MemoryError`` was raised in the run: a check or the import raised one (the
    runner reports the exception by its class names), or the output holds a traceback's last
    line of one or the interpreter's fatal error (an allocation that failed in its own code,
    or in a process the module started). The word elsewhere (a print, a returned string) is
    not one."""
    for line in reported.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        raised = entry.get("raised")
        if isinstance(raised, list) and "MemoryError" in raised:
            return True
        if str(entry.get("import_error", "")).startswith("MemoryError"):
            return True
    return _MEMORY_ERROR_LINE.search(raw) is not None


@dataclass(frozen=True)
class _Limits:
    timeout_s: float
    memory_bytes: int
    pids: PidsCgroup | None
    memory: MemoryCgroup | None
    run_uid_base: int | None = None

    @property
    def cgroups(self) -> list[PidsCgroup | MemoryCgroup]:
        return [cg for cg in (self.pids, self.memory) if cg is not None]


def _await_runner(
    proc: subprocess.Popen[bytes], done_r: int, spec: bytes, root: Path, limits: _Limits
) -> tuple[bool, bool, int | None]:
    """Set the runner's limits, feed it its spec and wait for its done byte, its exit, an
    OOM kill in its memory cgroup or the timeout; then kill it with everything it started.
    Whether it timed out, whether it was ended for its memory cap, and the runner's isolation
    report (None where none came). (The limits are set before the spec is written: the keeper
    reads it before it forks or runs anything.)"""
    timeout_s = limits.timeout_s
    # a backstop should the timeout below never come (this process stopped): SIGKILL
    # past about test_timeout_s of CPU (soft = hard: no SIGXCPU core dump)
    cpu_s = math.ceil(timeout_s) + 1
    with contextlib.suppress(OSError, ValueError):
        resource.prlimit(proc.pid, resource.RLIMIT_CPU, (cpu_s, cpu_s))
    with contextlib.suppress(OSError, ValueError):
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (MAX_FILE_BYTES, MAX_FILE_BYTES))
    with contextlib.suppress(OSError, ValueError):
        set_memory_limit(proc.pid, limits.memory_bytes)
    for cgroup in limits.cgroups:
        cgroup.add(proc.pid)
    if limits.run_uid_base is not None:  # the module's uid, as the keeper computes it
        hand_over(root, limits.run_uid_base + proc.pid)
    oom_fd = limits.memory.oom_eventfd() if limits.memory is not None else None
    try:
        return _await_end(proc, done_r, spec, root, limits, oom_fd)
    finally:
        if oom_fd is not None:
            os.close(oom_fd)


def _await_end(
    proc: subprocess.Popen[bytes], done_r: int, spec: bytes, root: Path, limits: _Limits, oom_fd: int | None
) -> tuple[bool, bool, int | None]:
    assert proc.stdin is not None
    with contextlib.suppress(OSError):  # it died at once: its exit tells
        proc.stdin.write(spec)
        proc.stdin.flush()
    deadline = time.monotonic() + limits.timeout_s
    timed_out, oom_ended = True, False
    report: int | None = None
    first = True
    # the done byte, or the keeper's exit (it died: the done pipe stays open in whatever the
    # module forked, so its EOF cannot tell). poll, not select: select takes no fd past 1023
    poller = select.poll()
    poller.register(done_r, select.POLLIN)
    if oom_fd is not None:
        poller.register(oom_fd, select.POLLIN)
    with _exit_watch(proc.pid) as exited:
        for fd in exited:
            poller.register(fd, select.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            wait_s = left if exited else min(left, 0.05)
            ready = {fd for fd, _ in poller.poll(math.ceil(wait_s * 1000))}
            if oom_fd is not None and oom_fd in ready:
                with contextlib.suppress(OSError):
                    os.read(oom_fd, 8)  # (reset: it stays readable until read)
                # v1 tells every cgroup below one out of memory: the container's OOM, whose
                # victim was maybe outside the run, fires it too. The run ends only for a kill
                # of its own (counted just after the event: a bounded wait for it)
                if limits.memory is not None and limits.memory.oom_killed(within_s=_OOM_KILL_WAIT_S):
                    # out of memory: the OOM killer took one process, and the run ends here as
                    # a whole (what waited on that one would have waited until the timeout)
                    timed_out, oom_ended = False, True
                    break
            if done_r in ready:
                byte = os.read(done_r, 1)
                if first and byte and byte[0] & 0x80:
                    # the runner's isolation report, written before the module ran: only the
                    # first byte may be one (the module can write this pipe once it runs)
                    first, report = False, byte[0] & 0x7F
                    continue
                first = False
                if byte:
                    timed_out = False
                    break
                poller.unregister(done_r)  # closed by the module: its exit, or the timeout, tells
            if (exited and exited[0] in ready) or (not exited and proc.poll() is not None):
                timed_out = False
                break
    if proc.returncode is None:  # not reaped (a zombie at worst): its pid is still its own
        kill_tree(proc.pid)  # the keeper and all below it (a subreaper, or a namespace's init)
    with contextlib.suppress(OSError):
        proc.stdin.close()
    proc.wait()
    for cgroup in limits.cgroups:  # their members: what the run started, wherever it went
        cgroup.kill_all()
    # a keeper that ended by itself (its namespace's init ended, which took the namespace
    # with it; or, without a namespace, the module killed it) cannot be told apart from a
    # kill: in the second case what the run started left its tree, but maybe not this
    # process group nor the work dir (a run in a PID namespace is not in this group, and
    # nothing of it outlives its init). One scan of /proc, after every run
    kill_left_in(root)
    if limits.run_uid_base is not None:  # nothing of the run is left: its uid may come back
        take_back(root)
    return timed_out, oom_ended, report


@contextlib.contextmanager
def _exit_watch(pid: int) -> Iterator[list[int]]:
    """``[a pidfd]`` that turns readable when ``pid`` exits, or ``[]`` where there is none
    (then the caller polls)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        yield []
        return
    try:
        yield [fd]
    finally:
        os.close(fd)
