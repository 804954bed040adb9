"""The inproc backend's own behaviour: what its threads hold, as the callers that admit calls
to it (the client's ``max_concurrency`` slots, ``fabric serve``'s gate) count it."""

from __future__ import annotations

import asyncio
import threading

from fabric.backends.inproc import InprocBackend
from fabric.protocol import Invocation
from fabric.registry import Registry


async def test_every_admitted_synchronous_call_runs_at_once():
    """The gate (and the client) admit up to each function's ``max_concurrency`` calls, but
    the inproc backend ran synchronous handlers on 32 threads shared by every function: the
    rest waited unseen in the thread queue, their wait counted against timeout_s. Each call
    admitted now has a thread: two functions of 30 each, all 60 running together."""
    reg = Registry()
    parties = 60
    together = threading.Barrier(parties, timeout=10)  # broken (an error) if they never meet

    for name in ("a", "b"):

        @reg.function(name=name, warm=0, timeout_s=60, max_concurrency=30)
        def met() -> bool:
            together.wait()
            return True

    async with InprocBackend(reg) as backend:
        futs = [backend.submit(Invocation(function=n, payload={})) for n in ("a", "b") for _ in range(30)]
        results = await asyncio.gather(*futs)
    assert all(r.ok and r.value is True for r in results), [r.error for r in results if not r.ok][:1]
