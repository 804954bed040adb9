"""The node's unpacked bundles: ``<root>/<hex>`` directories, evicted least recently used
first to stay under a byte budget, never while a container runs from one.

A bundle in use is *pinned*: a shared ``flock`` on its directory, held until the container
that runs from it has stopped. An eviction takes the exclusive lock without waiting, so it
skips a bundle pinned by this process or by any other process sharing the directory (the
cache is one copy per node), and it renames the directory away while it holds the lock: a
pin taken afterwards finds the path gone (or another directory there) and fetches again.
Uses touch the directory's mtime, so the LRU order survives a restart; as with the disk
tier, each process keeps its own view of the order and the total, so the budget is
enforced per process, not exactly across processes.

A bundle is unpacked beside its place, synced to the disk, marked whole (``MARKER``) and
renamed into place (``unpack_tree``); a directory at its place without the marker is never
taken for a bundle: it is moved away and unpacked again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from envpool.images import durable
from envpool.images.bundle import UNPACKED_MARKER, unpack
from envpool.images.errors import ImageError, UnsafeBundle
from envpool.images.held import remove_unless_held
from envpool.images.tiers.disk import STALE_TEMP_S

log = logging.getLogger(__name__)

_HEX_RE = re.compile(r"[0-9a-f]{64}")


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (what the budget counts)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                total += st.st_size
    return total


class UnpackedStore:
    def __init__(self, root: Path, budget_bytes: int | None):
        self.root = root
        self.budget_bytes = budget_bytes
        self._lru: OrderedDict[str, int] = OrderedDict()  # hex -> bytes, least recent first
        self._total = 0
        self._pins: dict[str, list[int]] = {}  # hex -> locked directory fds, one per pin
        self._reserved: Counter[str] = Counter()
        """Bundles being acquired here (fetched, not pinned yet): not evicted by this process
        in the loop turns between the fetch and the pin."""
        self.evictions = 0
        self.over_budget = 0
        """Times the bundles went over the budget and could not be brought under it because
        what was left was in use: once per such spell (as the warning), however often its
        evictions are tried again."""
        self._over = False
        self.blocked_elsewhere = False
        """The last eviction left the bundles over the budget and skipped one that another
        process holds (its pin, or its eviction under way): nothing here tells when that ends,
        so the cache tries again on a timer."""

    @property
    def total_bytes(self) -> int:
        return self._total

    def snapshot(self) -> dict[str, int | None]:
        return {
            "bundles": len(self._lru),
            "bytes": self._total,
            "budget_bytes": self.budget_bytes,
            "pinned": sum(len(fds) for fds in self._pins.values()),
            "evictions": self.evictions,
            "over_budget": self.over_budget,
        }

    # -- blocking: called in a thread; they read the disk and change nothing here
    def scan(self) -> list[tuple[str, int]]:
        """The whole bundles already unpacked here (a restart, a neighbour), oldest use
        first; ``prepare`` first."""
        prepare(self.root)
        found = []
        for entry in os.scandir(self.root):
            if _HEX_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                if not complete(self.root / entry.name):
                    # half written (a crash lost its data), or from before markers: not
                    # counted; gone now unless another process pins it (a get replaces it)
                    discard_incomplete(self.root / entry.name)
                    continue
                try:
                    found.append((entry.stat(follow_symlinks=False).st_mtime, entry.name))
                except FileNotFoundError:  # evicted since the listing (by a neighbour)
                    continue
        return [(name, tree_bytes(self.root / name)) for _, name in sorted(found)]

    def sized(self, hex_: str) -> int:
        """The size of a bundle this process has not seen yet (unpacked by another)."""
        return tree_bytes(self.root / hex_)

    # -- on the event loop (cheap system calls only)
    def known(self, hex_: str) -> bool:
        return hex_ in self._lru

    def added(self, hex_: str, size: int) -> None:
        self._remember(hex_, size)

    def used(self, hex_: str) -> None:
        """A get of the bundle: most recently used, here and (mtime) for a restart."""
        if hex_ in self._lru:
            self._lru.move_to_end(hex_)
        with contextlib.suppress(OSError):
            os.utime(self.root / hex_)

    def pin(self, hex_: str) -> bool:
        """Keep the bundle from eviction until ``unpin``. False if it is not there (evicted
        between the get and the pin, by this process or another): fetch it again."""
        path = self.root / hex_
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return False
        try:
            # an eviction holds the exclusive lock only while it renames the directory away
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return False
        self._pins.setdefault(hex_, []).append(fd)
        return True

    def unpin(self, hex_: str) -> None:
        fds = self._pins.get(hex_)
        if not fds:
            return
        os.close(fds.pop())  # closing the descriptor drops its lock
        if not fds:
            del self._pins[hex_]

    def pinned(self, hex_: str) -> bool:
        """Whether this process holds a pin on the bundle."""
        return bool(self._pins.get(hex_))

    def reserve(self, hex_: str) -> None:
        """Keep this process from evicting the bundle until ``unreserve`` (no lock: another
        process may still evict it before ``pin``)."""
        self._reserved[hex_] += 1

    def unreserve(self, hex_: str) -> None:
        self._reserved[hex_] -= 1
        if self._reserved[hex_] <= 0:
            del self._reserved[hex_]

    def unpin_all(self) -> None:
        for fds in self._pins.values():
            for fd in fds:
                os.close(fd)
        self._pins.clear()

    def evict(self, keep: str | None = None) -> list[Path]:
        """Take least recently used bundles out of place until the total is under the
        budget, skipping ``keep`` and pinned ones; return the renamed directories for the
        caller to delete off the event loop."""
        self.blocked_elsewhere = False
        if self.budget_bytes is None or self._total <= self.budget_bytes:
            self._over = False
            return []
        victims: list[Path] = []
        elsewhere = False
        for hex_ in list(self._lru):
            if self._total <= self.budget_bytes:
                break
            if hex_ == keep:
                continue
            taken, moved = self._take_out(hex_)
            if not taken:  # pinned here or by another process
                elsewhere = elsewhere or not (self._pins.get(hex_) or self._reserved.get(hex_))
                continue
            self._forget(hex_)
            self.evictions += 1
            if moved is not None:
                victims.append(moved)
        over = self._total > self.budget_bytes
        self.blocked_elsewhere = over and elsewhere
        if over and not self._over:
            self.over_budget += 1
            log.warning(
                "unpacked bundles hold %d bytes, over the %d-byte budget: the rest are in use",
                self._total,
                self.budget_bytes,
            )
        self._over = over
        return victims

    def _take_out(self, hex_: str) -> tuple[bool, Path | None]:
        """Rename the bundle's directory out of place under its exclusive lock: (taken, where
        it went). Not taken if it is pinned; taken with nowhere if it was gone already
        (another process sharing the directory evicted it)."""
        if self._pins.get(hex_) or self._reserved.get(hex_):
            return False, None
        path = self.root / hex_
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return True, None
        except OSError:
            return False, None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False, None
            # the prefix is the one a restart's cleanup removes when a process died mid-delete
            moved = self.root / f".tmp-evict-{hex_[:12]}-{uuid.uuid4().hex}"
            try:
                os.rename(path, moved)
            except FileNotFoundError:
                return True, None
            except OSError:
                return False, None
            return True, moved
        finally:
            os.close(fd)

    def load(self, entries: list[tuple[str, int]]) -> None:
        """Take in what ``scan`` found (on the loop: the LRU is only changed there), as less
        recently used than anything this process has used meanwhile."""
        for hex_, size in reversed(entries):  # oldest first: each goes to the front in turn
            if hex_ not in self._lru:
                self._remember(hex_, size)
                self._lru.move_to_end(hex_, last=False)

    def _remember(self, hex_: str, size: int) -> None:
        self._forget(hex_)
        self._lru[hex_] = size
        self._total += size

    def _forget(self, hex_: str) -> None:
        size = self._lru.pop(hex_, None)
        if size is not None:
            self._total -= size


def remove_all(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


# -- one load of a bundle per node


def try_lock(root: Path, hex_: str) -> int | None:
    """The node's lock on loading the bundle ``hex_`` (a descriptor for ``unlock``), or None
    while another process sharing ``root`` holds it. Cheap system calls: on the loop.

    A holder removes the lock file as it lets go (none are left behind); whoever locked the
    file just removed finds it no longer at its name, and locks the new one."""
    path = root / f".lock-{hex_}"
    while True:
        # read-only: a flock needs no more, and a file another user made is 0644 to us
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:  # removed since it was opened: not the tree at path
            pass
        os.close(fd)


def unlock(root: Path, hex_: str, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / f".lock-{hex_}")  # before the close: see try_lock
    os.close(fd)


# -- unpacking (blocking: in a thread)

MARKER = UNPACKED_MARKER
"""An empty file at the root of each unpacked bundle, written and synced last, after all its
data is on the disk: a tree at its place without it (unpacked before there were markers, or
its data lost in a crash) is taken for incomplete, moved away and unpacked again. The
containers see it; ``build_bundle`` leaves it out (the tree bundled again keeps its digest),
and a bundle holding one is refused."""

_PUBLISH_ATTEMPTS = 5
"""Tries to move an incomplete tree away from a bundle's place (another process may be at it)."""


