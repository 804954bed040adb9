"""C and C++ assert-style tests in a sandbox of their own (docs/code-verifier.md).

The program and its tests are two binaries that share no text and no process:

1. ``cdecls.py`` reads the program's top-level declarations with libclang, inside the
   sandbox (the source is untrusted); ``plan`` (``native_decls``) validates what it printed
   (untrusted too) and picks the functions the tests call.
2. The tests' binary: ``rlfabric_rpc.hpp`` (or ``.h``), the standard headers (and the
   standard headers the program includes, as the tests saw them in one process), a stub for
   each of those functions with the declared signature (rendered here from the validated
   types, never copied from the program's text), then the test code. A stub sends its
   arguments over the channel and returns what comes back.
3. The program's binary: the same header, the program's text with its ``main`` renamed
   (it never runs), then a ``main`` that answers calls (``rlfabric::serve``).

``Sandbox.run_pair`` runs both; the tests' exit status is the verdict. The program only
ever answers calls: it cannot reach the tests' memory, descriptors or exit status, and
what it answers is a value of the declared type (or a protocol error).

A function the channel cannot carry soundly (a raw pointer other than a C string, a
struct of the program, a function pointer, an overloaded name, a default argument) that
the tests' code names (outside comments and literals), or any other name of the program
(a variable, a type, a template) without which the tests do not compile (their own local
``n`` is theirs; so is a name of the program's macros, which never reach the tests' text)
makes the case a ``RuntimeError`` that says which, not run: a refusal the program's own
signature can cause must score like a failure, or a program could dodge a 0 with it. So
does a function the tests call that a library of their binary defines too, where the tests
declare the library's function as well (``native_link``, ``LIBRARY_STUB``), and in C always
(an undeclared call declares the library's: ``native_link.c_refusal``); and a C++ function
named like one the tests' headers declare (``std::size``, ``std::max``) where some use of
the name in the tests compiles without its stub (``native_collide``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from functions.verifiers.native_decls import _ONE, _TWO

# the declarations' names, re-exported (``native.plan``, ``native.Unsupported``)
from functions.verifiers.native_decls import STANDARD_HEADERS as STANDARD_HEADERS
from functions.verifiers.native_decls import BadDeclarations as BadDeclarations
from functions.verifiers.native_decls import Function as Function
from functions.verifiers.native_decls import Param as Param
from functions.verifiers.native_decls import Plan as Plan
from functions.verifiers.native_decls import Unsupported as Unsupported
from functions.verifiers.native_decls import code_names as code_names
from functions.verifiers.native_decls import plan as plan
from functions.verifiers.native_decls import refusal as refusal
from functions.verifiers.native_decls import render as render
from functions.verifiers.sandbox import Limits

HERE = Path(__file__).parent
NATIVE = HERE / "native"
#: the sandboxed run's program that reads the declarations: a file beside the C and C++ sides
#: (a program of the run's, never imported here: discovery of the built-ins walks this package,
#: and it exits where libclang is missing, an extra the rest of the package does without)
CDECLS = NATIVE / "cdecls.py"
#: what the program's ``main`` becomes (it must not run: only the server's does)
PROGRAM_MAIN = "__rlfabric_program_main"


#: ``cdecls.py``'s exit status (with its own line on stderr) when libclang cannot be imported
NO_LIBCLANG = 87
NO_LIBCLANG_LINE = b"rlfabric: libclang cannot be imported: "


def available() -> bool:
    """Whether libclang's Python package is installed (``pip install 'rl-fabric[verifiers]'``)."""
    return importlib.util.find_spec("clang") is not None


def tests_compile_argv(lang: Any) -> tuple[str, ...]:
    """How the tests' binary is built: as the program is, but ``-O1`` (tests are mostly
    calls: less to compile, and their speed is not what is judged)."""
    ext = "cpp" if lang.name == "cpp" else "c"
    argv = [a for a in lang.compile_argv if a not in ("-O2", "-o", "main", lang.source_file)]
    flags, libs = [a for a in argv[1:] if not a.startswith("-l")], [a for a in argv[1:] if a.startswith("-l")]
    return (argv[0], "-O1", *flags, "-o", "tests", f"tests.{ext}", *libs)


