"""The tasks of ``code-repair-v1``: each a buggy module and its tests, written as typed
checks (a call and the value it must give, or the exception it must raise). The checks are
what the env judges by, outside the process that runs the policy's module; the
``test_*.py`` file the policy reads is rendered from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Raises:
    """A check's expectation that the call raises this built-in exception (or a subclass)."""

    error: str


@dataclass(frozen=True)
class Check:
    call: str
    """A Python expression over the test file's imports, e.g. ``add(2, 3)``."""
    expect: Any
    """A plain JSON value (tuples compare as lists), or :class:`Raises`."""


@dataclass(frozen=True)
class Test:
    name: str
    checks: tuple[Check, ...]
    """In order; the test fails at the first that does not hold."""


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    module: str
    """The module's file name, e.g. ``mathutils.py``: the one file the policy may edit."""
    source: str
    """The module's (buggy) content."""
    imports: tuple[str, ...]
    """The names the tests import from the module."""
    tests: tuple[Test, ...]
    fix: tuple[tuple[str, str, str], ...]
    """``(file, search, replace)`` edits that solve the task (for the test suite)."""

    @property
    def n_tests(self) -> int:
        return len(self.tests)

    @property
    def test_file(self) -> str:
        return f"test_{self.module}"

    @property
    def files(self) -> dict[str, str]:
        """File name -> content: the module and its tests (``test_*.py``, read-only)."""
        return {self.module: self.source, self.test_file: render_tests(self)}

    def checks(self) -> list[tuple[int, Check]]:
        """Every check, flattened in order, with the index of its test."""
        return [(t, c) for t, test in enumerate(self.tests) for c in test.checks]


def render_tests(task: Task) -> str:
    """The checks as a test file a person (or the policy) reads; it is never executed."""
    stem = task.module.removesuffix(".py")
    parts = [f"from {stem} import {', '.join(task.imports)}\n"]
    for test in task.tests:
        body = []
        for check in test.checks:
            if isinstance(check.expect, Raises):
                body += [
                    "    try:",
                    f"        {check.call}",
                    f"    except {check.expect.error}:",
                    "        pass",
                    "    else:",
                    f"        raise AssertionError({f'{check.call} did not raise {check.expect.error}'!r})",
                ]
            else:
                body.append(f"    assert {check.call} == {check.expect!r}")
        parts.append(f"\ndef {test.name}():\n" + "\n".join(body) + "\n")
    return "\n".join(parts)


TASKS: tuple[Task, ...] = (
    Task(
        name="mathutils",
        description="add() returns the wrong value.",
        module="mathutils.py",
        source='''"""Small numeric helpers."""


def add(a, b):
    """The sum of a and b."""
    return a - b


def clamp(x, lo, hi):
    """x limited to the range [lo, hi]."""
    return max(lo, min(x, hi))
''',
        imports=("add", "clamp"),
        tests=(
            Test("test_add", (Check("add(2, 3)", 5),)),
            Test("test_add_negative", (Check("add(-4, 1)", -3),)),
            Test(
                "test_clamp",
                (Check("clamp(5, 0, 3)", 3), Check("clamp(-1, 0, 3)", 0), Check("clamp(2, 0, 3)", 2)),
            ),
        ),
        fix=(("mathutils.py", "    return a - b", "    return a + b"),),
    ),
    Task(
        name="stats",
        description="mean() gives wrong results.",
        module="stats.py",
        source='''"""Descriptive statistics."""


def mean(xs):
    """The arithmetic mean of a non-empty list of numbers."""
    if not xs:
        raise ValueError("mean of an empty list")
    return sum(xs) / (len(xs) - 1)


def median(xs):
    """The middle value (the mean of the two middle values for an even count)."""
    s = sorted(xs)
    mid = len(s) // 2
    if len(s) % 2:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2
''',
        imports=("mean", "median"),
        tests=(
            Test("test_mean", (Check("mean([2, 4, 9])", 5),)),
            Test("test_mean_of_one", (Check("mean([7])", 7),)),
            Test("test_mean_empty", (Check("mean([])", Raises("ValueError")),)),
            Test("test_median", (Check("median([3, 1, 2])", 2), Check("median([4, 1, 3, 2])", 2.5))),
        ),
        fix=(("stats.py", "sum(xs) / (len(xs) - 1)", "sum(xs) / len(xs)"),),
    ),
    Task(
        name="fizzbuzz",
        description="fizzbuzz() never says FizzBuzz.",
        module="fizzbuzz.py",
        source='''"""The counting game."""


def fizzbuzz(n):
    """'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for both, else n."""
    if n % 3 == 0:
        return "Fizz"
    if n % 5 == 0:
        return "Buzz"
    if n % 15 == 0:
        return "FizzBuzz"
    return str(n)
''',
        imports=("fizzbuzz",),
        tests=(
            Test("test_plain", (Check("fizzbuzz(7)", "7"),)),
            Test("test_fizz_and_buzz", (Check("fizzbuzz(9)", "Fizz"), Check("fizzbuzz(10)", "Buzz"))),
            Test("test_fizzbuzz", (Check("fizzbuzz(30)", "FizzBuzz"),)),
        ),
        fix=(
            (
                "fizzbuzz.py",
                '    if n % 3 == 0:\n        return "Fizz"',
                '    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n        return "Fizz"',
            ),
        ),
    ),
    Task(
        name="words",
        description="word_count() miscounts text with irregular spacing.",
        module="words.py",
        source='''"""Text helpers."""


def word_count(text):
    """How many whitespace-separated words ``text`` has."""
    return len(text.split(" "))
''',
        imports=("word_count",),
        tests=(
            Test("test_simple", (Check("word_count('hello world')", 2),)),
            Test("test_irregular_spacing", (Check("word_count('  many   spaces\\there ')", 3),)),
            Test("test_empty", (Check("word_count('')", 0),)),
        ),
        fix=(("words.py", 'text.split(" ")', "text.split()"),),
    ),
)
TASKS_BY_NAME = {t.name: t for t in TASKS}
