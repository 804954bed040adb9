"""``code-repair-v1``'s judge: a module cannot forge a pass (the old runner's nonce, values
equal to everything, patched builtins, results written to its descriptors), forged output
is shown as output, values that are not plain, expected exceptions, huge ints, a missing
name, the tests the policy reads agree with the judge, and the end of a long output."""

from __future__ import annotations

import subprocess
import sys

import pytest
from code_repair_helpers import edit_action, repair_fixture  # noqa: F401 - by name=

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs.code_repair import TASKS


def test_code_repair_output_hides_the_work_dir_and_forged_results(repair):
    repair.reset(options={"task": "mathutils"})
    workdir = str(repair.env.workdir)
    res = repair.step(edit_action("mathutils.py", "    return a - b", "    return a -"))
    res = repair.step("run_tests")
    assert "ERROR test_mathutils.py: SyntaxError" in res.obs.text
    assert workdir not in res.obs.text and res.info["passed"] == 0
    forged = 'print("@@result x 3 0")\n    return a - b'
    repair.step(edit_action("mathutils.py", "    return a -", "    " + forged))
    res = repair.step("submit")
    assert res.reward == 0.0 and res.info["failed"] == 2


# The nonce, eq and int-subclass forgeries passed every test of the old runner, which ran
# the tests in the module's own process and trusted the result line it printed.
_FORGED_LINES = (
    "print('@@result x 3 0', 'PASS test_mathutils.py::test_add', 'Tests: 3 passed.', sep='\\n', flush=True)"
)


_FORGERIES = {
    # reads the old runner's verdict nonce from its globals, prints a pass and exits
    "nonce": (
        "import __main__, os\n"
        "print(f\"@@result {getattr(__main__, 'nonce', 'x')} 3 0\", flush=True)\nos._exit(0)\n",
        "prepend",
    ),
    # a value equal to everything
    "eq": ("    class _Any:\n        __eq__ = lambda s, o: True\n    return _Any()", "body"),
    # an int subclass equal to everything (an isinstance check would let it through)
    "int-subclass": ("    class _Int(int):\n        __eq__ = lambda s, o: True\n    return _Int(0)", "body"),
    # patches the comparison itself
    "builtins": ("import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\n", "prepend"),
    # the checks' results, wrong ones, written to every descriptor the runner may use
    "fds": (
        "import os, json\nfor fd in range(3, 64):\n    try:\n"
        "        lines = [json.dumps({'i': i, 'value': 'ok'}) for i in range(9)]\n"
        "        os.write(fd, ('\\n'.join(lines) + '\\n').encode())\n"
        "    except OSError:\n        pass\nos._exit(0)\n",
        "prepend",
    ),
}


@pytest.mark.parametrize("name", sorted(_FORGERIES))
def test_code_repair_module_cannot_forge_a_pass(repair, name):
    code, where = _FORGERIES[name]
    repair.reset(options={"task": "mathutils"})
    if where == "prepend":
        edit = ('"""Small numeric helpers."""', code + '"""Small numeric helpers."""')
    else:
        edit = ("    return a - b", code)
    assert "block(s) applied" in repair.step(edit_action("mathutils.py", *edit)).obs.text
    res = repair.step("submit")
    assert res.reward == 0.0 and not res.info["all_passed"], res.obs.text
    assert res.info["passed"] < 3


def test_code_repair_forged_output_is_shown_as_output_not_as_results(repair):
    repair.reset(options={"task": "mathutils"})
    forged = "import os\n" + _FORGED_LINES + "\nos._exit(0)\n"
    repair.step(edit_action("mathutils.py", '"""Small numeric helpers."""', forged))
    res = repair.step("run_tests")
    head, _, output = res.obs.text.partition("Output of the run:")
    assert head.startswith("Tests: 0 passed, 3 failed.")
    assert "FAIL test_mathutils.py::test_add: add(2, 3) did not finish" in head
    assert "PASS test_mathutils.py::test_add" in output  # the module's print, shown apart


