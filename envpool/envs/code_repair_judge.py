"""How ``code-repair-v1`` judges a test run: the runner's reported values (plain JSON, one
line per check) against the expected ones, which never enter the process that ran the
policy's module (see :mod:`envpool.envs.code_repair`)."""

from __future__ import annotations

import json
from typing import Any

from envpool.envs.code_repair_tasks import Check, Raises, Task

__all__ = ["judge", "parse_results", "verdict"]


def parse_results(text: str, n: int) -> dict[Any, dict[str, Any]]:
    """The subprocess's JSON lines by check index (the first line for an index counts), and
    under ``"import"`` its import failure. Lines that are not such objects are ignored."""
    found: dict[Any, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "import_error" in obj:
            found.setdefault("import", obj)
        elif type(obj.get("i")) is int and 0 <= obj["i"] < n:
            found.setdefault(obj["i"], obj)
    return found


def _plain(value: Any) -> Any:
    """An expected value as JSON gives it back (tuples as lists)."""
    return json.loads(json.dumps(value))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def verdict(check: Check, got: dict[str, Any] | None) -> str | None:
    """None when the reported result meets the check, else why not (for the policy)."""
    if got is None:
        return f"{check.call} did not finish"
    expect = check.expect
    if "raised" in got:
        names = got["raised"] if isinstance(got["raised"], list) else []
        if isinstance(expect, Raises) and expect.error in names:
            return None
        kind = str(names[0]) if names else "an exception"
        why = f"{check.call} raised {kind}: {got.get('message', '')}"
        return why + (f"\n    at {got['at']}" if got.get("at") else "")
    if "value" in got:
        if isinstance(expect, Raises):
            return f"{check.call} did not raise {expect.error} (it returned {_short(got['value'])})"
        if got["value"] == _plain(expect):  # plain JSON values on both sides: == is theirs
            return None
        return f"{check.call} returned {_short(got['value'])}, expected {expect!r}"
    if "not_plain" in got:
        return (
            f"{check.call} returned {str(got.get('repr', '?'))[:200]} (a {str(got['not_plain'])[:60]}; "
            "the tests compare plain values: numbers, strings, booleans, None, lists, dicts)"
        )
    if "too_large" in got:
        return f"{check.call} returned a value too large to compare"
    return f"{check.call} did not finish"


def judge(
    task: Task, checks: list[tuple[int, Check]], results: dict[Any, dict[str, Any]], timed_out: bool
) -> tuple[int, list[str]]:
    """``(tests passed, a line per test)``: a test passes when each of its checks does."""
    test_file = task.test_file
    if "import" in results:
        err = results["import"]
        line = f"ERROR {test_file}: {str(err.get('import_error', '?'))[:500]}"
        if err.get("at"):
            line += f"\n    at {str(err['at'])[:300]}"
        return 0, [line]
    failures: dict[int, str] = {}
    for i, (t, check) in enumerate(checks):
        if t in failures:
            continue  # a test stops at its first failing check
        why = verdict(check, results.get(i))
        if why is not None:
            failures[t] = why
    lines = []
    for t, test in enumerate(task.tests):
        where = f"{test_file}::{test.name}"
        lines.append(f"FAIL {where}: {failures[t]}" if t in failures else f"PASS {where}")
    return task.n_tests - len(failures), lines
