"""Attacks on C and C++ tests run apart (``functions.verifiers.native``), as a policy that
wants reward for a wrong program would make them: each forgery fails next to an honest
program that passes the same tests."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

import pytest

from functions.verifiers import native, native_pch
from functions.verifiers.sandbox import Limits, Sandbox
from functions.verifiers.verify import CodeTests, Verifier

BASE_UID = 445_000
LIMITS = Limits(cpu_s=5, wall_s=20, memory_mb=256)

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None or shutil.which("gcc") is None, reason="no gcc/g++"),
    pytest.mark.skipif(not native.available(), reason="libclang is not installed (pip install libclang)"),
]


@pytest.fixture
def box(pair_box):  # tests/functions/conftest.py: this module's BASE_UID
    return pair_box


@pytest.fixture
def v(pair_verifier):  # tests/functions/conftest.py: this module's BASE_UID and LIMITS
    return pair_verifier


def run(v: Verifier, code: str, test_code: str, lang: str):
    return v.verify(code, CodeTests(test_code=test_code), lang)


def forged_fails_honest_passes(v: Verifier, forged: str, honest: str, tests: str, lang: str) -> None:
    r = run(v, forged, tests, lang)
    assert r.status != "Finished", (r.compile, r.cases[0])
    h = run(v, honest, tests, lang)
    assert h.status == "Finished", (h.compile, h.cases[0])


GREET_C = (
    "#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n"
    "char *greet(const char *name) {\n"
    "    char *s = malloc(strlen(name) + 64);\n"
    '    sprintf(s, "Hello, %s!", name);\n'
    "    return s;\n}\n"
)
GREET_C_TESTS = (
    "#include <assert.h>\n#include <string.h>\n"
    'int main(void) { assert(strcmp(greet("Bob"), "Hello, Bob! How are you today?") == 0); return 0; }\n'
)


ROOT_CPP = "#include <cmath>\ndouble root(double x) { return std::sqrt(x); }\n"
ROOT_CPP_TESTS = (
    "#include <cassert>\n#include <cmath>\nint main() { assert(fabs(root(16.0) - 5.0) < 1e-6); }\n"
)
LIBRARY_NAMES = {
    "c_strcmp": ("int strcmp(const char *a, const char *b) { return 0; }\n" + GREET_C, "c"),
    "c_strstr": (
        "#include <string.h>\nchar *strstr(const char *h, const char *n) { return (char *)h; }\n" + GREET_C,
        "c",
    ),
    "cpp_fabs_noexcept": (
        "#include <cmath>\ndouble fabs(double x) noexcept { return 0; }\n" + ROOT_CPP,
        "cpp",
    ),
    "cpp_strcmp_extern_c": (
        '#include <cstring>\nextern "C" int strcmp(const char *a, const char *b) noexcept { return 0; }\n'
        "#include <string>\nconst char *greet(const char *n) { return n; }\n",
        "cpp",
    ),
}
CPP_GREET_TESTS = (
    "#include <cassert>\n#include <cstring>\n"
    'int main() { assert(strcmp(greet("Bob"), "Hello, Bob!") == 0); }\n'
)


# the tests call strcmp (fabs, strstr); a program that defines it must not answer that call
@pytest.mark.parametrize(("forged", "lang"), LIBRARY_NAMES.values(), ids=LIBRARY_NAMES.keys())
def test_library_names_of_the_program_never_answer_the_tests_checks(v, forged, lang):
    if "strstr" in forged:
        tests = "#include <assert.h>\n#include <string.h>\n" + (
            'int main(void) { assert(strstr(greet("A"), "Bye")); }\n'
        )
        honest = GREET_C.replace('"Hello, %s!"', '"Hello, %s! Bye"')
    elif "greet" in forged and lang == "cpp":
        tests = CPP_GREET_TESTS
        honest = '#include <string>\nconst char *greet(const char *n) { return "Hello, Bob!"; }\n'
    elif lang == "cpp":
        tests, honest = ROOT_CPP_TESTS, ROOT_CPP.replace("std::sqrt(x)", "std::sqrt(x) + 1")
    else:
        tests, honest = GREET_C_TESTS, GREET_C.replace('"Hello, %s!"', '"Hello, %s! How are you today?"')
    forged_fails_honest_passes(v, forged, honest, tests, lang)


def test_an_operator_the_program_defines_is_not_a_name_it_serves_and_does_not_refuse_it(v):
    # an operator is not called by name: the tests never see the program's (a lying
    # operator== on std types decides nothing), and the program's others are still served
    code = (
        "#include <iostream>\n#include <vector>\n"
        "std::ostream &operator<<(std::ostream &o, const std::vector<long> &v) { return o << v.size(); }\n"
        "bool operator==(const std::vector<long> &, const std::vector<long> &) { return true; }\n"
        "std::vector<long> evens(long n) {\n"
        "    std::vector<long> v;\n    for (long i = 0; i < n; i += 2) v.push_back(i);\n    return v;\n}\n"
    )
    tests = "#include <cassert>\n#include <vector>\n" + (
        "int main() { assert(evens(5) == (std::vector<long>({0, 2, 4}))); }"
    )
    r = run(v, code, tests, "cpp")
    assert r.status == "Finished", (r.compile, r.cases[0])
    wrong = run(v, code.replace("i += 2", "i += 1"), tests, "cpp")
    assert wrong.status == "Failed", (wrong.compile, wrong.cases[0])


def test_library_names_of_headers_the_tests_include_themselves_are_not_the_programs(v):
    # a library function of a header the test code includes itself (not in the prelude):
    # the stubs come before the test code, and C lets a later extern declaration name a
    # static function defined before it
    forged = (
        "int fnmatch(const char *p, const char *s, int f) { return 0; }\n"
        'const char *name_of(int k) { return "x.bin"; }\n'
    )
    tests = (
        "#include <assert.h>\n#include <fnmatch.h>\n"
        'int main(void) { assert(fnmatch("*.txt", name_of(1), 0) == 0); return 0; }\n'
    )
    honest = 'const char *name_of(int k) { return "x.txt"; }\n'
    forged_fails_honest_passes(v, forged, honest, tests, "c")
    # in C++ too (a static stub, then the header's extern "C" declaration)
    cpp_tests = tests.replace("assert.h", "cassert").replace("(void)", "()")
    forged_fails_honest_passes(v, forged, honest, cpp_tests, "cpp")


# -- what it costs: the tests' binary of a signature is compiled once ---------------------
class CountingRunner:
    """The sandbox, counting the compiles of the tests' binary it ran."""

    def __init__(self, box: Sandbox) -> None:
        self.box, self.tests_compiles = box, 0

    def run(self, **kw):
        if "tests.cpp" in kw.get("argv", ()) or "tests.c" in kw.get("argv", ()):
            self.tests_compiles += 1
        return self.box.run(**kw)

    def run_pair(self, **kw):
        return self.box.run_pair(**kw)


