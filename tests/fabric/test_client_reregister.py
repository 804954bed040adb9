"""A function registered again under its name with new code (a notebook cell run again, a
module reloaded): the client and the inproc backend take the new spec from the next call on.
The re-registration here is a real one: a module file rewritten and reloaded, its functions
discovered again."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest

from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.registry import Registry

_V1 = """
import asyncio
import fabric
from fabric.errors import Unavailable

RUNNING = [0, 0]  # now, most at once

@fabric.function(name="{name}", timeout_s=30, max_concurrency=8, warm=0,
                 retry={{"max_attempts": 3, "initial_backoff_s": 0.001}})
async def answer(nap: float = 0.0, fail: bool = False) -> str:
    RUNNING[0] += 1
    RUNNING[1] = max(RUNNING)
    try:
        await asyncio.sleep(nap)
    finally:
        RUNNING[0] -= 1
    if fail:
        raise Unavailable("down")
    return "v1"
"""

# new code and new limits: one call at a time, a 0.5 s timeout, no retries
_V2 = _V1.replace('"v1"', '"v2, rewritten"').replace("timeout_s=30", "timeout_s=0.5")
_V2 = _V2.replace("max_concurrency=8", "max_concurrency=1").replace('"max_attempts": 3', '"max_attempts": 1')


_NAMES = itertools.count(1)


def _write(path: Path, source: str, name: str) -> None:
    path.write_text(textwrap.dedent(source.format(name=name)))


@pytest.fixture
def reloadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A module of one function in a file of its own, and a function that rewrites and reloads it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no stale .pyc of the same second
    mod_name = f"reloaded_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    # a name of its own: the decorator registers it in the default registry too, by entry
    fn_name = f"reloaded_fn_{next(_NAMES)}"
    path = tmp_path / f"{mod_name}.py"
    _write(path, _V1, fn_name)
    module = importlib.import_module(mod_name)

    def reload() -> ModuleType:
        _write(path, _V2, fn_name)
        importlib.invalidate_caches()
        return importlib.reload(module)

    try:
        yield fn_name, mod_name, module, reload
    finally:
        sys.modules.pop(mod_name, None)


async def test_a_reregistered_function_is_run_with_its_new_spec(reloadable):
    """The client kept each function's spec from its first call: after the function was
    registered again with new code, a call under an idempotency key the old version had
    answered got the old version's cached answer (the key held the old version), and the old
    concurrency limit, timeout and retries stayed in force (so did the inproc backend's
    runner: the old code)."""
    name, mod_name, _, reload = reloadable
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="inproc", registry=reg) as c:
        first = await c.call(name, {}, idempotency_key="k")
        assert first.ok and first.value == "v1", first.error
        assert (await c.call(name, {}, idempotency_key="k")).cached  # the key works

        old = reg.get(name)
        module = reload()
        reg.discover(mod_name)  # registered again: same entry, new code
        assert reg.get(name).entry == old.entry and reg.get(name).version != old.version
        new = await c.call(name, {}, idempotency_key="k")
        assert new.ok and new.value == "v2, rewritten" and not new.cached, (new.value, new.cached)

        # the new limits: one call at a time (it was 8)
        rs = await asyncio.gather(*(c.call(name, {"nap": 0.05}) for _ in range(4)))
        assert all(r.ok for r in rs), [r.error for r in rs]
        assert module.RUNNING[1] == 1, f"{module.RUNNING[1]} calls ran at once under max_concurrency=1"
        # the new timeout (0.5 s; it was 30 s)
        slow = await c.call(name, {"nap": 5})
        assert slow.error is not None and slow.error.type == ErrorCode.TIMEOUT, slow.error
        # the new retries: one attempt (it was 3)
        down = await c.call(name, {"fail": True})
        assert down.error is not None and down.error.type == ErrorCode.UNAVAILABLE
        assert down.attempts == 1, down.attempts


async def test_slots_shrunk_while_held_admit_no_more_than_the_new_number():
    """A limit lowered while calls hold slots: they keep theirs, and the next callers wait
    until the held ones are down to the new number (asyncio's semaphore admits a caller
    whenever its count is not 0: a count below 0 let them in at once)."""
    from fabric.client_state import Slots

    slots = Slots(4)
    for _ in range(3):
        assert slots.take_now()  # three calls under way, one slot free
    slots.resize(-3)  # the limit is now 1
    assert not slots.take_now()
    for held in (3, 2):
        slots.release()  # a call under way ends: still `held - 1` >= 1 held
        assert not slots.take_now(), f"admitted with {held - 1} held under a limit of 1"
    slots.release()  # the last one ends: the one slot is free
    assert slots.take_now() and not slots.take_now()
    slots.resize(+2)  # raised again: a waiting caller gets a slot at once
    waiter = asyncio.ensure_future(slots.acquire())
    await asyncio.sleep(0)
    assert waiter.done() and slots.take_now() and not slots.take_now()


async def test_inproc_moves_a_run_of_the_replaced_code_within_its_own_timeout(reloadable):
    """A keyed run of the old code, under way when the function was registered again with a
    shorter timeout_s: moving its deadline later cut it at the new code's limit from its
    start (inproc read the timeout of the runner registered now, not of the run's own)."""
    from fabric.backends.inproc import InprocBackend
    from fabric.protocol import Invocation

    name, mod_name, module, reload = reloadable
    reg = Registry()
    reg.discover(mod_name)
    async with InprocBackend(reg) as b:
        deadline = time.time() + 10
        inv = Invocation(
            function=name, payload={"nap": 1.0}, idempotency_key="k", deadline=deadline, wait_for_run=True
        )
        run = b.submit(inv)
        limit = time.monotonic() + 5
        while module.RUNNING[0] == 0:  # the old code's run is under way
            assert time.monotonic() < limit, "the run did not start"
            await asyncio.sleep(0.01)
        reload()  # timeout_s 30 -> 0.5
        reg.discover(mod_name)
        new = await b.submit(Invocation(function=name, payload={}))
        assert new.ok and new.value == "v2, rewritten", new.error
        assert b.extend_deadline(name, "k", deadline + 10)
        done = await run
        assert done.ok and done.value == "v1", done.error
