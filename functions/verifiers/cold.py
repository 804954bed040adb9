"""The benchmark baseline: one fresh ``python`` subprocess per run, under the same limits.

This is how most RL code verifiers run programs: a temp dir, ``subprocess`` with rlimits in
``preexec_fn``, a timeout that kills the process group. It has none of the sandbox's
isolation (no namespaces, same uid as the worker) and exists only so ``fabric bench
code_verify --baseline fn:code_verify_subprocess`` can measure what the warm sandbox buys.
Never use it on untrusted code.
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Literal

import fabric
from fabric.protocol import RewardResult, Trajectory
from functions.verifiers.program import BASE_ENV
from functions.verifiers.sandbox import Limits, PairOutcome, RunOutcome, _package_root
from functions.verifiers.supervisor import kept_stderr
from functions.verifiers.verify import StdioCase, Verifier


class SubprocessRunner:
    """``Sandbox.run``'s interface, done the naive way (see the module docstring)."""

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
        limits = limits or Limits()
        with tempfile.TemporaryDirectory(prefix="rlfabric-cold-") as work:
            if marker and mode == "python" and entry and files:  # the runner's job in the sandbox
                tail = "\nimport os as _o\n_o.write(1, b'\\n' + _o.read(3, 80))\n"
                files = {**files, entry: files[entry] + tail.encode()}
            for name, blob in (files or {}).items():
                path = os.path.join(work, name)
                with open(path, "wb") as f:
                    f.write(blob)
                os.chmod(path, 0o755 if name in executable else 0o644)
            cmd = [sys.executable, entry or "solution.py"] if mode == "python" else list(argv or [])
            marker_fd = None
            if marker:
                marker_fd, w = os.pipe()
                os.write(w, marker.encode() + b"\n")
                os.close(w)
            t0 = time.monotonic()
            proc = subprocess.Popen(
                cmd,
                cwd=work,
                env={**BASE_ENV, "HOME": work, "TMPDIR": work, **(env or {})},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=lambda: _limit(limits, marker_fd),
                close_fds=marker_fd is None,  # the marker's pipe becomes fd 3, as in the sandbox
            )
            if marker_fd is not None:
                os.close(marker_fd)
            status = "exited"
            try:
                out, err = proc.communicate(stdin, timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                status = "timeout"
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            code = proc.returncode
            collected = {}
            for name in collect:
                path = os.path.join(work, name)
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        collected[name] = f.read()
        fields: dict[str, Any] = {
            "status": status if status == "timeout" else ("signaled" if code < 0 else "exited"),
            "exit_code": code if code >= 0 else None,
            "signal": -code if code < 0 else None,
            "stdout": out[: limits.stdout_bytes],
            "stderr": kept_stderr(err, limits.stderr_bytes),
            "stdout_total": len(out),
            "stderr_total": len(err),
            "wall_ms": (time.monotonic() - t0) * 1000,
            "cpu_ms": (usage.ru_utime + usage.ru_stime) * 1000,
            "files": collected,
        }
        return RunOutcome.model_validate(fields)

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
        """``Sandbox.run_pair`` done the naive way: two ``python`` subprocesses (or ``argv``
        and ``test_argv``) whose stdouts are each other's fd 3 (no supervisor in between, no
        limit on the channel)."""
        limits = limits or Limits()
        with tempfile.TemporaryDirectory(prefix="rlfabric-cold-") as work:
            for name, blob in {**files, **test_files}.items():
                with open(os.path.join(work, name), "wb") as f:
                    f.write(blob)
                os.chmod(
                    os.path.join(work, name), 0o755 if name in (*executable, *test_executable) else 0o644
                )
            to_tests_r, to_tests_w = os.pipe()
            to_program_r, to_program_w = os.pipe()
            env = {**BASE_ENV, "HOME": work, "TMPDIR": work, "PYTHONPATH": _package_root()}
            procs = []
            t0 = time.monotonic()
            for role, file, out, chan, cmd in (
                ("serve", entry, to_tests_w, to_program_r, argv),
                ("test", test_entry, to_program_w, to_tests_r, test_argv),
            ):
                procs.append(
                    subprocess.Popen(
                        cmd or [sys.executable, "-m", "functions.verifiers.program", role, file],
                        cwd=work,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                        preexec_fn=functools.partial(_limit, limits, chan, cmd is not None),
                        close_fds=False,  # its end of the channel becomes fd 3
                    )
                )
            for fd in (to_tests_r, to_tests_w, to_program_r, to_program_w):
                os.close(fd)
            program, tests = procs
            errs: list[bytes] = [b"", b""]
            readers = [
                threading.Thread(target=lambda i=i, p=p: errs.__setitem__(i, p.stderr.read()))  # type: ignore[union-attr]
                for i, p in enumerate(procs)
            ]
            for r in readers:
                r.start()
            status = ["exited", "exited"]
            try:
                tests.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                status[1] = "timeout"
                os.killpg(tests.pid, signal.SIGKILL)
                tests.wait()
            if program.poll() is None:
                os.killpg(program.pid, signal.SIGKILL)
            # ended once the tests closed its channel (or by our kill): stopped, as in the
            # sandbox; only a failure of its own before that counts
            if program.wait() in (0, -signal.SIGKILL):
                status[0] = "stopped" if status[1] != "timeout" else "timeout"
            for r in readers:
                r.join()
            wall_ms = (time.monotonic() - t0) * 1000
        outcomes = []
        for proc, st, err in zip(procs, status, errs, strict=True):
            code = proc.returncode
            outcomes.append(
                RunOutcome(
                    status=st if st != "exited" else ("signaled" if code < 0 else "exited"),  # type: ignore[arg-type]
                    exit_code=code if code >= 0 else None,
                    signal=-code if code < 0 else None,
                    stderr=kept_stderr(err, limits.stderr_bytes),
                    stderr_total=len(err),
                    wall_ms=wall_ms,
                )
            )
        return PairOutcome(program=outcomes[0], tests=outcomes[1])


def _limit(limits: Limits, marker_fd: int | None = None, frames_on_4: bool = False) -> None:
    if marker_fd is not None:
        os.dup2(marker_fd, 3)
        os.set_inheritable(3, True)  # dup2 onto itself keeps the pipe's close-on-exec flag
    if frames_on_4:  # an exec'd run of a pair: frames out on fd 4, fd 1 is its stderr
        os.dup2(1, 4)
        os.dup2(2, 1)
    mb = 1024 * 1024
    cpu = max(1, int(limits.cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, ((limits.address_space_mb or limits.memory_mb) * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.fsize_mb * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.nofile,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _cold_verifier() -> Verifier:
    return Verifier(SubprocessRunner())


@fabric.reward(
    setup=_cold_verifier,
    timeout_s=120,
    examples=(
        {
            "traj": "print(input()[::-1])",
            "extract": False,
            "tests": [{"stdin": "abc", "expected_stdout": "cba"}],
        },
    ),
)
def code_verify_subprocess(
    traj: Trajectory | str,
    *,
    tests: list[StdioCase] | None = None,
    test_code: str | None = None,
    entry_point: str | None = None,
    language: str = "python",
    extract: bool = True,
    ctx: Any = None,
) -> RewardResult:
    """BENCHMARK BASELINE ONLY (no isolation): ``code_verify`` with one subprocess per run."""
    from functions.verifiers.code import judge

    return judge(
        traj,
        tests=tests,
        test_code=test_code,
        entry_point=entry_point,
        language=language,
        extract=extract,
        verifier=ctx,
    )