ADD_CPP_TESTS = "#include <cassert>\nint main() { assert(add(2, 3) == 5); }\n"


def test_the_tests_binary_of_a_signature_is_compiled_once_and_judges_each_program(box, v):
    counting = CountingRunner(box)
    cached = Verifier(counting, LIMITS)
    honest = "int add(int a, int b) { return a + b; }\n"
    assert run(cached, honest, ADD_CPP_TESTS, "cpp").status == "Finished"
    # (the same standard includes too: the tests see those of the program, as in one process)
    wrong = run(cached, "int add(int x, int y) { return x * y; }\n", ADD_CPP_TESTS, "cpp")
    assert wrong.status == "Failed", wrong.cases[0]
    assert counting.tests_compiles == 1
    # another signature is another source: compiled again, and judged with its own types
    wider = run(cached, "long add(long a, long b) { return a + b; }\n", ADD_CPP_TESTS, "cpp")
    assert wider.status == "Finished" and counting.tests_compiles == 2, wider.cases[0]
    # a failed compile is not kept (a load-timed-out one is not the source's verdict)
    assert run(cached, "int sub(int a, int b) { return a - b; }\n", ADD_CPP_TESTS, "cpp").status != "Finished"
    assert run(cached, "int sub(int a, int b) { return a - b; }\n", ADD_CPP_TESTS, "cpp").status != "Finished"
    assert counting.tests_compiles == 4
    uncached = Verifier(counting, LIMITS, tests_binaries=0)
    for _ in range(2):
        assert run(uncached, honest, ADD_CPP_TESTS, "cpp").status == "Finished"
    assert counting.tests_compiles == 6


@pytest.mark.parametrize("lang", ["c", "cpp"])
def test_tests_that_declare_the_programs_function_themselves_still_call_it(v, lang):
    # the stubs are static: a prototype in the test code (extern or not) names the stub
    tests = (
        "#include <assert.h>\nint add(int a, int b);\nextern int add(int, int);\n"
        "int main(void) { assert(add(2, 3) == 5); return 0; }\n"
    )
    assert run(v, "int add(int a, int b) { return a + b; }\n", tests, lang).status == "Finished"
    wrong = run(v, "int add(int a, int b) { return a - b; }\n", tests, lang)
    assert wrong.status == "Failed", (wrong.compile, wrong.cases[0])