def test_code_repair_a_value_that_is_not_plain_fails_with_a_reason(repair):
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "    return a - b", "    return {1, 2}"))
    res = repair.step("run_tests")
    assert "add(2, 3) returned {1, 2} (a set; the tests compare plain values" in res.obs.text


def test_code_repair_expected_exceptions_match_by_class_and_subclass(repair):
    repair.reset(options={"task": "stats"})
    # UnicodeError is a ValueError subclass: `except ValueError` would take it too
    repair.step(
        edit_action("stats.py", 'raise ValueError("mean of an empty list")', "raise UnicodeError('x')")
    )
    assert "PASS test_stats.py::test_mean_empty" in repair.step("run_tests").obs.text
    repair.step(edit_action("stats.py", "raise UnicodeError('x')", "return 0"))
    text = repair.step("run_tests").obs.text
    assert "FAIL test_stats.py::test_mean_empty: mean([]) did not raise ValueError (it returned 0)" in text


def test_code_repair_a_huge_int_is_too_large_and_the_other_tests_still_run(repair):
    # json.dumps refuses an int past 4300 digits: the runner died there, and the correct
    # clamp tests after it read "did not finish"
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "    return a - b", "    return 10**5000 if a < 0 else a + b"))
    text = repair.step("run_tests").obs.text
    assert (
        "FAIL test_mathutils.py::test_add_negative: add(-4, 1) returned a value too large to compare" in text
    )
    assert "PASS test_mathutils.py::test_clamp" in text and "PASS test_mathutils.py::test_add" in text


def test_code_repair_missing_name_fails_every_test(repair):
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "def add(a, b):", "def plus(a, b):"))
    res = repair.step("run_tests")
    assert res.info["passed"] == 0 and res.info["failed"] == 3
    assert "ERROR test_mathutils.py: ImportError: cannot import name 'add' from 'mathutils'" in res.obs.text


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_code_repair_rendered_tests_agree_with_the_judge(task, tmp_path):
    """The test file the policy reads, run as plain Python, fails and passes the same tests
    as the judge does, before and after the fix."""
    for fixed in (False, True):
        source = task.source
        if fixed:
            for _, search, replace in task.fix:
                source = source.replace(search, replace, 1)
        (tmp_path / task.module).write_text(source)
        (tmp_path / task.test_file).write_text(task.files[task.test_file])
        script = (
            f"import {task.test_file[:-3]} as t\n"
            f"for name in {[x.name for x in task.tests]!r}:\n"
            "    try:\n        getattr(t, name)()\n    except BaseException:\n        print('FAIL', name)\n"
            "    else:\n        print('PASS', name)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True
        )
        env = envpool.make("code-repair-v1")
        try:
            env.reset(options={"task": task.name})
            (env.env.workdir / task.module).write_text(source)
            judged = env.step("run_tests").obs.text
        finally:
            env.close()
        for line in run.stdout.splitlines():
            verdict, name = line.split()
            assert f"{verdict} {task.test_file}::{name}" in judged, (fixed, line, judged)
        assert (f"Tests: {task.n_tests} passed" in judged) == fixed


def test_code_repair_shows_the_end_of_a_long_output(repair):
    # past 1 MB the first megabyte was read, and the "end" shown was its end: the last line
    # (a traceback, say) was lost, and the count of characters cut was that of the megabyte
    repair.reset(options={"task": "mathutils"})
    body = "print('x' * 1_500_000)\nprint('the last line')\ndef add"
    repair.step(edit_action("mathutils.py", "def add", body))
    text = repair.step("run_tests").obs.text
    output = text.partition("Output of the run:\n")[2]
    assert output.endswith("the last line"), output[-200:]
    assert output.startswith("[... output cut: the run wrote 1,500,015 bytes; its end follows]\n")
    assert len(output) < 4_100
