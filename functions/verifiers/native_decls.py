"""The program's declarations, as the sandboxed parse printed them, validated and read
into a ``Plan``: which of its functions the tests call, with the types their stubs declare,
and which of its other names the tests' code mentions (``native``'s steps 1 and 2: see its
docstring; ``native`` re-exports these names).

Everything here is untrusted input (the program chose its declarations, and could have
interfered with the parse): a tree ``cdecls.py`` would not print is ``BadDeclarations``; a
declaration the channel cannot carry soundly is ``Unsupported``, which says which.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

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
