"""The cache of the math reward's pure string functions (``canonical``, ``unit_key``,
``shape``): ``lru_cache`` for short arguments only."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, wraps
from typing import TypeVar

_CACHE_KEY_MAX = 256
"""Longer strings bypass the caches: answers are policy-controlled, and 65536 cached 1 MB
answers would hold gigabytes."""

_T = TypeVar("_T")


def _small_cache(fn: Callable[[str], _T]) -> Callable[[str], _T]:
    """``lru_cache`` for short arguments only (see ``_CACHE_KEY_MAX``)."""
    cached = lru_cache(maxsize=65536)(fn)

    @wraps(fn)
    def call(s: str) -> _T:
        return cached(s) if len(s) <= _CACHE_KEY_MAX else fn(s)

    return call
