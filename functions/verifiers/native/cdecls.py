"""The top-level declarations of a C or C++ program, read by libclang inside the sandbox.

``functions.verifiers.native`` runs this file as a sandboxed run (Python mode, the
compiler's limits) with the program beside it, and reads one JSON object from its stdout:

    {"using_std": bool,                       a top-level ``using namespace std;``
     "functions": [{"name", "ret", "params": [{"t", "ref"}], "sig", "variadic", "defaults",
                    "why"}],                   every top-level function declaration
     "others": [[name, kind], ...],            every other top-level name (types, variables,
                                               namespaces, templates; not macros: they never
                                               reach the tests, whose own names they are)
     "includes": [name, ...]}                  the system headers it includes (``<vector>``)

A type is ``{"k": kind, "a": [type, ...]}``: ``int`` and the other scalars by their C name,
``cstr`` (``char *``; ``"const": true`` for ``const char *``), ``string``, ``vector``,
``set``, ``map``, ``unordered_set``, ``unordered_map``, ``pair``, ``tuple``, ``optional``,
``void``; anything else is ``{"k": "?", "s": its spelling}``. ``ref`` is ``val``, ``cref``,
``mref`` (a non-const lvalue reference) or ``rref``.

Why libclang, not the DWARF of a ``-g`` object (pyelftools) or text processing: the stubs
need each declaration as the compiler sees it after macros and typedefs (``#define int long
long``, ``using ll = long long``), with template arguments as types; a C/C++ front end is the
only thing that has them, and libclang's canonical types give them directly. DWARF would
only describe functions that were emitted (not inline or unused ones), and spells template
types as strings to parse again. The source is untrusted: this runs in the sandbox (no
network, the read-only jail, CPU, memory and wall limits), and the host takes its output as
untrusted too (``native.plan`` validates every field and renders the types itself).

``cdecls.json`` may name a precompiled header of ``<bits/stdc++.h>`` (``"pch"``, built on
the host by ``native_pch.clang_header``, which runs this file with ``--pch``): the library
then comes first, as in the program's compile with gcc's (``native_pch``), and the parse
costs a tenth (the sandboxed read a quarter: Python and libclang start as before). It is
only a speed-up: where libclang cannot load it (another version, other flags, a truncated
file, headers changed since), where anything outside the program's text has an error with
it, or where the program does not include ``<bits/stdc++.h>`` after all (gcc compiles it
without its header then), the program is parsed again without it.
"""

from __future__ import annotations

import json
import sys

#: The exit status when libclang cannot be imported: the worker's setup, not the program
#: (``native.NO_LIBCLANG``; nothing in the program's text can make libclang exit with it
#: and print the line below, which only this file writes).
NO_LIBCLANG = 87

try:
    import clang.cindex as ci
except ImportError as e:  # pragma: no cover - only where the sandbox's Python lacks it
    sys.stderr.write(f"rlfabric: libclang cannot be imported: {e}\n")
    sys.exit(NO_LIBCLANG)

SCALARS = {
    ci.TypeKind.BOOL: "bool",
    ci.TypeKind.CHAR_S: "char",
    ci.TypeKind.CHAR_U: "char",
    ci.TypeKind.SCHAR: "signed char",
    ci.TypeKind.UCHAR: "unsigned char",
    ci.TypeKind.SHORT: "short",
    ci.TypeKind.USHORT: "unsigned short",
    ci.TypeKind.INT: "int",
    ci.TypeKind.UINT: "unsigned int",
    ci.TypeKind.LONG: "long",
    ci.TypeKind.ULONG: "unsigned long",
    ci.TypeKind.LONGLONG: "long long",
    ci.TypeKind.ULONGLONG: "unsigned long long",
    ci.TypeKind.FLOAT: "float",
    ci.TypeKind.DOUBLE: "double",
    ci.TypeKind.VOID: "void",
}
#: std templates and how many of their leading template arguments are the value's types
#: (the rest are allocators, comparators, hashers: the defaults, checked below)
STD = {
    "vector": 1,
    "set": 1,
    "unordered_set": 1,
    "map": 2,
    "unordered_map": 2,
    "pair": 2,
    "optional": 1,
    "tuple": -1,
}
DEFAULTS = {"allocator", "less", "hash", "equal_to", "char_traits"}


