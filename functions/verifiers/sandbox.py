"""The client side of the code sandbox: ``Sandbox`` starts a zygote and runs programs in it.

    with Sandbox() as sb:
        out = sb.run_python("print(input()[::-1])", stdin=b"hello\\n")
        out.stdout  # b"olleh\\n"

One ``Sandbox`` per worker process (the code verifier starts it in its setup hook). It is
thread-safe; each ``run`` takes one warm sandbox the zygote prepared ahead of time and
supervises it from the calling thread (``functions.verifiers.supervisor``), and gets back
exactly what happened (``RunOutcome``); judging the output is the verifier's business.
``run_pair`` runs a Python or JavaScript program and its assert-style tests as two such runs
that talk only through the supervisor (``PairOutcome``). If
the zygote dies, runs in flight end in ``SandboxError`` and the next run starts a fresh
zygote.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from functions.verifiers import _linux, jail
from functions.verifiers.cgroups import SlotCgroups, missing_note
from functions.verifiers.errors import SandboxError, SandboxUnavailable
from functions.verifiers.program import BASE_ENV, SPARE_FDS
from functions.verifiers.supervisor import Spare, supervise, supervise_pair

log = logging.getLogger("functions.verifiers")


class Limits(BaseModel):
    """What one run may use. Defaults suit a test case of a competitive-programming task."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cpu_s: float = Field(2.0, gt=0, le=600, description="CPU seconds (SIGKILL at the limit)")
    wall_s: float = Field(5.0, gt=0, le=3600, description="wall clock; the whole run is killed at it")
    memory_mb: int = Field(
        512, ge=32, le=1 << 20, description="memory of the whole run (cgroup; plus disk_mb for its files)"
    )
    address_space_mb: int | None = Field(
        None, ge=32, le=1 << 22, description="RLIMIT_AS per process (default memory_mb; V8 reserves more)"
    )
    nproc: int = Field(32, ge=1, le=4096, description="processes and threads of the run's uid")
    fsize_mb: int = Field(16, ge=0, le=1 << 20, description="largest file the run may write")
    nofile: int = Field(64, ge=8, le=65536, description="open files")
    disk_mb: int = Field(64, ge=1, le=1 << 16, description="size of the run's tmpfs (/sandbox, /tmp)")
    stdout_bytes: int = Field(1 << 20, ge=1, description="stdout kept; a run writing more is killed")
    stderr_bytes: int = Field(
        64 << 10, ge=1, description="stderr kept; past it, its first and last halves (never a kill)"
    )
    collect_bytes: int = Field(64 << 20, ge=1, description="largest file a run may hand back")
    channel_bytes: int = Field(
        64 << 20, ge=1, description="bytes a program and its tests (run_pair) may send each other, each way"
    )


class SandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    spares: int = Field(4, ge=1, le=64, description="warm sandboxes kept ready")
    base_uid: int = Field(200_000, ge=1000, description="runs get uids base_uid .. base_uid+1023")
    python: str = Field(default_factory=lambda: sys.executable, description="interpreter of the zygote")
    cgroups: bool = Field(True, description="per-run memory/CPU/task budgets in cgroups, where available")
    cpus: int = Field(
        jail.CPUS,
        ge=1,
        le=1024,
        description=(
            "cores every run sees (os.cpu_count(), which sizes default pools) and is pinned to"
            " (sched_getaffinity, nproc), whatever the host has"
        ),
    )
    start_timeout_s: float = Field(30.0, gt=0)
    #: how much longer than a run's wall limit the client waits for its report
    grace_s: float = Field(5.0, gt=0)


class RunOutcome(BaseModel):
    """What happened to one program (no judgement; see ``functions.verifiers.verify``)."""

    status: Literal["exited", "signaled", "timeout", "cpu_limit", "output_limit", "stopped", "sandbox_error"]
    """``stopped``: a run of a pair ended because the other one did (``Sandbox.run_pair``)."""
    exit_code: int | None = None
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    """All of it, or past ``stderr_bytes`` its first and last halves with a line between them
    that says how much was cut (``supervisor.cut_marker``)."""
    stdout_total: int = 0
    stderr_total: int = 0
    wall_ms: float = 0.0
    cpu_ms: float = 0.0
    maxrss_kb: int = 0
    files: dict[str, bytes] = Field(default_factory=dict)
    error: str | None = None
    oom_killed: bool = False
    """The run's memory cgroup killed a process at its limit."""