@functools.cache
def include_dirs(lang: str) -> tuple[str, ...]:
    """The compiler's own system include directories (``<vector>``, ``<stddef.h>``): the
    libclang wheel has no headers of its own, and these are what ``g++`` compiles with."""
    cc, x = ("g++", "c++") if lang == "cpp" else ("gcc", "c")
    out = subprocess.run(
        [cc, "-E", "-v", "-x", x, "/dev/null"], capture_output=True, text=True, timeout=30, check=False
    ).stderr
    lines = out.splitlines()
    try:
        start = lines.index("#include <...> search starts here:") + 1
        end = lines.index("End of search list.")
    except ValueError:
        return ()
    return tuple(line.strip() for line in lines[start:end])


def parse_args(lang: str) -> tuple[str, ...]:
    """libclang's arguments for the program's read (``cdecls.py``)."""
    std = (
        ["-x", "c++", "-std=gnu++17", "-nostdinc", "-nostdinc++"]
        if lang == "cpp"
        else ["-x", "c", "-std=gnu17", "-nostdinc"]
    )
    return (*std, *(a for d in include_dirs(lang) for a in ("-isystem", d)))


#: the text of libclang's precompiled header for the read of a C++ program that includes
#: ``<bits/stdc++.h>`` (``native_pch.clang_header``): fixed, never anything of a program's
CLANG_PCH_TEXT = "#include <bits/stdc++.h>\n"
#: a line of the program's that may include ``<bits/stdc++.h>`` (``cdecls.py`` reads it
#: again without the header where the program turns out not to include it)
_STDCXX_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<bits/stdc\+\+\.h>", re.MULTILINE)


def wants_clang_pch(lang: str, code: str) -> bool:
    """Whether the read of ``code`` may start from ``CLANG_PCH_TEXT``'s header."""
    return lang == "cpp" and _STDCXX_INCLUDE.search(code) is not None


#: the open files of a read that starts from the precompiled header: libclang keeps each
#: header open that it looks up and then skips (the program's ``#include <bits/stdc++.h>``
#: opens each of the library's again, about a hundred), more than a compile's 64
PCH_READ_NOFILE = 1024


def read_limits(limits: Limits, pch: str | None) -> Limits:
    """The limits of the read (``limits``: the compiler's), with room for ``pch``'s headers."""
    if pch is None or limits.nofile >= PCH_READ_NOFILE:
        return limits
    return limits.model_copy(update={"nofile": PCH_READ_NOFILE})


def parse_files(lang: str, code: str, pch: str | None = None) -> dict[str, bytes]:
    """The files of the sandboxed run that prints the program's declarations (``pch``: a
    precompiled header of ``CLANG_PCH_TEXT`` to try first, read-only in the sandbox)."""
    source = "main.cpp" if lang == "cpp" else "main.c"
    opts = {"source": source, "args": list(parse_args(lang)), "system": include_dirs(lang), "pch": pch}
    return {
        "cdecls.py": CDECLS.read_bytes(),
        "cdecls.json": json.dumps(opts).encode(),
        source: code.encode(),
    }


# -- the two sources ---------------------------------------------------------------------
#: The tests see the standard headers the program includes, as in one process, and these
#: (assert, abs, fabs: what HumanEval-X's tests use unincluded). `abs` is always std's
#: overloads: without them, and without the program's `using namespace std;`, the tests'
#: `abs(f(x) - 0.5) < 1e-6` is C's int abs, true for any answer within 1 of the right one,
#: and which abs the tests get must not be the program's choice ...
_CPP_TESTS_BASE = "".join(f"#include <{h}>\n" for h in ("cassert", "cmath", "cstdlib", "cstring")) + (
    "using std::abs;\n"
)
#: ... but a program's <bits/stdc++.h> becomes this list (MultiPL-E's programs all include
#: it; their tests use these containers): the whole library would double the tests'
#: compile (1.35 s of CPU against 0.68 s here). Tests that need a header beyond it include
#: it themselves.
_CPP_STDCXX = "".join(
    f"#include <{h}>\n"
    for h in (
        "algorithm",
        "array",
        "bitset",
        "cassert",
        "cctype",
        "climits",
        "cmath",
        "cstdint",
        "cstdio",
        "cstdlib",
        "cstring",
        "deque",
        "functional",
        "iomanip",
        "iostream",
        "limits",
        "list",
        "map",
        "numeric",
        "optional",
        "queue",
        "set",
        "sstream",
        "stack",
        "string",
        "tuple",
        "unordered_map",
        "unordered_set",
        "utility",
        "vector",
    )
)
_C_TESTS_PRELUDE = "".join(
    f"#include <{h}>\n"
    for h in (
        "assert.h",
        "ctype.h",
        "limits.h",
        "math.h",
        "stdbool.h",
        "stddef.h",
        "stdint.h",
        "stdio.h",
        "stdlib.h",
        "string.h",
    )
)