def std_name(decl: ci.Cursor) -> str | None:
    """``vector`` for ``std::vector`` (inline namespaces such as ``__cxx11`` skipped)."""
    parent = decl.semantic_parent
    # the library's own inline namespaces (``std::__cxx11::basic_string``): reserved names
    while parent is not None and parent.kind == ci.CursorKind.NAMESPACE and parent.spelling.startswith("__"):
        parent = parent.semantic_parent
    if parent is None or parent.kind != ci.CursorKind.NAMESPACE or parent.spelling != "std":
        return None
    grand = parent.semantic_parent
    while grand is not None and grand.kind == ci.CursorKind.LINKAGE_SPEC:  # libstdc++'s extern "C++"
        grand = grand.semantic_parent
    if grand is None or grand.kind != ci.CursorKind.TRANSLATION_UNIT:
        return None
    return str(decl.spelling)


def describe(t: ci.Type) -> dict:
    t = t.get_canonical()
    if t.kind in SCALARS:
        return {"k": SCALARS[t.kind]}
    if t.kind == ci.TypeKind.POINTER:
        p = t.get_pointee()
        if p.get_canonical().kind in (ci.TypeKind.CHAR_S, ci.TypeKind.CHAR_U):
            return {"k": "cstr", "const": p.is_const_qualified()}
    if t.kind in (ci.TypeKind.RECORD, ci.TypeKind.ELABORATED):
        name = std_name(t.get_declaration())
        n = t.get_num_template_arguments()
        args = [t.get_template_argument_type(i) for i in range(max(n, 0))]
        if name == "basic_string" and args and args[0].get_canonical().kind == ci.TypeKind.CHAR_S:
            return {"k": "string"}
        if name in STD and n >= 0:
            keep = len(args) if STD[name] < 0 else STD[name]
            if len(args) >= keep and all(
                std_name(a.get_canonical().get_declaration()) in DEFAULTS for a in args[keep:]
            ):
                return {"k": name, "a": [describe(a) for a in args[:keep]]}
    return {"k": "?", "s": t.spelling}


def param(t: ci.Type) -> dict:
    t = t.get_canonical()
    if t.kind == ci.TypeKind.LVALUEREFERENCE:
        p = t.get_pointee()
        return {"t": describe(p), "ref": "cref" if p.is_const_qualified() else "mref"}
    if t.kind == ci.TypeKind.RVALUEREFERENCE:
        return {"t": describe(t.get_pointee()), "ref": "rref"}
    return {"t": describe(t), "ref": "val"}


def function(c: ci.Cursor, errors: list[int] | None) -> dict:
    """``errors``: the lines of the file with an error (None: the system headers had one).
    clang reads a type it could not resolve as ``int``: such a declaration is ``invalid``."""
    first, last = c.extent.start.line, c.extent.end.line
    bad = errors is None or any(first <= line <= last for line in errors)
    ft = c.type
    ret = ft.get_result().get_canonical()
    out = {
        "name": c.spelling,
        "sig": ft.get_canonical().spelling,
        "ret": {"k": "&", "s": ret.spelling}
        if ret.kind in (ci.TypeKind.LVALUEREFERENCE, ci.TypeKind.RVALUEREFERENCE)
        else describe(ret),
        "params": [param(a.type) for a in c.get_arguments()],
        "variadic": ft.kind == ci.TypeKind.FUNCTIONPROTO and ft.is_function_variadic(),
        # a default argument would have to be copied into the tests (and run there)
        "defaults": any(any(ch.kind.is_expression() for ch in a.get_children()) for a in c.get_arguments()),
        "noproto": ft.kind == ci.TypeKind.FUNCTIONNOPROTO,
        # `const std::string f()`: part of the function's type in C++
        "cret": ret.is_const_qualified(),
        "invalid": bad,
    }
    return out


PARSE = ci.TranslationUnit.PARSE_SKIP_FUNCTION_BODIES | ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD
#: a precompiled header records each header's content hash too: where only its mtime differs
#: (the host marks the header's text as used), the content decides
PCH_FLAGS = ["-fpch-validate-input-files-content"]
#: what the program must include for its precompiled header to be used (``native_pch``)
PCH_INCLUDE = "bits/stdc++.h"


def only_in(tu: ci.TranslationUnit, source: str) -> bool:
    """Whether every error of ``tu`` is in ``source`` (none in a header, none nowhere)."""
    for d in tu.diagnostics:
        if d.severity >= ci.Diagnostic.Error and (d.location.file is None or d.location.file.name != source):
            return False
    return True


#: the line on stderr saying which read it was, where ``cdecls.json`` names a precompiled
#: header: only a note (the host never acts on it; the tests and the benchmark check with it
#: that the header was used, since the output is the same either way)
PCH_USED = "rlfabric: read after the precompiled header"
PCH_SKIPPED = "rlfabric: read without the precompiled header"


