"""C and C++ assert-style tests in a sandbox of their own (docs/code-verifier.md).

The program and its tests are two binaries that share no text and no process:

1. ``cdecls.py`` reads the program's top-level declarations with libclang, inside the
   sandbox (the source is untrusted); ``plan`` validates what it printed (untrusted too)
   and picks the functions the tests call.
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
does a function the tests call that a library of their binary defines too (``native_link``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
NATIVE = HERE / "native"
#: what the program's ``main`` becomes (it must not run: only the server's does)
PROGRAM_MAIN = "__rlfabric_program_main"

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: an operator's name (``operator<<``, ``operator""_km``, ``operator new``)
_OPERATOR = re.compile(r"operator(?![A-Za-z0-9_])")
_HEADER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./+-]{0,200}")
_SCALARS = {
    "bool",
    "char",
    "signed char",
    "unsigned char",
    "short",
    "unsigned short",
    "int",
    "unsigned int",
    "long",
    "unsigned long",
    "long long",
    "unsigned long long",
    "float",
    "double",
}
_ONE = {
    "vector": "std::vector",
    "set": "std::set",
    "unordered_set": "std::unordered_set",
    "optional": "std::optional",
}
_TWO = {"map": "std::map", "unordered_map": "std::unordered_map", "pair": "std::pair"}
_MAX_DEPTH = 16
_OTHER_KINDS = {
    "var_decl": "a variable",
    "struct_decl": "a type",
    "class_decl": "a type",
    "union_decl": "a type",
    "enum_decl": "an enum",
    "enum_constant_decl": "an enum constant",
    "typedef_decl": "a type alias",
    "type_alias_decl": "a type alias",
    "type_alias_template_decl": "a type alias",
    "namespace": "a namespace",
    "namespace_alias": "a namespace",
    "class_template": "a class template",
    "function_template": "a function template",
}


class Unsupported(Exception):
    """The tests use a declaration of the program that the channel cannot carry."""


class BadDeclarations(Exception):
    """What the sandboxed parse printed is not what ``cdecls.py`` prints (the program
    interfered with it, or it failed)."""


#: The program's includes the tests get too: the C and C++ standard library's only. Any
#: other header would let the program choose text that runs in the tests' translation unit
#: (a system header that defines NDEBUG and includes <assert.h> disables their asserts).
STANDARD_HEADERS = frozenset(
    (
        *"""algorithm any array atomic bit bitset cassert ccomplex cctype cerrno cfenv cfloat
        charconv chrono cinttypes ciso646 climits clocale cmath codecvt complex
        condition_variable csetjmp csignal cstdarg cstdbool cstddef cstdint cstdio cstdlib
        cstring ctgmath ctime cuchar cwchar cwctype deque exception execution filesystem
        forward_list fstream functional future initializer_list iomanip ios iosfwd iostream
        istream iterator limits list locale map memory memory_resource mutex new numeric
        optional ostream queue random ratio regex scoped_allocator set shared_mutex sstream
        stack stdexcept streambuf string string_view system_error thread tuple type_traits
        typeindex typeinfo unordered_map unordered_set utility valarray variant vector
        bits/stdc++.h""".split(),
        *(
            f"{h}.h"
            for h in """assert complex ctype errno fenv float inttypes iso646 limits locale math
            setjmp signal stdalign stdarg stdatomic stdbool stddef stdint stdio stdlib stdnoreturn
            string tgmath threads time uchar wchar wctype""".split()
        ),
    )
)


@dataclass(frozen=True)
class Param:
    type: str  # as the stub declares it
    wire: Any  # the validated type tree
    ref: str


@dataclass(frozen=True)
class Function:
    name: str
    ret: str
    ret_wire: Any
    params: tuple[Param, ...]


@dataclass
class Plan:
    functions: list[Function] = field(default_factory=list)
    using_std: bool = False
    #: the standard headers the program includes: in one process the tests saw them too
    includes: list[str] = field(default_factory=list)
    #: the program's other top-level names the tests' code mentions (a variable, a type), with
    #: what each is: never in the tests' translation unit, so tests that need one do not
    #: compile, and ``refusal`` then says which (a local of the tests' own compiles)
    others: dict[str, str] = field(default_factory=dict)


def refusal(p: Plan, compiler_stderr: str) -> str | None:
    """Why tests that did not compile are refused rather than failed: they need a name of
    the program that only a call can reach (``None``: gcc named none of the program's others
    it lacked, so they lack something else, and fail as tests that do not compile)."""
    if not p.others:
        return None
    # gcc quotes the name it could not find: "'n' was not declared", "unknown type name 'P'"
    quoted = set(_IDENT.findall(" ".join(_QUOTED.findall(compiler_stderr))))
    named = [n for n in p.others if n in quoted]
    if not named:  # they lack something else (the program's function): they did not compile
        return None
    which = ", ".join(f"{n!r}, {p.others[n]} of the program" for n in named)
    return (
        f"the tests use {which} (they do not compile without it); only calls of its functions"
        " can be made from a separate process"
    )


#: what gcc quotes in a diagnostic (U+2018 n U+2019 in a UTF-8 locale, 'n' in C's)
_QUOTED = re.compile(r"[\u2018'](.{1,200}?)[\u2019']")
#: what can hide a name from the tests' code: comments and string and character literals
#: (raw strings included); a ``'`` after a digit or letter is C++14's digit separator
_NOT_CODE = re.compile(
    r"""//(?:[^\n\\]|\\.)*|/\*.*?(?:\*/|$)|R"([^ ()\\\t\n]{0,16})\(.*?(?:\)\1"|$)"""
    r"""|"(?:[^"\\\n]|\\.)*"?|(?<![A-Za-z0-9_])'(?:[^'\\\n]|\\.)*'?""",
    re.DOTALL,
)