def _kinds(t: Any) -> set[str]:
    if not isinstance(t, dict):
        return set()
    return {str(t.get("k"))}.union(*(_kinds(a) for a in t.get("a", [])))


def _uses(p: Plan) -> str:
    """The containers the plan's types use, for ``rlfabric_rpc.hpp`` (``RLFABRIC_USES_*``:
    the headers of all of them would double a small program's compile)."""
    kinds: set[str] = set()
    for f in p.functions:
        kinds |= _kinds(f.ret_wire)
        for param in f.params:
            kinds |= _kinds(param.wire)
    containers = sorted((kinds & {*_ONE, *_TWO}) - {"pair"})
    return "".join(f"#define RLFABRIC_USES_{k.upper()} 1\n" for k in containers)


def header(lang: str) -> tuple[str, bytes]:
    name = "rlfabric_rpc.hpp" if lang == "cpp" else "rlfabric_rpc.h"
    return name, (NATIVE / name).read_bytes()


#: Stubs are ``static``: a program function named like one the tests' headers declare
#: (``strcmp``, ``fabs``, ``read``) would otherwise define it for the whole tests' binary, and
#: the program would answer the very comparison that judges it (``strcmp(greet(x), "...")``);
#: a static definition after the header's extern declaration does not compile, in C and C++.


#: A stub of a name a library defines too (``native_link``: ``truncate``, ``fnmatch``) is a
#: static function of a reserved name and, under the function's name, a constant that refers
#: to it (a reference to it in C++, a pointer to it in C): calls, ``auto candidate = f;`` and
#: the conversions of its parameters are the same, but it is a variable, so any declaration of
#: that name as a function in the tests' translation unit (a header's, or the test code's own
#: prototype, at file or block scope, ``extern "C"`` or through a ``using``) does not compile:
#: the tests that mean the library's function are refused (``library_refusal``), never
#: answered by the program, and tests that declare no such function get the program's. (C
#: tests never get here: C's implicit declaration makes even an undeclared call the library's
#: too, ``native_link.c_refusal``; the C stub stays a pointer all the same.)
LIBRARY_STUB = "__rlfabric_stub_"


def _stub_name(f: Function, library: frozenset[str]) -> str:
    return LIBRARY_STUB + f.name if f.name in library else f.name


def _cpp_stub(i: int, f: Function, library: frozenset[str] = frozenset()) -> str:
    params = ", ".join(f"{p.type} a{n}" for n, p in enumerate(f.params))
    types = "".join(f", {p.type}" for p in f.params)
    args = "".join(f", std::forward<{p.type}>(a{n})" for n, p in enumerate(f.params))
    name = _stub_name(f, library)
    stub = (
        f"static {f.ret} {name}({params}) {{\n"
        f'    return ::rlfabric::call<{f.ret}{types}>({i}, "{f.name}"{args});\n}}\n'
    )
    if name != f.name:
        stub += f"static {f.ret} (&{f.name})({', '.join(p.type for p in f.params)}) = {name};\n"
    return stub


def _c_kind(t: Any) -> str:
    k = t["k"]
    if k == "cstr":
        return "s"
    if k in ("float", "double"):
        return "f" if k == "float" else "d"
    return "u" if k.startswith("unsigned") or k == "bool" else "i"