def with_pch(index: ci.Index, source: str, args: list[str], pch: str) -> ci.TranslationUnit | None:
    """``source`` parsed after the precompiled header ``pch``, or None where that fails."""
    try:
        tu = index.parse(source, args=[*args, *PCH_FLAGS, "-include-pch", pch], options=PARSE)
    except ci.TranslationUnitLoadError:  # libclang would not load it: a fatal error
        return None
    # (an error in a header: "Too many open files" among them, as libclang keeps each header
    # open that it looks up and skips until the parse is disposed of: native.PCH_READ_NOFILE)
    return tu if only_in(tu, source) else None


def pch(mode: str, header: str, out: str, args: list[str]) -> int:
    """``--pch build``: build ``out`` from ``header`` (fixed text) with the read's ``args``;
    ``--pch check``: whether ``out`` loads. 0 where it (then) loads and parses clean."""
    index = ci.Index.create()
    if mode == "build":
        # the header's language: ``-x c++-header`` where the read says ``-x c++``
        hargs = [f"{a}-header" if i and args[i - 1] == "-x" else a for i, a in enumerate(args)]
        try:
            tu = index.parse(
                header, args=[*hargs, *PCH_FLAGS], options=PARSE | ci.TranslationUnit.PARSE_INCOMPLETE
            )
        except ci.TranslationUnitLoadError:
            return 1
        if any(d.severity >= ci.Diagnostic.Error for d in tu.diagnostics):
            return 1
        tu.save(out)
    probe = "rlfabric-pch-check.cpp"
    try:
        tu = index.parse(
            probe,
            args=[*args, *PCH_FLAGS, "-include-pch", out],
            unsaved_files=[(probe, "int rlfabric_pch_check;\n")],
            options=PARSE,
        )
    except ci.TranslationUnitLoadError:
        return 1
    return 1 if any(d.severity >= ci.Diagnostic.Error for d in tu.diagnostics) else 0


def main() -> None:
    with open("cdecls.json", encoding="utf-8") as f:
        opts = json.load(f)
    source = opts["source"]
    index = ci.Index.create()
    system = tuple(d.rstrip("/") + "/" for d in opts["system"])
    tu = with_pch(index, source, opts["args"], opts["pch"]) if opts.get("pch") else None
    if tu is not None:
        result = read(tu, source, system)
        if PCH_INCLUDE in result["includes"]:
            sys.stderr.write(PCH_USED + "\n")
            sys.stdout.write(json.dumps(result))
            return
    if opts.get("pch"):
        why = "libclang could not use it" if tu is None else "the program does not include the library"
        sys.stderr.write(f"{PCH_SKIPPED}: {why}\n")
    # the files the first parse holds open (see with_pch) are closed with it, before the second
    del tu
    tu = index.parse(source, args=opts["args"], options=PARSE)
    sys.stdout.write(json.dumps(read(tu, source, system)))


def read(tu: ci.TranslationUnit, source: str, system: tuple[str, ...]) -> dict:
    """What this file prints (above) of the parsed program."""
    result: dict = {"using_std": False, "functions": [], "others": [], "includes": []}
    errors: list[int] | None = []
    for d in tu.diagnostics:
        if d.severity < ci.Diagnostic.Error:
            continue
        where = d.location.file
        if where is not None and where.name == source and errors is not None:
            errors.append(d.location.line)
        else:  # in a header, or nowhere: any type may have been misread
            errors = None

    def walk(cursor: ci.Cursor) -> None:
        for c in cursor.get_children():
            if c.location.file is None or c.location.file.name != source:
                continue
            kind = c.kind
            if kind == ci.CursorKind.LINKAGE_SPEC or (kind == ci.CursorKind.NAMESPACE and not c.spelling):
                walk(c)  # extern "C" { ... } and namespace { ... }: their names are the file's
            elif kind == ci.CursorKind.FUNCTION_DECL:
                result["functions"].append(function(c, errors))
            elif kind == ci.CursorKind.USING_DIRECTIVE:
                ns = [r for r in c.get_children() if r.kind == ci.CursorKind.NAMESPACE_REF]
                if ns and ns[0].spelling == "std":
                    result["using_std"] = True
            elif kind == ci.CursorKind.INCLUSION_DIRECTIVE:
                included = c.get_included_file()
                if included is not None and included.name.startswith(system):
                    result["includes"].append(c.spelling)
            elif c.spelling and kind not in (
                ci.CursorKind.MACRO_INSTANTIATION,
                ci.CursorKind.MACRO_DEFINITION,
            ):
                result["others"].append([c.spelling, kind.name.lower()])
                if kind == ci.CursorKind.ENUM_DECL:
                    for e in c.get_children():
                        result["others"].append([e.spelling, "enum_constant_decl"])

    walk(tu.cursor)
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pch"]:  # on the host, from native_pch: never in the sandbox
        sys.exit(pch(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])))
    main()