def code_names(test_code: str) -> set[str]:
    """The identifiers of the tests' code outside comments and literals: a name in a comment
    (``// candidate is add``) or a message (``"n too big"``) is no use of the program's."""
    return set(_IDENT.findall(_NOT_CODE.sub(" ", test_code)))


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


def parse_files(lang: str, code: str) -> dict[str, bytes]:
    """The files of the sandboxed run that prints the program's declarations."""
    source = "main.cpp" if lang == "cpp" else "main.c"
    std = (
        ["-x", "c++", "-std=gnu++17", "-nostdinc", "-nostdinc++"]
        if lang == "cpp"
        else ["-x", "c", "-std=gnu17", "-nostdinc"]
    )
    args = [*std, *(a for d in include_dirs(lang) for a in ("-isystem", d))]
    opts = {"source": source, "args": args, "system": include_dirs(lang)}
    return {
        "cdecls.py": (HERE / "cdecls.py").read_bytes(),
        "cdecls.json": json.dumps(opts).encode(),
        source: code.encode(),
    }


def _name(v: Any) -> str:
    if not isinstance(v, str) or len(v) > 200 or not _IDENT.fullmatch(v):
        raise BadDeclarations(f"not a name: {str(v)[:60]!r}")
    return v


def _spelling(t: Any) -> str:
    s = t.get("s") if isinstance(t, dict) else None
    return str(s)[:120] if isinstance(s, str) else "?"


def render(t: Any, lang: str, top: bool = True, depth: int = 0) -> str:
    """The type as the stub declares it; ``Unsupported`` names a type the channel cannot
    carry, ``BadDeclarations`` a tree ``cdecls.py`` would not print."""
    if depth > _MAX_DEPTH or not isinstance(t, dict):
        raise BadDeclarations("a malformed type")
    k = t.get("k")
    if k in _SCALARS:
        return "_Bool" if (k == "bool" and lang == "c") else str(k)
    if k == "cstr":
        if not top:
            raise Unsupported("a C string inside a container (who would own it?)")
        if t.get("const") is True:
            return "const char *"
        if lang == "cpp":
            raise Unsupported("char * in C++ (take const char * or std::string)")
        return "char *"
    if k == "?" or k == "&":
        raise Unsupported(f"type {_spelling(t)!r}")
    if lang != "cpp":
        raise BadDeclarations(f"a C++ type in C: {str(k)[:40]}")
    args = t.get("a", [])
    if not isinstance(args, list) or len(args) > 64:
        raise BadDeclarations("a malformed type")
    inner = [render(a, lang, False, depth + 1) for a in args]
    if k == "string" and not inner:
        return "std::string"
    if k in _ONE and len(inner) == 1:
        return f"{_ONE[k]}<{inner[0]}>"
    if k in _TWO and len(inner) == 2:
        return f"{_TWO[k]}<{inner[0]}, {inner[1]}>"
    if k == "tuple":
        return f"std::tuple<{', '.join(inner)}>"
    raise BadDeclarations(f"a malformed type: {str(k)[:40]}")


def _function(f: dict[str, Any], lang: str) -> Function:
    """One validated declaration; ``Unsupported`` says why it cannot be called apart."""
    if f.get("invalid"):
        raise Unsupported("libclang could not read its declaration (an error in or before it)")
    if f.get("variadic"):
        raise Unsupported("it takes a variable number of arguments")
    if f.get("defaults"):
        raise Unsupported("it has default arguments (their expressions would run in the tests)")
    params = f.get("params")
    if not isinstance(params, list) or len(params) > 64:
        raise BadDeclarations("malformed parameters")
    ret_t = f.get("ret")
    if isinstance(ret_t, dict) and ret_t.get("k") == "&":
        raise Unsupported(f"it returns a reference ({_spelling(ret_t)!r})")
    ret = "void" if isinstance(ret_t, dict) and ret_t.get("k") == "void" else None
    if ret is None:
        try:
            ret = render(ret_t, lang)
        except Unsupported as e:
            raise Unsupported(f"its return type: {e}") from None
        if lang == "cpp" and f.get("cret") is True:
            ret = f"const {ret}"
    out = []
    for n, p in enumerate(params, 1):
        if not isinstance(p, dict) or p.get("ref") not in ("val", "cref", "mref", "rref"):
            raise BadDeclarations("a malformed parameter")
        ref = p["ref"]
        if lang == "c" and ref != "val":
            raise BadDeclarations("a reference in C")
        t = p.get("t")
        if isinstance(t, dict) and t.get("k") == "cstr" and ref != "val":
            raise Unsupported(f"parameter {n}: a reference to a C string")
        try:
            spelled = render(t, lang)
        except Unsupported as e:
            raise Unsupported(f"parameter {n}: {e}") from None
        if ref == "cref":
            spelled = f"const {spelled} &"
        elif ref == "mref":
            spelled = f"{spelled} &"
        elif ref == "rref":
            spelled = f"{spelled} &&"
        out.append(Param(spelled, t, ref))
    return Function(_name(f.get("name")), ret, ret_t, tuple(out))