class UnpackClosed(ImageError):
    """The cache closed while the bundle was unpacked: the unpack was abandoned."""


def complete(path: Path) -> bool:
    """Whether ``path`` holds a whole unpacked bundle (its marker; one stat)."""
    try:
        return stat.S_ISREG(os.lstat(path / MARKER).st_mode)
    except OSError:
        return False


def prepare(root: Path) -> None:
    """Make ``root``, and clear what dead processes left there."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.glob(".tmp-*"):
        # left by a process that died mid-unpack (or mid-eviction); young ones may belong
        # to a live neighbour, and may be renamed away as we look
        try:
            stale = time.time() - entry.lstat().st_mtime > STALE_TEMP_S
        except FileNotFoundError:
            continue
        if stale:
            remove_unless_held(entry)


def unpack_tree(
    root: Path,
    digest: str,
    data: bytes | BinaryIO,
    *,
    max_bytes: int | None,
    precompile: bool,
    stop: Callable[[], bool],
) -> tuple[Path, int]:
    """The bundle unpacked at ``root/<hex>``, and the bytes it takes. ``stop`` says the cache
    is closing: the unpack is abandoned (``UnpackClosed``) between its steps, and nothing is
    published after it says so."""
    final = root / digest.removeprefix("sha256:")
    if complete(final):
        return final, tree_bytes(final)
    # unpack beside the final place and rename: a directory is there whole or not at all
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[7:19]}-", dir=root))
    # held (shared, as a pin) while this unpack works on it: a neighbour's cleanup at its
    # start leaves it however old its mtime (``prepare``). Young, it is not stale before then
    try:
        held = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        fcntl.flock(held, fcntl.LOCK_SH)
        return _unpack_into(tmp, final, digest, data, max_bytes=max_bytes, precompile=precompile, stop=stop)
    finally:
        os.close(held)


def _unpack_into(
    tmp: Path,
    final: Path,
    digest: str,
    data: bytes | BinaryIO,
    *,
    max_bytes: int | None,
    precompile: bool,
    stop: Callable[[], bool],
) -> tuple[Path, int]:
    try:
        # a bundle's directories are 0755 (build_bundle), its root too: not mkdtemp's 0700,
        # which no container or sandbox of another user could enter
        tmp.chmod(0o755)
        _stop_if(stop, digest)
        unpack(data, tmp, max_bytes=max_bytes)
        if os.path.lexists(tmp / MARKER):  # it would say "whole" of a tree half written
            raise UnsafeBundle(f"bundle member {MARKER!r}: the name is the image cache's own")
        _stop_if(stop, digest)
        size = _precompile(tmp, max_bytes, stop) if precompile else tree_bytes(tmp)
        _stop_if(stop, digest)
        # the data first, then the marker that says it is there: a tree whose data a crash
        # lost has no marker either
        durable.sync_tree(tmp)
        durable.write_new(tmp / MARKER, b"")
        durable.fsync_path(tmp)
        _stop_if(stop, digest)
        if not _publish(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # another process unpacked it first
            return final, tree_bytes(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, size


def _stop_if(stop: Callable[[], bool], digest: str) -> None:
    if stop():
        raise UnpackClosed(f"the image cache closed while unpacking {digest}")


def _publish(tmp: Path, final: Path) -> bool:
    """Rename ``tmp`` to ``final``: True, or False if a whole tree is there already. An
    incomplete one there is moved away first."""
    for attempt in range(_PUBLISH_ATTEMPTS):
        try:
            os.rename(tmp, final)  # (over an empty directory too)
            return True
        except OSError:
            if complete(final):
                return False
            if not os.path.lexists(final):
                raise
        if not discard_incomplete(final) and attempt + 1 < _PUBLISH_ATTEMPTS:
            time.sleep(0.05 * 2**attempt)  # another process holds it: moving it, or pinned
    raise ImageError(
        f"{final} holds an incomplete unpacked bundle (no {MARKER}) that another process keeps "
        "(it runs a container from it, or is moving it away): try again once it has let go"
    )


def discard_incomplete(path: Path) -> bool:
    """Move away and delete what is at ``path`` unless it is a whole tree: under the tree's
    exclusive lock (not one pinned, by a process that took it whole before markers were
    written). False where another process holds the lock; True when the place is free of it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return True
    except OSError:  # a file or a link where a tree belongs: debris, nobody's pin
        fd = None
    try:
        if fd is not None and not _locked_incomplete(path, fd):
            return not os.path.lexists(path) or complete(path)
        moved = _move_away(path)
    finally:
        if fd is not None:
            os.close(fd)
    if moved is not None:
        log.warning(
            "%s has no %s (unpacked before markers, or a crash lost it): unpacked again", path, MARKER
        )
        if moved.is_dir() and not moved.is_symlink():
            shutil.rmtree(moved, ignore_errors=True)
        else:
            moved.unlink(missing_ok=True)
    return True


