"""Verdicts: what happened to a run (``RunOutcome``) or a pair (``PairOutcome``), judged.

``classify`` judges one run (a stdin/stdout case, a compile, the in-process C/C++
harness); ``classify_pair`` a program and its assert-style tests run apart, where the
tests' exit status is the verdict (``functions.verifiers.rpc``). The statuses and what
each means are in ``functions.verifiers.verify``'s docstring.
"""

from __future__ import annotations

import codecs
import signal
from typing import Literal

from pydantic import BaseModel, Field

from functions.verifiers import rpc
from functions.verifiers.errors import InvalidTests
from functions.verifiers.languages import Language
from functions.verifiers.sandbox import Limits, PairOutcome, RunOutcome

Status = Literal[
    "Finished", "Failed", "TimeLimitExceeded", "MemoryLimitExceeded", "RuntimeError", "SandboxError"
]
#: The overall status is the worst one among the cases, in this order.
SEVERITY: tuple[Status, ...] = (
    "SandboxError",
    "RuntimeError",
    "MemoryLimitExceeded",
    "TimeLimitExceeded",
    "Failed",
    "Finished",
)
EXCERPT = 1024


class CaseResult(BaseModel):
    status: Status
    message: str = ""
    exit_code: int | None = None
    stdout: str = Field("", description=f"first {EXCERPT} characters")
    stderr: str = Field("", description=f"last {EXCERPT} characters")
    wall_ms: float = 0.0
    cpu_ms: float = 0.0


def kept_text(kept: bytes, total: int) -> str:
    """What a run wrote (``total`` bytes, of which the sandbox ``kept`` the first), as text.
    Where the cap cut it, the cut may fall inside a character: that half is dropped, not
    shown as U+FFFD (a program's own broken bytes still are)."""
    if total > len(kept):  # an incremental decode, not final: an incomplete tail stays unread
        return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(kept)
    return kept.decode("utf-8", errors="replace")


def _text(data: bytes, total: int | None = None, tail: bool = False) -> str:
    """An excerpt of stdout (``total``: what it wrote, of which the sandbox kept the first
    ``data``) or of stderr (no ``total``: the sandbox keeps its start and end, and marks the
    cut between them)."""
    text = kept_text(data, total) if total is not None else data.decode("utf-8", errors="replace")
    return text[-EXCERPT:] if tail else text[:EXCERPT]


def _same_output(got: bytes, expected: str) -> bool:
    a = got.decode("utf-8", errors="replace").replace("\r\n", "\n").rstrip().split("\n")
    b = expected.replace("\r\n", "\n").rstrip().split("\n")
    return [line.rstrip() for line in a] == [line.rstrip() for line in b]


def classify(
    out: RunOutcome, lang: Language, limits: Limits, expected: str | None, marker: str | None = None
) -> CaseResult:
    """Turn what happened into a verdict (``expected`` None: assert-style, where exit 0 and
    ``marker`` as the last line of stdout pass)."""
    finished_tests = False
    if marker:
        body = out.stdout.rstrip(b"\n")
        finished_tests = body.endswith(marker.encode())
        if finished_tests:  # not part of what the program printed
            out = out.model_copy(update={"stdout": body[: -len(marker)].rstrip(b"\n")})
    base = {
        "exit_code": out.exit_code,
        "stdout": _text(out.stdout, out.stdout_total),
        "stderr": _text(out.stderr, tail=True),
        "wall_ms": round(out.wall_ms, 3),
        "cpu_ms": round(out.cpu_ms, 3),
    }
    if out.status == "timeout":
        return CaseResult(
            status="TimeLimitExceeded", message=f"killed at the {limits.wall_s:g} s wall limit", **base
        )
    if out.status == "output_limit":  # stdout's: past its cap stderr is cut, not the run
        return CaseResult(status="RuntimeError", message="wrote more than the stdout cap", **base)
    if out.status == "cpu_limit":
        msg = f"its processes used more than {limits.cpu_s:g} CPU seconds together"
        return CaseResult(status="TimeLimitExceeded", message=msg, **base)
    if out.oom_killed:
        msg = f"its processes used more than the {limits.memory_mb} MB limit together"
        return CaseResult(status="MemoryLimitExceeded", message=msg, **base)
    cpu_limit_ms = max(1, int(limits.cpu_s + 0.999)) * 1000
    # RLIMIT_CPU's SIGKILL: the CPU time read afterwards falls short of the limit the kernel
    # enforced (rusage read 0.93-1.0 s at a 1 s limit on a quiet VM, 0.85 s with the cores
    # oversubscribed), so half the budget already tells it from a crash
    if out.signal in (signal.SIGKILL, signal.SIGXCPU) and out.cpu_ms >= 0.5 * cpu_limit_ms:
        return CaseResult(
            status="TimeLimitExceeded", message=f"used its {limits.cpu_s:g} CPU seconds", **base
        )
    # only a run that did not exit cleanly died of it: one that caught a MemoryError (or
    # perror'd a refused malloc) and answered another way is judged on what it printed
    if out.exit_code != 0 and any(m in out.stderr for m in lang.oom_markers):
        msg = f"ran out of memory under the {limits.memory_mb} MB limit"
        return CaseResult(status="MemoryLimitExceeded", message=msg, **base)
    if out.signal is not None:
        name = (
            signal.Signals(out.signal).name if out.signal in signal.Signals._value2member_map_ else out.signal
        )
        hint = " (file size limit)" if out.signal == signal.SIGXFSZ else ""
        return CaseResult(status="RuntimeError", message=f"killed by {name}{hint}", **base)
    if out.exit_code != 0:
        if any(m in out.stderr for m in lang.assert_markers):
            return CaseResult(status="Failed", message="an assertion failed", **base)
        return CaseResult(status="RuntimeError", message=f"exited with code {out.exit_code}", **base)
    if marker and not finished_tests:
        return CaseResult(status="Failed", message="exited before the tests ran to their end", **base)
    if expected is None or _same_output(out.stdout, expected):
        return CaseResult(status="Finished", **base)
    return CaseResult(status="Failed", message="wrong output", **base)