def _c_stub(i: int, f: Function, library: frozenset[str] = frozenset()) -> str:
    params = ", ".join(f"{p.type} a{n}" for n, p in enumerate(f.params)) or "void"
    name = _stub_name(f, library)
    lines = [f"static {f.ret} {name}({params}) {{", f"    rlf_out o = rlf_begin({i});"]
    for n, p in enumerate(f.params):
        lines.append(f"    rlf_put_{_c_kind(p.wire)}(&o, a{n});")
    lines.append(f'    rlf_in in = rlf_call(&o, "{f.name}");')
    if f.ret != "void":
        lines.append(f"    {f.ret} r = ({f.ret})rlf_get_{_c_kind(f.ret_wire)}(&in);")
    for n, p in enumerate(f.params):
        if p.type == "char *":  # the program may have written into it: copied back, same length
            lines.append(f"    rlf_back_s(&in, a{n});")
    lines.append("    rlf_end(&in);")
    lines.append("    return r;" if f.ret != "void" else "    return;")
    lines.append("}")
    if name != f.name:
        types = ", ".join(p.type for p in f.params) or "void"
        lines.append(f"static {f.ret} (*const {f.name})({types}) = {name};")
    return "\n".join(lines) + "\n"


#: the test code's own ``#include <...>`` lines
_TESTS_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<[A-Za-z0-9_./+-]{1,200}>", re.MULTILINE)


def _never(name: str) -> str:
    """What stands for an omitted stub (``tests_source``): a function template no call can
    use, so that each use of the name that nothing else answers is an error of its own
    (without any declaration, gcc reports an undeclared name once per function), while
    ``std``'s functions of that name stay found, through ``using namespace std`` or the
    arguments' namespace, as they were next to the stub."""
    return (
        "namespace rlfabric_omitted { template <class T> struct never {}; }\n"
        f"template <class T> void {name}(::rlfabric_omitted::never<T>) = delete;\n"
    )


def tests_includes(test_code: str) -> list[str]:
    """The headers the test code includes itself (``#include <...>``)."""
    return [m.group(0).split("<", 1)[1].rstrip(">") for m in _TESTS_INCLUDE.finditer(test_code)]


def names_prelude(p: Plan, test_code: str) -> str | None:
    """The headers of the C++ tests' translation unit (``tests_source``'s text before the
    stubs, with every container's overloads of the wire), for the names they declare
    (``native_collide``); ``None`` where the test code includes a header outside the
    standard library's (that text is never read on the host)."""
    theirs = tests_includes(test_code)
    if any(h not in STANDARD_HEADERS for h in theirs):
        return None
    own = (f"#include <{h}>\n" if h != "bits/stdc++.h" else _CPP_STDCXX for h in [*p.includes, *theirs])
    return "".join([_ALL_USES, f'#include "{header("cpp")[0]}"\n', _CPP_TESTS_BASE, *own])


def tests_source(
    lang: str, test_code: str, p: Plan, library: frozenset[str] = frozenset(), omit: str | None = None
) -> str:
    """The tests' translation unit: the wire, the standard headers, a stub per function,
    then the test code (which has the file, and its line numbers, to itself). ``library``:
    the functions' names a library of the tests' binary defines too (``LIBRARY_STUB``);
    ``omit``: a C++ function whose stub is left out, a template no call can use in its place
    (``native_collide``: which uses of its name compile without it?).

    The headers the test code includes come before the stubs too (again: they have
    guards): a stub is ``static`` so that it cannot define a function a header declares,
    but C takes a later ``extern`` declaration of a static function as naming it, so a
    program's ``fnmatch`` would answer the tests' own ``fnmatch`` from ``<fnmatch.h>``."""
    name = header(lang)[0]
    theirs = "".join(m.group(0).strip() + "\n" for m in _TESTS_INCLUDE.finditer(test_code))
    if lang == "cpp":
        own = (f"#include <{h}>\n" if h != "bits/stdc++.h" else _CPP_STDCXX for h in p.includes)
        parts = [_uses(p), f'#include "{name}"\n', _CPP_TESTS_BASE, *own, theirs]
        if p.using_std:
            parts.append("using namespace std;\n")
        parts += [
            _cpp_stub(i, f, library) if f.name != omit else _never(f.name) for i, f in enumerate(p.functions)
        ]
        parts.append('#line 1 "tests.cpp"\n')
    else:
        parts = [f'#include "{name}"\n', _C_TESTS_PRELUDE, *(f"#include <{h}>\n" for h in p.includes), theirs]
        parts += [_c_stub(i, f, library) for i, f in enumerate(p.functions) if f.name != omit]
        parts.append('#line 1 "tests.c"\n')
    parts.append(test_code)
    parts.append("\n")
    return "".join(parts)


