"""C and C++ assert-style tests in a sandbox of their own (``functions.verifiers.native``):
honest MultiPL-E-style C++ and HumanEval-style C programs pass, wrong ones fail, and forgeries
that used to pass in one process fail next to an honest program that passes the same tests.
Declarations the channel cannot carry, and the host's side of the parse, are in
test_code_verify_native_decls.py."""

from __future__ import annotations

import shutil

import pytest
from code_verify_native_helpers import ADD_TESTS, HONEST_ADD, passes, run

from functions.verifiers import native
from functions.verifiers.code import code_verify
from functions.verifiers.errors import InvalidTests
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CodeTests

BASE_UID = 430_000
# compiled binaries start fast, but two compiles and a parse share a loaded 2-core machine
LIMITS = Limits(cpu_s=5, wall_s=20, memory_mb=256)

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None, reason="no gcc/g++"),
    pytest.mark.skipif(not native.available(), reason="libclang is not installed (pip install libclang)"),
]


# -- honest programs, MultiPL-E's C++ -----------------------------------------------------
MULTIPL_E = r"""
#include<assert.h>
#include<bits/stdc++.h>
std::vector<long> incr_list(std::vector<long> l) {
    for (auto& x : l) x += 1;
    return l;
}
std::string flip_case(std::string s) {
    for (auto& c : s) c = isupper(c) ? tolower(c) : toupper(c);
    return s;
}
std::map<std::string,long> histogram(std::string test) {
    std::map<std::string,long> m; std::string w; std::stringstream ss(test);
    while (ss >> w) m[w]++;
    return m;
}
std::optional<std::string> longest(std::vector<std::string> strings) {
    if (strings.empty()) return std::nullopt;
    std::string best = strings[0];
    for (auto& s : strings) if (s.size() > best.size()) best = s;
    return best;
}
std::tuple<long, long> sum_product(std::vector<long> numbers) {
    long s = 0, p = 1;
    for (long x : numbers) { s += x; p *= x; }
    return std::make_tuple(s, p);
}
float truncate_number(float number) { return number - (long)number; }
std::vector<std::vector<long>> pairs(const std::vector<std::pair<long, bool>>& xs) {
    std::vector<std::vector<long>> out;
    for (auto& [x, keep] : xs) if (keep) out.push_back({x, x * x});
    return out;
}
std::set<char> letters(const char* s) { return std::set<char>(s, s + strlen(s)); }
bool below_zero(std::vector<long> ops) {
    long b = 0;
    for (long o : ops) if ((b += o) < 0) return true;
    return false;
}
void sort_in_place(std::vector<long>& v) { std::sort(v.begin(), v.end()); }
int main() { abort(); }
"""


MULTIPL_E_TESTS = r"""
int main() {
    auto candidate = incr_list;
    assert(candidate((std::vector<long>())) == (std::vector<long>()));
    assert(candidate((std::vector<long>({(long)3, (long)2, (long)1})))
           == (std::vector<long>({(long)4, (long)3, (long)2})));
    assert(flip_case(("Hello!")) == ("hELLO!"));
    assert(histogram(("a b b a")) == (std::map<std::string,long>({{"a", 2}, {"b", 2}})));
    assert(longest((std::vector<std::string>())) == std::nullopt);
    assert(longest((std::vector<std::string>({"x", "yyy", "zz"}))) == "yyy");
    assert(sum_product((std::vector<long>({(long)1, (long)2, (long)3, (long)4})))
           == (std::make_tuple(10, 24)));
    assert(std::abs(truncate_number((3.5f)) - (0.5f)) < 1e-6);
    assert(pairs({{2, true}, {3, false}}) == (std::vector<std::vector<long>>({{2, 4}})));
    assert(letters("abca") == (std::set<char>({'a', 'b', 'c'})));
    assert(!below_zero({1, 2}) && below_zero({1, -2}));
    std::vector<long> v = {3, 1, 2};
    sort_in_place(v);
    assert(v == (std::vector<long>({1, 2, 3})));
}
"""


