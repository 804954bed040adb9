"""``python``: run a snippet for a tool-using policy, in the code sandbox."""

from __future__ import annotations

from typing import Any

import fabric
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import MAX_CODE_BYTES, Verifier, default_verifier

#: What the policy sees of a run's output, in characters.
MAX_SHOWN = 4000
TOOL_LIMITS = Limits(cpu_s=5, wall_s=10, memory_mb=512, stdout_bytes=256 << 10)

OPENAI_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python 3 program in an isolated sandbox (no network, no files kept between calls, "
            f"{TOOL_LIMITS.cpu_s:g} CPU seconds). Print what you want to see."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "a complete program, e.g. print(sum(range(10)))"},
                "stdin": {"type": "string", "description": "text on standard input (optional)"},
            },
            "required": ["code"],
            "additionalProperties": False,
        },
    },
}


def _shown(text: str, tail: bool = False) -> str:
    if len(text) <= MAX_SHOWN:
        return text
    cut = len(text) - MAX_SHOWN
    return (
        f"[... {cut} characters cut]\n" + text[-MAX_SHOWN:]
        if tail
        else text[:MAX_SHOWN] + f"\n[... {cut} characters cut]"
    )


@fabric.tool(
    setup=default_verifier,
    timeout_s=30,
    warm=1,
    examples=({"code": "print(6 * 7)"}, {"code": "print(input().upper())", "stdin": "hi"}),
)
def python(code: str, stdin: str = "", ctx: Any = None) -> str:
    """Run ``code`` and return what it printed (stdout, then stderr, then how it ended)."""
    if len(code.encode()) > MAX_CODE_BYTES:
        raise ValueError(f"code is {len(code.encode())} bytes; the limit is {MAX_CODE_BYTES}")
    verifier: Verifier = ctx or default_verifier()
    files = {"solution.py": code.encode()}
    out = verifier.sandbox.run(
        mode="python", entry="solution.py", files=files, stdin=stdin.encode(), limits=TOOL_LIMITS
    )
    parts = []
    if out.stdout:
        parts.append(_shown(out.stdout.decode("utf-8", errors="replace")))
    if out.stderr:
        parts.append("[stderr]\n" + _shown(out.stderr.decode("utf-8", errors="replace"), tail=True))
    if out.status == "timeout":
        parts.append(f"[killed: ran past {TOOL_LIMITS.wall_s:g} s]")
    elif out.status == "output_limit":
        parts.append("[killed: printed too much]")
    elif out.signal is not None:
        parts.append(f"[killed by signal {out.signal}: CPU or memory limit?]")
    elif out.exit_code:
        parts.append(f"[exit code {out.exit_code}]")
    return "\n".join(parts) if parts else "[no output]"
