"""A segment tree over a ring of time slots: the occupancy index of the cyclic-horizon
placement (``core.sched.horizon``)."""

from __future__ import annotations

_NEG = -(1 << 62)


class SegmentTree:
    """Range add and range max over slots ``[0, size)``. A lazy tag stays on the node it was
    added to and is re-added on the way up (addition distributes over max), so updates and
    queries are O(log size) and nothing is ever pushed down."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a segment tree needs >= 1 slot, got {size}")
        self.size = size
        self._max = [0] * (4 * size)
        self._tag = [0] * (4 * size)

    def _check(self, lo: int, hi: int) -> None:
        if not 0 <= lo <= hi <= self.size:
            raise ValueError(f"range [{lo}, {hi}) is not inside [0, {self.size})")

    def add(self, lo: int, hi: int, value: int) -> None:
        """Add ``value`` to every slot of ``[lo, hi)``."""
        self._check(lo, hi)
        if lo < hi:
            self._add(1, 0, self.size, lo, hi, value)

    def max(self, lo: int, hi: int) -> int:
        """The largest slot of ``[lo, hi)`` (which must not be empty)."""
        self._check(lo, hi)
        if lo == hi:
            raise ValueError("the max of an empty range is undefined")
        return self._query(1, 0, self.size, lo, hi)

    def _add(self, i: int, nlo: int, nhi: int, lo: int, hi: int, v: int) -> None:
        if lo <= nlo and nhi <= hi:
            self._max[i] += v
            self._tag[i] += v
            return
        mid = (nlo + nhi) // 2
        if lo < mid:
            self._add(2 * i, nlo, mid, lo, hi, v)
        if mid < hi:
            self._add(2 * i + 1, mid, nhi, lo, hi, v)
        self._max[i] = max(self._max[2 * i], self._max[2 * i + 1]) + self._tag[i]

    def _query(self, i: int, nlo: int, nhi: int, lo: int, hi: int) -> int:
        if lo <= nlo and nhi <= hi:
            return self._max[i]
        mid = (nlo + nhi) // 2
        best = _NEG
        if lo < mid:
            best = self._query(2 * i, nlo, mid, lo, hi)
        if mid < hi:
            best = max(best, self._query(2 * i + 1, mid, nhi, lo, hi))
        return best + self._tag[i]


def arcs(start: int, length: int, horizon: int) -> list[tuple[int, int]]:
    """``[start, start + length)`` on a ring of ``horizon`` slots as at most two plain
    ``[lo, hi)`` intervals (the part past the end wraps to 0)."""
    if length < 0:
        raise ValueError(f"an interval's length must be >= 0, got {length}")
    if length > horizon:
        raise ValueError(f"an interval of {length} slots does not fit on a ring of {horizon}")
    if length == 0:
        return []
    s = start % horizon
    if s + length <= horizon:
        return [(s, s + length)]
    return [(s, horizon), (0, s + length - horizon)]
