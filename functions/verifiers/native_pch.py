"""Precompiled headers for the C++ pair's compiles when the program includes
``<bits/stdc++.h>`` (MultiPL-E's programs all do; docs/code-verifier.md).

Parsing the library is most of both compiles. A ``.gch`` of it is 60-100 MB: too big to
copy into each run, so it lives in ``PCH_DIR``, a root-owned directory on the host that the
jail binds read-only into every run (``jail.prepare_pch_dir``). Each header is
built here, on the host, from fixed text only (the wire header, the standard headers),
never from anything of a program's, and named by the hash of that text, the compiler's
version and the flags: a program cannot write it, and what it holds is the same whatever
program is judged. gcc checks that a ``.gch`` fits the compile's flags, and reads the
header's text when it does not, so a stale one costs time, not correctness.

gcc does not check the headers a ``.gch`` reached, though, and its name covers only the
compiler's version: after a libc6-dev or libstdc++ upgrade an old one would go on giving
the old declarations. So its build records each header gcc read (its ``-MD`` list) with
its size, mtime, inode and content hash in a sidecar (``.gch.deps``), and each process
checks those once before it first hands the ``.gch`` out (a few hundred stats; the content
is hashed only where a size matches and the mtime or inode does not), building it anew
where one differs or the sidecar is missing or unreadable.

Each new version of the wire (or of the compiler) names new files, so building one also
removes the headers nobody has used for ``STALE_S`` (each process marks the ones it uses,
at most hourly) and nobody holds: a compile holds its header's shared ``flock`` from
before its compile starts to after it ends (``hold``), and the removal takes the lock
exclusively, so it never takes a file from under a compile.

The sandboxed libclang read of such a program (``cdecls.py``) starts from one too
(``clang_header``): a ``.pch`` that libclang builds here from fixed text with the read's own
arguments. libclang checks that it fits (its version, the language options, each header's
size and, where its mtime differs, its content) and refuses to parse with one that does not,
or that is truncated; ``cdecls.py`` then parses without it, so a bad one costs time, never a
declaration. Each process checks an existing one once before it first hands it out, and
builds it anew where it no longer loads (the system headers changed under it).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from functions.verifiers.jail import PCH_DIR, prepare_pch_dir

# (CDECLS, the sandboxed run's declaration reader, builds and checks libclang's headers too:
# --pch)
from functions.verifiers.native import CDECLS

__all__ = ["PCH_DIR", "STALE_S", "clang_header", "header", "hold"]

#: a header unused (by any process) this long goes when another is built
STALE_S = 24 * 3600
#: how often a process marks a header it uses as used (its mtime)
_MARK_S = 3600

_lock = threading.Lock()
_failed: set[str] = set()
_marked: dict[str, float] = {}
#: the libclang headers this process checked (``clang_header``)
_checked: set[str] = set()
#: a header's files: the text, its ``.gch`` (gcc's) or ``.pch`` (libclang's), and a build's
#: temporary copies of them
_FILE = re.compile(r"(rlfabric-[0-9a-f]{20}\.hpp)(?:\.[0-9]+\.tmp)?(?:\.gch|\.pch)?(?:\.deps)?")
#: a ``.gch``'s sidecar: the headers its build read (``_reached``)
_DEPS = ".deps"
_SUFFIXES = (".gch", ".pch", ".gch" + _DEPS)


@functools.cache
def _version(compiler: str) -> str:
    """What ``compiler --version`` says (a new compiler names new headers); ``""`` if it
    cannot be run (the build then fails too)."""
    try:
        return subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def header(text: str, compiler: str, flags: tuple[str, ...]) -> str | None:
    """The path to ``-include``, its ``.gch`` built (on first use, here: seconds), or None
    if it cannot be built. The compile that reads it must ``hold`` it."""
    key = hashlib.sha256(repr((text, compiler, _version(compiler), flags)).encode()).hexdigest()[:20]

    def build(path: str, out: str) -> bool:
        deps = out + _DEPS  # gcc's list first, then (parsed) the sidecar, in its place
        argv = [compiler, *flags, "-MD", "-MF", deps, "-x", "c++-header", path, "-o", out]
        if not _run(argv):
            Path(deps).unlink(missing_ok=True)
            return False
        try:
            reached = _reached(Path(deps).read_text(errors="surrogateescape"), skip=path)
        except (OSError, ValueError):
            reached = None
        if reached is None:  # no list to check it by: not kept (the compiles go without)
            Path(deps).unlink(missing_ok=True)
            return False
        Path(deps).write_text(json.dumps(reached))
        return True

    def check(path: str) -> bool:
        return _unchanged(path + ".gch" + _DEPS)

    return _header(key, text, ".gch", build, check)


def _reached(depfile: str, skip: str) -> list[list[str | int]] | None:
    """``[path, size, mtime_ns, inode, sha256]`` of each file in gcc's ``-MD`` list but
    ``skip`` (the header's own text: ``hold`` touches it, and its name is its hash), or None
    if the list is not one gcc wrote."""
    _, colon, rest = depfile.partition(": ")
    if not colon:
        return None
    # make's syntax: lines continued with a backslash, a space in a name escaped as "\ ",
    # "#" as "\#" and "$" as "$$"
    rest = rest.replace("\\\n", " ")
    names = [
        re.sub(r"\\([ #\\])", r"\1", n).replace("$$", "$") for n in re.findall(r"(?:\\.|[^\s\\])+", rest)
    ]
    out: list[list[str | int]] = []
    for name in names:
        full = os.path.abspath(name)
        if full == os.path.abspath(skip):
            continue
        with open(full, "rb") as f:
            st = os.fstat(f.fileno())
            digest = hashlib.sha256(f.read()).hexdigest()
        out.append([full, st.st_size, st.st_mtime_ns, st.st_ino, digest])
    return out


def _unchanged(deps: str) -> bool:
    """Whether each header a ``.gch``'s build read is as it was then (``_reached``). Where
    only its mtime or inode differs (touched, or reinstalled unchanged) its content decides,
    as libclang does for its ``.pch``."""
    try:
        reached = json.loads(Path(deps).read_text())
        for name, size, mtime_ns, ino, digest in reached:
            if not isinstance(name, str):  # (os.stat would take an int as a descriptor)
                return False
            st = os.stat(name)
            if st.st_size != size:
                return False
            if (st.st_mtime_ns, st.st_ino) != (mtime_ns, ino):
                with open(name, "rb") as f:
                    if hashlib.sha256(f.read()).hexdigest() != digest:
                        return False
    except (OSError, ValueError, TypeError):  # gone, unreadable, or no sidecar (an older build)
        return False
    return True


@functools.cache
def _clang_version() -> str:
    """The version of the libclang package this process has (another names new headers)."""
    try:
        return importlib.metadata.version("libclang")
    except importlib.metadata.PackageNotFoundError:  # no metadata: the build's check decides
        return ""


def clang_header(text: str, args: tuple[str, ...]) -> str | None:
    """The path of a header whose ``.pch`` libclang built from ``text`` with ``args`` (the
    read's own: ``-x c++`` and the rest) and that loads here, or None if it cannot be built.
    The read that uses it must ``hold(path, ..., ".pch")`` it."""
    key = hashlib.sha256(repr((text, "libclang", _clang_version(), args)).encode()).hexdigest()[:20]
    spec = json.dumps(list(args))

    def build(path: str, out: str) -> bool:
        return _run([sys.executable, str(CDECLS), "--pch", "build", path, out, spec])

    def check(path: str) -> bool:
        return _run([sys.executable, str(CDECLS), "--pch", "check", path, path + ".pch", spec])

    return _header(key, text, ".pch", build, check)


def _run(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=300, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):  # no such compiler here, or it hung
        return False


def _header(
    key: str,
    text: str,
    suffix: str,
    build: Callable[[str, str], bool],
    check: Callable[[str], bool] | None = None,
) -> str | None:
    """The text's path, its ``suffix`` file built by ``build(text path, output)``; where
    ``check`` is given, an existing one is checked once per process and built anew if it
    fails."""
    path = f"{PCH_DIR}/rlfabric-{key}.hpp"
    if os.path.exists(path + suffix) and (check is None or path in _checked):
        return path
    with _lock:
        if os.path.exists(path + suffix):
            if check is None or path in _checked:
                return path
            if check(path):
                _checked.add(path)
                return path
        if key in _failed or not prepare_pch_dir():
            return None
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(text)
        os.replace(tmp, path)
        if not build(path, tmp + suffix):
            _failed.add(key)
            Path(tmp + suffix).unlink(missing_ok=True)
            Path(tmp + suffix + _DEPS).unlink(missing_ok=True)
            Path(path).unlink(missing_ok=True)  # its name has this compiler and these flags
            Path(path + suffix).unlink(missing_ok=True)  # one that no longer loads
            Path(path + suffix + _DEPS).unlink(missing_ok=True)
            return None
        os.replace(tmp + suffix, path + suffix)
        if os.path.exists(tmp + suffix + _DEPS):
            # after the .gch: a reader between the two sees the new one with the old list,
            # which at worst makes it build again, never trust a stale one
            os.replace(tmp + suffix + _DEPS, path + suffix + _DEPS)
        _checked.add(path)
        _marked[path] = time.monotonic()
        remove_stale(keep=path)
        return path


def hold(path: str, held: contextlib.ExitStack, suffix: str = ".gch") -> bool:
    """Hold ``path`` (a shared lock on its text) until ``held`` closes: ``remove_stale``
    leaves it alone meanwhile. False: it was removed before the lock (compile without it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    held.callback(os.close, fd)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:  # still the file the path names (a removal may have come between open and lock)
        if os.stat(path).st_ino != os.fstat(fd).st_ino or not os.path.exists(path + suffix):
            return False
    except OSError:
        return False
    now = time.monotonic()
    if now - _marked.get(path, -_MARK_S) >= _MARK_S:
        with contextlib.suppress(OSError):
            os.utime(path)
        _marked[path] = now
    return True


def remove_stale(keep: str) -> list[str]:
    """Remove the headers (but ``keep``) unused for ``STALE_S`` that no compile holds, and
    what a build that died left; returns what it removed."""
    removed: list[str] = []
    old = time.time() - STALE_S
    try:
        names = os.listdir(PCH_DIR)
    except OSError:
        return removed
    for name in sorted(names):
        m = _FILE.fullmatch(name)
        path, text = f"{PCH_DIR}/{name}", f"{PCH_DIR}/{m.group(1) if m else ''}"
        if m is None or text == keep or text in _marked:  # not ours, or this process uses it
            continue
        if name != m.group(1):
            # a build's temporary (only its builder reads it, for at most 300 s), or a .gch
            # or .pch whose text is gone (no compile can -include it): they go with their text
            with contextlib.suppress(OSError):
                if (".tmp" in name or not os.path.exists(text)) and os.stat(path).st_mtime < old:
                    os.unlink(path)
                    removed.append(path)
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a compile holds it: it stays
            if os.stat(path).st_mtime < old and os.stat(path).st_ino == os.fstat(fd).st_ino:
                # the text first: a .gch whose text is gone is never read, and no build
                # replaces the text while its .gch is there
                for victim in (path, *(path + suffix for suffix in _SUFFIXES)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(victim)
                        removed.append(victim)
        except OSError:
            pass  # locked by a compile, or gone meanwhile: it stays (a later sweep tries again)
        finally:
            os.close(fd)
    return removed
