"""On the disk before the rename that publishes it.

A rename is a journalled change of a directory; the data of the file renamed (or of the files
in a renamed directory) may still be in the page cache only. After a power loss or a kernel
crash the journal replays the rename and the files come back empty or short: a disk tier's
blob that no longer hashes to its name (found corrupt, fetched again), an unpacked bundle with
empty files (run as it is: a broken environment). So what a rename publishes is synced first.

``fsync`` and ``syncfs`` are the only places this package asks for either: the tests count
and stand in for them here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from functools import cache


def fsync(fd: int) -> None:
    os.fsync(fd)


@cache
def _libc_syncfs() -> object | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc.syncfs
    except (OSError, AttributeError):  # not Linux (macOS has no syncfs), or no libc found
        return None


def syncfs(fd: int) -> bool:
    """syncfs(2) of the file system that holds ``fd``; False where there is no such call (not
    Linux, or a seccomp profile that refuses it)."""
    fn = _libc_syncfs()
    if fn is None:
        return False
    if fn(fd) != 0:  # type: ignore[operator]
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM):
            return False
        raise OSError(err, f"syncfs: {os.strerror(err)}")
    return True


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory by its path (no link followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def write_new(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Create the file ``path`` (nothing may be there: no link is followed) holding ``data``,
    synced before this returns."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str | os.PathLike[str]) -> None:
    """Everything written under ``root`` on the disk: one syncfs of its file system where the
    platform has one (a journal commit, however many files the tree holds), else an fsync of
    each file and directory, the deepest first."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if syncfs(fd):
            return
    finally:
        os.close(fd)
    for parent, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(parent, name)
            if stat.S_ISREG(os.lstat(path).st_mode):  # (a symlink holds no data of its own)
                fsync_path(path)
        fsync_path(parent)
