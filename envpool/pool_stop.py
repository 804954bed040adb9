"""Stopping the containers a pool gives up, and the image pins they hold.

A stop that fails is retried in the background with backoff; one that keeps failing is
handed to the runtime as leaked (its slot freed) and tried again every ``leaked_retry_s``.
A container started from a pinned image bundle keeps that pin until it has stopped for
sure, so the image cache never evicts files a running container still reads.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from envpool.errors import InfraError
from envpool.pool_config import ImageResolver, PinningImageResolver, PoolConfig
from envpool.runtimes.base import Container, Runtime

log = logging.getLogger("envpool.pool")


class ContainerStopper:
    """The pool's stops. ``spawn`` runs a coroutine as one of the pool's background tasks
    (cancelled at its close), ``kick`` tells claimers waiting for capacity that a slot may
    have freed, ``closed`` says whether the pool is closing (its runtime's close then stops
    what is left, so nothing is retried)."""

    def __init__(
        self,
        runtime: Runtime,
        config: PoolConfig,
        images: ImageResolver | None,
        metrics: Counter[str],
        *,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
        kick: Callable[[], None],
        closed: Callable[[], bool],
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.images = images
        self.metrics = metrics
        self._spawn = spawn
        self._kick = kick
        self._closed = closed
        self.pinned: dict[str, str] = {}
        """Container id -> the image digest whose unpacked bundle it runs from, pinned in the
        image cache (not evicted) until the container has stopped."""
        self._stopping_again: set[str] = set()
        """Containers whose stop failed and is being retried in the background."""
        self._leak_tried: dict[str, float] = {}  # leaked container id -> its last stop attempt

    async def stop(self, c: Container) -> None:
        """Stop a container the pool gives up; a failure is counted, not raised (the session
        or housekeeping that let it go is done with it), and retried in the background."""
        try:
            await self._stop_once(c)
        except Exception as e:
            self.metrics[f"stop_failed:{type(e).__name__}"] += 1
            if not self._closed() and c.id not in self._stopping_again:
                self._stopping_again.add(c.id)
                self._spawn(self._stop_again(c, e))
        else:
            self.unpin(c.id)

    async def stop_and_kick(self, c: Container) -> None:
        try:
            await self.stop(c)
        finally:
            self._kick()  # its slot is free: claimers waiting for capacity hear of it

    async def _stop_once(self, c: Container) -> None:
        """One stop attempt, bounded by ``stop_timeout_s``: ``Runtime.stop`` shields the stop
        it shares, so giving up here does not interrupt it; a later attempt joins it."""
        # not wait_for: on Python 3.11 it swallows a cancellation that lands as the stop
        # returns, and the cancelled caller (an aborted trajectory) would go on
        stop = asyncio.ensure_future(self.runtime.stop(c))
        try:
            await asyncio.wait((stop,), timeout=self.config.stop_timeout_s)
        except BaseException:
            if not stop.done():
                stop.cancel()  # only this wait on it: the stop itself goes on, shielded
            elif not stop.cancelled():
                stop.exception()  # retrieved: its caller is gone
            raise
        if not stop.done():
            stop.cancel()
            raise InfraError(f"stopping container {c.id} did not return in {self.config.stop_timeout_s:g} s")
        stop.result()

    async def _stop_again(self, c: Container, error: Exception) -> None:
        """Retry a failed stop with backoff and full jitter. Until it succeeds the container
        holds a slot (it may still run); once ``stop_retry.attempts`` are spent it is handed
        over as leaked (``Runtime.abandon``): it frees its slot, and the runtime's close and
        exit hook try once more. Capacity must not shrink for the rest of a run because an
        engine or API refused a few removals."""
        rc = self.config.stop_retry
        try:
            for n in range(1, rc.attempts):
                cap = min(rc.max_backoff_s, rc.initial_backoff_s * 2 ** (n - 1))
                await asyncio.sleep(random.uniform(0, cap))  # full jitter
                if c.id not in self.runtime.live:
                    return  # stopped (or given up) on another path meanwhile
                if self.runtime.stopping(c):
                    # the stop that timed out still hangs: waiting on it again for another
                    # stop_timeout_s would hold the slot attempts x that long; count it failed
                    self.metrics["stop_failed:still_stopping"] += 1
                    continue
                try:
                    await self._stop_once(c)
                except Exception as e:
                    self.metrics[f"stop_failed:{type(e).__name__}"] += 1
                    error = e
                    continue
                self.metrics["stop_retried_ok"] += 1
                self.unpin(c.id)
                return
            if self.runtime.abandon(c):
                self.metrics["containers_leaked"] += 1
                # named by what finds it by hand: a docker id, a pod name, a sandbox id, a pid
                where = c.handle if isinstance(c.handle, str) else f"pid {c.pid}"
                log.warning(
                    "envpool: gave up stopping container %s (%s runtime, %s, image %s) after %d "
                    "attempts; its pool slot is released and it is recorded as leaked (tried "
                    "again every %g s, and at the pool's close). Last error: %s: %s",
                    c.id,
                    self.runtime.kind,
                    where,
                    c.image or "built-ins",
                    rc.attempts,
                    self.config.leaked_retry_s,
                    type(error).__name__,
                    error,
                )
        finally:
            self._stopping_again.discard(c.id)
            self._kick()  # a slot may have freed up either way

    def retry_leaked(self, now: float) -> None:
        """Try the leaked containers' stops again, each every ``leaked_retry_s``: the engine
        or API that refused them may have recovered, and a remote container left running
        until the pool closes holds its node for the rest of the run. A stop of one still
        under way (hung) is not doubled."""
        leaked = self.runtime.leaked
        for cid in [k for k in self._leak_tried if k not in leaked]:
            del self._leak_tried[cid]
        for cid, c in list(leaked.items()):
            # first seen: it was given up just now, after stop_retry's attempts
            last = self._leak_tried.setdefault(cid, now)
            if now - last < self.config.leaked_retry_s or self.runtime.stopping(c):
                continue
            self._leak_tried[cid] = now
            self._spawn(self._stop_leaked(c))

    async def _stop_leaked(self, c: Container) -> None:
        try:
            await self._stop_once(c)
        except Exception as e:
            self.metrics[f"leaked_stop_failed:{type(e).__name__}"] += 1
        else:
            self.metrics["leaked_stopped"] += 1
            self.unpin(c.id)

    # ------------------------------------------------------------------ image pins
    def unpin(self, cid: str) -> None:
        """The container has stopped: its bundle may be evicted again."""
        digest = self.pinned.pop(cid, None)
        if digest is not None:
            self.release_pin(digest)

    def unpin_stopped(self) -> None:
        """Release the pins of the containers that stopped on a path that did not (a stop
        whose caller was cancelled went on); what may still run (a stop that failed, a
        leaked container) stays pinned."""
        for cid in list(self.pinned):
            if cid not in self.runtime.live and cid not in self.runtime.leaked:
                self.unpin(cid)

    def release_pin(self, digest: str) -> None:
        assert isinstance(self.images, PinningImageResolver)
        try:
            self.images.release(digest)
        except Exception as e:  # the cache's bookkeeping must not fail a stop
            self.metrics[f"unpin_failed:{type(e).__name__}"] += 1
