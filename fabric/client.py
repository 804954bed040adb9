"""``Client``: the one resilient async entry point to every backend.

    async with fabric.Client(backend="local") as c:
        r = await c.call("exact_match", {"traj": t, "ground_truth": "42"})

What it adds on top of a backend, per function:

* refuses bad calls before sending (unknown name, bad arguments, not JSON, over 6 MB);
* a concurrency limit (the function's ``max_concurrency``) and a deadline that travels
  with the call to the worker;
* retries of retryable failures only, with exponential backoff and full jitter (tenacity),
  bounded by attempts and by the deadline;
* hedged requests: a duplicate after the function's observed p95 latency, capped to a
  share of calls; the first answer wins and the loser is cancelled;
* idempotency: one execution per key, shared by every caller with the key (each waits
  within its own deadline; the execution's is the latest of theirs), then its cached result;
* a circuit breaker that opens after consecutive infrastructure failures;
* metrics (``client.metrics()``).

A failed call is a ``Result(ok=False)``, never an exception; ``Result.unwrap()`` raises.

The public calls live here; calls under an idempotency key in ``fabric.client_keyed``, and
what every call goes through (the breaker, retries, the metrics of an outcome) in
``fabric.client_attempts``, and a call's copies (hedging) in ``fabric.client_copies``:
``Client`` is ``KeyedCalls`` over ``Attempts`` over ``Copies``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

from pydantic import BaseModel, ValidationError

from fabric.backends.base import Backend, make_backend
from fabric.client_config import BreakerConfig, ClientConfig, HedgeConfig
from fabric.client_keyed import KeyedCalls
from fabric.client_state import Execution, FnState, Sent
from fabric.errors import (
    BackendClosedError,
    ConfigError,
    ErrorCode,
    FabricError,
    PayloadError,
    validation_problems,
)
from fabric.protocol import Invocation, Result, encode_payload
from fabric.registry import Registry, default_registry
from fabric.spec import FunctionSpec

# the settings live in their own module; they stay importable from here
__all__ = ["BreakerConfig", "Client", "ClientConfig", "HedgeConfig"]

NO_DEADLINE_S = 1e9
"""A ``deadline_s`` from here on (~32 years), ``math.inf`` included, is no deadline."""


def _no_shared_key(what: str, kw: dict[str, Any]) -> None:
    """``map``/``stream`` pass their keywords to every payload's call: one idempotency key
    there made every call one execution, and each payload got the first one's answer."""
    if kw.get("idempotency_key") is not None:
        raise ConfigError(
            f"{what}: idempotency_key would be shared by every payload's call, and each would get the "
            "answer of the first (one key, one execution); give each payload its own key with "
            "client.call(name, payload, idempotency_key=...)"
        )