# -- precompiled headers: built on the host from fixed text, read-only in the runs -------
STDCXX_PROGRAM = (
    "#include<assert.h>\n#include<bits/stdc++.h>\n"
    "std::vector<long> incr_list(std::vector<long> l) {\n    for (auto& x : l) x += 1;\n    return l;\n}\n"
)
STDCXX_TESTS = (
    "}\nint main() {\n    auto candidate = incr_list;\n"
    "    assert(candidate((std::vector<long>({(long)3, (long)1})))\n"
    "           == (std::vector<long>({(long)4, (long)2})));\n}\n"
)[2:]


def test_a_bits_stdcxx_program_compiles_against_the_shared_precompiled_headers(box, v):
    assert native_pch.PCH_DIR in box.shared.split(",")
    assert run(v, STDCXX_PROGRAM, STDCXX_TESTS, "cpp").status == "Finished"
    wrong = run(v, STDCXX_PROGRAM.replace("x += 1", "x += 2"), STDCXX_TESTS, "cpp")
    assert wrong.status == "Failed", (wrong.compile, wrong.cases[0])
    # one for the tests' flags, one for the program's
    assert len(list(Path(native_pch.PCH_DIR).glob("*.hpp.gch"))) >= 2


def test_a_program_cannot_write_the_precompiled_headers(v):
    # it runs where the compiles read them: each write must fail, or add answers wrong
    gch = sorted(Path(native_pch.PCH_DIR).glob("*.gch"))
    target = str(gch[0]) if gch else native_pch.PCH_DIR + "/x.gch"
    code = (
        "#include <bits/stdc++.h>\n#include <fcntl.h>\n#include <unistd.h>\n"
        "long add(long a, long b) {\n"
        f'    int w = open("{target}", O_WRONLY | O_TRUNC);\n'
        f'    int c = open("{native_pch.PCH_DIR}/new.hpp.gch", O_WRONLY | O_CREAT, 0644);\n'
        "    return (w < 0 && c < 0) ? a + b : 0;\n}\n"
    )
    r = run(v, code, "}\nint main() { assert(add(2, 3) == 5); }\n"[2:], "cpp")
    assert r.status == "Finished", (r.compile, r.cases[0])


def test_a_precompiled_header_that_cannot_be_built_is_compiled_without():
    # a compiler missing on the host, or one that fails: the compile reads the headers
    assert native_pch.header("int x;\n", "/nonexistent/g++", ("-O1",)) is None
    assert native_pch.header("#error no\n", "g++", ("-O1",)) is None


