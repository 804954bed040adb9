"""The embedded default: per-function warm pools of worker processes on this machine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fabric.backends._pool import FunctionPool
from fabric.backends.base import Backend, LocalConfig, cpu_count
from fabric.errors import (
    BackendClosedError,
    EntryPointError,
    ErrorCode,
    SetupFailedError,
    UnknownFunctionError,
)
from fabric.protocol import Invocation, Result
from fabric.registry import Registry


class LocalBackend(Backend):
    kind = "local"

    def __init__(self, registry: Registry | None = None, config: LocalConfig | None = None):
        super().__init__(registry)
        self.config = config or LocalConfig()
        self._pools: dict[str, FunctionPool] = {}
        self._cpu = cpu_count()

    def pool(self, name: str) -> FunctionPool:
        """The pool of ``name``, started on first use; ``BackendClosedError`` once closed."""
        if self._closed:  # a pool started now would never be closed: its workers would linger
            raise BackendClosedError(f"{self.kind} backend is closed")
        pool = self._pools.get(name)
        if pool is None:
            spec = self.registry.get(name)
            if "<locals>" in spec.entry or "<lambda>" in spec.entry:
                raise EntryPointError(
                    f"{name}: {spec.entry} is a nested function or lambda; the local backend imports "
                    "functions in worker processes, so define it at the top level of a module "
                    "(or use backend='inproc')"
                )
            if spec.entry.startswith("__main__:"):
                # a script's functions get a file path as their module; no path means there is
                # no file (python -c, stdin, a notebook cell, the REPL) for a worker to import,
                # and a worker's own __main__ is fabric.worker
                raise EntryPointError(
                    f"{name} is defined in __main__ without a file (python -c, stdin, a notebook "
                    "cell or the REPL): the local backend imports functions in worker processes, "
                    "so define it in a module or a .py file (or use backend='inproc')"
                )
            pool = FunctionPool(spec, self.config, cpu=self._cpu)
            self._pools[name] = pool
            pool.start()
        return pool

    def _submit(self, inv: Invocation) -> asyncio.Future[Result]:
        pool = self._pools.get(inv.function)
        if pool is None:
            try:
                pool = self.pool(inv.function)
            except (UnknownFunctionError, EntryPointError) as e:
                fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
                code = (
                    ErrorCode.UNKNOWN_FUNCTION
                    if isinstance(e, UnknownFunctionError)
                    else ErrorCode.SETUP_FAILED
                )
                fut.set_result(Result.failure(code, str(e), function=inv.function, request_id=inv.request_id))
                return fut
        return pool.submit(inv)

    async def _invoke(self, inv: Invocation) -> Result:
        return await self._submit(inv)

    def capacity(self, function: str) -> int | None:
        pool = self._pools.get(function)
        if pool is None:
            try:
                pool = self.pool(function)
            except (UnknownFunctionError, EntryPointError, BackendClosedError):
                return None  # no pool can hold its calls: submit answers each (SetupFailed, ...)
        return pool.capacity

    def watch_capacity(self, function: str, grew: Callable[[], None]) -> None:
        if self.capacity(function) is not None:  # the pool, started
            self._pools[function].watch_capacity(grew)

    def settled(self, function: str, fut: asyncio.Future[Result]) -> asyncio.Future[None] | None:
        pool = self._pools.get(function)
        return None if pool is None else pool.settled(fut)

    def extend_deadline(self, function: str, idempotency_key: str, deadline: float | None) -> bool:
        pool = self._pools.get(function)
        if pool is not None:  # no pool: nothing was sent yet, and what will be carries the new one
            pool.extend_deadline(idempotency_key, deadline)
        return True

    async def _warmup(self, names: list[str] | None) -> None:
        """Start the pools of ``names`` and wait for their warm workers. Raises
        ``SetupFailedError`` for a function whose workers cannot start (its setup hook or
        import raised), after every pool has settled."""
        pools = [self.pool(n) for n in (names if names is not None else self.registry.names())]
        outcomes = await asyncio.gather(*(p.wait_ready() for p in pools), return_exceptions=True)
        failed = [
            (p.spec.name, o) for p, o in zip(pools, outcomes, strict=True) if isinstance(o, BaseException)
        ]
        if not failed:
            return
        first = failed[0][1]
        if isinstance(first, SetupFailedError) and len(failed) > 1:
            # the first failure in full, and the names of the others: each needs fixing
            others = ", ".join(name for name, _ in failed[1:])
            raise SetupFailedError(f"{first.message}; also failed to start: {others}", first.traceback)
        raise first

    async def _close(self) -> None:
        await asyncio.gather(*(p.close() for p in self._pools.values()))

    def stats(self) -> dict[str, Any]:
        return {name: p.stats() for name, p in self._pools.items()}
