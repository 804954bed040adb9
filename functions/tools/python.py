"""``python``: run a snippet for a tool-using policy, in the code sandbox."""

from __future__ import annotations

import signal
from typing import Any

import fabric
from functions.tools._args import holds_json_arguments, utf8
from functions.verifiers.sandbox import Limits, RunOutcome
from functions.verifiers.verdicts import kept_text
from functions.verifiers.verify import MAX_CODE_BYTES, Verifier, default_verifier

#: What the policy sees of a run's output, in characters.
MAX_SHOWN = 4000
#: The most stdin a call may pass, in UTF-8 bytes: the supervisor writes it into a memfd before
#: the run starts, as the worker, so it counts against the worker's memory, not the run's, and
#: only the 6 MiB payload limit bounded it
MAX_STDIN_BYTES = 1 << 20
#: stderr keeps as much as stdout (its start and end, past that: the sandbox cuts its middle)
TOOL_LIMITS = Limits(cpu_s=5, wall_s=10, memory_mb=512, stdout_bytes=256 << 10, stderr_bytes=256 << 10)

OPENAI_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python 3 program in an isolated sandbox (no network, no files kept between calls; "
            f"limits: {TOOL_LIMITS.cpu_s:g} CPU seconds, {TOOL_LIMITS.wall_s:g} s wall time, "
            f"{TOOL_LIMITS.memory_mb} MB memory, {TOOL_LIMITS.stdout_bytes >> 10} KiB of stdout; "
            f"past {TOOL_LIMITS.stderr_bytes >> 10} KiB, stderr keeps its start and end). "
            f"Print what you want to see: you are shown the first {MAX_SHOWN:,} characters of stdout "
            f"and the last {MAX_SHOWN:,} of stderr."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {
                    "type": "string",
                    "description": (
                        f"a complete program, e.g. print(sum(range(10))) (up to {MAX_CODE_BYTES >> 10} KiB)"
                    ),
                },
                "stdin": {
                    "type": "string",
                    "description": f"text on standard input (optional; up to {MAX_STDIN_BYTES >> 10} KiB)",
                },
            },
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}


def _shown(kept: bytes, total: int, stream: str, tail: bool = False) -> str:
    """What the policy sees of a stream: at most ``MAX_SHOWN`` characters of what the sandbox
    kept (its start, or with ``tail`` its end), each cut marked where it falls. (Of stderr the
    sandbox keeps the start and the end, its cut marked: its end is the program's own.)"""
    text = kept_text(kept, total) if stream == "stdout" else kept.decode("utf-8", errors="replace")
    if len(text) > MAX_SHOWN:
        cut = len(text) - MAX_SHOWN
        text = (
            f"[... {cut} characters cut]\n" + text[-MAX_SHOWN:]
            if tail
            else text[:MAX_SHOWN] + f"\n[... {cut} characters cut]"
        )
    if stream == "stdout" and total > len(kept):
        # the sandbox kept only the start (and ended the run): say so where it was cut
        text += ("" if text.endswith("\n") else "\n") + f"[... cut at the {stream} limit]"
    return text


@fabric.tool(
    setup=default_verifier,
    timeout_s=30,
    warm=1,
    examples=({"code": "print(6 * 7)"}, {"code": "print(input().upper())", "stdin": "hi"}),
)
def python(code: str, stdin: str = "", ctx: Any = None) -> str:
    """Run ``code`` and return what it printed (stdout, then stderr, then how it ended)."""
    return run_python(ctx or default_verifier(), code, stdin)