def test_a_new_precompiled_header_removes_the_stale_ones_no_compile_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(native_pch, "PCH_DIR", str(tmp_path))
    monkeypatch.setattr(native_pch, "prepare_pch_dir", lambda: (str(tmp_path),))
    day_ago = time.time() - native_pch.STALE_S - 60

    def made(name: str, old: bool = True) -> Path:
        p = tmp_path / name
        p.write_text("x")
        if old:
            os.utime(p, (day_ago, day_ago))
        return p

    key = "rlfabric-{}.hpp".format
    stale = [made(key("a" * 20)), made(key("a" * 20) + ".gch"), made(key("a" * 20) + ".pch")]
    stale += [made(key("b" * 20) + ".123.tmp.gch"), made(key("c" * 20) + ".gch")]  # a dead build's
    stale += [made(key("f" * 20) + ".123.tmp.pch"), made(key("9" * 20) + ".pch")]  # libclang's
    fresh = [made(key("e" * 20), old=False), made(key("e" * 20) + ".gch", old=False)]
    held = [made(key("d" * 20)), made(key("d" * 20) + ".gch"), made(key("d" * 20) + ".pch")]
    other = made("README")
    # another verifier's compile is reading d's header: its shared lock keeps it
    fd = os.open(held[0], os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        path = native_pch.header("int x;\n", "g++", ("-O1",))
        assert path is not None and Path(path + ".gch").is_file()
        assert [p.name for p in stale if p.exists()] == []
        assert all(p.exists() for p in [*fresh, *held, other])
    finally:
        os.close(fd)
    # unheld, it goes at the next build; a compile that held it first keeps it meanwhile
    with contextlib.ExitStack() as mine:
        assert native_pch.hold(path, mine)
        assert native_pch.remove_stale(keep="") == [str(p) for p in held]
        assert Path(path).exists()  # this process uses it (and it is held)
    assert not native_pch.hold(str(held[0]), contextlib.ExitStack())  # gone: compile without


def test_a_new_compiler_version_names_a_new_precompiled_header(tmp_path, monkeypatch):
    monkeypatch.setattr(native_pch, "PCH_DIR", str(tmp_path))
    monkeypatch.setattr(native_pch, "prepare_pch_dir", lambda: (str(tmp_path),))
    paths = set()
    for version in ("g++ 99.1", "g++ 99.2"):
        monkeypatch.setattr(native_pch, "_version", lambda compiler, v=version: v)
        paths.add(native_pch.header("int v99;\n", "g++", ("-O1",)))
    assert None not in paths and len(paths) == 2


@pytest.mark.parametrize(
    ("lib", "proto", "call"),
    [
        # in the C prelude's <string.h>: a static stub after its extern declaration
        ("strcmp", "int strcmp(const char *, const char *);", 'strcmp(name_of(1), "x.txt")'),
        # in no header the tests include: only the tests' own prototype declares it
        ("fnmatch", "int fnmatch(const char *, const char *, int);", 'fnmatch("*.txt", name_of(1), 0)'),
        ("strverscmp", "int strverscmp(const char *, const char *);", 'strverscmp(name_of(1), "x.txt")'),
    ],
)
def test_a_library_function_the_tests_prototype_themselves_is_the_librarys(v, lib, proto, call):
    # the tests declare a library function without its header and check with it; a program
    # defining that name would answer (through its stub) the very check that judges it
    params = ", ".join(f"{t} a{i}" for i, t in enumerate(proto[proto.index("(") + 1 : -2].split(", ")))
    forged = f"int {lib}({params}) {{ return 0; }}\n" + 'const char *name_of(int k) { return "x.bin"; }\n'
    honest = 'const char *name_of(int k) { return "x.txt"; }\n'
    tests = f"#include <assert.h>\n{proto}\nint main(void) {{ assert({call} == 0); return 0; }}\n"
    forged_fails_honest_passes(v, forged, honest, tests, "c")
    cpp_tests = (
        tests.replace("assert.h", "cassert").replace("(void)", "()").replace(proto, f'extern "C" {proto}')
    )
    forged_fails_honest_passes(v, forged, honest, cpp_tests, "cpp")
    # the program's own function of a library's name that the tests call: refused, by name
    r = run(v, forged, tests, "c")
    assert (
        r.status == "RuntimeError" and f"{lib!r}" in r.cases[0].message and "library" in r.cases[0].message
    ), r


@pytest.mark.parametrize("lang", ["cpp", "cpp_stdcxx"])
def test_a_library_name_the_tests_translation_unit_never_declares_is_the_programs(v, lang):
    # libc defines `truncate` (<unistd.h>), but nothing the tests include declares it, nor do
    # they: the only `truncate` their C++ can mean is the program's (C's may mean libc's, by an
    # implicit declaration: test_code_verify_native_sec.py)
    honest = "int truncate(int x) { return x / 10 * 10; }\n"
    tests = "#include <cassert>\nint main() { assert(truncate(57) == 50); return 0; }\n"
    if lang == "cpp_stdcxx":
        # the program's own <bits/stdc++.h> declares libc's too, in its translation unit (an
        # overload there); the tests get the library's common headers, which do not
        honest, lang = "#include <bits/stdc++.h>\nusing namespace std;\n" + honest, "cpp"
    r = run(v, honest, tests, lang)
    assert r.status == "Finished", (r.compile, r.cases[0])
    wrong = run(v, honest.replace("x / 10 * 10", "x"), tests, lang)
    assert wrong.status == "Failed", (wrong.compile, wrong.cases[0])


def test_a_library_function_the_tests_prototype_inside_a_function_is_the_librarys(v):
    # a prototype at block scope declares the library's function too: C would take it as
    # naming a static stub declared before it (C++'s would have C++ linkage: no library's)
    forged = "int fnmatch(const char *p, const char *s, int f) { return 0; }\n" + (
        'const char *name_of(int k) { return "x.bin"; }\n'
    )
    honest = 'const char *name_of(int k) { return "x.txt"; }\n'
    tests = (
        "#include <assert.h>\nint main(void) {\n    int fnmatch(const char *, const char *, int);\n"
        '    assert(fnmatch("*.txt", name_of(1), 0) == 0);\n    return 0;\n}\n'
    )
    forged_fails_honest_passes(v, forged, honest, tests, "c")