def _c_handler(i: int, f: Function) -> str:
    lines = [f"static void rlf_h{i}(rlf_in *in, rlf_out *o) {{"]
    for n, p in enumerate(f.params):
        if p.type in ("char *", "const char *"):
            lines.append(f"    size_t rlf_n{n} = 0; char *rlf_a{n} = rlf_get_sn(in, &rlf_n{n});")
        else:
            lines.append(f"    {p.type} rlf_a{n} = ({p.type})rlf_get_{_c_kind(p.wire)}(in);")
    lines.append("    rlf_request_end(in);")
    call = f"{f.name}({', '.join(f'rlf_a{n}' for n in range(len(f.params)))})"
    if f.ret == "void":
        lines += [f"    {call};", "    rlf_put_byte(o, 0);"]
    else:
        lines += [f"    {f.ret} rlf_r = {call};", "    rlf_put_byte(o, 0);"]
        lines.append(f"    rlf_put_{_c_kind(f.ret_wire)}(o, rlf_r);")
    for n, p in enumerate(f.params):
        if p.type == "char *":
            lines.append(f"    rlf_put_back_s(o, rlf_a{n}, rlf_n{n});")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _same_signature(lang: str, f: Function) -> str:
    types = ", ".join(p.type for p in f.params)
    why = f'"rlfabric: the compiler reads the declaration of {f.name} otherwise than libclang did"'
    if lang == "cpp":
        return f"static_assert(::rlfabric::signature_of<{f.ret} (*)({types})>::is(&::{f.name}), {why});\n"
    proto = f"{f.ret} (*)({types or 'void'})"
    return f"_Static_assert(__builtin_types_compatible_p(__typeof__(&{f.name}), {proto}), {why});\n"


def program_source(lang: str, code: str, p: Plan) -> str:
    """The program's translation unit: the wire first (no macro of the program reaches
    it), the program with its ``main`` renamed, then the server's ``main``."""
    name = header(lang)[0]
    head = _uses(p) + (
        f'#include "{name}"\n#define main {PROGRAM_MAIN}\n#line 1 "main.{"cpp" if lang == "cpp" else "c"}"\n'
    )
    # the stubs were made from libclang's reading; where the compiler reads a declaration
    # differently (a gcc extension, a header clang misreads), the program does not compile,
    # rather than the two ends taking different types
    checks = "".join(_same_signature(lang, f) for f in p.functions)
    if lang == "cpp":
        # the function of the stub's type: a header the program includes may overload its name
        # (<bits/stdc++.h> declares libc's `truncate(const char *, off_t)` too)
        table = ", ".join(
            f"::rlfabric::fn(static_cast<{f.ret} (*)({', '.join(q.type for q in f.params)})>(&::{f.name}))"
            for f in p.functions
        )
        tail = (
            f"\n#undef main\n{checks}signed main(void) {{\n"
            f"    static const ::rlfabric::Served table[] = {{{table}}};\n"
            f"    return ::rlfabric::serve(table, {len(p.functions)});\n}}\n"
        )
    else:
        handlers = "".join(_c_handler(i, f) for i, f in enumerate(p.functions))
        table = ", ".join(f"rlf_h{i}" for i in range(len(p.functions)))
        tail = (
            f"\n#undef main\n{checks}{handlers}"
            f"signed main(void) {{\n    static rlf_handler table[] = {{{table}}};\n"
            f"    return rlf_serve(table, {len(p.functions)});\n}}\n"
        )
    return head + code + tail


# -- precompiled headers (``native_pch``) ------------------------------------------------
_ALL_USES = "".join(f"#define RLFABRIC_USES_{k.upper()} 1\n" for k in sorted({*_ONE, *_TWO} - {"pair"}))


def pch_text(side: str) -> str:
    """What a precompiled header of a ``<bits/stdc++.h>`` program's compile holds: fixed
    text only. The tests': the wire and their headers, as ``tests_source`` includes them
    (every container's overloads: the list has them all); the program's: the wire and
    ``<bits/stdc++.h>`` (its own include of it then costs nothing)."""
    wire = header("cpp")[1].decode()
    if side == "tests":
        return _ALL_USES + wire + _CPP_TESTS_BASE + _CPP_STDCXX
    return _ALL_USES + wire + "#include <bits/stdc++.h>\n"
