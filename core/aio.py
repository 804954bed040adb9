"""asyncio helpers the job's parts share."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def gather_or_stop(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Every coroutine's result, in order; when one raises or the caller is cancelled, the
    others are cancelled and waited for first. ``asyncio.gather`` raises at the first error
    and leaves the rest running as orphans (an evaluation's episodes holding their sessions
    while the job shuts down, a sample's reward calls past the stream's close)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
