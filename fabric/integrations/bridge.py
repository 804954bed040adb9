"""``SyncBridge``: a ``RewardAdapter`` for callers that are synchronous (a trainer's own
threads) or on another event loop. The bridge owns one event loop on a daemon thread,
started on the first call, where the adapter's ``Client`` lives; ``close()`` ends it, and an
exit backstop closes a bridge a trainer never closed. A caller that stops waiting (Ctrl-C in
``run``, a cancelled ``arun``) cancels its batch on the bridge's loop. A forked child starts
a bridge of its own.

Split from ``fabric.integrations.base`` (the adapter), which still exports ``SyncBridge``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures.thread  # registers its exit hook on import: ours, later, runs before it
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fabric.integrations.errors import BatchDeadlineError, RewardClosedError

if TYPE_CHECKING:
    from fabric.integrations.base import RewardAdapter, Sample, Score

log = logging.getLogger("fabric.integrations")

T = TypeVar("T")

#: Extra seconds the bridge waits past a batch's deadline: the client answers a call whose
#: deadline passed by itself, so this only catches a loop that stopped answering.
DEADLINE_GRACE_S = 30.0

#: Bridges started and not closed yet: closed at exit (``_close_open_bridges``).
_OPEN: set[SyncBridge] = set()
_OPEN_LOCK = threading.Lock()


def _close_open_bridges() -> None:
    """The exit backstop for a trainer that never closed its reward. It runs among the
    ``threading`` exit hooks, before ``concurrent.futures`` refuses new work: a plain
    ``atexit`` hook runs after that, when closing the local pools' workers (which waits for
    them on the loop's executor) fails with "cannot schedule new futures after interpreter
    shutdown". A non-daemon thread still scoring then sees its batch cancelled."""
    with _OPEN_LOCK:
        bridges = list(_OPEN)
    for bridge in bridges:
        bridge.close()


#: Every bridge alive, open or not: a fork may catch one between states (a thread inside
#: ``_ensure`` before it joins ``_OPEN``, or inside ``close`` after it left), lock held.
_ALL: weakref.WeakSet[SyncBridge] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # a lock held by another thread of the parent at the fork (starting or closing a
    # bridge) would never be released in the child, whose first call would wait forever
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()
    for bridge in list(_ALL):
        bridge._lock = threading.Lock()


_register_exit_hook: Any = getattr(threading, "_register_atexit", atexit.register)
_register_exit_hook(_close_open_bridges)
os.register_at_fork(after_in_child=_after_fork_in_child)


