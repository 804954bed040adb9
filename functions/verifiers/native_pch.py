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

Each new version of the wire (or of the compiler) names new files, so building one also
removes the headers nobody has used for ``STALE_S`` (each process marks the ones it uses,
at most hourly) and nobody holds: a compile holds its header's shared ``flock`` from
before its compile starts to after it ends (``hold``), and the removal takes the lock
exclusively, so it never takes a file from under a compile.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import re
import subprocess
import threading
import time
from pathlib import Path

from functions.verifiers.jail import PCH_DIR, prepare_pch_dir

__all__ = ["PCH_DIR", "STALE_S", "header", "hold"]

#: a header unused (by any process) this long goes when another is built
STALE_S = 24 * 3600
#: how often a process marks a header it uses as used (its mtime)
_MARK_S = 3600

_lock = threading.Lock()
_failed: set[str] = set()
_marked: dict[str, float] = {}
#: a header's files: the text, its ``.gch``, and a build's temporary copies of both
_FILE = re.compile(r"(rlfabric-[0-9a-f]{20}\.hpp)(?:\.[0-9]+\.tmp)?(?:\.gch)?")


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
    path = f"{PCH_DIR}/rlfabric-{key}.hpp"
    if os.path.exists(path + ".gch"):
        return path
    with _lock:
        if os.path.exists(path + ".gch"):
            return path
        if key in _failed or not prepare_pch_dir():
            return None
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(text)
        os.replace(tmp, path)
        try:
            built = subprocess.run(
                [compiler, *flags, "-x", "c++-header", path, "-o", tmp + ".gch"],
                capture_output=True,
                timeout=300,
                check=False,
            ).returncode
        except (OSError, subprocess.TimeoutExpired):  # no such compiler here, or it hung
            built = -1
        if built != 0:
            _failed.add(key)
            Path(tmp + ".gch").unlink(missing_ok=True)
            Path(path).unlink(missing_ok=True)  # its name has this compiler and these flags
            return None
        os.replace(tmp + ".gch", path + ".gch")
        _marked[path] = time.monotonic()
        remove_stale(keep=path)
        return path


def hold(path: str, held: contextlib.ExitStack) -> bool:
    """Hold ``path`` (a shared lock on its text) until ``held`` closes: ``remove_stale``
    leaves it alone meanwhile. False: it was removed before the lock (compile without it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    held.callback(os.close, fd)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:  # still the file the path names (a removal may have come between open and lock)
        if os.stat(path).st_ino != os.fstat(fd).st_ino or not os.path.exists(path + ".gch"):
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
            # whose text is gone (no compile can -include it): the .gch of a text goes with it
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
                for victim in (path, path + ".gch"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(victim)
                        removed.append(victim)
        except OSError:
            pass  # locked by a compile, or gone meanwhile: it stays (a later sweep tries again)
        finally:
            os.close(fd)
    return removed
