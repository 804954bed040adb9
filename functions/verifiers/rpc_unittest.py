"""unittest and doctest runs of the tests, watched (stdlib only, like the harness): a run
that found no test, or whose tests failed, must not end as a pass. Neither raises when a
test fails (``unittest.main(exit=False)`` and ``doctest.testmod()`` print and go on)."""

from __future__ import annotations

import unittest
from typing import Any


def watch_unittest() -> list[Any]:
    """Record every unittest run the tests start: ``unittest.main()`` that found no test, or
    ``unittest.main(exit=False)`` whose tests failed, must not end as a pass. (unittest is
    imported with this module, in the zygote: importing it per run cost ~11 ms.)"""
    runs: list[Any] = []
    run = unittest.TextTestRunner.run

    def recorded(self: Any, test: Any) -> Any:
        result = run(self, test)
        runs.append(result)
        return result

    unittest.TextTestRunner.run = recorded  # type: ignore[method-assign]
    return runs


def watch_doctest() -> list[tuple[str, int, int]]:
    """Record every doctest run the tests start, as ``(kind, failed, attempted)``: each
    docstring's examples (``"run"``) and each ``testmod()`` (``"testmod"``, which finds no
    docstring at all when none has an example). Only for tests that name doctest: importing
    it costs ~5 ms, too much for every run and too much memory for the zygote."""
    import doctest

    results: list[tuple[str, int, int]] = []
    run, testmod = doctest.DocTestRunner.run, doctest.testmod

    def recorded_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = run(self, *args, **kwargs)
        results.append(("run", result.failed, result.attempted))
        return result

    def recorded_testmod(*args: Any, **kwargs: Any) -> Any:
        result = testmod(*args, **kwargs)
        results.append(("testmod", result.failed, result.attempted))
        return result

    doctest.DocTestRunner.run = recorded_run  # type: ignore[method-assign]
    doctest.testmod = recorded_testmod
    return results


def run_failures(runs: list[Any], doctests: list[tuple[str, int, int]]) -> str:
    """What failed in the unittest and doctest runs the tests started ("" when nothing did)."""
    for result in runs:
        if not result.wasSuccessful():
            return f"unittest: {len(result.failures)} failed, {len(result.errors)} errors"
    failed = sum(f for kind, f, _ in doctests if kind == "run")
    if failed:
        tried = sum(a for kind, _, a in doctests if kind == "run")
        return f"doctest: {failed} of {tried} examples failed"
    return ""


def empty_runs(runs: list[Any], doctests: list[tuple[str, int, int]]) -> str:
    """A unittest or doctest run that tested nothing ("" when there is none): the tests are
    broken, whatever the program."""
    if any(result.testsRun == 0 for result in runs):
        return "unittest ran no test (the tests define no TestCase it could find)"
    if any(kind == "testmod" and attempted == 0 for kind, _, attempted in doctests):
        return "doctest.testmod() found no example to run (no docstring of the tests has a >>> line)"
    return ""


def tests_ran(runs: list[Any], doctests: list[tuple[str, int, int]]) -> bool:
    """Did a unittest or doctest run test something?"""
    return any(result.testsRun for result in runs) or any(a for kind, _, a in doctests if kind == "run")
