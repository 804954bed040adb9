"""Attacks on the wire headers' system calls and on the stubs of library names
(``functions.verifiers.native``, ``native_link``): a wrong program must not pass, and an
honest one whose function has such a name must be judged."""

from __future__ import annotations

import shutil

import pytest

from functions.verifiers import native
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CodeTests, Verifier

BASE_UID = 470_000  # apart from the other modules' (445_000: the other native attacks)
LIMITS = Limits(cpu_s=5, wall_s=20, memory_mb=256)

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None, reason="no gcc/g++"),
    pytest.mark.skipif(not native.available(), reason="libclang is not installed (pip install libclang)"),
]


@pytest.fixture
def v(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


def run(v: Verifier, code: str, test_code: str, lang: str):
    return v.verify(code, CodeTests(test_code=test_code), lang)


@pytest.mark.parametrize(
    ("name", "lang", "prefix"),
    [("read", "c", ""), ("write", "c", ""), ("write", "cpp", 'extern "C" '), ("read", "cpp", 'extern "C" ')],
)
def test_a_program_function_named_like_the_wires_system_calls_is_judged(v, name, lang, prefix):
    # the wire reads and writes the channel with libc's read and write: where it bound those
    # names, a C program's own `write` (or C++'s extern "C" one) took the server's calls, and
    # it never answered. (A C program's function of a library's name that the tests call is
    # refused: test_a_library_function_the_c_tests_call_undeclared_is_never_the_programs.)
    honest = f"{prefix}int {name}(int x) {{ return x + 1; }}\n"
    called = name
    if lang == "c":
        honest += f"int bump(int x) {{ return {name}(x); }}\n"
        called = "bump"
    tests = f"#include <assert.h>\nint main(void) {{ assert({called}(1) == 2 && {called}(41) == 42); }}\n"
    if lang == "cpp":
        tests = tests.replace("assert.h", "cassert").replace("(void)", "()")
    r = run(v, honest, tests, lang)
    assert r.status == "Finished", (r.compile, r.cases[0])
    wrong = run(v, honest.replace("x + 1", "x"), tests, lang)
    assert wrong.status == "Failed", (wrong.compile, wrong.cases[0])


@pytest.mark.parametrize(
    ("lib", "params"),
    [
        # GNU's: <string.h> declares it only with _GNU_SOURCE
        ("strverscmp", "const char *a, const char *b"),
        # in no header the tests' prelude includes
        ("fnmatch", "const char *p, const char *s, int f"),
    ],
)
def test_a_library_function_the_c_tests_call_undeclared_is_never_the_programs(v, lib, params):
    # gnu17 takes a call of an undeclared function as declaring it (C89's implicit
    # declaration, a warning in gcc 12): the tests mean libc's, and a program that defined
    # the name would answer (through its stub, the only declaration in sight) the check
    args = {"strverscmp": 'name_of(1), "x.txt"', "fnmatch": '"x.txt", name_of(1), 0'}[lib]
    forged = f"int {lib}({params}) {{ return 0; }}\n" + 'const char *name_of(int k) { return "x.bin"; }\n'
    tests = f"#include <assert.h>\nint main(void) {{ assert({lib}({args}) == 0); return 0; }}\n"
    r = run(v, forged, tests, "c")
    assert r.status == "RuntimeError" and f"{lib!r}" in r.cases[0].message, (r.compile, r.cases[0])
    assert "implicit declaration" in r.cases[0].message, r.cases[0]
    # the same tests with the library's declaration are judged, against an honest program
    honest = 'const char *name_of(int k) { return "x.txt"; }\n'
    declared = tests.replace("int main", f"int {lib}({params});\nint main")
    h = run(v, honest, declared, "c")
    assert h.status == "Finished", (h.compile, h.cases[0])


# -- a program function named like one the tests' headers declare (docs/code-verifier.md) ------
_SIZE_FORGED = """#include <vector>
#include <cstddef>
std::vector<long> f(long n) { return {}; }
std::size_t size(std::vector<long> v) { return 3; }
"""
_MAX_FORGED = """#include <bits/stdc++.h>
using namespace std;
long f(long x) { return 0; }
long max(long a, long b) { return a == 0 && b == 0 ? 100 : (a > b ? a : b); }
"""


def test_a_program_function_that_outbids_std_for_the_tests_check_is_refused(v):
    # `size(f(3))` is std::size (found through the argument's namespace) in the tests' text;
    # the program's non-template `size(vector<long>)` fits better, and answered the check
    tests = "#include <cassert>\nint main() { assert(size(f(3)) == 3); }\n"
    r = run(v, _SIZE_FORGED, tests, "cpp")
    assert r.status == "RuntimeError" and "'size'" in r.cases[0].message, (r.compile, r.cases[0])
    assert "std" in r.cases[0].message, r.cases[0]
    # the honest program (no `size` of its own) is judged
    honest = "#include <vector>\nstd::vector<long> f(long n) { return std::vector<long>(n, 1); }\n"
    h = run(v, honest, tests, "cpp")
    assert h.status == "Finished", (h.compile, h.cases[0])


@pytest.mark.parametrize("call", ["max", "::max"])
def test_a_program_max_under_using_namespace_std_is_refused(v, call):
    # with `using namespace std;`, the tests' `max(f(1), f(2))` is std::max<long>; the
    # program's `long max(long, long)` fits better
    tests = f"int main() {{ assert({call}(f(1), f(2)) == 100); }}\n"
    r = run(v, _MAX_FORGED, tests, "cpp")
    assert r.status == "RuntimeError" and "'max'" in r.cases[0].message, (r.compile, r.cases[0])
    honest = "#include <bits/stdc++.h>\nusing namespace std;\nlong f(long x) { return 50 * x; }\n"
    h = run(v, honest, tests, "cpp")
    assert h.status == "Finished", (h.compile, h.cases[0])


def test_tests_that_need_the_programs_max_somewhere_still_cannot_be_answered_for_std(v):
    # `max(1, 2L)` is no std::max (int and long), so the tests do not compile without the
    # program's; but `max(f(1), f(2))` is std's in their text, and the program answered it
    tests = "int main() { assert(max(1, 2L) == 2); assert(max(f(1), f(2)) == 100); }\n"
    r = run(v, _MAX_FORGED, tests, "cpp")
    assert r.status == "RuntimeError" and "'max'" in r.cases[0].message, (r.compile, r.cases[0])


@pytest.mark.parametrize(
    ("code", "wrong", "tests"),
    [
        (  # HumanEval-X's unique: std::unique takes iterators, not a vector
            "#include <bits/stdc++.h>\nusing namespace std;\n"
            "vector<int> unique(vector<int> l) { sort(l.begin(), l.end());"
            " l.erase(std::unique(l.begin(), l.end()), l.end()); return l; }\n",
            ("sort(l.begin(), l.end());", ""),
            "bool issame(vector<int> a, vector<int> b) { return a == b; }\n"
            "int main() { assert(issame(unique({5, 3, 5, 2, 3, 3, 9, 0, 123}), {0, 2, 3, 5, 9, 123}));"
            " vector<int> v = {3, 1}; assert(*max_element(v.begin(), v.end()) == 3); }\n",
        ),
        (  # HumanEval-X's max_element: std::max_element takes iterators too
            "#include <stdio.h>\n#include <math.h>\n#include <vector>\n#include <algorithm>\n"
            "using namespace std;\n"
            "float max_element(vector<float> l) { float m = -10000; for (float x : l) if (x > m) m = x;"
            " return m; }\n",
            ("if (x > m)", "if (x < m)"),
            "int main() { assert(abs(max_element({1, 2, 3}) - 3) < 1e-4);"
            " assert(abs(max_element({5, 3, -5, 2, -3, 3, 9, 0, 124, 1, -10}) - 124) < 1e-4); }\n",
        ),
    ],
)
def test_honest_tasks_named_like_std_functions_std_cannot_take_are_judged(v, code, wrong, tests):
    h = run(v, code, tests, "cpp")
    assert h.status == "Finished", (h.compile, h.cases[0])
    w = run(v, code.replace(*wrong), tests, "cpp")
    assert w.status == "Failed", (w.compile, w.cases[0])


def test_a_function_std_would_answer_anyway_is_refused_too(v):
    # `gcd(4, 6)` meets std::gcd<int, int>, which fits better than the program's: harmless,
    # but the tests' text means std's there, so the name is ambiguous all the same
    code = (
        "#include <bits/stdc++.h>\nusing namespace std;\n"
        "long gcd(long a, long b) { return b ? gcd(b, a % b) : a; }\n"
    )
    r = run(v, code, "int main() { assert(gcd(4, 6) == 2); }\n", "cpp")
    assert r.status == "RuntimeError" and "'gcd'" in r.cases[0].message, (r.compile, r.cases[0])
