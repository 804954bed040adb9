"""SIGTERM stops a command's main coroutine as Ctrl-C does (``KeyboardInterrupt``), so what
it started is stopped on the way out.

Left alone, SIGTERM (``kill``, a scheduler's stop, a pod's deletion) ends the process on the
spot: no ``finally`` and no ``async with`` exit runs, and temp dirs, containers and workers
are left behind; under Ray it meets the handler Ray's core worker installs, which prints a
C stack trace and kills the process. For the commands' main coroutines: ``fabric bench``,
``envpool bench`` (which imports it only as a bench starts: envpool does not otherwise
depend on fabric) and ``fabric run``'s job (``core.job``).
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class TermAsInterrupt:
    """While the coroutine that enters it runs, SIGTERM cancels that coroutine's task.

    Installed only from the main thread over the default disposition (an application that
    handles SIGTERM itself keeps its handler); put back as it was on the way out. A second
    SIGTERM while the task stops is ignored: SIGKILL is the way to skip the shutdown. Call
    ``reinstall`` after something replaced the handler (``ray.init`` does)."""

    def __init__(self) -> None:
        self.received = False
        self._installed = False
        self._task: asyncio.Task[Any] | None = None

    def __enter__(self) -> TermAsInterrupt:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._task = asyncio.current_task()
            self._installed = True
            self.reinstall()
        return self

    def reinstall(self) -> None:
        if self._installed:
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._on_term)

    def _on_term(self) -> None:
        if not self.received and self._task is not None:
            self.received = True
            self._task.cancel()

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)  # back to SIG_DFL


async def term_as_interrupt(run: Callable[[TermAsInterrupt], Awaitable[T]]) -> T:
    """``await run(term)``; a SIGTERM meanwhile cancels it, and once it has stopped what it
    started, raises ``KeyboardInterrupt("SIGTERM")`` (what the CLI does for Ctrl-C)."""
    with TermAsInterrupt() as term:
        try:
            return await run(term)
        except asyncio.CancelledError:
            if term.received:
                raise KeyboardInterrupt("SIGTERM") from None
            raise
        except SystemExit as e:
            # a handler put in place of ours took it, before ``reinstall`` (ray.init installs
            # its sys.exit(15) as it starts, seconds before it returns): the same stop, with
            # what it unwound run on the way out
            if term._installed and e.code == signal.SIGTERM:
                raise KeyboardInterrupt("SIGTERM") from None
            raise