def _locked_incomplete(path: Path, fd: int) -> bool:
    """Whether the directory ``fd`` is still at ``path``, without a marker, and locked here
    (exclusively: pinned by nobody, moved by nobody else)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        os.stat(MARKER, dir_fd=fd, follow_symlinks=False)
        return False  # a whole tree took the place (another process's) since we looked
    except FileNotFoundError:  # still no whole tree there: this one may take the place
        pass
    try:
        return os.lstat(path).st_ino == os.fstat(fd).st_ino  # not replaced meanwhile
    except FileNotFoundError:
        return False


def _move_away(path: Path) -> Path | None:
    # the prefix is the one a restart's cleanup removes when a process died mid-delete
    moved = path.with_name(f".tmp-incomplete-{path.name[:12]}-{uuid.uuid4().hex}")
    try:
        os.rename(path, moved)
    except FileNotFoundError:
        return None
    return moved


_PRECOMPILE_TIMEOUT_S = 300.0


def _precompile(root: Path, max_bytes: int | None, stop: Callable[[], bool]) -> int:
    """Byte-compile the bundle's modules once, as it is unpacked, before any container sees
    it. A container sees its image read-only below a layer of its own
    (``envpool.isolation.private_view``), so the bytecode it writes stays in that layer and
    went with it: every container compiled the image's modules again (tens of ms for a large
    module, against a zygote fork's few). Written by the cache, never by a container: no
    container can leave bytecode that another one runs. The digest is the archive's and
    does not change; the bytes are counted with the bundle's.

    In a subprocess: compiling holds the interpreter lock, this thread's loop would stall.
    ``-I``: beside the sources, whatever ``PYTHONPYCACHEPREFIX`` says (containers look there,
    ``private_view``). A file that does not compile, or a compile that fails or runs past its
    timeout, is left to the import to compile or report: this only saves time.

    Within ``max_bytes`` (``max_unpacked_bytes``) with the bundle: bytecode can be hundreds of
    times its source (a constant folded from ``"x" * n``), and a bundle that unpacked within
    the limit took many times it. Past it, what the compile wrote goes (each container
    compiles what it imports, in its own layer). The tree's bytes, its bytecode included.
    Killed when ``stop`` says the cache is closing (``UnpackClosed``)."""
    before = None if max_bytes is None else _files_and_dirs(root)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-m", "compileall", "-q", "-q", str(root)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # its __pycache__ directories and bytecode open to every user, as the bundle is
            # (an operator's umask 077 made them 0700 and 0600: another user's container
            # compiled everything again)
            umask=0o022,
        )
    except OSError as e:
        log.warning("byte-compiling the bundle at %s failed (its containers compile it): %s", root, e)
    else:
        with proc:
            deadline = time.monotonic() + _PRECOMPILE_TIMEOUT_S
            # in short waits: a closing cache must not wait for a big bundle's compile
            while proc.poll() is None and not stop() and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                if stop():
                    raise UnpackClosed(f"the image cache closed while byte-compiling {root}")
                log.warning(
                    "byte-compiling the bundle at %s ran past %ss (its containers compile it)",
                    root,
                    _PRECOMPILE_TIMEOUT_S,
                )
    size = tree_bytes(root)
    if before is None or max_bytes is None or size <= max_bytes:
        return size
    log.warning(
        "the bundle at %s takes %d bytes with its bytecode, over max_unpacked_bytes (%d): "
        "its bytecode is dropped (its containers compile what they import)",
        root,
        size,
        max_bytes,
    )
    files, dirs = _files_and_dirs(root)
    for path in files - before[0]:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for path in sorted(dirs - before[1], key=len, reverse=True):  # the deepest first
        with contextlib.suppress(OSError):
            os.rmdir(path)
    return tree_bytes(root)


def _files_and_dirs(root: Path) -> tuple[set[str], set[str]]:
    """The paths of the files and of the directories under ``root`` (symlinks not followed)."""
    files: set[str] = set()
    dirs: set[str] = set()
    for parent, dirnames, filenames in os.walk(root):
        dirs.update(os.path.join(parent, d) for d in dirnames)
        files.update(os.path.join(parent, f) for f in filenames)
    return files, dirs