def _in_a_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """``fn()`` on a daemon thread of its own: not the caller loop's default executor, which
    ``asyncio.run`` joins at its end (a start that hangs would hold the trainer's exit)."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the awaiting caller
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class SyncBridge:
    """Runs an adapter's coroutines on a loop of its own (a daemon thread), for callers that
    are synchronous or on another loop. Thread-safe; started on first use; ``close()``
    ends it, and an exit backstop closes a bridge left open (its workers too). A
    forked child starts a bridge of its own: the parent's thread does not exist there."""

    def __init__(self, adapter: RewardAdapter, *, name: str = "fabric-bridge"):
        self.adapter = adapter
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._batches: set[asyncio.Task[Any]] = set()
        """Batches running on the loop (touched on the loop's thread only)."""
        self._closed_under: set[asyncio.Task[Any]] = set()
        """Those that ``close()`` cancelled: their callers hear ``RewardClosedError``."""
        _ALL.add(self)

    @property
    def started(self) -> bool:
        return self._loop is not None and self._pid == os.getpid()

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            return self._ensure_locked()

    def _ensure_locked(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid():  # forked: the loop's thread stayed in the parent
            self._loop, self._thread, self._pid = None, None, os.getpid()
            self._batches, self._closed_under = set(), set()
            self.adapter._client = None
        if self._loop is not None:
            return self._loop
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
        thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.adapter.start(), loop).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=5)
            loop.close()
            raise
        self._loop, self._thread = loop, thread
        with _OPEN_LOCK:
            _OPEN.add(self)
        return loop

    def _submit(self, coro: Callable[[], Coroutine[Any, Any, T]]) -> concurrent.futures.Future[T]:
        # scheduled under the lock: a close() in another thread cannot stop the loop between
        # the two, and its shutdown, scheduled after, finds the batch (the loop runs its
        # callbacks in the order they came)
        with self._lock:
            loop = self._ensure_locked()
            return asyncio.run_coroutine_threadsafe(self._batch(coro), loop)

    async def _batch(self, coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
        task = asyncio.current_task()
        assert task is not None
        self._batches.add(task)
        try:
            return await coro()
        except asyncio.CancelledError:
            if task not in self._closed_under:
                raise  # its caller stopped waiting (Ctrl-C, a cancelled arun)
            raise RewardClosedError(
                f"{self.adapter.spec.name}: the reward was closed while this batch was being scored; "
                "its calls were cancelled"
            ) from None
        finally:
            self._batches.discard(task)
            self._closed_under.discard(task)

    async def _shutdown(self) -> None:
        """Cancel the batches under way (their callers hear at once), then close the client."""
        batches = list(self._batches)
        self._closed_under.update(batches)
        for t in batches:
            t.cancel()
        await asyncio.gather(*batches, return_exceptions=True)
        await self.adapter.aclose()

    def _wait_s(self) -> float | None:
        """How long a caller waits for a batch: its deadline and the grace, or for ever when
        the client reads the deadline as none (``math.inf``, decades), as the wait cannot:
        past ``threading.TIMEOUT_MAX`` a waiting ``Future.result`` raises OverflowError."""
        from fabric.client import NO_DEADLINE_S

        deadline_s = self.adapter.config.deadline_s
        return None if deadline_s >= NO_DEADLINE_S else deadline_s + DEADLINE_GRACE_S

    def run(self, samples: Sequence[Sample]) -> list[Score]:
        """Score ``samples`` from a synchronous caller; waits at most the batch deadline."""
        payloads, held = self.adapter.prepare(samples)  # bad input raises here, in the caller's thread
        fut = self._submit(lambda: self.adapter.score_payloads(payloads, held))
        timeout = self._wait_s()
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise BatchDeadlineError(
                f"{self.adapter.spec.name}: a batch of {len(samples)} did not finish within {timeout:g} s"
            ) from None
        except BaseException:
            fut.cancel()  # Ctrl-C (KeyboardInterrupt) in the caller: the batch stops on the bridge too
            raise

    async def arun(self, samples: Sequence[Sample]) -> list[Score]:
        """Score ``samples`` from a coroutine on any event loop (the trainer's own)."""
        payloads, held = self.adapter.prepare(samples)
        if not self.started:
            # starting waits for the client (a local backend's pools): not on the caller's loop
            await asyncio.wrap_future(_in_a_thread(self._ensure, f"{self.name}-start"))
        fut = self._submit(lambda: self.adapter.score_payloads(payloads, held))
        timeout = self._wait_s()
        try:
            # not wait_for: on Python 3.11 scores that arrive in the loop turn the caller is
            # cancelled win over the cancel, and the cancelled trainer task goes on
            async with asyncio.timeout(timeout):
                return await asyncio.wrap_future(fut)
        except TimeoutError:
            raise BatchDeadlineError(
                f"{self.adapter.spec.name}: a batch of {len(samples)} did not finish within {timeout:g} s"
            ) from None

    def close(self) -> None:
        """Cancel the batches under way (their callers get ``RewardClosedError``), close the
        client (and its worker pools) and stop the loop. Idempotent; a later call starts a
        new one."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
            with _OPEN_LOCK:
                _OPEN.discard(self)
            if loop is None or self._pid != os.getpid():
                return
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=60)
            except Exception as e:  # closing must not mask why the caller is closing
                log.warning("%s: closing the fabric client failed: %s: %s", self.name, type(e).__name__, e)
            finally:
                loop.call_soon_threadsafe(loop.stop)
                if thread is not None:
                    thread.join(timeout=10)
                if not loop.is_running():
                    loop.close()