def plan(decls: Any, lang: str, test_code: str) -> Plan:
    """The functions of the program the tests call, from what ``cdecls.py`` printed.
    ``Unsupported``: the tests use a name of the program that cannot be run apart."""
    if not isinstance(decls, dict):
        raise BadDeclarations("not an object")
    functions, others = decls.get("functions"), decls.get("others")
    if not isinstance(functions, list) or not isinstance(others, list):
        raise BadDeclarations("no functions or others")
    used = code_names(test_code)
    result = Plan(using_std=decls.get("using_std") is True)
    for item in others:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], str)):
            raise BadDeclarations("a malformed name")
        # ``namespace std { ... }`` reopens the library's namespace: ``std`` is not the program's
        if isinstance(item[0], str) and item[0] in used and item[0] != "std":
            result.others.setdefault(item[0], _OTHER_KINDS.get(item[1], "a declaration"))
    by_name: dict[str, list[dict[str, Any]]] = {}
    for f in functions:
        if not isinstance(f, dict):
            raise BadDeclarations("a malformed function")
        if _OPERATOR.match(str(f.get("name"))):
            # ``operator==``: never called by name, so never served; what the tests compare
            # with is their own operator (the program's on std types would decide nothing)
            continue
        name = _name(f.get("name"))
        if name != "main" and name in used:
            by_name.setdefault(name, []).append(f)
    includes = decls.get("includes", [])
    if not isinstance(includes, list) or len(includes) > 1000:
        raise BadDeclarations("malformed includes")
    for h in includes:
        if not isinstance(h, str) or not _HEADER.fullmatch(h) or ".." in h:
            raise BadDeclarations(f"not a header name: {str(h)[:60]!r}")
        if h in STANDARD_HEADERS and h not in result.includes:
            result.includes.append(h)
    for name, decls_of in by_name.items():
        if len({json.dumps(d.get("sig")) for d in decls_of}) > 1:
            raise Unsupported(f"the tests call {name!r}, which the program overloads")
        try:
            result.functions.append(_function(decls_of[-1], lang))
        except Unsupported as e:
            raise Unsupported(f"the tests call {name!r}: {e}") from None
    return result


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


def _cpp_stub(i: int, f: Function) -> str:
    params = ", ".join(f"{p.type} a{n}" for n, p in enumerate(f.params))
    types = "".join(f", {p.type}" for p in f.params)
    args = "".join(f", std::forward<{p.type}>(a{n})" for n, p in enumerate(f.params))
    return (
        f"static {f.ret} {f.name}({params}) {{\n"
        f'    return ::rlfabric::call<{f.ret}{types}>({i}, "{f.name}"{args});\n}}\n'
    )


def _c_kind(t: Any) -> str:
    k = t["k"]
    if k == "cstr":
        return "s"
    if k in ("float", "double"):
        return "f" if k == "float" else "d"
    return "u" if k.startswith("unsigned") or k == "bool" else "i"


def _c_stub(i: int, f: Function) -> str:
    params = ", ".join(f"{p.type} a{n}" for n, p in enumerate(f.params)) or "void"
    lines = [f"static {f.ret} {f.name}({params}) {{", f"    rlf_out o = rlf_begin({i});"]
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
    return "\n".join(lines) + "\n"


#: the test code's own ``#include <...>`` lines
_TESTS_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<[A-Za-z0-9_./+-]{1,200}>", re.MULTILINE)


def tests_source(lang: str, test_code: str, p: Plan) -> str:
    """The tests' translation unit: the wire, the standard headers, a stub per function,
    then the test code (which has the file, and its line numbers, to itself).

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
        parts += [_cpp_stub(i, f) for i, f in enumerate(p.functions)]
        parts.append('#line 1 "tests.cpp"\n')
    else:
        parts = [f'#include "{name}"\n', _C_TESTS_PRELUDE, *(f"#include <{h}>\n" for h in p.includes), theirs]
        parts += [_c_stub(i, f) for i, f in enumerate(p.functions)]
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
        fn = f"decltype(&::{f.name}), {f.ret} (*)({types})"
        return f"static_assert(::rlfabric::same_signature_v<{fn}>, {why});\n"
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
        table = ", ".join(f"::rlfabric::fn(&::{f.name})" for f in p.functions)
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
