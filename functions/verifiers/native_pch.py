"""Precompiled headers for the C++ pair's compiles when the program includes
``<bits/stdc++.h>`` (MultiPL-E's programs all do; docs/code-verifier.md).

Parsing the library is most of both compiles. A ``.gch`` of it is 60-100 MB: too big to
copy into each run, so it lives in ``PCH_DIR``, a root-owned directory on the host that the
jail binds read-only into every run (``jail.prepare_pch_dir``). Each header is
built here, on the host, from fixed text only (the wire header, the standard headers),
never from anything of a program's, and named by the hash of that text and the flags: a
program cannot write it, and what it holds is the same whatever program is judged. gcc
checks that a ``.gch`` fits the compile's flags, and reads the header's text when it does
not, so a stale one costs time, not correctness.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
from pathlib import Path

from functions.verifiers.jail import PCH_DIR, prepare_pch_dir

__all__ = ["PCH_DIR", "header"]

_lock = threading.Lock()
_failed: set[str] = set()


def header(text: str, compiler: str, flags: tuple[str, ...]) -> str | None:
    """The path to ``-include``, its ``.gch`` built (on first use, here: seconds), or None
    if it cannot be built."""
    key = hashlib.sha256(repr((text, compiler, flags)).encode()).hexdigest()[:20]
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
        return path