class PairOutcome(BaseModel):
    """What happened to a program and its assert-style tests (``Sandbox.run_pair``)."""

    program: RunOutcome
    """Its stdout is empty (it was the channel); what the program printed, to stdout or
    stderr, is its ``stderr``."""
    tests: RunOutcome
    """Its exit code is the verdict (``functions.verifiers.rpc.PASSED`` and the others)."""


class Sandbox:
    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._lock = threading.Lock()
        self._pair_lock = threading.Lock()
        self._zygote: subprocess.Popen[bytes] | None = None
        self._chan: socket.socket | None = None
        self._spares: queue.Queue[Spare | _Failed | None] = queue.Queue()
        self._slots = SlotCgroups({})
        self.shared = ""
        self.cgroups: list[str] = []
        self._warned = False  # that it runs without some of its cgroups

    # -- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        with self._lock:
            if self._zygote is not None and self._zygote.poll() is None:
                return
            self._shutdown()
            reason = _linux.supported()
            if reason:
                raise SandboxUnavailable(reason)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            cmd = [self.config.python, "-m", "functions.verifiers.zygote"]
            cmd += [str(self.config.base_uid), str(self.config.spares), "1" if self.config.cgroups else "0"]
            cmd.append(str(self.config.cpus))
            # an empty environment: nothing of the worker's (keys, tokens) reaches a run
            env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": _package_root()}
            # Python runs are forks of the zygote's interpreter, whose malloc read its settings
            # at start: the arenas' bound (program.BASE_ENV says why) must be set here too
            env["MALLOC_ARENA_MAX"] = BASE_ENV["MALLOC_ARENA_MAX"]
            # a session of its own: a kill of the worker's process group (the local pool kills
            # it to end the helpers a function forked) must not cut short the zygote's own
            # shutdown, which ends its runs and removes its cgroups. It still dies with the
            # worker: the worker's end of the channel closes with it (no exec'd child inherits
            # it), and the zygote shuts down on that EOF
            self._zygote = subprocess.Popen(
                cmd,
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                env=env,
                cwd="/",
                start_new_session=True,
            )
            theirs.close()
            ours.settimeout(self.config.start_timeout_s)
            try:
                hello = json.loads(ours.recv(65536) or b"{}")
            except (OSError, ValueError) as e:
                hello = {"error": f"no answer from the sandbox zygote ({e})"}
            if not hello.get("ready"):
                self._zygote.kill()
                self._zygote.wait()
                raise SandboxUnavailable(hello.get("error") or "the sandbox zygote exited while starting")
            ours.settimeout(None)
            self.shared = hello["shared"]
            paths = hello.get("cgroups") or {}
            self.cgroups = sorted(paths)
            # once per sandbox, not per zygote restart; not where the config turned them off
            if self.config.cgroups and not self._warned and (note := missing_note(paths)):
                self._warned = True
                log.warning("%s", note)
            self._slots = SlotCgroups(paths)
            self._chan = ours
            self._spares = queue.Queue()
            args = (ours, self._spares, self.config.base_uid, self._slots)
            threading.Thread(target=self._receive, args=args, daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._chan is not None:
            # shutdown, not just close: it also wakes the thread blocked reading the channel
            with contextlib.suppress(OSError):
                self._chan.shutdown(socket.SHUT_RDWR)
            self._chan.close()  # the zygote exits on EOF; its sandboxes die with it
            self._chan = None
        if self._zygote is not None:
            try:
                self._zygote.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait()
            self._zygote = None
        while not self._spares.empty():
            spare = self._spares.get_nowait()
            if isinstance(spare, Spare):
                spare.close()  # its namespace ends
        self._spares.put(None)  # runs still waiting on this zygote wake up and go to the next
        self._slots.close()

    @staticmethod
    def _receive(
        chan: socket.socket,
        spares: queue.Queue[Spare | _Failed | None],
        base_uid: int,
        cgroups: SlotCgroups,
    ) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(chan, 4096, len(SPARE_FDS))
                _close_on_exec(fds)
            except OSError:
                msg, fds = b"", []
            if not msg:
                spares.put(None)  # the zygote is gone: waiting runs fail fast
                return
            if fds:
                try:
                    spares.put(Spare.from_message(msg, fds, base_uid, chan, cgroups))
                except (ValueError, KeyError, OSError) as e:  # a cut-off message: this spare only
                    for fd in fds:
                        os.close(fd)
                    spares.put(_Failed(chan, SandboxError(f"a warm sandbox arrived incomplete ({e})")))
            else:
                try:
                    error = str(json.loads(msg)["error"])
                except (ValueError, KeyError, TypeError):
                    error = f"the zygote could not make a sandbox ({msg[:200]!r})"
                spares.put(_Failed(chan, SandboxError(error)))

    # -- runs ------------------------------------------------------------------------
    def run_python(
        self, source: str, *, stdin: bytes = b"", limits: Limits | None = None, **kw: Any
    ) -> RunOutcome:
        files = {"solution.py": source.encode(), **kw.pop("files", {})}
        return self.run(mode="python", entry="solution.py", files=files, stdin=stdin, limits=limits, **kw)

    def run(
        self,
        *,
        mode: Literal["python", "exec"],
        files: dict[str, bytes] | None = None,
        entry: str | None = None,
        argv: list[str] | None = None,
        stdin: bytes = b"",
        limits: Limits | None = None,
        executable: tuple[str, ...] = (),
        collect: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        marker: str | None = None,
    ) -> RunOutcome:
        """Run one program in a fresh sandbox. Raises ``SandboxError`` only for the sandbox's
        own failures (retryable); whatever the program does is in the ``RunOutcome``.

        ``marker``: a line the supervisor leaves on the program's fd 3, after the start
        message, for a test harness to print once the tests ran, so a caller can tell "all
        the asserts ran" from an early ``exit(0)``. In Python mode the runner prints it after
        the source ran to its end; an exec'd harness reads fd 3 itself (``verify.with_tests``).
        It is in no source, argv, environment or frame of the run, but a program that reads
        fd 3 can forge it (docs/code-verifier.md). Bad file names raise ``ValueError``."""
        limits = limits or Limits()
        for name in (*(files or {}), *collect):
            if not _plain_name(name):
                raise ValueError(f"file name {name!r}: use a plain name inside the work dir (no '/', '..')")
        req = {
            "mode": mode,
            "entry": entry,
            "argv": argv,
            "files": dict(files or {}),
            "executable": list(executable),
            "stdin": stdin,
            "limits": limits.model_dump(),
            "collect": list(collect),
            "env": env or {},
            "marker": marker,
        }
        spare = self._take_spare()
        try:
            try:
                slot = spare.cgroups.slot(spare.slot)
            except OSError as e:
                raise SandboxError(f"opening the run's cgroups: {e}") from e
            reply = supervise(spare, req, slot, self.config.start_timeout_s, self.config.grace_s)
        finally:
            spare.close()
            spare.done()  # only now may the zygote give the uid slot to another run
        outcome = RunOutcome.model_validate(reply)
        if outcome.status == "sandbox_error":
            raise SandboxError(outcome.error or "the sandbox failed")
        return outcome

    def run_pair(
        self,
        *,
        files: dict[str, bytes],
        entry: str,
        test_files: dict[str, bytes],
        test_entry: str,
        limits: Limits | None = None,
        argv: list[str] | None = None,
        test_argv: list[str] | None = None,
        executable: tuple[str, ...] = (),
        test_executable: tuple[str, ...] = (),
    ) -> PairOutcome:
        """Run a program and its assert-style tests as two sandboxed runs that talk only
        through the supervisor (``functions.verifiers.rpc``): the program (``files``,
        ``entry``; empty stdin) runs its top-level code, then answers the tests' requests;
        the tests (``test_files``, ``test_entry``) run with its names bound to proxies. Each
        run has its own namespaces, uid and cgroups and ``limits``; the wall limit covers
        both. The pair ends when the tests end; then the program is ``stopped``.

        Python runs in the zygote's interpreter (``functions.verifiers.rpc_server`` and
        ``rpc_harness``); with ``argv`` and ``test_argv`` each run execs its command instead
        (JavaScript: ``functions/verifiers/js``; C and C++: ``functions.verifiers.native``),
        reading requests from fd 3 and writing frames to fd 4, with its fd 1 pointed at its
        stderr; ``executable`` and ``test_executable`` name the files of each run that get
        the execute bit (a compiled binary).

        What the program prints goes to its stderr (its stdout is the channel), which keeps
        ``stdout_bytes + stderr_bytes`` of it (its start and end); the channel carries at most
        ``channel_bytes`` each way. Raises ``SandboxError`` for the sandbox's own failures only."""
        limits = limits or Limits()
        for name in (*files, *test_files):
            if not _plain_name(name):
                raise ValueError(f"file name {name!r}: use a plain name inside the work dir (no '/', '..')")
        program_limits = limits.model_copy(update={"stderr_bytes": limits.stdout_bytes + limits.stderr_bytes})
        if (argv is None) != (test_argv is None):
            raise ValueError("give both argv and test_argv, or neither (Python)")
        mode = "python" if argv is None else "exec"
        reqs = [
            self._request(
                mode, files, entry, program_limits, rpc="serve", argv=argv, executable=list(executable)
            ),
            self._request(
                mode,
                test_files,
                test_entry,
                limits,
                rpc="test",
                argv=test_argv,
                executable=list(test_executable),
            ),
        ]
        # both spares under one lock: two pairs that each took one spare and wait for a
        # second would otherwise hold two slots while waiting for replacements
        with self._pair_lock:
            first = self._take_spare()
            try:
                second = self._take_spare()
            except BaseException:
                first.close()
                first.done()
                raise
        spares = [first, second]
        try:
            try:
                slots = [s.cgroups.slot(s.slot) for s in spares]
            except OSError as e:
                raise SandboxError(f"opening the run's cgroups: {e}") from e
            replies = supervise_pair(spares, reqs, slots, self.config.start_timeout_s, self.config.grace_s)
        finally:
            for spare in spares:
                spare.close()
                spare.done()
        program, tests = (RunOutcome.model_validate(r) for r in replies)
        for out in (program, tests):
            if out.status == "sandbox_error":
                raise SandboxError(out.error or "the sandbox failed")
        return PairOutcome(program=program, tests=tests)

    @staticmethod
    def _request(
        mode: str, files: dict[str, bytes], entry: str, limits: Limits, **extra: Any
    ) -> dict[str, Any]:
        return {
            "mode": mode,
            "entry": entry,
            "argv": None,
            "files": dict(files),
            "executable": [],
            "stdin": b"",
            "limits": limits.model_dump(),
            "collect": [],
            "env": {},
            "marker": None,
            **extra,
        }

    def _take_spare(self) -> Spare:
        for _ in range(2):  # a dead zygote is restarted once per run
            self.start()
            spares = self._spares  # this zygote's; a restart makes a new queue
            try:
                spare = spares.get(timeout=self.config.start_timeout_s)
            except queue.Empty:
                raise SandboxError(
                    "no warm sandbox became ready in time (is the machine overloaded?)"
                ) from None
            if spare is None:  # that zygote is gone
                spares.put(None)  # so every other run waiting on it wakes up too
                with self._lock:
                    if self._spares is spares:  # and no other run has restarted it yet
                        self._shutdown()
                continue
            with contextlib.suppress(OSError):
                spare.chan.send(b"u")  # its zygote makes a replacement
            if isinstance(spare, _Failed):
                raise spare.error
            return spare
        raise SandboxError("the sandbox zygote keeps dying; see the worker's stderr")


@dataclass
class _Failed:
    """A spare the zygote (``chan``) could not make."""

    chan: socket.socket
    error: SandboxError


def _close_on_exec(fds: list[int]) -> None:
    """Descriptors received from the zygote arrive inheritable (``socket.recv_fds`` drops its
    ``flags``, so ``MSG_CMSG_CLOEXEC`` cannot be asked for): a process this worker forks or
    starts must not hold a run's pipes open, or the other side of a pair would never see
    them close."""
    for fd in fds:
        os.set_inheritable(fd, False)


def _plain_name(name: str) -> bool:
    return (
        bool(name) and "/" not in name and "\0" not in name and name not in (".", "..") and len(name) <= 255
    )


def _package_root() -> str:
    """Where ``functions`` lives, so the zygote imports this checkout and nothing else."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
