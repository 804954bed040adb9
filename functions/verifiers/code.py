"""``code_verify``: the reward of a program written by the policy, judged in the sandbox."""

from __future__ import annotations

from typing import Any, Literal

import fabric
from fabric.protocol import RewardResult, Trajectory
from functions.verifiers.errors import SandboxError
from functions.verifiers.languages import LANGUAGES
from functions.verifiers.verify import CodeTests, StdioCase, Verifier, default_verifier

_EXAMPLE_TRAJ = {
    "messages": [
        {"role": "user", "content": "Read a line and print it reversed."},
        {"role": "assistant", "content": "```python\nprint(input()[::-1])\n```", "policy_version": 0},
    ]
}


# the tags a fence may carry for each language: its name and aliases, and a few more that
# Markdown writers use
_EXTRA_TAGS = {"python": ("py3",), "cpp": ("cc", "hpp"), "javascript": ("nodejs", "mjs", "cjs")}
_FENCE_TAGS = {
    alias: lang.name
    for lang in LANGUAGES.values()
    for alias in (lang.name, *lang.aliases, *_EXTRA_TAGS.get(lang.name, ()))
}


def _language_of(tag: str) -> str | None:
    """The language a fence tag or a ``language`` argument names (``py``: python), or None."""
    return _FENCE_TAGS.get(tag.strip().lower())


def extract_code(text: str, language: str | None = None) -> str:
    """The program in ``text`` (a model's answer): the last fenced code block tagged with
    ``language`` (any of its names: ``py``, ``python3``; ``c++``; ``js``...), else the last
    fenced block, else all of the text. An answer often shows its program in a ```python
    block and then what it prints in a plain ``` block after it: the output is not the
    program.

    A block opens at a fence (```, then an optional language tag, then the rest of that
    line) and its body runs to the next fence. One pass over the text: once a fence has no
    newline or no closing fence after it, no later one has either (a regex tried at every
    fence scanned to the end each time, quadratic in a run of unclosed fences).
    """
    wanted = _language_of(language) if language else None
    last = tagged = None  # (where its fence is, where its body starts and ends)
    at = text.find("```")
    while at >= 0:
        newline = text.find("\n", at + 3)
        if newline < 0:
            break
        close = text.find("```", newline + 1)
        if close < 0:
            break
        last = (at, newline + 1, close)
        tag = text[at + 3 : newline].strip().lstrip("`").split(maxsplit=1)
        if wanted is not None and tag and _language_of(tag[0]) == wanted:
            tagged = last
        at = text.find("```", close + 3)
    block = tagged or last
    return text if block is None else _body(text, *block)


def _body(text: str, fence: int, start: int, end: int) -> str:
    """A block's text, less the indentation of its fence on each line (up to that many
    spaces), as Markdown reads it: a block inside a list item is indented with the item,
    and its program kept that indentation (an IndentationError). Looked up for the block
    taken only: for every fence, a run of them with no newline was quadratic."""
    line = text.rfind("\n", 0, fence) + 1
    indent = fence - line if text[line:fence].strip(" ") == "" else 0
    body = text[start:end]
    if not indent:
        return body
    return "\n".join(row[min(indent, len(row) - len(row.lstrip(" "))) :] for row in body.split("\n"))


@fabric.reward(
    setup=default_verifier,
    timeout_s=120,
    warm=1,
    examples=(
        {"traj": _EXAMPLE_TRAJ, "tests": [{"stdin": "abc\n", "expected_stdout": "cba"}]},
        {
            "traj": "def add(a, b):\n    return a + b\n",
            "test_code": "assert add(2, 3) == 5",
            "extract": False,
        },
    ),
)
def code_verify(
    traj: Trajectory | str,
    *,
    tests: list[StdioCase] | None = None,
    test_code: str | None = None,
    entry_point: str | None = None,
    language: str = "python",
    extract: bool = True,
    c_asserts: Literal["apart", "in_process"] = "apart",
    ctx: Any = None,
) -> RewardResult:
    """Pass fraction of the program in the final answer (its last fenced block tagged with
    ``language``, else its last fenced block: ``extract_code``; ``extract=False``: the whole
    text) on ``tests`` (stdin/stdout cases) or ``test_code`` (asserts run against it).
    ``entry_point`` (Python ``test_code``): the program's function that a HumanEval
    ``check(candidate)`` checks, when the tests define ``check`` and do not call it. The
    per-case verdicts are in ``info``. Tests that cannot judge any program (they run nothing)
    fail the call (``InvalidTests``), not a score. ``c_asserts`` (C and C++ ``test_code``):
    ``"in_process"`` appends the tests to the program, which a program can forge
    (docs/code-verifier.md); the default runs them apart."""
    return judge(
        traj,
        tests=tests,
        test_code=test_code,
        entry_point=entry_point,
        language=language,
        extract=extract,
        verifier=ctx,
        c_asserts=c_asserts,
    )


def judge(
    traj: Trajectory | str,
    *,
    tests: list[StdioCase] | None,
    test_code: str | None,
    language: str,
    extract: bool,
    verifier: Verifier | None,
    entry_point: str | None = None,
    c_asserts: Literal["apart", "in_process"] = "apart",
) -> RewardResult:
    text = traj if isinstance(traj, str) else traj.final_text()
    code = extract_code(text, language) if extract else text
    result = (verifier or default_verifier()).verify(
        code,
        CodeTests(cases=tests, test_code=test_code, entry_point=entry_point, c_asserts=c_asserts),
        language,
    )
    if result.retryable:
        # a 0 here would punish the policy for our failure: fail the call so it is retried
        raise SandboxError(f"the sandbox failed on {result.total - result.passed} case(s); retry")
    return RewardResult(
        score=result.pass_fraction,
        components={"pass_fraction": result.pass_fraction, "all_passed": float(result.status == "Finished")},
        info=result.model_dump(),
    )
