"""Which of the program's C++ functions the tests may mean another function by.

A stub is a non-template function of the declared type. Where the tests' headers declare
the name too (``std::size``, found through the argument's namespace; ``std::max``, through
``using namespace std``), a call the test code makes with ``std``'s in mind picks the stub
wherever it fits the arguments better than ``std``'s template does: a program's
``size_t size(vector<long>) { return 3; }`` answered ``assert(size(f(3)) == 3)``, and so the
very check that judges it. Which of the two the tests mean cannot be read from their text,
so such a name is refused (as ``native_link`` refuses a library's), unless no call of it
in the test code compiles without the program's: HumanEval-X's ``unique(vector<int>)`` and
``max_element(vector<float>)`` stay served, since ``std``'s take iterators.

The check costs nothing where no name collides: the names the tests' headers declare
(every identifier of their preprocessed text, a superset) are read once per set of headers
and cached per process (a run of ``g++ -E`` on the host, of fixed text and standard headers
only); only a function of such a name costs a syntax-only compile of the tests without its
stub (``tests_source(omit=...)``, in the sandbox), whose errors ``refusal`` reads.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import threading
from collections import OrderedDict

from functions.verifiers.native_decls import _IDENT, _NOT_CODE, _QUOTED

_LOCK = threading.Lock()
_DECLARED: dict[tuple[str, tuple[str, ...], str], frozenset[str]] = {}
#: the verdicts of earlier syntax-only compiles, by their argv and source (``checked``): the
#: same task's tests, next to programs of the same signature, are checked once
_VERDICTS: OrderedDict[bytes, str | None] = OrderedDict()
_MAX_VERDICTS = 4096
#: gcc's error line in the test code: "tests.cpp:3:16: error: ..."
_ERROR = re.compile(r"^tests\.cpp:(\d+):(\d+): error: (.*)$", re.MULTILINE)


def declared_names(compiler: str, flags: tuple[str, ...], prelude: str, include_dir: str) -> frozenset[str]:
    """The identifiers of ``prelude`` preprocessed (a superset of the names its headers
    declare), cached per compiler, flags and text. An empty set never comes back for a
    failed run: it raises ``RuntimeError`` (the worker's setup, not the program's fault)."""
    key = (compiler, flags, prelude)
    with _LOCK:
        hit = _DECLARED.get(key)
    if hit is not None:
        return hit
    done = subprocess.run(
        [compiler, *flags, "-E", "-P", "-I", include_dir, "-x", "c++", "-"],
        input=prelude,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the tests' headers could not be preprocessed: {done.stderr[-300:]}")
    names = frozenset(_IDENT.findall(done.stdout))
    with _LOCK:
        _DECLARED[key] = names
    return names


def verdict_key(argv: tuple[str, ...], name: str, source: bytes) -> bytes:
    return hashlib.sha256(repr((argv, name)).encode() + b"\0" + source).digest()


def checked(key: bytes) -> tuple[bool, str | None]:
    """Whether ``key``'s compile was checked before, and its verdict (``refusal``'s)."""
    with _LOCK:
        if key not in _VERDICTS:
            return False, None
        _VERDICTS.move_to_end(key)
        return True, _VERDICTS[key]


def remember(key: bytes, verdict: str | None) -> None:
    with _LOCK:
        _VERDICTS[key] = verdict
        while len(_VERDICTS) > _MAX_VERDICTS:
            _VERDICTS.popitem(last=False)


def _uses(name: str, test_code: str) -> tuple[int, int]:
    """How many times the test code names ``name`` where the stub may answer, outside
    comments and literals, unqualified and as ``::name``: ``v.size()``, ``p->size()`` and
    ``std::size(v)`` never reach it."""
    code = _NOT_CODE.sub(" ", test_code)
    plain = qualified = 0
    for m in re.finditer(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", code):
        before = code[max(0, m.start() - 400) : m.start()].rstrip()
        if before.endswith((".", "->")):
            continue
        if not before.endswith("::"):
            plain += 1
        elif not re.search(r"[A-Za-z0-9_>]$", before[:-2].rstrip()):  # else a namespace's or class's
            qualified += 1
    return plain, qualified


def refusal(name: str, exit_code: int | None, stderr: str, test_code: str) -> str | None:
    """Why the tests are refused, from their syntax-only compile with no stub of ``name``
    (``native._never`` in its place): it compiled (every use of it has another function),
    or fewer of their uses of ``name`` failed than there are (one of them means another
    one, and the program's would answer it), or they name it ``::name``, which without the
    stub is what their headers put in the global namespace (``using namespace std``: std's;
    the placeholder hides that from qualified lookup, so such a use is refused unseen).
    ``None``: every use of it needs the program's."""
    plain, qualified = _uses(name, test_code)
    if exit_code != 0 and not qualified:
        failed = {
            (m[1], m[2])
            for m in _ERROR.finditer(stderr)
            if name in _IDENT.findall(" ".join(_QUOTED.findall(m[3])))
        }
        if len(failed) >= plain:
            return None
    return (
        f"the tests call {name!r}, which the program defines, and their headers declare it too"
        " (std's, found through using namespace std or the arguments' namespace): the tests'"
        " text calls that one where the program's is not there, so which of the two they mean"
        " cannot be told apart (tests that mean std's can say std::"
        f"{name})"
    )
