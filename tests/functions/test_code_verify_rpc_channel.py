"""Python's assert-style tests in a sandbox of their own (``Sandbox.run_pair``), the test
channel and the pair's limits: fake frames and floods on the channel, time, output and
memory limits of the program and of the tests, concurrent pairs, a program that cannot see
its tests; and honest programs still pass, with what a case shows. The forgeries are in
test_code_verify_rpc.py. Real sandbox, no mocks; uids from 410 000 up."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from code_verify_rpc_helpers import TWO_ASSERTS, judge

from functions.verifiers.sandbox import Limits

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


BASE_UID = 410_000  # apart from the other modules' (380_000: the forgeries' module)


@pytest.fixture
def verifier(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


# -- the channel and the limits ------------------------------------------------------------------
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


def test_chatty_programs_and_tests_are_judged_on_the_asserts(verifier):
    # what they print (the program's stdout too: it goes to its stderr) was killed past the
    # output cap, and a right program that logged its progress scored 0; now its middle is
    # cut, its start and end kept
    chatty = (
        "import sys\nfor i in range(100_000):\n    print('debug', i)\n    print('note', i, file=sys.stderr)\n"
    )
    case = judge(verifier, chatty + "def add(a, b):\n    return a + b\n", TWO_ASSERTS)
    assert (case.status, case.message) == ("Finished", ""), case
    assert case.stdout.startswith("debug 0\nnote 0\n"), case.stdout[:100]
    honest = "def add(a, b):\n    return a + b\n"
    case = judge(verifier, honest, chatty + TWO_ASSERTS)
    assert (case.status, case.message) == ("Finished", ""), case
    failed = judge(verifier, "def add(a, b):\n    return 0\n", chatty + TWO_ASSERTS)
    assert (failed.status, failed.message) == ("Failed", "an assertion failed"), failed
    assert "AssertionError" in failed.stderr, failed.stderr[-300:]
    # one that prints forever runs into its limits like a loop
    endless = judge(verifier, "while True:\n    print('y' * 1000)\n", TWO_ASSERTS, CPU_BOUND)
    assert endless.status == "TimeLimitExceeded", endless


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
    chatty = judge(verifier, honest, "while True:\n    print('x' * 1000)\n", CPU_BOUND)
    assert chatty.status == "TimeLimitExceeded", chatty


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