class Client(KeyedCalls):
    def __init__(
        self,
        backend: str | dict[str, Any] | BaseModel | Backend = "local",
        *,
        registry: Registry | None = None,
        config: ClientConfig | dict[str, Any] | None = None,
    ):
        importing = os.environ.get("_FABRIC_WORKER_IMPORTING")
        if importing:
            raise FabricError(
                f"a fabric worker imported {importing.rpartition(':')[0]} to find its function, and the "
                "import started a fabric.Client. Put the script's entry point under "
                '`if __name__ == "__main__":` so importing the file only defines functions.'
            )
        try:
            self.config = (
                config if isinstance(config, ClientConfig) else ClientConfig.model_validate(config or {})
            )
        except ValidationError as e:  # the SDK raises FabricErrors; pydantic's named no key
            raise ConfigError(f"bad client config: {validation_problems(e, ClientConfig)}") from None
        self.registry = registry if registry is not None else default_registry
        self._owns_backend = not isinstance(backend, Backend)
        self.backend = make_backend(backend, self.registry)
        self._fns: dict[str, FnState] = {}
        self._cache: dict[str, tuple[bytes, Result, int]] = {}
        self._cache_bytes = 0
        self._inflight: dict[str, Execution] = {}
        self._executions: set[asyncio.Task[Result]] = set()
        self._ids = itertools.count(1)
        # a plain call's idempotency key is name:version:<prefix>-<n>, deduplicated by the Lambda
        # handler per tenant: 64 bits, so that no two client processes of a fleet share one
        # (32 did, about once in a hundred fleets of 10,000, and then every n-th call collided)
        self._prefix = os.urandom(8).hex()
        self._closed = False

    @property
    def closed(self) -> bool:
        """True from the start of ``aclose`` on: every call is refused ``BackendClosed``."""
        return self._closed

    def _closed_message(self, what: str) -> str:
        return f"{what}: the client is closed, and is not reopened (make a new Client)"

    async def __aenter__(self) -> Client:
        if self._closed:
            # its keys in flight were forgotten at the close: reopened, a side effect cut
            # there could run again under its key
            raise BackendClosedError(self._closed_message("async with"))
        await self.backend.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        # first: a backend passed in stays open, and a call made through the client after its
        # close (or while it closes) ran there, a side effect cut by the close again under
        # the key the close forgot
        self._closed = True
        # keyed executions outlive their callers (see Execution); they end with the client,
        # those started while it waits for them too: one left running lost its key with the
        # clear below, and the next caller with the key ran it again beside it
        while self._executions:
            tasks = list(self._executions)
            self._before_cut()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        # a task cancelled before it ever ran skipped its own clean-up (its finally)
        self._inflight.clear()
        for fn in self._fns.values():
            fn.probing = False
        if self._owns_backend:
            await self.backend.aclose()

    # ------------------------------------------------------------------ public calls
    async def call(
        self,
        name: str,
        payload: dict[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        deadline_s: float | None = None,
        hedge: bool | None = None,
        tenant: str | None = None,
    ) -> Result:
        """Run ``name`` with ``payload`` (its keyword arguments); never raises for a failed call."""
        t0 = time.perf_counter()
        request_id = f"{self._prefix}-{next(self._ids)}"
        payload = {} if payload is None else payload
        spec = self.registry.find(name)
        if self._closed:
            closed = self._closed_message(name) + "; nothing was sent"
            if spec is None:  # not counted, as an unknown name is not while the client is open
                return Result.failure(
                    ErrorCode.BACKEND_CLOSED, closed, function=name, request_id=request_id, started=False
                )
            # counted as every refused call is: a job whose client closed under it (a
            # shutdown, a bug) saw its calls fail while metrics() said nothing of them
            m = self._fn_state(name, spec).metrics
            m.calls += 1
            return self._refuse(m, ErrorCode.BACKEND_CLOSED, closed, name, request_id)
        if spec is None:
            from fabric.errors import UnknownFunctionError

            return Result.failure(
                ErrorCode.UNKNOWN_FUNCTION,
                str(UnknownFunctionError(name, self.registry.names())),
                function=name,
                request_id=request_id,
            )
        fn = self._fn_state(name, spec)
        m = fn.metrics
        m.calls += 1
        # refuse bad input before anything is sent
        if not isinstance(payload, dict):
            return self._refuse(
                m,
                ErrorCode.INVALID_ARGUMENTS,
                f"{name}: payload must be a dict of keyword arguments, got {type(payload).__name__}",
                name,
                request_id,
            )
        problem = spec.check_args(payload)
        if problem is not None:
            return self._refuse(m, ErrorCode.INVALID_ARGUMENTS, problem, name, request_id)
        try:
            raw = encode_payload(payload, limit=self.backend.max_payload_bytes, what=f"payload of {name}")
        except PayloadError as e:
            return self._refuse(m, e.code, str(e), name, request_id)
        deadline_s = deadline_s if deadline_s is not None else self.config.default_deadline_s
        if deadline_s is not None and not deadline_s < NO_DEADLINE_S:  # inf, past a lifetime, NaN
            if deadline_s != deadline_s:
                why = f"{name}: deadline_s is NaN; give seconds, or None (or math.inf) for no deadline"
                return self._refuse(m, ErrorCode.INVALID_ARGUMENTS, why, name, request_id)
            deadline_s = None  # the backends' nanosecond clocks overflowed on it (OverflowError)
        deadline = time.time() + deadline_s if deadline_s is not None else None
        if idempotency_key is not None:
            return await self._call_keyed(
                fn, idempotency_key, payload, raw, request_id, deadline, hedge, tenant, t0
            )
        if deadline is not None and deadline <= time.time():
            # a budget already spent (computed as 0 or less): a free slot let it be sent, to a
            # remote function that ran for no one
            why = f"{name}: deadline passed before the call was made (deadline_s={deadline_s:g}); not sent"
            return self._refuse(m, ErrorCode.DEADLINE_EXCEEDED, why, name, request_id)
        refusal, probe = self._breaker_admits(fn)
        if refusal is not None:
            return self._refuse(m, ErrorCode.CIRCUIT_OPEN, refusal, name, request_id)
        inv = Invocation.fast(
            function=name,
            payload=payload,
            request_id=request_id,
            idempotency_key=f"{name}:{spec.version}:{request_id}",
            deadline=deadline,
            tenant=tenant or self.config.tenant,
            attempt=1,
            hedge=False,
            wait_for_run=False,
            raw=raw,
        )
        try:
            if await self._acquire_slot(fn, deadline):
                sent = Sent(spec.retry)  # the budget of the spec the call began under
                try:
                    # asked again: the circuit may have opened while this call waited in line
                    # for a slot (a map over a batch), and every caller waiting then was sent
                    # (not when the client closed while it waited: it is refused below)
                    refusal, probe = (None, probe) if probe or self._closed else self._breaker_admits(fn)
                    if self._closed:
                        result = Result.failure(
                            ErrorCode.BACKEND_CLOSED,
                            self._closed_message(name) + "; nothing was sent",
                            function=name,
                            request_id=request_id,
                            started=False,
                        )
                    elif refusal is not None:
                        result = Result.failure(
                            ErrorCode.CIRCUIT_OPEN,
                            refusal + "; nothing was sent",
                            function=name,
                            request_id=request_id,
                            started=False,
                        )
                    else:
                        result = await self._attempt(fn, inv, hedge, None, sent)
                        if not result.ok and self._should_retry(self._may_have_effects(fn, sent), result):
                            result = await self._retry(fn, inv, result, hedge, lambda: deadline, sent)
                finally:
                    # held while a copy it let go still runs (a synchronous handler past the deadline)
                    self._release_when_settled(fn, sent.copies, fn.sem.release)
            else:
                result = Result.failure(
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"{name}: deadline passed while the call waited for a concurrency slot "
                    f"(max_concurrency={spec.max_concurrency} calls in flight); nothing was sent",
                    function=name,
                    request_id=request_id,
                    started=False,
                )
        finally:
            if probe:
                fn.probing = False
        self._settle(fn, result, t0)
        return result

    async def warmup(self, names: list[str] | None = None) -> None:
        """Start the warm instances of ``names`` (default: every registered function) and wait
        until they are ready, so the first calls do not pay a cold start. Raises
        ``BackendClosedError`` once the client is closed (a backend passed in too)."""
        if self._closed:
            raise BackendClosedError(self._closed_message("warmup"))
        await self.backend.warmup(names)

    async def map(self, name: str, payloads: Iterable[dict[str, Any]], **kw: Any) -> list[Result]:
        """Run ``name`` over ``payloads``; results in input order."""
        _no_shared_key("map", kw)
        results = await asyncio.gather(*(self.call(name, p, **kw) for p in payloads))
        for i, r in enumerate(results):
            r.index = i
        return list(results)

    async def stream(
        self,
        name: str,
        payloads: Iterable[dict[str, Any]] | AsyncIterable[dict[str, Any]],
        *,
        max_inflight: int | None = None,
        **kw: Any,
    ) -> AsyncIterator[Result]:
        """Yield results as they complete (``Result.index`` is the payload's position).
        ``payloads`` may be an async iterable that is still being produced."""
        _no_shared_key("stream", kw)
        if max_inflight is not None and max_inflight < 1:
            # 0 read as "the default" (the `or` below) and a negative one as a bare ValueError
            raise ConfigError(
                f"stream: max_inflight must be >= 1 (or None: twice max_concurrency), got {max_inflight}"
            )
        limit = max_inflight or max(1, 2 * self._spec_or_default(name).max_concurrency)
        # a slot is held from launch until the consumer takes the result: at most ``limit``
        # calls are running or waiting to be consumed, and a lazy input is read only as fast
        slots = asyncio.Semaphore(limit)
        done: asyncio.Queue[Result | BaseException | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int, p: dict[str, Any]) -> None:
            try:
                r = await self.call(name, p, **kw)
            except Exception as e:
                # (a misspelt keyword, a bug) to the consumer: a task that died here kept its
                # slot, which only the consumer gives back, and past max_inflight payloads the
                # producer waited for a slot and the consumer for a result, for good
                done.put_nowait(e)
                return
            r.index = i
            done.put_nowait(r)

        def launch(i: int, p: dict[str, Any]) -> None:
            t = asyncio.create_task(one(i, p))
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        async def produce() -> None:
            try:
                i = 0
                if isinstance(payloads, AsyncIterable):
                    async for p in payloads:
                        await slots.acquire()
                        launch(i, p)
                        i += 1
                else:
                    for p in payloads:
                        await slots.acquire()
                        launch(i, p)
                        i += 1
                while tasks:
                    await asyncio.gather(*list(tasks))
            except BaseException as e:  # a failing input iterator reaches the consumer
                done.put_nowait(e)
                raise
            finally:
                done.put_nowait(None)

        producer = asyncio.create_task(produce())
        try:
            while (item := await done.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
                slots.release()
        finally:
            producer.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(producer, *tasks, return_exceptions=True)

    def metrics(self) -> dict[str, Any]:
        return {name: fn.metrics.snapshot() for name, fn in self._fns.items()}

    # ------------------------------------------------------------------ internals
    def _fn_state(self, name: str, spec: FunctionSpec) -> FnState:
        """The client's state of function ``name``, registered now as ``spec``."""
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = FnState(spec, self.config.hedge.quantile)
        elif fn.spec is not spec:
            # registered again (a notebook cell run again, a module reloaded): its version
            # keys the idempotency cache, so the old code's answers are not served for the
            # new code's, and its limits (concurrency, timeout, retries) apply from now on
            fn.respec(spec)
        return fn

    def _spec_or_default(self, name: str) -> FunctionSpec:
        if name in self.registry:
            return self.registry.get(name)
        return FunctionSpec(name="unknown", entry="unknown:unknown", version="0")
