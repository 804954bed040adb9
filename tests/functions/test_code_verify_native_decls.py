"""C and C++ assert-style tests (``functions.verifiers.native``): declarations the channel
cannot carry are refused with a message that says which (and only those the tests use), tests
that need the program's variables or types are refused by name, the in-process harness runs
what the channel cannot; the host's side of the parse (what the sandbox printed is untrusted),
a missing libclang, and the library names the tests' link reaches."""

from __future__ import annotations

import shutil

import pytest
from code_verify_native_helpers import ADD_TESTS, HONEST_ADD, passes, run

from fabric.errors import Misconfigured
from functions.verifiers import native, native_link
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CodeTests

BASE_UID = 420_000  # apart from the other native modules' (430_000, 445_000, 462_000, 470_000)
# compiled binaries start fast, but two compiles and a parse share a loaded 2-core machine
LIMITS = Limits(cpu_s=5, wall_s=20, memory_mb=256)

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None, reason="no gcc/g++"),
    pytest.mark.skipif(not native.available(), reason="libclang is not installed (pip install libclang)"),
]


@pytest.fixture
def v(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


# -- what cannot be carried: refused, not run ---------------------------------------------
UNSUPPORTED = {
    "raw_pointer": (
        "long sum(long *a, int n) { long s = 0; while (n--) s += a[n]; return s; }",
        "sum",
        "'long *'",
    ),
    "struct": ("struct P { int x; };\nint getx(P p) { return p.x; }", "getx", "'P'"),
    "overloaded": (
        "int twice(int x) { return 2 * x; }\ndouble twice(double x) { return 2 * x; }",
        "twice",
        "overloads",
    ),
    "global_read": ("int counter = 0;\nint bump() { return ++counter; }", "counter", "a variable"),
    "default_argument": ("int inc(int x, int by = 1) { return x + by; }", "inc", "default arguments"),
    "function_pointer": ("long apply(long (*f)(long), long x) { return f(x); }", "apply", "parameter 1"),
    "template": ("template <class T> T ident(T x) { return x; }", "ident", "function template"),
    "returns_a_reference": (
        "#include <string>\nstd::string s;\nstd::string& ref() { return s; }",
        "ref",
        "reference",
    ),
}


@pytest.mark.parametrize(("code", "name", "why"), UNSUPPORTED.values(), ids=UNSUPPORTED.keys())
def test_declarations_the_channel_cannot_carry_are_refused_by_name(v, code, name, why):
    r = run(v, code, f"#include <cassert>\nint main() {{ (void)&{name}; return 0; }}")
    msg = r.cases[0].message
    assert r.status == "RuntimeError" and msg.startswith("not run: "), r.cases[0]
    assert repr(name) in msg and why in msg and "stdin/stdout" in msg, msg


def test_a_declaration_libclang_misread_is_never_called_with_the_wrong_types(v):
    # clang reads an unknown type as int: refused, not called as add(int, long)
    unknown = run(v, "long add(Foo a, long b) { return b; }\n", ADD_TESTS["cpp"])
    assert unknown.status == "RuntimeError" and "could not read its declaration" in unknown.cases[0].message
    # what the compiler reads otherwise than libclang (its own macros) does not compile
    two_faced = (
        "#ifdef __clang__\ntypedef long num;\n#else\ntypedef int num;\n#endif\n"
        "num add(num a, num b) { return a + b; }\n"
    )
    for lang in ("cpp", "c"):
        r = run(v, two_faced, ADD_TESTS[lang], lang)
        assert r.status == "RuntimeError" and r.compile is not None, r
        assert "reads the declaration of add otherwise than libclang" in r.compile.stderr, r.compile


def test_an_unused_unsupported_helper_is_not_refused(v):
    code = "int helper(int *a) { return *a; }\nint add(int a, int b) { int s = a + b; return helper(&s); }\n"
    passes(v, code, ADD_TESTS["cpp"])


# a program's name the tests mention but do not use: their own local, a comment, a string
NOT_THE_PROGRAMS = {
    "a_local_of_the_tests": (
        "int n;\nstruct a { int x; };\nint add(int a, int b) { n = a; return n + b; }\n",
        "#include <cassert>\nint main() { int n = 2; assert(add(n, 3) == 5); return 0; }",
        "cpp",
    ),
    "a_comment_and_a_string": (
        "#include <string.h>\nint n;\nstruct a { int x; };\nint add(int a, int b) { return a + b; }\n",
        "#include <assert.h>\n#include <string.h>\n/* n: add's struct a */\nint main(void) {\n"
        '    assert(add(2, 3) == 5); // n and a\n    assert(strcmp("n a", "n a") == 0);\n    return 0;\n}',
        "c",
    ),
    "an_unsupported_function_in_a_comment": (
        "int twice(int x) { return 2 * x; }\ndouble twice(double x) { return 2 * x; }\n"
        "long sum(long *a, int n) { return n; }\nint add(int a, int b) { return a + b; }\n",
        "#include <cassert>\n// like twice() and sum(), add is\nint main() {\n"
        '    assert(add(2, 3) == 5); /* twice */ const char *s = R"(sum(a, 1))"; (void)s;\n    return 0;\n}',
        "cpp",
    ),
}


@pytest.mark.parametrize(("code", "tests", "lang"), NOT_THE_PROGRAMS.values(), ids=NOT_THE_PROGRAMS.keys())
def test_a_name_the_tests_do_not_use_as_the_programs_is_not_refused(v, code, tests, lang):
    passes(v, code, tests, lang)
    wrong = run(v, code.replace("return a + b", "return a - b").replace("n + b", "n - b"), tests, lang)
    assert wrong.status == "Failed", (wrong.compile, wrong.cases[0])


USES_THE_PROGRAMS = {
    "a_c_type": (
        "typedef struct P { int x; } P;\nint getx(int x) { return x; }",
        "P p = {1}; getx(p.x);",
        "c",
        "P",
    ),
    "a_c_struct": (
        "struct P { int x; };\nint getx(int x) { return x; }",
        "struct P *p = 0; getx(p->x);",
        "c",
        "P",
    ),
    "a_cpp_struct": ("struct P { int x; };\nint getx(int x) { return x; }", "P p{1}; getx(p.x);", "cpp", "P"),
    "an_enum_constant": ("enum { RED = 1 };\nint getx(int x) { return x; }", "getx(RED);", "cpp", "RED"),
    "a_variable_in_c": (
        "int n, counter;\nint getx(int x) { return x; }",
        "int n = 1; getx(counter + n);",
        "c",
        "counter",
    ),
    "a_variable_in_cpp": (
        "int n, counter;\nint getx(int x) { return x; }",
        "int n = 1; getx(counter + n);",
        "cpp",
        "counter",
    ),
}


@pytest.mark.parametrize(
    ("code", "body", "lang", "name"), USES_THE_PROGRAMS.values(), ids=USES_THE_PROGRAMS.keys()
)
def test_tests_that_need_a_variable_or_type_of_the_program_are_refused_by_name(v, code, body, lang, name):
    r = run(v, code, f"int main(void) {{ {body} return 0; }}", lang)
    msg = r.cases[0].message
    assert r.status == "RuntimeError" and msg.startswith("not run: "), r.cases[0]
    assert repr(name) in msg and "of the program" in msg and "stdin/stdout" in msg, msg
    assert "'n'" not in msg, msg  # the tests' own n: the compiler said which name it lacked


def test_tests_that_lack_something_else_are_not_refused_for_a_name_they_mention(v):
    # their own n, the program's global n, and no add: gcc names add, the program fails
    r = run(
        v, "int n;\nint sub(int a, int b) { return a - b; }\n", "int main() { int n = add(1, 2); return n; }"
    )
    assert r.status == "RuntimeError" and r.compile is not None, r
    assert "the tests did not compile" in r.compile.message and "add" in r.compile.stderr, r.compile


def test_code_names_skips_comments_and_literals_only():
    code = '// a \\\n b\n/* c */ d "e \\" f" g \'h\' i R"x(j)" k)x" l 1\'000 m u8\'n\' /* o'
    names = native.code_names(code)
    assert {"d", "g", "i", "l", "m"} <= names
    assert not names & {"a", "b", "c", "e", "f", "h", "j", "k", "o"}


def test_the_in_process_harness_runs_what_the_channel_cannot(v):
    code = "long sum(long *a, int n) { long s = 0; while (n--) s += a[n]; return s; }\n"
    tests = "#include <cassert>\nint main() { long a[] = {1, 2, 3}; assert(sum(a, 3) == 6); return 0; }"
    r = v.verify(code, CodeTests(test_code=tests, c_asserts="in_process"), "cpp")
    assert r.status == "Finished", r.cases[0]


# -- the host's side of the parse: what the sandbox printed is untrusted ------------------
def test_plan_rejects_declarations_cdecls_would_not_print():
    fn = {"ret": {"k": "int"}, "params": [], "sig": "int ()"}
    with pytest.raises(native.BadDeclarations, match="not a name"):
        native.plan({"functions": [{**fn, "name": "f(); system"}], "others": []}, "cpp", "f(); system")
    deep: dict = {"k": "int"}
    for _ in range(40):
        deep = {"k": "vector", "a": [deep]}
    with pytest.raises(native.BadDeclarations):
        native.plan({"functions": [{**fn, "name": "f", "ret": deep}], "others": []}, "cpp", "f")
    with pytest.raises(native.BadDeclarations):  # a C++ type claimed for C
        native.plan({"functions": [{**fn, "name": "f", "ret": {"k": "string"}}], "others": []}, "c", "f")
    # a spelling is only ever quoted in a message, never put in a source
    p = native.plan({"functions": [{**fn, "name": "f", "ret": {"k": "int"}}], "others": []}, "cpp", "f")
    assert native.tests_source("cpp", "int main() { f(); }", p).count("int f()") == 1
    with pytest.raises(native.Unsupported, match="type"):
        native.plan(
            {"functions": [{**fn, "name": "f", "ret": {"k": "?", "s": "x\n#include"}}], "others": []},
            "cpp",
            "f",
        )


def test_only_the_standard_library_of_the_programs_includes_reaches_the_tests():
    # a system header may define NDEBUG and include <assert.h>: the program's choice of
    # header must not be text in the tests' translation unit
    fn = {"name": "f", "ret": {"k": "int"}, "params": [], "sig": "int ()"}
    decls = {
        "functions": [fn],
        "others": [],
        "includes": ["vector", "tcl8.6/tcl-private/generic/regguts.h", "math.h"],
    }
    p = native.plan(decls, "cpp", "f")
    assert p.includes == ["vector", "math.h"]
    assert "regguts" not in native.tests_source("cpp", "int main() { f(); }", p)
    with pytest.raises(native.BadDeclarations, match="header"):
        native.plan({**decls, "includes": ["../../etc/passwd"]}, "cpp", "f")


def test_a_missing_libclang_is_a_clear_error(v, monkeypatch):
    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.raises(ValueError, match="libclang"):
        run(v, HONEST_ADD, ADD_TESTS["cpp"])


def test_libclang_missing_in_the_sandbox_is_no_score_for_the_program(v, monkeypatch):
    # the worker has it, the sandbox's interpreter does not: the setup's fault, not a 0
    real = native.parse_files

    def without_clang(lang: str, code: str, pch: str | None = None) -> dict[str, bytes]:
        files = real(lang, code, pch)
        files["cdecls.py"] = files["cdecls.py"].replace(
            b"import clang.cindex as ci", b"import clang_gone.cindex as ci"
        )
        return files

    monkeypatch.setattr(native, "parse_files", without_clang)
    with pytest.raises(Misconfigured, match="cannot import libclang") as caught:
        run(v, HONEST_ADD, ADD_TESTS["cpp"])
    # the import's error on the same line as what to do (cdecls.py's line ended in a newline)
    assert "cannot import libclang: No module named 'clang_gone'; install libclang for" in str(caught.value)


def test_the_library_names_are_what_the_tests_link_reaches():
    # asked of the linker with the tests' driver and libraries: libc's (declared in a header
    # of the prelude or not), libm's with -lm, never a name no library defines
    names = ["strcmp", "fnmatch", "sqrt", "truncate", "add_two", "sort_array"]
    assert native_link.library_names(("gcc", "-lm"), names) == ["strcmp", "fnmatch", "sqrt", "truncate"]
    # a name the probe's text cannot refer to (g++ declares namespace std itself) counts as
    # the library's: refused, never stubbed; the others are still told apart
    assert native_link.library_names(("g++",), ["std", "fnmatch", "add_two"]) == ["std", "fnmatch"]