def run_python(verifier: Verifier, code: str, stdin: str = "", limits: Limits = TOOL_LIMITS) -> str:
    """The ``python`` tool's run under ``limits``: what it printed, then how it ended when that
    was not a clean exit (``[exit code 2]``, or the limit that ended it and its value).
    ``ValueError`` for what cannot run: code or stdin that is no string, empty or too long code,
    code in a Markdown fence or holding the tool's JSON arguments, stdin over ``MAX_STDIN_BYTES``."""
    # envpool's in-process bridge passes the policy's values as they are (the fabric checks
    # their types first): an int was "AttributeError: 'int' object has no attribute 'encode'"
    for name, value in (("code", code), ("stdin", stdin)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    source = utf8(code, "code")
    if len(source) > MAX_CODE_BYTES:
        raise ValueError(f"code is {len(source)} bytes; the limit is {MAX_CODE_BYTES}")
    # both ran and answered "[no output]", which told the policy nothing of its mistake
    if not code.strip():
        raise ValueError("code is empty: pass a complete program that prints, e.g. print(6 * 7)")
    if code.lstrip().startswith("```"):
        # no program starts so (a syntax error at line 1, after a sandbox run): the policy
        # pasted the fence its answer's code is written in
        raise ValueError(
            "code is in a Markdown code fence (```): pass the program itself, without the fence lines"
        )
    if holds_json_arguments(code, "code"):
        raise ValueError(
            'code holds the JSON arguments ({"code": ...}): pass the program itself as the string, '
            "e.g. print(6 * 7)"
        )
    data = utf8(stdin, "stdin")
    if len(data) > MAX_STDIN_BYTES:
        raise ValueError(
            f"stdin is {len(data)} bytes; the limit is {MAX_STDIN_BYTES} ({MAX_STDIN_BYTES >> 10} KiB): "
            "pass less, or have the program make its input itself"
        )
    files = {"solution.py": source}
    out = verifier.sandbox.run(mode="python", entry="solution.py", files=files, stdin=data, limits=limits)
    parts = []
    if out.stdout:
        parts.append(_shown(out.stdout, out.stdout_total, "stdout"))
    if out.stderr:
        parts.append("[stderr]\n" + _shown(out.stderr, out.stderr_total, "stderr", tail=True))
    if (ending := _ending(out, limits)) is not None:
        parts.append(f"[{ending}]")
    return "\n".join(parts) if parts else "[no output]"


# what Python prints when it runs into a limit it can survive to report: the address-space
# rlimit (MemoryError), the file size rlimit (Python ignores SIGXFSZ, so the write fails with
# EFBIG) and the process/thread rlimit (a thread that cannot start; fork's EAGAIN, told from
# any other EAGAIN, a non-blocking read's, by the fork in its traceback: os.fork(),
# subprocess's _fork_exec, multiprocessing's)
_MEMORY_MARKS = (b"MemoryError",)
_FSIZE_MARKS = (b"File too large",)


def _hit_nproc(stderr: bytes) -> bool:
    if b"RuntimeError: can't start new thread" in stderr:
        return True
    return b"BlockingIOError: [Errno 11]" in stderr and b"fork" in stderr


def _size(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _ending(out: RunOutcome, limits: Limits) -> str | None:
    """How a run ended, naming the limit and its value when one ended it ("killed: wall time
    limit 10 s exceeded"), so the policy can tell a slow program from a hungry one; ``None``
    for a clean exit. The rules follow the code verifier's verdicts (``classify``)."""
    if out.status == "timeout":
        return f"killed: wall time limit {limits.wall_s:g} s exceeded"
    if out.status == "cpu_limit":
        return f"killed: CPU time limit {limits.cpu_s:g} s exceeded"
    if out.status == "output_limit":  # stdout's: past its cap stderr is cut, not the run
        return f"killed: stdout limit {_size(limits.stdout_bytes)} exceeded"
    if out.oom_killed:
        return f"killed: memory limit {limits.memory_mb} MB exceeded"
    # RLIMIT_CPU's kill: the CPU time read afterwards falls short of the limit, so half of
    # it already tells it from a crash (as the verifier's classify does)
    cpu_limit_ms = max(1, int(limits.cpu_s + 0.999)) * 1000
    if out.signal in (signal.SIGKILL, signal.SIGXCPU) and out.cpu_ms >= 0.5 * cpu_limit_ms:
        return f"killed: CPU time limit {limits.cpu_s:g} s exceeded"
    if out.signal == signal.SIGXFSZ:
        return f"killed: file size limit {limits.fsize_mb} MB exceeded"
    if out.signal is not None:
        known = out.signal in signal.Signals._value2member_map_
        return f"killed by {signal.Signals(out.signal).name if known else f'signal {out.signal}'}"
    if not out.exit_code:
        return None
    ended = f"exit code {out.exit_code}"
    if any(m in out.stderr for m in _MEMORY_MARKS):
        return f"{ended}: memory limit {limits.address_space_mb or limits.memory_mb} MB reached (MemoryError)"
    if any(m in out.stderr for m in _FSIZE_MARKS):
        return f"{ended}: file size limit {limits.fsize_mb} MB reached (File too large)"
    if _hit_nproc(out.stderr):
        return f"{ended}: process limit {limits.nproc} processes and threads reached"
    return ended
