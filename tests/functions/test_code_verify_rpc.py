"""Python's assert-style tests run in a sandbox of their own (``Sandbox.run_pair``): the
forgeries that worked while the tests ran inside the program's process now fail (the old
harness's, the tests' libraries' protocols, module names, objects that lie about comparisons
and operators, isinstance, unary answers). The test channel, the pair's limits and honest
programs are in test_code_verify_rpc_channel.py. Real sandbox, no mocks; uids from 380 000 up."""

from __future__ import annotations

import pytest
from code_verify_rpc_helpers import TWO_ASSERTS, judge

from functions.verifiers.errors import InvalidTests
from functions.verifiers.sandbox import Limits

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=256)
BASE_UID = 380_000


@pytest.fixture
def verifier(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


# -- forgeries ---------------------------------------------------------------------------------
FORGERIES = {
    # the old proof of a pass was a marker line on fd 3; now fd 3 carries the tests' requests
    "read_fd3_at_top_level": "import os\nm = os.read(3, 80)\nprint(m.decode())\nos._exit(0)\n",
    "read_fd3_when_called": (
        "import os\ndef add(a, b):\n    os.write(1, b'\\n' + os.read(3, 80))\n    os._exit(0)\n"
    ),
    "patch_assertion_error": (
        "import builtins\nclass Quiet(Exception):\n    pass\nbuiltins.AssertionError = Quiet\n"
        "def add(a, b):\n    return 0\n"
    ),
    "settrace_skips_asserts": (
        "import sys\ndef tracer(frame, event, arg):\n    return None\nsys.settrace(tracer)\n"
        "sys.setprofile(tracer)\ndef add(a, b):\n    return 0\n"
    ),
    "exit_zero_from_a_function": "import sys\ndef add(a, b):\n    sys.exit(0)\n",
    "exit_before_defining": "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b\n",
    "os_exit_before_defining": "import os\nos._exit(0)\ndef add(a, b):\n    return a + b\n",
    "assertion_error_from_the_program": "def add(a, b):\n    raise AssertionError('passed')\n",
    "rebinding_builtins_for_the_tests": (
        "def add(a, b):\n    return 0\ndef abs(x):\n    return 0\ndef isinstance(*a):\n    return True\n"
    ),
    # the hello named a "__builtins__" of the program's making, which became the tests' own
    "binding___builtins___through_the_hello": (
        "import sys, builtins\n"
        "_srv = sys.modules['functions.verifiers.rpc_server']\n"
        "_hello = _srv.Server.hello\n"
        "def hello(self, ns):\n"
        "    msg = _hello(self, ns)\n"
        "    fake = dict(vars(builtins))\n"
        "    fake['abs'] = lambda x: 0\n"
        "    msg[1]['__builtins__'] = self.encode(fake)\n"
        "    return msg\n"
        "_srv.Server.hello = hello\n"
        "def add(a, b):\n    return 12345\n"
    ),
    # a StopIteration of the program ended the tests' own loop: all(map(f, xs)) was True
    "stop_iteration_from_the_program": "def add(a, b):\n    raise StopIteration\n",
}


@pytest.mark.parametrize("code", FORGERIES.values(), ids=FORGERIES.keys())
def test_forgeries_of_the_old_harness_fail(verifier, code):
    tests_tried = (
        TWO_ASSERTS,
        "assert abs(add(0.5, 0.25) - 0.75) < 1e-9\n",
        "assert all(map(lambda p: add(*p) == sum(p), [(1, 2), (3, 4)]))\n",
    )
    if "os.read(3" in code:  # it takes the tests' channel and both sides wait to the wall limit:
        tests_tried = tests_tried[:1]  # the same 3 s whatever the tests (9 s for three)
    for tests in tests_tried:
        case = judge(verifier, code, tests)
        assert case.status != "Finished", (tests, case)


UNITTEST = (
    "import unittest\n"
    "class TestAdd(unittest.TestCase):\n"
    "    def test_add(self):\n"
    "        self.assertEqual(add(2, 3), 5)\n"
    "{tail}"
)


@pytest.mark.parametrize(
    "tail",
    ["if __name__ == '__main__':\n    unittest.main()\n", "unittest.main()\n", "unittest.main(exit=False)\n"],
    ids=["guarded_main", "main", "main_no_exit"],
)
def test_unittest_style_tests_judge_the_program(verifier, tail):
    # run in a bare dict, unittest.main() found no TestCase: "Ran 0 tests ... OK" passed any
    # program; and unittest.main(exit=False) went on past failed tests to a pass
    tests = UNITTEST.format(tail=tail)
    assert judge(verifier, "def add(a, b):\n    return a + b\n", tests).status == "Finished"
    wrong = judge(verifier, "def add(a, b):\n    return 0\n", tests)
    assert wrong.status == "Failed" and "unittest: 1 failed" in wrong.stderr, wrong
    # a run that found no test judges no program: the caller's tests are broken (no 0, no 1)
    with pytest.raises(InvalidTests, match="unittest ran no test"):
        judge(verifier, "def add(a, b):\n    return a + b\n", "import unittest\nunittest.main()\n")


def test_a_program_object_cannot_answer_the_tests_libraries_protocols(verifier):
    # numpy reads __array_interface__ off the object, a raw pointer included: the program
    # chose memory of the tests' process as its answer (or crashed it)
    code = (
        "class A:\n    @property\n    def __array_interface__(self):\n"
        "        return {'shape': (1,), 'typestr': '<f8', 'data': (4096, True), 'version': 3}\n"
        "def sq(xs):\n    return A()\n"
    )
    tests = (
        "r = sq([1])\nfor name in ('__array_interface__', '__array_struct__', '__array__', '__dlpack__'):\n"
    )
    tests += "    assert not hasattr(r, name), name\n"
    assert judge(verifier, code, tests).status == "Finished"


MODULE_FAKES = {
    # the tests forgot `import numpy as np` (the reference solution imported it): the program's
    # np, a class or the real module patched, answered them
    "fake_np_class": (
        "class np:\n    @staticmethod\n    def allclose(*a, **k):\n        return True\n"
        "def f(x):\n    return [0.0]\n",
        "assert np.allclose(f(1), [2.0])",
    ),
    "fake_pytest_approx": (
        "class Any:\n    def __eq__(self, o):\n        return True\n"
        "class pytest:\n    @staticmethod\n    def approx(v, **k):\n        return Any()\n"
        "def f(x):\n    return Any()\n",
        "assert f(1) == pytest.approx(0.5)",
    ),
    "patched_module_the_tests_have_not_loaded": (
        "import json\nimport wave as np\nnp.allclose = lambda *a, **k: True\ndef f(x):\n    return [0.0]\n",
        "assert np.allclose(f(1), [2.0])",
    ),
}


@pytest.mark.parametrize(("code", "tests"), MODULE_FAKES.values(), ids=MODULE_FAKES.keys())
def test_a_module_name_the_tests_did_not_import_is_never_the_programs(verifier, code, tests):
    case = judge(verifier, code, tests)
    assert case.status != "Finished" and "NameError" in case.stderr + case.message, case


def test_an_exception_group_from_the_program_is_an_error_of_the_program(verifier):
    code = "class E(ExceptionGroup):\n    pass\ndef f(x):\n    raise E('m', [ValueError('v')])\n"
    tests = "try:\n    f(1)\nexcept Exception as e:\n    assert str(e).startswith('E: m'), e\n"
    assert judge(verifier, code, tests).status == "Finished"


def test_a_stdlib_module_name_is_bound_only_to_that_module(verifier):
    # the tests forgot to import math: the program's fake math answered math.isclose
    fake = "class M:\n    def isclose(self, *a, **k):\n        return True\n"
    fake += "math = M()\ndef f(x):\n    return 0\n"
    assert judge(verifier, fake, "assert math.isclose(f(2), 4.0)").status != "Finished"
    honest = "import math\ndef f(x):\n    return math.sqrt(x) * 2\n"
    assert judge(verifier, honest, "assert math.isclose(f(4), 4.0)").status == "Finished"


ALWAYS_EQUAL = {
    "python_eq": (
        "class Any:\n    def __eq__(self, o):\n        return True\n    __ne__ = lambda s, o: False\n"
    ),
    "every_comparison": (
        "class Any:\n    __eq__ = __le__ = __ge__ = __lt__ = __gt__ = lambda s, o: True\n"
        "    __ne__ = lambda s, o: False\n    __hash__ = lambda s: 5\n"
    ),
    "int_subclass": (
        "class Any(int):\n    __eq__ = int.__ge__\n    __ne__ = int.__lt__\n"
        "    __lt__ = __gt__ = lambda s, o: True\n"
    ),
    "metaclass_lies": (
        "class Meta(type):\n    __dict__ = property(lambda cls: {})\n"
        "class Any(metaclass=Meta):\n    def __eq__(self, other):\n        return True\n"
    ),
}


#: each is true of an answer equal to 5 (and of the lying object, in the program's process)
COMPARISONS = {
    "eq": "assert add(2, 3) == 5",
    "eq_reflected": "assert 5 == add(2, 3)",
    "ne": "assert not (add(2, 3) != 5)",
    "chained": "assert 4 < add(2, 3) < 6",
    "in_a_list": "assert [add(2, 3)] == [5]",
    "in_a_set": "assert {add(2, 3)} == {5}",
    "assert_equal": "import unittest\nunittest.TestCase().assertEqual(add(2, 3), 5)",
    "fraction_expected": "from fractions import Fraction\nassert add(2, 3) == Fraction(5)",
}


#: an expected value of a class of the tests' own, which no honest answer equals either
DATACLASS_EXPECTED = (
    "import dataclasses\n@dataclasses.dataclass\nclass P:\n    x: int\nassert add(2, 3) == P(5)"
)


@pytest.mark.parametrize("cls", ALWAYS_EQUAL.values(), ids=ALWAYS_EQUAL.keys())
@pytest.mark.parametrize("test", COMPARISONS.values(), ids=COMPARISONS.keys())
def test_an_object_that_lies_about_comparisons_fails(verifier, cls, test):
    code = f"{cls}\ndef add(a, b):\n    return Any(10**9) if Any.__mro__[1] is int else Any()\n"
    case = judge(verifier, code, test)
    assert case.status in ("Failed", "RuntimeError"), case
    # and the same answer, honest, passes the same test
    honest = judge(verifier, "def add(a, b):\n    return a + b\n", test)
    assert honest.status == "Finished", honest
    case = judge(verifier, code, DATACLASS_EXPECTED)
    assert case.status == "Failed", case


#: each is true of f(3) == 2.5 and g() == [5, 6]; the tests' value in it (2.5, 5, 7) used to
#: reach the program, whose operator or __contains__ could answer whatever passed
OPERATOR_FORMS = {
    "abs_of_difference": "assert abs(f(3) - 2.5) < 1e-9",
    "abs_of_reflected_difference": "assert abs(2.5 - f(3)) < 1e-9",
    "difference_is_zero": "assert f(3) - 2.5 == 0",
    "reflected_difference_is_zero": "assert 2.5 - f(3) == 0",
    "ratio_is_one": "assert f(3) / 2.5 == 1",
    "floor_division": "assert f(3) // 1 == 2",
    "round_to_digits": "assert round(f(3), 2) == 2.5",
    "math_isclose": "import math\nassert math.isclose(f(3), 2.5)",
    "in": "assert 5 in g()",
    "in_and_not_in": "assert 5 in g() and 7 not in g()",
}


HONEST_ANSWERS = "def f(x):\n    return x - 0.5\ndef g():\n    return [5, 6]\n"


#: answers 'yes' to its first question, 'no' to the next, and so on: passes `5 in g() and 7 not in g()`
ALTERNATING_CONTAINS = (
    "calls = [0]\ndef alternating(self, x):\n    calls[0] += 1\n    return calls[0] % 2 == 1\n"
)


OPERATOR_LIARS = {
    "program_class_answers_zero": ALTERNATING_CONTAINS
    + "class Liar:\n    __sub__ = __rsub__ = lambda s, o: 0\n    __truediv__ = lambda s, o: 1\n"
    "    __floordiv__ = __round__ = lambda s, *a: s\n    __abs__ = lambda s: 0.0\n"
    "    __float__ = lambda s: 0.0\n    __eq__ = lambda s, o: True\n    __hash__ = lambda s: 0\n"
    "    __contains__ = alternating\n    def __iter__(self):\n        yield Liar()\n"
    "def f(x=None):\n    return Liar()\ng = f\n",
    "program_class_whose_difference_has_abs_zero": ALTERNATING_CONTAINS
    + "class Liar:\n    __sub__ = __rsub__ = __truediv__ = __floordiv__ = lambda s, o: s\n"
    "    __abs__ = lambda s: 0.0\n    __eq__ = lambda s, o: True\n    __contains__ = alternating\n"
    "def f(x=None):\n    return Liar()\ng = f\n",
    "float_subclass": ALTERNATING_CONTAINS
    + "class Liar(float):\n    __sub__ = __rsub__ = lambda s, o: 0.0\n    __truediv__ = lambda s, o: 1.0\n"
    "    __floordiv__ = __round__ = lambda s, *a: s\n    __abs__ = lambda s: 0.0\n"
    "    __float__ = lambda s: 0.0\n    __eq__ = lambda s, o: True\n    __hash__ = float.__hash__\n"
    "class Bag(list):\n    __contains__ = alternating\n    __len__ = lambda s: 2\n"
    "def f(x):\n    return Liar(7.0)\ndef g():\n    return Bag()\n",
    "int_subclass": ALTERNATING_CONTAINS
    + "class Liar(int):\n    __sub__ = __rsub__ = lambda s, o: 0\n    __truediv__ = lambda s, o: 1.0\n"
    "    __floordiv__ = __round__ = lambda s, *a: s\n    __abs__ = lambda s: 0\n"
    "    __index__ = __int__ = lambda s: 2\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
    "class Bag(tuple):\n    __contains__ = alternating\n"
    "def f(x):\n    return Liar(7)\ndef g():\n    return Bag((1, 2))\n",
}


@pytest.mark.parametrize("test", OPERATOR_FORMS.values(), ids=OPERATOR_FORMS.keys())
def test_an_object_that_lies_about_operators_fails(verifier, test):
    honest = judge(verifier, HONEST_ANSWERS, test)
    assert honest.status == "Finished", honest
    for name, liar in OPERATOR_LIARS.items():
        case = judge(verifier, liar, test)
        assert case.status in ("Failed", "RuntimeError"), (name, case)


def test_an_operator_with_a_value_of_the_tests_is_refused_clearly(verifier):
    code = (
        "class V:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    def __add__(self, o):\n        return V(self.x + o.x, self.y + o.y)\n"
        "    def __mul__(self, k):\n        return V(self.x * k, self.y * k)\n"
        "    def __eq__(self, o):\n        return isinstance(o, V) and (self.x, self.y) == (o.x, o.y)\n"
        "    def __abs__(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n"
        "    def __float__(self):\n        return float(abs(self))\n"
        "    def __len__(self):\n        return 2\n"
        "    def __contains__(self, v):\n        return v in (self.x, self.y)\n"
    )
    # between the program's own objects, and unary: the program's own semantics
    tests = (
        "assert V(1, 2) + V(3, 4) == V(4, 6) and abs(V(3, 4)) == 5 and float(V(3, 4)) == 5.0\n"
        "assert len(V(0, 0)) == 2 and -V(3, 4).x == -3 and V(1, 2).x * 2 == 2\n"
    )
    case = judge(verifier, code, tests)
    assert case.status == "Finished", case
    for test, shown in (
        ("V(1, 2) * 2 == V(2, 4)", "not computed: the program's V * the tests' int"),
        ("2 in V(1, 2)", "not computed: the tests' int in the program's V (it is not iterable"),
    ):
        case = judge(verifier, code, f"assert {test}\n")
        assert (case.status, case.message.split(":")[0]) == ("RuntimeError", "the tests stopped on TypeError")
        assert shown in case.stderr and "could answer anything" in case.stderr, case.stderr


def test_isinstance_tells_the_program_a_type_not_a_value(verifier):
    code = (
        "seen = []\nclass Meta(type):\n    def __instancecheck__(cls, x):\n        seen.append(x)\n"
        "        return False\n    def __subclasscheck__(cls, t):\n"
        "        seen.append(t)\n        return False\n"
        "class Num(metaclass=Meta):\n    pass\ndef f(x):\n    return seen[-1] if seen else 0\n"
    )
    tests = "assert not isinstance(2.5, Num)\nassert f(3) == 2.5\n"
    case = judge(verifier, code, tests)
    assert case.status == "Failed", case
    honest = "from numbers import Number\nclass Num:\n    pass\ndef f(x):\n    return x - 0.5\n"
    tests += "assert isinstance(5, Number) and isinstance(f(3), Number) and not isinstance('5', Number)\n"
    case = judge(verifier, honest, tests)
    assert case.status == "Finished", case


def test_unary_answers_are_type_checked(verifier):
    # a program that rewrites its own server can answer float() with anything: not with a handle
    code = (
        "import sys\nserver = sys.modules['functions.verifiers.rpc_server']\n"
        "server._UNARY.update(float=lambda o: o, len=lambda o: 2.0)\n"
        "class P:\n    pass\ndef f():\n    return P()\n"
    )
    for test in ("float(f()) == 1.0", "len(f()) == 2"):
        case = judge(verifier, code, f"assert {test}\n")
        expected = ("RuntimeError", "protocol error on the test channel")
        assert (case.status, case.message.split(":")[0]) == expected, case
