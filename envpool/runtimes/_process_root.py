"""The process runtime's root, the parent of its containers' directories, where none is
configured: made in the temp dir under a name that carries its owner's pid, locked while
that owner lives (``make_root``), and removed, with what its containers left running, once
the owner is gone (``reap_dead_roots``: a driver SIGKILLed runs nothing of its close)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from pathlib import Path

from envpool import escapees, isolation

ROOT_PREFIX = "envpool-p"  # + the owner's pid + "-" + mkdtemp's random part
ROOT_NAME = re.compile(r"envpool-p([0-9]+)-[A-Za-z0-9_]+")
OWNER_LOCK = ".owner"
"""A file in each root its owner holds an exclusive ``flock`` on while it lives: released by
the kernel when the owner dies, whatever pid namespace it (or the reaper) runs in."""
_UNLOCKED_GRACE_S = 60.0


def make_root() -> tuple[Path, int]:
    """A new root of ours, and the descriptor of its lock, held (close it to release)."""
    # made under a name the reaper does not look at, locked, then renamed to ours (the
    # lock goes with the file): a reaper never sees it unlocked (between the open and
    # the flock, one took the free lock for a dead owner's and removed the directory)
    tmp = Path(tempfile.mkdtemp(prefix=f"envpool-new-{os.getpid()}-"))
    # held while we live (close-on-exec: no container or zygote inherits it)
    fd = os.open(tmp / OWNER_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    root = tmp.with_name(f"{ROOT_PREFIX}{os.getpid()}-{tmp.name.rsplit('-', 1)[1]}")
    os.rename(tmp, root)
    return root, fd


def reap_dead_roots(tmp: Path) -> list[str]:
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(tmp):
            m = ROOT_NAME.fullmatch(entry.name)
            if m is None or not entry.is_dir(follow_symlinks=False):
                continue
            pid = int(m.group(1))
            if pid == os.getpid() or not _owner_gone(Path(entry.path), pid):
                continue
            # what its containers started that nobody swept: a fresh interpreter's container
            # dies of its driver's death at once (PR_SET_PDEATHSIG, SIGKILL), with no time to;
            # a zygote killed outright did not either. Its containers' marks are its
            # directories' (``escapees.token``): this backstop kills their processes only
            with contextlib.suppress(OSError):
                cdirs = [Path(d.path) for d in os.scandir(entry.path) if d.is_dir(follow_symlinks=False)]
                escapees.sweep({escapees.token(cdir) for cdir in cdirs})
            isolation.remove_scratch(entry.path)
            removed.append(entry.path)
    return removed


def _owner_gone(root: Path, pid: int) -> bool:
    """Whether the runtime that made ``root`` is gone: its lock is free. A pid alone is not
    proof: a driver in another pid namespace sharing this temp dir is no process we can see.
    A root without its lock file yet (just made) or from before the lock: its pid is not a
    live process and it is over a minute old."""
    try:
        fd = os.open(root / OWNER_LOCK, os.O_RDWR)
    except FileNotFoundError:
        try:
            old = time.time() - root.stat().st_mtime > _UNLOCKED_GRACE_S
        except OSError:
            return False
        return old and not _pid_exists(pid)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner lives
        return False
    finally:
        os.close(fd)  # (a lock we took goes with it)
    return True


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True
