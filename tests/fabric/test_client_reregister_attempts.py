"""The client's per-call decisions across a re-registration (new code under the same name,
a module rewritten and reloaded, run on the inproc backend): the circuit breaker is the
code's, and whether a call may be run again follows the code its attempts ran."""

from __future__ import annotations

import asyncio
import importlib
import itertools
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.registry import Registry

# RUNS and GATES outlive a reload (it runs the new source in the same module dict): the old
# code's runs and the new code's are counted in one place, and a run waits on its own gate.
_SOURCE = """
import asyncio
import fabric
from fabric.errors import Unavailable

RUNS = globals().setdefault("RUNS", [])
GATES = globals().setdefault("GATES", {{}})

@fabric.function(name="{name}", timeout_s=30, warm=0, side_effects={side_effects},
                 retry={{"max_attempts": {attempts}, "initial_backoff_s": 0.001}})
async def answer(fail: bool = False, gate: str = "") -> str:
    if gate:
        RUNS.append("{code}")  # the effect, before the wait: the run has begun
        await GATES[gate].wait()
    if fail:
        raise Unavailable("down")
    return "{code}"
"""

_NAMES = itertools.count(1)


@pytest.fixture
def loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A function's name, its module's, and ``load(code, side_effects, attempts)``, which
    writes the module's file and imports it, or reloads it (the function registered again
    once discovered again)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no stale .pyc of the same second
    mod_name = f"reattempt_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    fn_name = f"reattempt_fn_{next(_NAMES)}"  # the decorator registers it in the default registry too
    path = tmp_path / f"{mod_name}.py"

    def load(code: str, side_effects: bool = False, attempts: int = 3) -> ModuleType:
        source = _SOURCE.format(name=fn_name, code=code, side_effects=side_effects, attempts=attempts)
        path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        module = sys.modules.get(mod_name)
        return importlib.import_module(mod_name) if module is None else importlib.reload(module)

    try:
        yield fn_name, mod_name, load
    finally:
        sys.modules.pop(mod_name, None)


async def _until(cond: Callable[[], bool], what: str, within_s: float = 5.0) -> None:
    limit = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < limit, what
        await asyncio.sleep(0.005)


async def test_new_code_starts_with_a_closed_circuit(loader):
    """The breaker the old code opened kept refusing the new code's calls until its cooldown
    ran out (the circuit is the function's by name; the new code had never been called)."""
    name, mod_name, load = loader
    load("v1")
    reg = Registry()
    reg.discover(mod_name)
    cfg = {"breaker": {"failure_threshold": 3, "cooldown_s": 600}, "hedge": {"enabled": False}}
    async with Client(backend="inproc", registry=reg, config=cfg) as c:
        down = await c.call(name, {"fail": True})  # three attempts, three failures in a row
        assert down.error is not None and down.error.type == ErrorCode.UNAVAILABLE, down.error
        refused = await c.call(name, {})
        assert refused.error is not None and refused.error.type == ErrorCode.CIRCUIT_OPEN, refused.error

        load("v2")
        reg.discover(mod_name)  # registered again: new code
        new = await c.call(name, {})
        assert new.ok and new.value == "v2", new.error
        # the new code's own failures open its circuit as before
        assert not (await c.call(name, {"fail": True})).ok
        again = await c.call(name, {})
        assert again.error is not None and again.error.type == ErrorCode.CIRCUIT_OPEN, again.error


async def test_the_old_codes_failures_after_a_reregistration_do_not_open_the_new_codes_circuit(loader):
    """A call of the old code under way when the function was registered again, failing
    after the new code had taken over, counted toward the new code's circuit."""
    name, mod_name, load = loader
    module = load("v1", attempts=1)  # one attempt: what fails is the old code's
    reg = Registry()
    reg.discover(mod_name)
    cfg = {"breaker": {"failure_threshold": 1, "cooldown_s": 600}, "hedge": {"enabled": False}}
    async with Client(backend="inproc", registry=reg, config=cfg) as c:
        gate = module.GATES["old"] = asyncio.Event()
        old = asyncio.create_task(c.call(name, {"fail": True, "gate": "old"}, deadline_s=30))
        await _until(lambda: module.RUNS == ["v1"], "the old code's call did not start")

        load("v2", attempts=1)  # the old call is not retried (under the new code)
        reg.discover(mod_name)
        assert (await c.call(name, {})).value == "v2"  # the client takes the new spec
        gate.set()  # the old code's attempt fails now
        r = await old
        assert r.error is not None and r.error.type == ErrorCode.UNAVAILABLE, r.error
        after = await c.call(name, {})
        assert after.ok and after.value == "v2", after.error
