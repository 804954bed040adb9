"""Python test texts that define tests and run none of them: the verifier runs what they
define (``functions.verifiers.rpc_collect``), or says they cannot judge a program. Before,
each of these texts passed every program. Real sandbox, no mocks; uids from 390 000 up."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from functions.verifiers import rpc_collect
from functions.verifiers.cold import SubprocessRunner
from functions.verifiers.errors import InvalidTests
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CaseResult, CodeTests, Verifier

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=256)
BASE_UID = 390_000
ADD = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return 0\n"
#: right on add(2, 3) only
ONLY_2_3 = "def add(a, b):\n    return 5 if (a, b) == (2, 3) else 0\n"
#: ends the program when called: the channel breaks inside a test the harness runs
EXITS = "import os\ndef add(a, b):\n    os._exit(0)\n"


@pytest.fixture
def verifier(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


def judge(verifier: Verifier, code: str, tests: str, entry_point: str | None = None) -> CaseResult:
    result = verifier.verify(code, CodeTests(test_code=tests, entry_point=entry_point))
    assert result.total == 1
    return result.cases[0]


# -- pytest style --------------------------------------------------------------------------------
PYTEST = "def test_add():\n    assert add(2, 3) == 5\n\ndef test_add_zero():\n    assert add(0, 7) == 7\n"


def test_uncalled_pytest_tests_run_and_judge_the_program(verifier):
    assert judge(verifier, ADD, PYTEST).status == "Finished"
    wrong = judge(verifier, WRONG, PYTEST)
    assert wrong.status == "Failed" and wrong.message == "an assertion failed in test_add", wrong
    assert 'File "tests.py", line 2, in test_add' in wrong.stderr, wrong.stderr  # the text's lines
    later = judge(verifier, ONLY_2_3, PYTEST)  # the second test runs too
    assert later.status == "Failed" and later.message == "an assertion failed in test_add_zero", later
    gone = judge(verifier, EXITS, PYTEST)
    # which of the two ends first is a race: the program's own exit, or the tests' broken channel
    assert gone.status in ("Failed", "RuntimeError") and (
        "closed the test channel" in gone.message or "exited before the tests" in gone.message
    ), gone


def test_a_test_the_text_called_is_not_run_again(verifier):
    # test_a ran once, called by the text; the harness runs test_b, never test_a a second time
    tests = (
        "runs = []\n"
        "def test_a():\n    runs.append('a')\n    assert add(2, 3) == 5\n"
        "def test_b():\n    runs.append('b')\n    assert add(1, 1) == 2\n"
        "    assert runs == ['a', 'b'], runs\n"
        "test_a()\n"
    )
    assert judge(verifier, ADD, tests).status == "Finished"
    wrong = judge(verifier, ONLY_2_3, tests)  # only test_b, which the text never called, sees it
    assert wrong.status == "Failed" and wrong.message == "an assertion failed in test_b", wrong


def test_uncalled_test_class_methods_run(verifier):
    tests = (
        "class TestAdd:\n"
        "    def test_small(self):\n        assert add(2, 3) == 5\n"
        "    def test_zero(self):\n        assert add(0, 7) == 7\n"
        "    @staticmethod\n    def test_static():\n        assert add(1, 1) == 2\n"
    )
    assert judge(verifier, ADD, tests).status == "Finished"
    wrong = judge(verifier, ONLY_2_3, tests)
    assert wrong.status == "Failed" and wrong.message == "an assertion failed in TestAdd.test_zero", wrong


def test_a_test_that_takes_fixtures_cannot_judge_a_program(verifier):
    tests = (
        "def test_add(tmp_path, capsys):\n    assert add(2, 3) == 5\n\n"
        "def test_ok():\n    assert add(1, 1) == 2\n"
    )
    with pytest.raises(InvalidTests, match=r"test_add\(tmp_path, capsys\) takes arguments \(pytest fixtures"):
        judge(verifier, ADD, tests)
    # a parameter with a default is no fixture
    assert judge(verifier, ADD, "def test_add(n=3):\n    assert add(n, 2) == 5\n").status == "Finished"


@pytest.mark.parametrize(
    ("tests", "message"),
    [
        ("assert add(2, 3) ==\n", r"do not compile: SyntaxError: invalid syntax \(tests.py, line 1\)"),
        ("assert add(2, 3) == 5\0\n", r"the tests do not compile: SyntaxError: source code .*null bytes"),
    ],
)
def test_tests_that_do_not_compile_cannot_judge_a_program(verifier, tests, message):
    # a syntax error of the tests scored every program 0 ("the tests stopped on
    # SyntaxError"), as JavaScript's tests that do not compile never did
    with pytest.raises(InvalidTests, match=message):
        judge(verifier, ADD, tests)
    # one the tests meet as they run (compiling a text of their own) is still theirs to judge
    assert judge(verifier, ADD, "compile('x ==', 't', 'exec')\n").status == "RuntimeError"


def test_an_error_in_an_uncalled_test_names_it(verifier):
    tests = "def test_add():\n    assert add(2, 3) == 5\n    int('x')\n"
    case = judge(verifier, ADD, tests)
    assert case.status == "RuntimeError", case
    assert case.message.startswith("the tests stopped in test_add on ValueError: invalid literal"), case


# -- HumanEval's check(candidate) ----------------------------------------------------------------
CHECK = (
    "METADATA = {'author': 'x'}\n\n"
    "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 7) == 7\n"
)


def test_check_runs_on_the_entry_point(verifier):
    assert judge(verifier, ADD, CHECK, entry_point="add").status == "Finished"
    wrong = judge(verifier, ONLY_2_3, CHECK, entry_point="add")
    assert wrong.status == "Failed" and wrong.message == "an assertion failed in check", wrong
    # the program's add, never a function of the tests of that name
    shadowed = CHECK + "\ndef add(a, b):\n    return a + b\n"
    assert judge(verifier, WRONG, shadowed, entry_point="add").status == "Failed"


def test_check_without_an_entry_point_cannot_judge_a_program(verifier):
    with pytest.raises(InvalidTests, match=r"check\(candidate\) is defined but never called.*entry_point"):
        judge(verifier, ADD, CHECK)
    # a text that calls check itself needs none, and check does not run twice
    called = "n = []\n" + CHECK.replace("def check(candidate):\n", "def check(candidate):\n    n.append(1)\n")
    called += "check(add)\nassert n == [1]\n"
    assert judge(verifier, ADD, called).status == "Finished"
    assert judge(verifier, ADD, called, entry_point="add").status == "Finished"
    assert judge(verifier, WRONG, called, entry_point="add").status == "Failed"


def test_check_called_by_a_test_the_harness_runs_runs_once(verifier):
    once = "def check(candidate):\n    assert n == [], 'check ran twice'\n    n.append(1)\n"
    tests = (
        "n = []\n" + CHECK.replace("def check(candidate):\n", once) + "def test_check():\n    check(add)\n"
    )
    assert judge(verifier, ADD, tests).status == "Finished"  # no entry point needed
    assert judge(verifier, ADD, tests, entry_point="add").status == "Finished"  # nor run again
    wrong = judge(verifier, ONLY_2_3, tests, entry_point="add")
    assert wrong.status == "Failed" and wrong.message == "an assertion failed in test_check", wrong


def test_an_entry_point_the_program_lacks_is_the_programs_failure(verifier):
    case = judge(verifier, "def plus(a, b):\n    return a + b\n", CHECK, entry_point="add")
    assert case.status == "RuntimeError" and "NameError: name 'add' is not defined" in case.message, case


def test_entry_point_is_validated_at_the_edge(verifier):
    assert CodeTests(test_code=CHECK, entry_point="add").entry_point == "add"
    with pytest.raises(ValidationError, match="not a Python name"):
        CodeTests(test_code=CHECK, entry_point="add; import os")
    with pytest.raises(ValidationError, match="entry_point goes with test_code"):
        CodeTests(cases=[{"stdin": "", "expected_stdout": "1"}], entry_point="add")
    with pytest.raises(ValueError, match="entry_point is for Python"):
        verifier.verify(
            "int add(int a, int b) { return a + b; }", CodeTests(test_code="x", entry_point="add"), "c"
        )


def test_check_through_the_subprocess_runner():
    # the benchmark's baseline reads the entry point from beside the tests as well
    cold = Verifier(SubprocessRunner(), LIMITS)
    assert cold.verify(ADD, CodeTests(test_code=CHECK, entry_point="add")).status == "Finished"
    assert cold.verify(WRONG, CodeTests(test_code=CHECK, entry_point="add")).status == "Failed"


# -- doctest, unittest ---------------------------------------------------------------------------
DOCTEST = "def example():\n    '''\n    >>> add(2, 3)\n    5\n    '''\n\nimport doctest\ndoctest.testmod()\n"


def test_doctest_examples_judge_the_program(verifier):
    assert judge(verifier, ADD, DOCTEST).status == "Finished"
    # testmod() prints a failed example and returns: that was a pass
    wrong = judge(verifier, WRONG, DOCTEST)
    assert wrong.status == "Failed" and "doctest: 1 of 1 examples failed" in wrong.stderr, wrong


@pytest.mark.parametrize(
    "tests",
    [
        "import doctest\ndoctest.testmod()\n",
        "def f():\n    '''no example here'''\n\nimport doctest\ndoctest.testmod()\nprint('done')\n",
        "from doctest import testmod\ntestmod()\n",
    ],
    ids=["testmod_alone", "docstring_without_example", "imported_testmod"],
)
def test_a_doctest_run_with_no_example_cannot_judge_a_program(verifier, tests):
    with pytest.raises(InvalidTests, match=r"doctest.testmod\(\) found no example"):
        judge(verifier, ADD, tests)


def test_testcases_the_text_never_ran_run(verifier):
    tests = (
        "import unittest\n"
        "class AddCase(unittest.TestCase):\n"
        "    def test_small(self):\n        self.assertEqual(add(2, 3), 5)\n"
        "    def test_zero(self):\n        self.assertEqual(add(0, 7), 7)\n"
    )
    assert judge(verifier, ADD, tests).status == "Finished"
    wrong = judge(verifier, ONLY_2_3, tests)
    assert wrong.status == "Failed" and "unittest: 1 failed" in wrong.stderr, wrong


# -- texts that test nothing, and the common text ------------------------------------------------
@pytest.mark.parametrize(
    "tests",
    [
        "",
        "pass\n",
        "# assert add(2, 3) == 5\n",
        '"""assert add(2, 3) == 5"""\n',
        "import math\nX = add\nY: int = 2\nY += 1\n",
        "def helper():\n    assert add(2, 3) == 5\n\n"
        "class Cases:\n    def test_x(self):\n        assert False\n",
        "async def test_add():\n    assert add(2, 3) == 5\n",
    ],
    ids=["empty", "pass", "comment", "docstring", "imports_and_assignments", "helpers_only", "async_test"],
)
def test_a_text_that_runs_nothing_cannot_judge_a_program(verifier, tests):
    for program in (ADD, WRONG):
        with pytest.raises(InvalidTests, match=r"they ran nothing: define test_\* functions"):
            judge(verifier, program, tests)


def test_the_tests_are_compiled_with_their_own_future_flags(verifier):
    # the harness's `from __future__ import annotations` reached the tests: annotations were
    # strings, and honest tests that read them failed every program
    reads = "def f(x: int):\n    return x\nassert f.__annotations__['x'] is int\nassert add(2, 3) == 5\n"
    assert judge(verifier, ADD, reads).status == "Finished"
    collected = "def test_reads():\n    def f(x: int):\n        return x\n"
    collected += "    assert f.__annotations__['x'] is int\n"
    assert judge(verifier, ADD, collected).status == "Finished"


def test_plain_asserts_are_judged_as_before(verifier):
    tests = "assert add(2, 3) == 5\nassert add(0, 7) == 7\n"
    assert judge(verifier, ADD, tests).status == "Finished"
    wrong = judge(verifier, ONLY_2_3, tests)
    assert wrong.status == "Failed" and wrong.message == "an assertion failed", wrong
    assert 'File "tests.py", line 2, in <module>' in wrong.stderr
    # a top-level statement that is not a definition counts as testing: a print, a loop
    assert judge(verifier, ADD, "print(add(2, 3))\n").status == "Finished"
    assert judge(verifier, WRONG, "for a in range(3):\n    assert add(a, 1) == a + 1\n").status == "Failed"
    # and so does an assignment that calls: a runner not named test* (it was "ran nothing")
    runner = "def run_all():\n    assert add(2, 3) == 5\n    return True\nok = run_all()\n"
    assert judge(verifier, ADD, runner).status == "Finished"
    assert judge(verifier, WRONG, runner).status == "Failed"


# -- the plan, without a sandbox -----------------------------------------------------------------
@pytest.mark.parametrize(
    "tests",
    [
        "assert add(2, 3) == 5\n",
        "import math\nfor x in range(3):\n    assert math.isclose(add(x, 0.5), x + 0.5)\n",
        "if __name__ == '__main__':\n    assert add(2, 3) == 5\n",
        "def helper(x):\n    return x + 1\nassert add(helper(1), 3) == 5\n",
    ],
    ids=["one_assert", "loop", "guarded", "with_a_helper"],
)
def test_plain_asserts_compile_once_with_no_ast_pass(tests, monkeypatch):
    def no_ast(*args, **kwargs):
        raise AssertionError("an AST pass for a text of plain asserts")

    monkeypatch.setattr(rpc_collect.ast, "parse", no_ast)
    code, plan = rpc_collect.prepare(tests, "tests.py")
    assert code == compile(tests, "tests.py", "exec", dont_inherit=True)
    assert plan.acts and plan.tests == [] and not plan.check


def test_the_plan_names_the_tests_and_what_acts():
    tests = (
        '"""doc"""\nimport math\nX = 1\n'
        "def test_a():\n    '''doc'''\n    assert True\n"
        "def check(candidate):\n    pass\n"
        "class TestB:\n    def test_c(self):\n        pass\n    def helper(self):\n        pass\n"
        "class Other:\n    def test_d(self):\n        pass\n"
    )
    code, plan = rpc_collect.prepare(tests, "tests.py")
    assert (plan.acts, plan.tests, plan.classes, plan.check) == (
        False,
        ["test_a", "TestB.test_c"],
        ["TestB", "Other"],
        True,
    )
    namespace = {rpc_collect.RAN: plan.ran}
    exec(code, namespace)
    assert namespace["test_a"].__doc__ == "doc"  # still a docstring (doctest reads it)
    namespace["test_a"]()
    namespace["TestB"]().test_c()
    assert plan.ran == {"test_a", "TestB.test_c"}
    assert rpc_collect.prepare("x = f()\nprint(x)\n", "tests.py")[1].acts
    assert rpc_collect.prepare("ok: bool = run_all()\n", "tests.py")[1].acts
    assert rpc_collect.prepare("n = 0\nn += len([1])\n", "tests.py")[1].acts
    assert not rpc_collect.prepare("EPS = 1e-9\nF = EPS\nG: int = -1\n", "tests.py")[1].acts
