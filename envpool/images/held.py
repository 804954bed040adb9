"""Temporary files and trees a writer holds while it works on them, and the cleanup that
leaves those alone.

A disk tier's blob is written to a ``.tmp-*`` file, a bundle unpacked into a ``.tmp-*``
directory, each renamed into place when whole. A process that died half-way leaves its temp
behind, and a start sweeps the old ones; but an old mtime alone does not say its writer is
dead (one stalled in its fsync, its process stopped, a long extraction whose top directory's
entries were made at its start). So a writer holds a shared ``flock`` on its temp for as long
as it works on it, and the sweep removes only a temp it can lock exclusively.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path


def remove_unless_held(path: Path) -> None:
    """Delete the temp file or tree at ``path`` unless a live writer holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone meanwhile, or a link: nobody's to hold
        _remove(path)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # held: its write is under way
        _remove(path)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