def classify_pair(pair: PairOutcome, lang: Language, limits: Limits) -> CaseResult:
    """The verdict of a program and its tests run apart (``Sandbox.run_pair``). If the
    program ended before its tests did (a crash, a limit, an exit of its own), that is the
    verdict; else the tests' exit status is (``rpc.PASSED``: every assert held). Tests that
    cannot judge any program (``rpc.TESTS_INVALID``) raise ``InvalidTests``: no verdict.

    ``stdout`` shows what the program printed (its stdout and stderr, in order: both went to
    one pipe); ``stderr`` the end of the tests' stderr (a failed assert's traceback, the
    tests' own prints), or of the program's output when the program's failure is the
    verdict. ``cpu_ms`` is the program's; ``wall_ms`` the pair's."""
    program, tests = pair.program, pair.tests
    shown = {
        "stdout": _text(program.stderr),
        "stderr": _text(tests.stderr, tail=True),
        "exit_code": tests.exit_code,
        "wall_ms": round(max(program.wall_ms, tests.wall_ms), 3),
        "cpu_ms": round(program.cpu_ms, 3),
    }

    def verdict(status: Status, message: str, **extra: object) -> CaseResult:
        return CaseResult.model_validate({**shown, **extra, "status": status, "message": message})

    if program.status != "stopped":  # it ended first: its own verdict
        own = {
            "stderr": _text(program.stderr, tail=True),
            "exit_code": program.exit_code,
        }
        if program.status == "output_limit":  # the channel's: what it prints is cut, not the run
            why = f"sent its tests more than the {limits.channel_bytes}-byte channel cap"
            return verdict("RuntimeError", why, **own)
        alone = classify(program, lang, limits, None)
        if alone.status == "Finished":
            return verdict("Failed", "exited before the tests ran to their end", **own)
        return verdict(alone.status, alone.message, **own)
    if tests.status == "output_limit":
        return verdict("RuntimeError", "the tests wrote more than the channel cap")
    if tests.signal == signal.SIGABRT and any(m in tests.stderr for m in lang.assert_markers):
        return verdict("Failed", "an assertion failed")  # C's and C++'s assert() aborts
    if tests.status != "exited":  # killed for a limit (the wall limit covers both runs) or a signal
        alone = classify(tests, lang, limits, None)
        return verdict(alone.status, alone.message)
    lines = [ln for ln in _text(tests.stderr, tail=True).splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    where = ""  # a test the harness ran itself (the tests defined it, never called it)
    if last.startswith(rpc.IN_COLLECTED) and len(lines) > 1:
        where, last = f" in {last[len(rpc.IN_COLLECTED) :][:100]}", lines[-2]
    code = tests.exit_code
    if code == rpc.PASSED:
        return verdict("Finished", "")
    if code == rpc.ASSERTION_FAILED:
        return verdict("Failed", f"an assertion failed{where}")
    if code == rpc.UNFINISHED:
        return verdict("Failed", last[:200])
    if code == rpc.TESTS_RAISED and last.startswith("MemoryError"):
        return verdict("MemoryLimitExceeded", f"ran out of memory under the {limits.memory_mb} MB limit")
    if code == rpc.TESTS_RAISED:
        return verdict("RuntimeError", f"the tests stopped{where} on {last[:200]}")
    if code == rpc.TESTS_INVALID:
        raise InvalidTests(f"the tests cannot judge a program: {last[:500]}")
    if code == rpc.PROTOCOL_ERROR:
        return verdict("RuntimeError", f"protocol error on the test channel: {last[:200]}")
    if code == rpc.PROGRAM_GONE:
        return verdict("RuntimeError", f"the program closed the test channel: {last[:200]}")
    return verdict("RuntimeError", f"the tests exited with code {code}")