@pytest.fixture
def box(pair_box):  # tests/functions/conftest.py: this module's BASE_UID
    return pair_box


@pytest.fixture
def v(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


def test_multipl_e_style_cpp_programs_pass_and_wrong_ones_fail(v):
    passes(v, MULTIPL_E, MULTIPL_E_TESTS)
    wrong = run(v, MULTIPL_E.replace("p *= x", "p += x"), MULTIPL_E_TESTS)
    assert wrong.status == "Failed" and wrong.cases[0].message == "an assertion failed", wrong.cases[0]
    # a copy-back that did not happen would fail the last assert
    unsorted = run(v, MULTIPL_E.replace("std::sort(v.begin(), v.end());", ""), MULTIPL_E_TESTS)
    assert unsorted.status == "Failed", unsorted.cases[0]


WIDE = r"""
#include <bits/stdc++.h>
std::vector<bool> flags(const std::vector<long>& xs) {
    std::vector<bool> out;
    for (long x : xs) out.push_back(x % 2);
    return out;
}
std::unordered_map<std::string, long> counts(std::unordered_set<long> s, char c) {
    return {{std::string(1, c), (long)s.size()}};
}
std::tuple<long, double, std::string, bool> mixed(unsigned long long u) {
    return {(long)u, u / 2.0, std::to_string(u), u > 1};
}
std::optional<std::vector<long>> maybe(bool yes) {
    if (!yes) return std::nullopt;
    return std::vector<long>{1, 2};
}
std::map<long, std::vector<std::string>> groups(std::vector<std::vector<std::string>> vs) {
    std::map<long, std::vector<std::string>> m;
    for (auto& v : vs) for (auto& s : v) m[(long)s.size()].push_back(s);
    return m;
}
std::pair<std::string, char> first(std::string s) { return {s.substr(1), s[0]}; }
void bump(int& x, std::string& log) { x += 1; log += "+"; }
"""


WIDE_TESTS = r"""
int main() {
    assert(flags({1, 2, 3}) == (std::vector<bool>{true, false, true}));
    assert(counts({1, 2, 3}, 'k') == (std::unordered_map<std::string, long>{{"k", 3}}));
    assert(mixed(5) == std::make_tuple(5L, 2.5, std::string("5"), true));
    assert(!maybe(false).has_value() && *maybe(true) == (std::vector<long>{1, 2}));
    auto g = groups({{"ab", "c"}, {"de"}});
    assert(g.size() == 2 && g[2] == (std::vector<std::string>{"ab", "de"}) && g[1][0] == "c");
    assert(first("xyz") == std::make_pair(std::string("yz"), 'x'));
    int n = 1; std::string log;
    bump(n, log); bump(n, log);
    assert(n == 3 && log == "++");
    return 0;
}
"""


def test_the_wider_types_travel_both_ways(v):
    passes(v, WIDE, WIDE_TESTS)
    assert run(v, WIDE.replace('log += "+";', ""), WIDE_TESTS).status == "Failed"


def test_humaneval_x_style_cpp_with_using_namespace_std(v):
    code = (
        "#include<stdio.h>\n#include<math.h>\n#include<vector>\nusing namespace std;\n"
        "vector<float> rescale_to_unit(vector<float> numbers){\n"
        "    float mn = 1e9, mx = -1e9;\n"
        "    for (float x : numbers) { mn = min(mn, x); mx = max(mx, x); }\n"
        "    for (float& x : numbers) x = (x - mn) / (mx - mn);\n"
        "    return numbers;\n}\n"
    )
    tests = (
        "#undef NDEBUG\n#include<assert.h>\n"
        "bool issame(vector<float> a, vector<float> b){\n"
        "    if (a.size() != b.size()) return false;\n"
        "    for (int i = 0; i < a.size(); i++) if (abs(a[i] - b[i]) > 1e-4) return false;\n"
        "    return true;\n}\n"
        "int main(){\n"
        "    assert(issame(rescale_to_unit({2.0, 49.9}), {0.0, 1.0}));\n"
        "    assert(issame(rescale_to_unit({1.0, 2.0, 3.0, 4.0, 5.0}), {0.0, 0.25, 0.5, 0.75, 1.0}));\n}\n"
    )
    passes(v, code, tests)
    assert run(v, code.replace("(x - mn)", "(x + mn)"), tests).status == "Failed"


def test_the_tests_see_the_programs_headers_and_its_types_after_its_macros(v):
    # <complex> is none of the tests' own headers: they get it because the program included
    # it, as in one process; `#define int long long` is the program's, and so is the type
    code = (
        "#include <complex>\n#include <string>\n#include <vector>\n#define int long long\n"
        "int add(int a, int b) { return a + b; }\n"
        'const std::string name() { return "n"; }\nauto ones(int n) { return std::vector<int>(n, 1); }\n'
    )
    tests = (
        "#include <cassert>\nint main() {\n    std::complex<double> z(3, 4);\n    assert(std::abs(z) == 5);\n"
        '    assert(add(1LL << 40, 1) == (1LL << 40) + 1 && name() == "n" && ones(2).size() == 2);\n'
        "    return 0;\n}\n"
    )
    passes(v, code, tests)


def test_code_verify_runs_cpp_tests_apart_and_in_process_on_request(v):
    # functions in an anonymous namespace and in extern "C" are the file's own
    answer = (
        "Here it is:\n```cpp\n#include <string>\nnamespace { long twice(long x) { return 2 * x; } }\n"
        'extern "C" int add(int a, int b) { return a + b; }\n'
        'std::string hi() { return "hi"; }\n```'
    )
    tests = '#include <cassert>\nint main() { assert(twice(add(1, 2)) == 6 && hi() == "hi"); return 0; }'
    apart = code_verify(answer, test_code=tests, language="cpp", ctx=v)
    assert apart.score == 1.0, apart.info["cases"]
    forged = FD3_FORGERY + "int add(int a, int b) { return 0; }\n"
    tests = "#include <cassert>\nint main() { assert(add(2, 3) == 5); return 0; }"
    assert code_verify(forged, test_code=tests, language="cpp", extract=False, ctx=v).score == 0.0
    # the old harness, asked for by name, is forgeable (docs/code-verifier.md)
    opted = code_verify(forged, test_code=tests, language="cpp", extract=False, c_asserts="in_process", ctx=v)
    assert opted.score == 1.0, opted.info["cases"]


def test_abs_in_the_tests_is_never_cs_int_abs_whatever_the_program_says(v):
    # without `using namespace std;` (the program's choice) abs(double) was C's abs(int):
    # abs(0.9 - 0.5) < 1e-6 held for a wrong answer
    wrong = "#include <cmath>\nfloat truncate_number(float x) { return x - std::floor(x) + 0.4f; }\n"
    tests = "#include <assert.h>\nint main() { assert(abs(truncate_number(3.5) - 0.5) < 1e-4); return 0; }"
    assert run(v, wrong, tests).status == "Failed"
    passes(v, wrong.replace(" + 0.4f", ""), tests)


def test_exceptions_of_the_program_reach_the_tests(v):
    code = (
        "#include <stdexcept>\n"
        'long checked(long x) { if (x < 0) throw std::invalid_argument("negative"); return x * 2; }\n'
    )
    caught = (
        "#include <cassert>\n#include <string>\n"
        "int main() {\n    assert(checked(2) == 4);\n"
        "    try { checked(-1); assert(false); }\n"
        "    catch (const std::exception& e) {\n"
        '        assert(std::string(e.what()).find("negative") != std::string::npos);\n    }\n}\n'
    )
    passes(v, code, caught)
    uncaught = run(v, code, "#include <cassert>\nint main() { assert(checked(-1) == 0); }")
    assert uncaught.status == "RuntimeError" and "SIGABRT" in uncaught.cases[0].message, uncaught.cases[0]


# -- honest programs, HumanEval-style C ---------------------------------------------------
C_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ctype.h>
#include <stdbool.h>
static int add(int x, int y) { return x + y; }
double triangle_area(double a, double h) { return a * h / 2.0; }
char *flip_case(const char *s) {
    char *out = malloc(strlen(s) + 1);
    for (size_t i = 0; s[i]; i++) out[i] = isupper(s[i]) ? tolower(s[i]) : toupper(s[i]);
    out[strlen(s)] = 0;
    return out;
}
bool is_palindrome(const char *text) {
    size_t n = strlen(text);
    for (size_t i = 0; i < n / 2; i++) if (text[i] != text[n - 1 - i]) return false;
    return true;
}
void reverse(char *s) {
    size_t n = strlen(s);
    for (size_t i = 0; i < n / 2; i++) { char t = s[i]; s[i] = s[n - 1 - i]; s[n - 1 - i] = t; }
}
long long fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }
int main(void) { puts("the program's main must not run"); return 1; }
"""


C_TESTS = r"""
#include <assert.h>
#include <math.h>
#include <string.h>
int main(void) {
    assert(add(2, 3) == 5);
    assert(fabs(triangle_area(5, 3) - 7.5) < 1e-6);
    char *f = flip_case("Hello");
    assert(strcmp(f, "hELLO") == 0);
    free(f);
    assert(is_palindrome("aba") && !is_palindrome("ab"));
    char buf[] = "abc";
    reverse(buf);
    assert(strcmp(buf, "cba") == 0);
    assert(fib(30) == 832040);
    return 0;
}
"""


def test_humaneval_style_c_programs_pass_and_wrong_ones_fail(v):
    passes(v, C_PROGRAM, C_TESTS, "c")
    wrong = run(v, C_PROGRAM.replace("a * h / 2.0", "a * h / 2.5"), C_TESTS, "c")
    assert wrong.status == "Failed", wrong.cases[0]
    # the in-place reverse is copied back: without it the tests see "abc"
    lazy = run(v, C_PROGRAM.replace("char t = s[i];", "break; char t = s[i];"), C_TESTS, "c")
    assert lazy.status == "Failed", lazy.cases[0]


# -- forgeries: each used to pass, or could, with the tests in the program's process ------
FD3_FORGERY = (  # the marker of the in-process harness waits on fd 3: print it, exit 0
    "#include <unistd.h>\n"
    "__attribute__((constructor)) static void forge(void) {\n"
    "    char m[81]; int n = read(3, m, 80);\n"
    '    if (n > 0) { write(1, "\\n", 1); write(1, m, n); }\n'
    "    _exit(0);\n}\n"
)
WRONG_ADD = "int add(int a, int b) { return 0; }\n"
FORGERIES = {
    "constructor_exit_0": (
        "#include <stdlib.h>\n__attribute__((constructor)) static void early(void) { exit(0); }\n"
    ),
    "override_exit_abort_assert_fail": (
        "#include <unistd.h>\n"
        '#ifdef __cplusplus\nextern "C" {\n'
        "#define NOEXCEPT noexcept\n#else\n#define NOEXCEPT\n#endif\n"
        "void exit(int c) NOEXCEPT { _exit(0); }\nvoid abort(void) NOEXCEPT { _exit(0); }\n"
        "void __assert_fail(const char *a, const char *f, unsigned l, const char *fn) NOEXCEPT\n"
        "{ _exit(0); }\n"
        "#ifdef __cplusplus\n}\n#endif\n"
    ),
    "macros_that_rewrite_the_tests": "#define assert(x) ((void)0)\n#define main not_main\n#define NDEBUG 1\n",
    "fake_frames_then_exit": (
        # frames that look like the server's, an oversized one and garbage, then an exit 0
        "#include <unistd.h>\n#include <stdint.h>\n"
        "__attribute__((constructor)) static void early(void) {\n"
        "    unsigned char ok[13] = {9, 0, 0, 0, 0, 5};\n"
        "    write(4, ok, 13);\n"
        "    uint32_t huge = 0x7fffffff; write(4, &huge, 4);\n"
        '    write(4, "rlfabric-tests-done\\n", 20);\n'
        "    _exit(0);\n}\n"
    ),
    "reads_fd_3": (
        "#include <unistd.h>\n"
        "__attribute__((constructor)) static void early(void) {\n"
        "    char m[81]; int n = read(3, m, 80);\n"
        '    if (n > 0) { write(1, "\\n", 1); write(1, m, n); write(4, m, n); }\n'
        "    _exit(0);\n}\n"
    ),
    "floods_the_channel": (
        "#include <unistd.h>\n#include <string.h>\n"
        "__attribute__((constructor)) static void early(void) {\n"
        "    static char junk[1 << 16]; memset(junk, 0x41, sizeof junk);\n"
        "    for (;;) if (write(4, junk, sizeof junk) < 0) _exit(0);\n}\n"
    ),
}


@pytest.mark.parametrize("lang", ["cpp", "c"])
@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
def test_forgeries_fail_and_the_same_program_honest_passes(v, forgery, lang):
    forged = run(v, forgery + WRONG_ADD, ADD_TESTS[lang], lang)
    assert forged.status != "Finished", (forged.compile, forged.cases[0])
    assert forged.compile is None or forged.compile.status == "Finished", forged.compile
    # a program that never answers cannot pass beside an honest add either: the honest
    # program is the same one without its constructor
    passes(v, (forgery if "early" not in forgery else "") + HONEST_ADD, ADD_TESTS[lang], lang)


def test_an_always_true_operator_of_the_program_does_not_decide_the_tests_comparison(v):
    code = (
        "#include <vector>\n"
        "namespace std { bool operator==(const vector<long>&, const vector<long>&) { return true; } }\n"
        "std::vector<long> evens(long n) { return {}; }\n"
    )
    tests = (
        "#include <cassert>\n#include <vector>\n"
        "int main() { assert(evens(5) == (std::vector<long>({0, 2, 4}))); }"
    )
    lying = run(v, code, tests)
    assert lying.status == "Failed", (lying.compile, lying.cases[0])
    honest = (
        "#include <vector>\nstd::vector<long> evens(long n) {\n"
        "    std::vector<long> v;\n    for (long i = 0; i < n; i += 2) v.push_back(i);\n    return v;\n}\n"
    )
    passes(v, honest, tests)


def test_a_program_that_crashes_or_never_answers_fails(v):
    crash = run(v, "int add(int a, int b) { return *(volatile int *)0; }\n", ADD_TESTS["cpp"])
    assert crash.status == "RuntimeError" and "SIGSEGV" in crash.cases[0].message, crash.cases[0]
    quick = LIMITS.model_copy(update={"cpu_s": 1, "wall_s": 3})
    loop = v.verify(
        "int add(int a, int b) { for (;;) {} }\n", CodeTests(test_code=ADD_TESTS["cpp"]), "cpp", quick
    )
    assert loop.status == "TimeLimitExceeded", loop.cases[0]
    sleeps = v.verify(
        "#include <unistd.h>\nint add(int a, int b) { pause(); return 0; }\n",
        CodeTests(test_code=ADD_TESTS["c"]),
        "c",
        quick,
    )
    assert sleeps.status == "TimeLimitExceeded", sleeps.cases[0]


def test_a_program_without_the_function_fails_to_compile_the_tests(v):
    r = run(v, "int sub(int a, int b) { return a - b; }\n", ADD_TESTS["cpp"])
    assert r.status == "RuntimeError" and r.compile is not None, r
    assert "the tests did not compile" in r.compile.message and "add" in r.compile.stderr


def test_tests_that_call_no_function_of_the_program_are_the_callers_error(v):
    with pytest.raises(InvalidTests, match="call none of the program's functions"):
        run(v, HONEST_ADD, "#include <cassert>\nint main() { assert(1 + 1 == 2); }")
