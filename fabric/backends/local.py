"""The embedded default: per-function warm pools of worker processes on this machine.

A pool's workers import the function once, when they start: the source of its module (and
of the helper modules beside it) as it was registered, whatever the files hold now
(``_pool_snapshot``). A function registered again
under its name (a module edited and reloaded, a notebook cell run again: a new spec in the
registry) gets a new pool at its next call, whose workers import the code registered then;
the old pool is retired: what it holds runs to its end there, then its workers stop.
"""

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
from fabric.registry import CODE_ATTR, SPEC_ATTR, FunctionCode, Registry
from fabric.spec import FunctionSpec


class LocalBackend(Backend):
    kind = "local"
    runs_registered_code = True

    def __init__(self, registry: Registry | None = None, config: LocalConfig | None = None):
        super().__init__(registry)
        self.config = config or LocalConfig()
        self._pools: dict[str, FunctionPool] = {}
        # pools replaced by a function's new registration, until their calls have ended
        self._retiring: dict[FunctionPool, asyncio.Task[None]] = {}
        # the final counts (calls, spawned, ...) of a function's pools that have stopped:
        # stats() adds them in, so a function's counters never go down when it is
        # registered again (Prometheus reads a drop as a restart, and rate() over it lies)
        self._retired_counts: dict[str, dict[str, int]] = {}
        # kept by function, not by pool: a pool replaced hands them to the next one
        self._watchers: dict[str, list[Callable[[], None]]] = {}
        self._cpu = cpu_count()

    def pool(self, name: str) -> FunctionPool:
        """The pool of ``name`` as registered now: started on first use, and replaced when
        the function was registered again since (see the module docstring);
        ``BackendClosedError`` once closed."""
        if self._closed:  # a pool started now would never be closed: its workers would linger
            raise BackendClosedError(f"{self.kind} backend is closed")
        pool = self._pools.get(name)
        spec = self.registry.get(name)
        # by identity, as the client tells a new registration: a module reloaded with only a
        # helper of the function changed registers an equal spec, and its code is new too
        if pool is None or pool.spec is not spec:
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
            old, pool = pool, FunctionPool(spec, self.config, cpu=self._cpu, code=self._code(name, spec))
            self._pools[name] = pool
            pool.start()
            watchers = self._watchers.get(name, [])
            for grew in watchers:
                pool.watch_capacity(grew)
            if old is not None:
                self._retire(old)
                for grew in watchers:  # the new pool's room may be more: whoever waits, look
                    grew()
        return pool

    def _code(self, name: str, spec: FunctionSpec) -> FunctionCode | None:
        """The code of ``spec`` as it was registered (its module files then), for the pool's
        workers to import in place of the files, which may have changed since."""
        fn = self.registry.callable(name)
        code = getattr(fn, CODE_ATTR, None)
        # this registration's: the function decorated again since (for another registry)
        # carries that one's code
        if getattr(fn, SPEC_ATTR, None) is not spec or not isinstance(code, FunctionCode):
            return None
        return code

    def _retire(self, pool: FunctionPool) -> None:
        name = pool.spec.name
        task = asyncio.get_running_loop().create_task(pool.retire(lambda: self._pools.get(name)))
        self._retiring[pool] = task

        def stopped(_: asyncio.Task[None]) -> None:
            # in one step, so no stats() sees the counts in neither place; a closed pool
            # counts nothing more (its workers' ends are not losses), so they are final
            if self._retiring.pop(pool, None) is not None:
                totals = self._retired_counts.setdefault(name, {})
                for key, n in pool.metrics.items():
                    totals[key] = totals.get(key, 0) + n

        task.add_done_callback(stopped)

    def _all_pools(self, name: str) -> list[FunctionPool]:
        """The pool of ``name`` and those it replaced that still hold calls."""
        pools = [p for p in self._retiring if p.spec.name == name]
        current = self._pools.get(name)
        return pools if current is None else [current, *pools]

    def _submit(self, inv: Invocation) -> asyncio.Future[Result]:
        pool = self._pools.get(inv.function)
        if pool is None or pool.spec is not self.registry.find(inv.function):
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
        if pool is None or pool.spec is not self.registry.find(function):
            try:
                pool = self.pool(function)
            except (UnknownFunctionError, EntryPointError, BackendClosedError):
                return None  # no pool can hold its calls: submit answers each (SetupFailed, ...)
        return pool.capacity

    def watch_capacity(self, function: str, grew: Callable[[], None]) -> None:
        if self.capacity(function) is not None:  # the pool, started
            self._watchers.setdefault(function, []).append(grew)
            self._pools[function].watch_capacity(grew)

    def settled(self, function: str, fut: asyncio.Future[Result]) -> asyncio.Future[None] | None:
        # a pool replaced meanwhile still runs the calls it had
        for pool in self._all_pools(function):
            settled = pool.settled(fut)
            if settled is not None:
                return settled
        return None

    def started(self, function: str, fut: asyncio.Future[Result]) -> bool | None:
        for pool in self._all_pools(function):
            began = pool.started(fut)
            if began is not None:
                return began
        return None

    def extend_deadline(self, function: str, idempotency_key: str, deadline: float | None) -> bool:
        # no pool: nothing was sent yet, and what will be carries the new one
        for pool in self._all_pools(function):
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
        # the retiring pools too: their calls are answered BackendClosed and their workers stop
        await asyncio.gather(*(p.close() for p in [*self._pools.values(), *self._retiring]))
        await asyncio.gather(*self._retiring.values(), return_exceptions=True)

    def stats(self) -> dict[str, Any]:
        """Each function's pool. Its counters (``calls``, ``spawned``, ``lost``, ...) are
        the function's, over every pool it has had in this process: those of the pools it
        replaced are added in, so they never go down when it is registered again. The
        gauges are the live pool's; the workers of the pools it replaced that still run
        calls are counted apart (``retiring_workers``, ``retiring_pids``): processes that
        are there, holding what their setup hook loaded, until their calls end."""
        out = {}
        for name, pool in self._pools.items():
            retiring_pools = [p for p in self._retiring if p.spec.name == name]
            retiring = [w for p in retiring_pools for w in p._workers]
            counts = dict(pool.metrics)
            for old in [self._retired_counts.get(name, {}), *(p.metrics for p in retiring_pools)]:
                for key, n in old.items():
                    counts[key] = counts.get(key, 0) + n
            out[name] = {
                **pool.stats(),
                **counts,
                "retiring_workers": len(retiring),
                "retiring_pids": [w.proc.pid for w in retiring if w.proc is not None],
            }
        return out
