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
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import uuid
from collections import Counter, OrderedDict
from pathlib import Path

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
        """The bundles already unpacked here (a restart, a neighbour), oldest use first."""
        found = []
        for entry in os.scandir(self.root):
            if _HEX_RE.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
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
