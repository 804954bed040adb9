"""Which of the program's function names the tests' link reaches in a library too.

A stub is ``static``, so it cannot define a function that a header before it declares
(``strcmp`` after ``<string.h>``: that does not compile). But test code may declare a library
function itself, without its header (``int fnmatch(const char *, const char *, int);``), and
C (and C++, for ``extern "C"``) takes that later declaration as naming a static stub before
it: a program that defined ``fnmatch`` would answer the very check that judges it. So the
stub of such a name is a variable (``native.LIBRARY_STUB``): any declaration of the name as a
function in the tests' translation unit, a header's or their own, then does not compile, and
``refusal`` says why (which of the two they mean cannot be read from their text); tests that
declare no such function (``truncate`` is libc's, but no header of theirs declares it) can
only mean the program's, and call it, in C++ (docs/code-verifier.md). Not in C: gnu17 takes a
call of an undeclared function as declaring it (C89's implicit declaration), so tests that
check with ``strverscmp(name, "x.txt")`` and no prototype mean libc's, in the very text that
would call a program's ``strverscmp``: a C program's function of a library's name is refused
(``c_refusal``) before any compile.

The probe is a link, on the host, of fixed text that refers to each name (validated
identifiers only) with the tests' driver and libraries: what the linker does not report as
undefined is a library's (libc, libm, libstdc++, the dynamic loader), exactly what the tests'
own link would reach; a name the probe's text cannot refer to counts as the library's (a
refusal, never a stub). Each answer is cached per driver and libraries.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
import threading
from collections.abc import Collection
from pathlib import Path

from functions.verifiers.native_decls import _IDENT, _QUOTED

_LOCK = threading.Lock()
_KNOWN: dict[tuple[tuple[str, ...], str], bool] = {}
_UNDEFINED = re.compile(r"undefined reference to [`'\u2018]([A-Za-z_][A-Za-z0-9_]*)['\u2019]")


def _probe(link: tuple[str, ...], names: list[str]) -> set[str]:
    """The names among ``names`` that ``link`` (a driver, then ``-l`` flags) resolves."""
    cpp = link[0].endswith("++")
    # the names as the C library spells them (``extern "C"``: unmangled), in the tests'
    # language, so that the driver adds the libraries it adds to theirs; no builtins
    # (``strcmp`` declared as char[] is only a warning then, and -w hides it)
    linkage = 'extern "C"' if cpp else "extern"
    decls = "".join(f"{linkage} char {n}[];\n" for n in names)
    refs = ", ".join(names)
    text = f"{decls}void *volatile rlfabric_refs[] = {{{refs}}};\nint main(void) {{ return 0; }}\n"
    with tempfile.TemporaryDirectory(prefix="rlfabric-link-") as d:
        src, out = Path(d) / ("probe.cpp" if cpp else "probe.c"), Path(d) / "probe"
        src.write_text(text)
        done = subprocess.run(
            [link[0], "-w", "-fno-builtin", str(src), "-o", str(out), *link[1:]],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    missing = set(_UNDEFINED.findall(done.stderr))
    if done.returncode != 0 and not missing:
        if len(names) > 1:  # one name broke the text (a C++ program's ``std``): one at a time
            return set().union(*(_probe(link, [n]) for n in names))
        # a name the probe cannot refer to is counted as the library's: refused, never stubbed
        return set(names)
    return {n for n in names if n not in missing}


def library_names(link: tuple[str, ...], names: list[str]) -> list[str]:
    """The names (in order) that a library of the tests' binary defines."""
    with _LOCK:
        todo = sorted({n for n in names if (link, n) not in _KNOWN})
    if todo:
        found = _probe(link, todo)
        with _LOCK:
            _KNOWN.update(((link, n), n in found) for n in todo)
    return [n for n in names if _KNOWN[(link, n)]]


def refusal(library: Collection[str], compiler_stderr: str) -> str | None:
    """Why tests that did not compile are refused: an error of their compile quotes one of
    ``library`` (the program's functions whose names a library defines too), whose stub is a
    variable only a declaration of the same name as a function conflicts with (``None``:
    they failed for something else, and fail as tests that do not compile)."""
    errors = " ".join(line for line in compiler_stderr.splitlines() if "error" in line)
    quoted = set(_IDENT.findall(" ".join(_QUOTED.findall(errors))))
    named = [n for n in sorted(library) if n in quoted]
    if not named:
        return None
    which = ", ".join(repr(n) for n in named)
    return (
        f"the tests call {which}, which the program defines, and declare it too as a function of a"
        " library their binary links (in a header they include, or a prototype of their own): which"
        " of the two they mean cannot be told apart"
    )


def c_refusal(library: Collection[str]) -> str | None:
    """Why C tests are refused before their compile: they call ``library`` (the program's
    functions whose names a library defines too), and C's implicit declaration makes their
    call of such a name, undeclared, the library's as much as the program's (``None``: no
    such name)."""
    if not library:
        return None
    which = ", ".join(repr(n) for n in sorted(library))
    return (
        f"the tests call {which}, which the program defines and a library their binary links"
        " defines too: C takes a call of an undeclared function as declaring the library's"
        " (an implicit declaration), so which of the two they mean cannot be told apart"
    )
