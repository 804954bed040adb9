"""Stopping an aiohttp server in two steps: drain the requests in flight, and at a second
signal (Ctrl-C again) cancel them. aiohttp alone waits up to its shutdown timeout (60 s by
default) and gives no way to cut the wait short."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from typing import Any

#: How long after the drain's end aiohttp's own shutdown timeout fires: only a backstop.
_BACKSTOP_S = 1.0


def drain_timeout(drain_s: float) -> float:
    """aiohttp's ``shutdown_timeout`` for a drain of ``drain_s`` (0 included: aiohttp reads 0
    as no timeout at all). The drain's end is ``cleanup_within``'s timer, which cancels the
    requests left; aiohttp's timeout comes a little later. At the same moment as the timer,
    aiohttp gave up its wait for a request (cancelling the future the request's end sets) as
    the request was being cancelled: each call cut was logged as an "Unhandled exception"
    (``InvalidStateError``) with two tracebacks, which reads as a crash."""
    return drain_s + _BACKSTOP_S


class InFlight:
    """The requests an aiohttp app is answering: add ``middleware`` to the app's
    middlewares, and ``cancel()`` ends them (their clients see a dropped connection)."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()

    async def middleware(self, request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        task = asyncio.current_task()  # the request's own task (aiohttp makes one per request)
        assert task is not None
        self.tasks.add(task)
        try:
            return await handler(request)
        finally:
            self.tasks.discard(task)

    # what aiohttp's @web.middleware sets (without it, a middleware is taken for an old-style
    # factory and called with the app); set here so this module needs no aiohttp
    middleware.__middleware_version__ = 1  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.tasks)

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()


async def cleanup_within(runner: Any, drain_s: float, stop_now: Callable[[], None]) -> None:
    """``runner.cleanup()`` (an aiohttp ``AppRunner``: stop accepting, wait for the requests
    in flight) with the wait cut at ``drain_s``, when ``stop_now`` cancels what is left.

    aiohttp's ``shutdown_timeout`` alone is no such bound: it waits that long for a handler,
    then as long again after cancelling only the handler's body read, and 0 means no limit."""
    timer = asyncio.get_running_loop().call_later(drain_s, stop_now)
    try:
        await runner.cleanup()
    finally:
        timer.cancel()


class SignalStop:
    """SIGINT and SIGTERM set ``event``: the server stops accepting and drains, and a second
    one cancels what is left (``close_in_two_steps``). Made in the running loop.

    Once the server has closed, ``exit_if_signalled`` raises ``KeyboardInterrupt`` after a
    SIGINT (which the CLI makes exit 130, the shell's status for Ctrl-C, as ``fabric run`` and
    ``fabric bench`` exit): it exited 0, as if nothing had interrupted it. SIGTERM is a
    server's normal end, its supervisor's stop (systemd, Kubernetes, a job script), so it
    exits 0 after it: a 130 or 143 there reads as a failed service to systemd."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.received: str | None = None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received = sig.name
        self.event.set()

    def exit_if_signalled(self) -> None:
        if self.received == "SIGINT":
            raise KeyboardInterrupt(self.received)


async def start_unless_stopped(start: Awaitable[None], stop: asyncio.Event) -> bool:
    """Await ``start`` (a server's start-up: warm pools can take minutes) unless ``stop`` is
    set first (Ctrl-C during start-up), which cancels it: then False, and ``stop`` is left
    set. The caller closes whatever the start had begun."""
    starting = asyncio.ensure_future(start)
    waiting = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        return False
    starting.result()
    return True


async def close_in_two_steps(
    close: Awaitable[None],
    again: asyncio.Event,
    stop_now: Callable[[], None],
    on_stop_now: Callable[[], None] | None = None,
) -> None:
    """Await ``close`` (a server's drain and shutdown); if ``again`` is set first (a second
    signal), call ``on_stop_now`` then ``stop_now`` (which cancels what is in flight) and
    finish closing."""
    closing = asyncio.ensure_future(close)
    waiting = asyncio.ensure_future(again.wait())
    try:
        await asyncio.wait({closing, waiting}, return_when=asyncio.FIRST_COMPLETED)
        if not closing.done():
            if on_stop_now is not None:
                on_stop_now()
            stop_now()
    finally:
        waiting.cancel()
    await closing
