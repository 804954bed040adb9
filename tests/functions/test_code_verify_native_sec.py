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
