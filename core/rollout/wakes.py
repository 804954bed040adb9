"""Waits the LLM proxy ends early, by what ends them.

    wakes = Wakes()
    try:
        await wakes.wait([("slot", id(replica))], scheduler.admit(...))
    except Woken:
        ...                         # the replica broke while the turn waited: look again
    wakes.wake(("slot", id(replica)))   # elsewhere: its recovery began

A wait is a cancel scope (``asyncio.timeout(None)``) filed under each of its keys; ``wake``
expires the scopes of a key, so the awaited call is cancelled (it cleans up as on any
cancellation) and ``wait`` raises ``Woken``. The proxy files the calls running on a replica
(its drop ends them), the turns waiting for a slot on it (its recovery or drop ends them)
and the turns of a trajectory waiting for a recovery (its abort ends them).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Hashable, Iterable
from typing import TypeVar

T = TypeVar("T")


class Woken(Exception):
    """A wait was ended by ``Wakes.wake`` of one of its keys."""


class Wakes:
    def __init__(self) -> None:
        self._scopes: dict[Hashable, set[asyncio.Timeout]] = {}

    async def wait(self, keys: Iterable[Hashable], aw: Awaitable[T]) -> T:
        """``await aw``; ``Woken`` if one of ``keys`` is woken first."""
        keys = list(keys)
        scope = asyncio.timeout(None)
        for key in keys:
            self._scopes.setdefault(key, set()).add(scope)
        try:
            async with scope:
                return await aw
        except TimeoutError:
            if scope.expired():  # (the scope has no deadline: only a wake expires it)
                raise Woken from None
            raise
        finally:
            for key in keys:
                scopes = self._scopes.get(key)
                if scopes is not None:
                    scopes.discard(scope)
                    if not scopes:
                        del self._scopes[key]

    def wake(self, key: Hashable) -> int:
        """End the waits filed under ``key``; how many there were."""
        scopes = self._scopes.pop(key, set())
        if scopes:
            now = asyncio.get_running_loop().time()
            for scope in scopes:
                if not scope.expired():  # woken under another key already (no second change)
                    scope.reschedule(now)
        return len(scopes)

    def waiting(self, key: Hashable) -> bool:
        return bool(self._scopes.get(key))
