"""How the gateway runs a call once its request is read: the tenant's quota slot (taken by
the route) and a slot of the function's fair gate, held while the call may run and given
back when it no longer does; an ``Event`` call on a task of its own.

The gateway is built in layers, each in a module on the one before: this one, the HTTP
routes (``_routes.GatewayRoutes``), and the lifecycle (``app.Gateway``). The gateway's state
is declared here, so that each layer type-checks on its own, and set in ``Gateway.__init__``.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fabric.backends.base import Backend
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry
from fabric.serve.config import ServeConfig
from fabric.serve.gate import FairGate, Quotas
from fabric.serve.metrics import ServeMetrics

log = logging.getLogger("fabric.serve")

#: Answers a backend may give while the call still runs: at the caller's deadline, and at
#: timeout_s where the run cannot be stopped (an inproc thread; the local pool kills the worker)
_MAY_RUN_ON = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.TIMEOUT})


def _shown(text: str, limit: int = 200) -> str:
    """A caller's text in a log line: an envelope's ``request_id``, an error message that
    echoes the payload. Its own newlines forged whole lines (another tenant's, the server's),
    and a megabyte of it was a megabyte of log: control characters escaped, cut at ``limit``."""
    if len(text) <= limit and text.isprintable():
        return text
    shown = repr(text[:limit])[1:-1]
    return shown if len(text) <= limit else f"{shown}... ({len(text):,} characters)"


class StoppedBeforeRun(Exception):
    """The server stopped (the drain's end, a second Ctrl-C) while the call still waited for
    room in its function's pool: it never reached the backend, so it did not run."""


class GatewayCalls:
    """Calls through their gates to the backend and back (see the module docstring)."""

    config: ServeConfig
    registry: Registry
    backend: Backend
    quotas: Quotas
    metrics: ServeMetrics
    _gates: dict[str, FairGate]
    _events: set[asyncio.Task[None]]
    _running_on: set[asyncio.Future[None]]
    """When each call given up on that still runs (a hang-up, a deadline) ends its run: the
    gateway's ``inflight`` counts them, and its drain waits for them."""
    _stopped_now: asyncio.Event

    def _gate(self, function: str) -> FairGate:
        gate = self._gates.get(function)
        if gate is None:
            backend = self.backend
            # inproc has no bound of its own: the function's concurrency bound
            fallback = self.registry.get(function).max_concurrency

            def capacity() -> int:
                room = backend.capacity(function)
                return fallback if room is None else max(1, room)

            gate = self._gates[function] = FairGate(capacity)
            backend.watch_capacity(function, gate.admit)  # room gained is taken at once
        return gate

    async def _call(self, inv: Invocation, tenant: str, *, say_if_stopped: bool = False) -> Result:
        """Run ``inv`` through the function's gate; the tenant's quota slot (taken by the
        caller) and the gate slot are given back when the call no longer runs. A call still
        waiting for the gate, or queued in the pool, is dropped when its client hangs up (it
        never runs). One already on a worker may run on past its answer (a deadline; timeout_s
        on an inproc thread) or its client (a hang-up): a synchronous handler runs to its end,
        and both slots stay held until the backend says its run ended, or a tenant could fill
        every worker with calls it gave up on while holding none of its quota.

        ``say_if_stopped``: a call cancelled by the server stopping while it waits for room
        raises ``StoppedBeforeRun`` instead, for its caller to be told it did not run (cut
        with the rest, its connection dropped: a fault after which a call may have run, so a
        side effect was not retried, and a keyed one was left OutcomeUnknown)."""
        try:
            gate = self._gate(inv.function)
            # the envelope's deadline bounds the wait for room too: a call still waiting at it
            # is answered then (nothing ran), not when a worker comes free, seconds later
            async with asyncio.timeout(None if inv.deadline is None else inv.deadline - time.time()):
                await gate.acquire(tenant)
        except TimeoutError:
            self.quotas.give(tenant)
            return Result.failure(
                ErrorCode.DEADLINE_EXCEEDED,
                "deadline passed while waiting for room in the pool (it did not run)",
                function=inv.function,
                request_id=inv.request_id,
                started=False,
            )
        except asyncio.CancelledError:
            self.quotas.give(tenant)
            task = asyncio.current_task()
            if say_if_stopped and self._stopped_now.is_set() and task is not None:
                task.uncancel()  # the server's own cancel, answered instead
                raise StoppedBeforeRun from None
            raise
        except BaseException:
            self.quotas.give(tenant)
            raise
        try:
            fut = self.backend.submit(inv)
        except BaseException:
            self._release(tenant, gate)
            raise
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.cancel()  # a queued call never runs; an async handler is cancelled where it runs
            self._release_when_settled(inv.function, fut, tenant, gate)
            raise
        except BaseException:  # the backend's future failed (a bug of a backend)
            self._release(tenant, gate)
            raise
        if result.ok or result.error is None or result.error.type not in _MAY_RUN_ON:
            self._release(tenant, gate)  # the worker answered: it is done with the call
        else:
            self._release_when_settled(inv.function, fut, tenant, gate)
        return result

    def _release(self, tenant: str, gate: FairGate) -> None:
        gate.release()
        self.quotas.give(tenant)

    def _release_when_settled(
        self, function: str, fut: asyncio.Future[Result], tenant: str, gate: FairGate
    ) -> None:
        settled = self.backend.settled(function, fut)
        if settled is None:
            self._release(tenant, gate)
            return
        self.metrics.running_on += 1
        self._running_on.add(settled)
        log.debug(
            "a call of %s runs on without its caller; %s's slots are held until it ends", function, tenant
        )

        def ended(_: object) -> None:
            self.metrics.running_on -= 1
            self._running_on.discard(settled)
            self._release(tenant, gate)

        settled.add_done_callback(ended)

    def _start_event(self, inv: Invocation, tenant: str) -> None:
        """Run an accepted ``Event`` call on its own task, which takes over its quota slot.
        A task cancelled before its first step (the server stopping in the loop turn that
        accepted it) never runs its coroutine, so ``_call`` never has the slot to give back:
        then the task's end gives it back."""
        begun = False

        async def run() -> None:
            nonlocal begun
            begun = True
            await self._run_event(inv, tenant)

        def ended(task: asyncio.Task[None]) -> None:
            self._events.discard(task)
            if not begun:
                self.quotas.give(tenant)
            self._event_ended(inv, tenant, task)

        task = asyncio.get_running_loop().create_task(run())
        self._events.add(task)
        task.add_done_callback(ended)

    async def _run_event(self, inv: Invocation, tenant: str) -> None:
        try:
            result = await self._call(inv, tenant)  # gives the quota back
        except Exception:
            # a bug of ours (as a RequestResponse call's 500): its caller had its 202 and hears
            # of it nowhere else; left on the task, it showed only when the task was collected
            log.exception(
                "event %s %s (tenant %s) failed inside the server",
                _shown(inv.request_id),
                inv.function,
                tenant,
            )
            return
        if not result.ok and result.error is not None:
            log.warning(
                "event %s %s (tenant %s) failed: %s: %s",
                _shown(inv.request_id),
                inv.function,
                tenant,
                result.error.type,
                _shown(result.error.message, 1000),
            )

    def _event_ended(self, inv: Invocation, tenant: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            return
        # cancelled: the server stopped (the drain ran out, or a second Ctrl-C) before the call
        # ended; its caller got 202 long ago and hears of it nowhere else
        self.metrics.event_dropped(tenant, inv.function)
        log.warning(
            "event %s %s (tenant %s) dropped: the server stopped before it ended (drain_s=%g); "
            "it was queued or cut while running, so it may not have run, or run in part",
            _shown(inv.request_id),
            inv.function,
            tenant,
            self.config.drain_s,
        )
