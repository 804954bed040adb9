"""unittest runs of the tests, watched (stdlib only, like the harness): a run that found
no test, or whose tests failed, must not end as a pass."""

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


def unittest_failures(runs: list[Any]) -> str:
    """What went wrong in the unittest runs the tests started ("" when nothing did)."""
    for result in runs:
        if not result.wasSuccessful():
            return f"unittest: {len(result.failures)} failed, {len(result.errors)} errors"
        if result.testsRun == 0:
            return "unittest ran no test (the tests define no TestCase it could find)"
    return ""
