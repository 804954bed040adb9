"""Python's assert-style tests run in a sandbox of their own (``Sandbox.run_pair``): the
forgeries that worked while the tests ran inside the program's process now fail, and honest
programs still pass. Real sandbox, no mocks; uids from 380 000 up."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from functions.verifiers.errors import InvalidTests
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CodeTests, Verifier

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=256)
#: for a verdict that must come from the CPU limit: a spinning run on a loaded machine (CI beside
#: other jobs) gets a fraction of a core, and at 3 s of wall it may not have used 1 CPU second
CPU_BOUND = LIMITS.model_copy(update={"wall_s": 15})
#: the program's end of the channel to its tests (the runner keeps it aside, above fd 9)
CHANNEL = (
    "import os, fcntl\n"
    "def _writable(fd):\n"
    "    try:\n"
    "        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY\n"
    "    except OSError:\n"
    "        return False\n"
    "chan = [fd for fd in map(int, os.listdir('/proc/self/fd')) if fd > 2 and _writable(fd)][0]\n"
)
TWO_ASSERTS = "assert add(2, 3) == 5\nassert add(1, 1) == 2\n"


BASE_UID = 380_000


@pytest.fixture
def verifier(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


def judge(verifier: Verifier, code: str, tests: str, limits: Limits | None = None):
    result = verifier.verify(code, CodeTests(test_code=tests), limits=limits)
    assert result.total == 1
    return result.cases[0]


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


def test_fake_frames_on_the_channel_fail(verifier):
    fake_hello = '["hello",{"add":["h",0,null,"function"]}]'
    fake_ok = '["ok",5,[]]'
    frames = "".join(
        f"os.write(chan, len({f!r}).to_bytes(4, 'big') + {f!r}.encode())\n"
        for f in (fake_hello, fake_ok, fake_ok, fake_ok)
    )
    code = CHANNEL + frames + "def add(a, b):\n    return 0\n"
    case = judge(verifier, code, TWO_ASSERTS + "assert add(10, 10) == 20\n")
    assert case.status != "Finished", case
    code = CHANNEL + "os.write(chan, b'\\xff' * 64)\ndef add(a, b):\n    return a + b\n"
    garbage = judge(verifier, code, TWO_ASSERTS)
    assert (garbage.status, garbage.message.split(":")[0]) == (
        "RuntimeError",
        "protocol error on the test channel",
    ), garbage
    # what the program prints is not on the channel, whatever it looks like
    printed = judge(
        verifier,
        f"import sys\nsys.stdout.write({fake_hello!r})\nprint({fake_ok!r})\n"
        "def add(a, b):\n    return a + b\n",
        TWO_ASSERTS,
    )
    assert printed.status == "Finished", printed
    assert fake_ok in printed.stdout


def test_flooding_the_channel_is_cut_off(verifier):
    code = CHANNEL + (
        "os.write(chan, (15 << 20).to_bytes(4, 'big'))\n"  # a frame announced, then too much of it
        "while True:\n    os.write(chan, b'[' * 65536)\n"
    )
    limits = LIMITS.model_copy(update={"channel_bytes": 1 << 20})
    case = judge(verifier, code, TWO_ASSERTS, limits)
    assert (case.status, case.message) == (
        "RuntimeError",
        "sent its tests more than the 1048576-byte channel cap",
    ), case
    printed = judge(verifier, "while True:\n    print('y' * 1000)\n", TWO_ASSERTS)
    assert (printed.status, "output cap" in printed.message) == ("RuntimeError", True), printed


def test_a_program_that_never_answers_runs_out_of_time(verifier):
    spin = judge(verifier, "def add(a, b):\n    while True:\n        pass\n", TWO_ASSERTS, CPU_BOUND)
    assert (spin.status, "CPU seconds" in spin.message) == ("TimeLimitExceeded", True), spin
    sleep = judge(verifier, "import time\ndef add(a, b):\n    time.sleep(60)\n", TWO_ASSERTS)
    assert (sleep.status, "wall limit" in sleep.message) == ("TimeLimitExceeded", True), sleep
    top = judge(verifier, "import time\ntime.sleep(60)\n", TWO_ASSERTS)
    assert top.status == "TimeLimitExceeded", top


def test_the_tests_own_limits(verifier):
    honest = "def add(a, b):\n    return a + b\n"
    spin = judge(verifier, honest, "assert add(1, 2) == 3\nwhile True:\n    pass\n", CPU_BOUND)
    assert (spin.status, "CPU seconds" in spin.message) == ("TimeLimitExceeded", True), spin
    chatty = judge(verifier, honest, "while True:\n    print('x' * 1000)\n")
    assert (chatty.status, chatty.message) == ("RuntimeError", "the tests wrote more than the stderr cap")


def test_concurrent_pairs_share_the_spares_without_deadlock(verifier):
    # each case takes two of the two warm spares; six at once wait for replacements in turn
    honest, wrong = "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return 0\n"
    with ThreadPoolExecutor(6) as pool:
        cases = list(pool.map(lambda i: judge(verifier, (honest, wrong)[i % 2], TWO_ASSERTS), range(24)))
    assert [c.status for c in cases] == ["Finished", "Failed"] * 12


def test_the_program_cannot_see_the_tests(verifier):
    code = (
        "import os\nseen = [p for d in ('/sandbox', '/tmp') for p in os.listdir(d)]\n"
        "procs = [p for p in os.listdir('/proc') if p.isdigit()]\n"
        "def report():\n    return seen, len(procs)\n"
    )
    tests = (
        "seen, procs = report()\nassert 'solution.py' in seen and 'tests.py' not in seen, seen\n"
        "assert procs <= 2\n"  # its own init and itself: no process of the tests
    )
    case = judge(verifier, code, tests)
    assert case.status == "Finished", case


# -- honest programs ---------------------------------------------------------------------------
HONEST = {
    "plain_values": (
        "def f(kind):\n"
        "    return {'int': 5, 'list': [1, [2]], 'dict': {'a': (1, 2)}, 'tuple': (1, 'x'),\n"
        "            'set': {1, 2}, 'frozenset': frozenset({3}), 'float': 0.1 + 0.2, 'none': None,\n"
        "            'str': 'héllo\\ud800', 'bytes': b'\\x00\\xff', 'big': 3 ** 200, 'neg': -(2 ** 70),\n"
        "            'nan': float('nan'), 'inf': float('-inf'), 'complex': 1 + 2j, 'bool': True}[kind]\n",
        "import math\n"
        "assert f('int') == 5 and f('list') == [1, [2]] and f('dict') == {'a': (1, 2)}\n"
        "assert f('tuple') == (1, 'x') and f('set') == {1, 2} and f('frozenset') == {3}\n"
        "assert f('float') == 0.30000000000000004 and f('none') is None\n"
        "assert f('str') == 'héllo\\ud800' and f('bytes') == b'\\x00\\xff'\n"
        "assert f('big') == 3 ** 200 and f('neg') == -(2 ** 70)\n"
        "assert math.isnan(f('nan')) and f('inf') == -math.inf and f('complex') == 1 + 2j\n"
        "assert f('bool') is True and type(f('int')) is int and type(f('list')) is list\n",
    ),
    "class_based_solution": (
        "from typing import List\nclass Solution:\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n        for i, n in enumerate(nums):\n"
        "            if target - n in seen:\n                return [seen[target - n], i]\n"
        "            seen[n] = i\n",
        "s = Solution()\nassert s.twoSum([2, 7, 11, 15], 9) == [0, 1]\n"
        "assert Solution().twoSum([3, 3], 6) == [0, 1]\n",
    ),
    "program_objects_compared_with_each_other": (
        "import collections\nclass P:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __eq__(self, o):\n        return isinstance(o, P) and o.x == self.x\n"
        "    def __hash__(self):\n        return hash(self.x)\n"
        "    def __repr__(self):\n        return f'P({self.x})'\n"
        "Pair = collections.namedtuple('Pair', 'a b')\n"
        "def count(s):\n    return collections.Counter(s)\n",
        "assert P(1) == P(1) and P(1) != P(2) and len({P(1), P(1)}) == 1\n"
        "assert Pair(1, 2) == (1, 2) and Pair(1, 2).b == 2 and repr(P(3)) == 'P(3)'\n"
        "assert count('aab') == {'a': 2, 'b': 1} and count('aab')['z'] == 0\n"
        "assert isinstance(P(1), P) and not isinstance(5, P) and P(4).x == 4\n",
    ),
    "generators_and_iterators": (
        "def gen(n):\n    for i in range(n):\n        yield i * i\n"
        "def count():\n    i = 0\n    while True:\n        yield i\n        i += 1\n",
        "import itertools\nassert list(gen(5)) == [0, 1, 4, 9, 16]\n"
        "assert sum(gen(2000)) == sum(i * i for i in range(2000))\n"
        "assert list(itertools.islice(count(), 3)) == [0, 1, 2]\ng = gen(3)\nassert next(g) == 0\n"
        "assert list(g) == [1, 4]\n",
    ),
    "expected_exceptions": (
        "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n"
        "class NotFound(Exception):\n    pass\n"
        "def find(d, k):\n    if k not in d:\n        raise NotFound(k)\n    return d[k]\n"
        "def read(path):\n    return open(path).read()\n",
        "try:\n    root(-1)\nexcept ValueError as e:\n    assert 'negative' in str(e)\n"
        "else:\n    assert False\n"
        "try:\n    find({}, 'k')\nexcept Exception as e:\n    assert 'NotFound' in str(e)\n"
        "else:\n    assert False\n"
        "try:\n    read('/nonexistent')\nexcept FileNotFoundError:\n    pass\nelse:\n    assert False\n"
        "assert root(4) == 2.0\n",
    ),
    "helpers_imports_and_candidate": (
        "import math\ndef hypot(a, b):\n    return math.sqrt(a * a + b * b)\nMOD = 10 ** 9 + 7\n",
        "import math\nfrom math import isclose\n\ndef check(candidate):\n"
        "    assert isclose(candidate(3, 4), 5)\n    assert math.isclose(candidate(5, 12), 13.0)\n\n"
        "check(hypot)\nassert MOD == 1_000_000_007\nassert math is __import__('math')\n",
    ),
    "prints_at_top_level_and_when_called": (
        "print('starting')\ndef add(a, b):\n    print('adding', a, b)\n    return a + b\n",
        "print('testing')\nassert add(2, 3) == 5\n",
    ),
    "recursion_heavy": (
        "import sys\nsys.setrecursionlimit(20000)\n"
        "def depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n"
        "def fib(n, memo={}):\n    if n < 2:\n        return n\n"
        "    if n not in memo:\n        memo[n] = fib(n - 1) + fib(n - 2)\n    return memo[n]\n",
        "assert depth(5000) == 5000\n"
        "assert fib(300) == 222232244629420445529739893461909967206666939096499764990979600\n",
    ),
    "big_global_table": (
        "N = 10 ** 6\nSIEVE = [True] * N\nSQUARES = {i: i * i for i in range(100_000)}\n"
        "def is_even(n):\n    return n % 2 == 0\n",
        "assert len(SIEVE) == N and SIEVE[10] is True and SIEVE[:2] == [True, True]\n"
        "assert SQUARES[300] == 90_000 and is_even(4) and not is_even(3)\n",
    ),
    "mutates_its_arguments": (
        "def sort_in_place(nums):\n    nums.sort()\n"
        "def rotate(m):\n    m[:] = [list(r) for r in zip(*m[::-1])]\n"
        "def tally(d, k):\n    d[k] = d.get(k, 0) + 1\n    return len(d)\n",
        "nums = [3, 1, 2]\nassert sort_in_place(nums) is None and nums == [1, 2, 3]\n"
        "m = [[1, 2], [3, 4]]\nrotate(m)\nassert m == [[3, 1], [4, 2]]\n"
        "d = {}\nassert tally(d, 'a') == 1 and tally(d=d, k='a') == 1 and d == {'a': 2}\n",
    ),
    "stdlib_value_types_and_stateful_objects": (
        "from fractions import Fraction\nfrom decimal import Decimal\n"
        "def half(n):\n    return Fraction(n, 2)\ndef price():\n    return Decimal('1.10')\n"
        "class Stack:\n    def __init__(self):\n        self.items = []\n"
        "    def push(self, x):\n        self.items.append(x)\n        return self\n"
        "    def pop(self):\n        return self.items.pop()\n"
        "    def __len__(self):\n        return len(self.items)\n",
        "from fractions import Fraction\nassert half(1) == Fraction(1, 2) == 0.5\n"
        "assert str(price()) == '1.10'\n"
        "s = Stack()\nassert s.push(1).push(2) is s\nassert len(s) == 2 and s.pop() == 2 and s.items == [1]\n"
        "s.items = [7]\nassert s.pop() == 7 and not s\n",
    ),
    "stdlib_dates_deques_and_ranges": (
        "from datetime import date, datetime, time, timedelta, timezone\nfrom collections import deque\n"
        "def day():\n    return date(2020, 1, 1)\n"
        "def moment():\n    return datetime(2020, 1, 1, 12, 30, tzinfo=timezone.utc)\n"
        "def noon():\n    return time(12, 0)\ndef week():\n    return timedelta(days=7)\n"
        "def window(n):\n    return deque(range(n), maxlen=3)\ndef push(q, x):\n    q.append(x)\n"
        "def evens(n):\n    return range(0, n, 2)\n",
        "from datetime import date, datetime, time, timedelta, timezone\nfrom collections import deque\n"
        "assert day() == date(2020, 1, 1) and type(day()) is date\n"
        "assert day() - date(2019, 12, 31) == timedelta(days=1) and day().isoformat() == '2020-01-01'\n"
        "assert moment() == datetime(2020, 1, 1, 12, 30, tzinfo=timezone.utc)\n"
        "assert moment().tzinfo is timezone.utc\n"
        "assert noon() == time(12) and week() == timedelta(weeks=1) and week().total_seconds() == 604800\n"
        "assert window(5) == deque([2, 3, 4]) and window(5).maxlen == 3 and type(window(1)) is deque\n"
        "q = deque([1])\npush(q, 2)\nassert q == deque([1, 2])\n"
        "assert evens(7) == range(0, 7, 2) and 4 in evens(7) and -2 not in evens(10 ** 12)\n",
    ),
    "dict_and_tuple_subclasses": (
        "from collections import OrderedDict, defaultdict, Counter, namedtuple\n"
        "Point = namedtuple('Point', 'x y')\n"
        "def ordered():\n    return OrderedDict([('b', 1), ('a', 2)])\n"
        "def groups():\n    d = defaultdict(list)\n    d['a'].append(1)\n    return d\n"
        "def count(s):\n    return Counter(s)\ndef origin():\n    return Point(0, 0)\n",
        "from collections import OrderedDict, Counter as C\n"
        "assert ordered() == {'a': 2, 'b': 1} and ordered() == OrderedDict(b=1, a=2)\n"
        "assert list(ordered()) == ['b', 'a']\n"
        "assert groups() == {'a': [1]} and groups()['z'] == [] and 'a' in groups() and len(groups()) == 1\n"
        "assert count('aab') == C(a=2, b=1) and count('aab')['z'] == 0\n"
        "assert count('aab').most_common(1) == [('a', 2)]\n"
        "assert count('ab') + count('b') == C('abb') and 'a' in count('ab') and bool(count('')) is False\n"
        "assert origin() == (0, 0) and origin().x == 0 and origin() + (1,) == (0, 0, 1)\n"
        "assert len(origin()) == 2\n"
        "x, y = origin()\nassert (x, y) == (0, 0) and hash(origin()) == hash((0, 0)) and 0 in origin()\n",
    ),
    "number_subclasses_and_float_answers": (
        "from enum import IntEnum\nclass Color(IntEnum):\n    RED = 1\n    GREEN = 2\n"
        "class Meters(float):\n    pass\ndef dist():\n    return Meters(2.5)\n"
        "def color():\n    return Color.GREEN\n"
        "def mean(xs):\n    return sum(xs) / len(xs)\n",
        "import math\n"
        "assert abs(dist() - 2.5) < 1e-9 and abs(2.5 - dist()) < 1e-9 and math.isclose(dist(), 2.5)\n"
        "assert round(dist(), 1) == 2.5 and dist() // 1 == 2 and -dist() == -2.5 and float(dist()) == 2.5\n"
        "assert color() == 2 and color() + 1 == 3 and 1 + color() == 3 and int(color()) == 2\n"
        "assert color() in [2] and 2 in [color()] and [0, 1, 2][color()] == 2 and color().name == 'GREEN'\n"
        "assert abs(mean([1, 2, 4]) - 7 / 3) < 1e-9 and round(mean([1, 2]), 2) == 1.5\n"
        "assert mean([2]) - 2 == 0\n",
    ),
    "membership_in_program_objects": (
        "def keys():\n    return {'a': 1, 'b': 2}.keys()\n"
        "def squares(n):\n    return (i * i for i in range(n))\n"
        "class Bag:\n    def __init__(self):\n        self.items = [1, 2]\n"
        "    def __iter__(self):\n        return iter(self.items)\n"
        "def bag():\n    return Bag()\n",
        "assert 'a' in keys() and 'z' not in keys() and 9 in squares(5) and 3 not in squares(5)\n"
        "assert 2 in bag() and 3 not in bag() and sorted(keys()) == ['a', 'b']\n",
    ),
}


HONEST["exception_subclasses_of_builtins"] = (
    "import json\nclass BadInput(ValueError):\n    pass\n"
    "def parse(s):\n    if s == 'x':\n        raise BadInput('no x')\n    return json.loads(s)\n",
    "try:\n    parse('x')\n    raise RuntimeError('no exception')\n"
    "except ValueError as e:\n    assert 'no x' in str(e)\n"
    "try:\n    parse('{')\n    raise RuntimeError('no exception')\nexcept ValueError:\n    pass\n"
    "assert parse('[1]') == [1]\n",
)


HONEST["mutated_arguments_of_builtin_subclasses"] = (
    "def bump(d, key):\n    d[key] = d.get(key, 0) + 1\n\ndef push(xs, x):\n    xs.append(x)\n",
    "from collections import Counter, OrderedDict\n"
    "c = Counter(a=1)\nbump(c, 'a')\nbump(c, 'b')\nassert c == Counter(a=2, b=1) and type(c) is Counter\n"
    "o = OrderedDict(x=1)\nbump(o, 'y')\nassert list(o) == ['x', 'y'] and type(o) is OrderedDict\n"
    "class Stack(list):\n    pass\ns = Stack([1])\npush(s, 2)\nassert s == [1, 2] and type(s) is Stack\n",
)

try:
    import numpy  # noqa: F401  (in the sandbox too: it runs this interpreter)

    HONEST["numpy_scalars_are_numbers"] = (
        "import numpy as np\ndef total(xs):\n    return np.sum(np.array(xs))\n"
        "def mean(xs):\n    return np.mean(xs)\ndef positive(x):\n    return np.array([x])[0] > 0\n",
        "assert total([1, 2, 3]) == 6\nassert abs(mean([1, 2]) - 1.5) < 1e-9\n"
        "assert positive(3) == True\nassert positive(-3) == False\n",
    )
except ImportError:  # the numpy case is not run where numpy is not installed
    pass  # the other cases run as they are


@pytest.mark.parametrize(("code", "tests"), HONEST.values(), ids=HONEST.keys())
def test_honest_programs_pass(verifier, code, tests):
    case = judge(verifier, code, tests)
    assert case.status == "Finished", case


def test_what_the_case_shows(verifier):
    code = "print('from the program')\ndef add(a, b):\n    return a - b\n"
    case = judge(verifier, code, "print('from the tests')\nassert add(2, 3) == 5, 'add is wrong'\n")
    assert (case.status, case.message) == ("Failed", "an assertion failed")
    assert case.stdout == "from the program\n"
    assert "from the tests" in case.stderr and "AssertionError: add is wrong" in case.stderr
    crashed = judge(verifier, "def add(a, b):\n    return a + b\nraise KeyError('boom')\n", TWO_ASSERTS)
    assert (crashed.status, crashed.message) == ("RuntimeError", "exited with code 1"), crashed
    assert "KeyError: 'boom'" in crashed.stderr
    raised = judge(verifier, "def add(a, b):\n    return {}[a]\n", TWO_ASSERTS)
    assert (raised.status, raised.message) == ("RuntimeError", "the tests stopped on KeyError: 2"), raised
    assert "raised in the program" in raised.stderr


def test_a_function_of_the_tests_cannot_be_passed(verifier):
    code = "def apply(f, x):\n    return f(x)\n"
    case = judge(verifier, code, "assert apply(lambda x: x + 1, 1) == 2\n")
    assert case.status == "RuntimeError", case
    assert "cannot pass function" in case.stderr and "cross to its sandbox" in case.stderr


def test_memory_and_limits_of_the_program(verifier):
    big = judge(verifier, "def add(a, b):\n    return bytearray(10 ** 10)\n", TWO_ASSERTS)
    assert big.status == "MemoryLimitExceeded", big


def test_a_program_that_crashes_at_its_top_level_gets_its_own_verdict(verifier):
    # its channel ends (the tests stop on that EOF) a moment before its exit can be read: about
    # 1 case in 9 read as "stopped" by its tests' end, "the program closed the test channel"
    # with the program's traceback lost
    for _ in range(40):
        crashed = judge(verifier, "def add(a, b):\n    return a + b\nraise KeyError('boom')\n", TWO_ASSERTS)
        assert (crashed.status, crashed.message) == ("RuntimeError", "exited with code 1"), crashed
        assert "KeyError: 'boom'" in crashed.stderr


def test_a_program_that_closes_its_channel_and_lives_on_is_stopped(verifier):
    # a guard on the wait above: a program whose channel ended but that does not exit is
    # stopped after a short grace, not at the wall limit
    case = judge(verifier, CHANNEL + "os.close(chan)\nimport time\ntime.sleep(30)\n", TWO_ASSERTS)
    assert case.status == "RuntimeError" and "closed the test channel" in case.message, case
    assert case.wall_ms < 2000  # the grace for its exit, not the wall limit
