"""``InprocessTools``: the default tool bridge of a pool, on threads of its own.

A tool may block, so it runs in a thread. On the loop's default executor (as
``asyncio.to_thread`` runs it) a hung tool held a thread for good, one more on every retry
of its step, until the image cache and the docker runtime, which use that executor too,
starved. Here the pool's tools have a bounded executor of their own, closed with the pool,
and each call a time limit: the function's ``timeout_s`` or the time its step has left,
whichever is less."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import Counter
from typing import Any

from envpool.api import inprocess_tool_caller
from envpool.errors import ToolUnavailable


class InprocessTools:
    """Runs registered ``@fabric.tool`` functions (of ``fabric.default_registry``) in this
    process, on at most ``threads`` threads; counts into ``metrics`` (the pool's):

    * ``tool_timeouts``: calls answered with an error at their time limit;
    * ``tool_threads_stuck``: threads still running such a call. A thread cannot be
      killed: it runs on until its tool returns (its result discarded), and holds one of
      ``threads`` meanwhile, and the interpreter waits for it at exit;
    * ``tool_calls_unstarted``: calls that found no free thread in their time (or had none)."""

    def __init__(self, threads: int = 32, metrics: Counter[str] | None = None):
        self.threads = threads
        self.metrics: Counter[str] = metrics if metrics is not None else Counter()
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="envpool-tool")

    async def __aenter__(self) -> InprocessTools:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop taking calls; calls waiting for a thread are dropped, a stuck one runs on."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, name: str, arguments: dict[str, Any], *, deadline_s: float | None = None) -> str:
        limit = deadline_s
        timeout_s = _timeout_s(name)
        if timeout_s is not None and (limit is None or timeout_s < limit):
            limit = timeout_s
        if limit is not None and limit <= 0:
            # its step's time is spent (an earlier call used it): submitted, a free thread
            # ran it at once and its answer was a "ran past 0 s" error for the policy; the
            # fabric bridge sends such a call nowhere either
            self.metrics["tool_calls_unstarted"] += 1
            raise ToolUnavailable(f"tool {name!r} not run: no time left in its step")
        cf = self._executor.submit(inprocess_tool_caller, name, arguments)
        fut = asyncio.wrap_future(cf)
        try:
            # not wait_for: a cancelled wait must not cancel a call that is running
            await asyncio.wait((fut,), timeout=limit)
        except asyncio.CancelledError:
            cf.cancel()  # (one not started yet never runs; one running runs on, unread)
            fut.add_done_callback(_consume)
            raise
        if fut.done():
            return fut.result()  # (a ToolUnavailable of the tool's raised here)
        if not cf.done() and cf.cancel():  # still waiting for a thread: it never ran
            self.metrics["tool_calls_unstarted"] += 1
            assert limit is not None
            busy = self.metrics["tool_threads_stuck"]
            raise ToolUnavailable(
                f"tool {name!r} could not start in {limit:.3g} s: no free tool thread of {self.threads} "
                f"({busy} held by tools that ran past their time)"
            )
        fut.add_done_callback(_consume)
        if cf.done():  # (done as the wait ended, its answer not yet passed to the loop)
            return cf.result()
        assert limit is not None
        self.metrics["tool_timeouts"] += 1
        self.metrics["tool_threads_stuck"] += 1
        loop = asyncio.get_running_loop()
        cf.add_done_callback(lambda _: _call_soon(loop, self._unstuck))
        return (
            f"error: tool {name!r} ran past its {limit:.3g} s time limit and was given up "
            "(its result will be discarded)"
        )

    def _unstuck(self) -> None:
        self.metrics["tool_threads_stuck"] -= 1


def _timeout_s(name: str) -> float | None:
    import fabric

    spec = fabric.default_registry.find(name)
    return None if spec is None else float(spec.timeout_s)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop has closed: nobody reads the count any more
        pass


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # (read: a late failure of a call given up is not logged as unretrieved)
