"""The client's per-call decisions across a re-registration (new code under the same name,
a module rewritten and reloaded, run on the inproc backend): the circuit breaker is the
code's, and whether a call may be run again follows the code its attempts ran."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from rewritable_module import module_loader

from fabric.client import Client
from fabric.errors import ErrorCode, Unavailable
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
    mod_name = f"reattempt_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    fn_name = f"reattempt_fn_{next(_NAMES)}"  # the decorator registers it in the default registry too
    with module_loader(tmp_path, monkeypatch, mod_name) as write:

        def load(code: str, side_effects: bool = False, attempts: int = 3) -> ModuleType:
            return write(
                _SOURCE.format(name=fn_name, code=code, side_effects=side_effects, attempts=attempts)
            )

        yield fn_name, mod_name, load


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


async def test_a_keyed_call_of_a_side_effect_is_not_retried_once_the_function_is_registered_pure(loader):
    """The first attempt ran the old code, which has side effects, and failed in a way after
    which it may have run (Unavailable); meanwhile the function was registered again without
    side effects. The retry decision read the spec registered now and sent the call again,
    and the key kept no OutcomeUnknown. What may have run decides: the old code's effect."""
    name, mod_name, load = loader
    module = load("v1", side_effects=True)
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        gate = module.GATES["k"] = asyncio.Event()
        payload = {"fail": True, "gate": "k"}
        first = asyncio.create_task(c.call(name, payload, idempotency_key="k", deadline_s=30))
        await _until(lambda: module.RUNS == ["v1"], "the old code's call did not start")
        joined = asyncio.create_task(c.call(name, payload, idempotency_key="k", deadline_s=30))
        # one loop turn: the joining caller runs up to its wait on the execution (no I/O before it)
        await asyncio.sleep(0)

        load("v2", side_effects=False)
        reg.discover(mod_name)
        assert (await c.call(name, {})).value == "v2"  # the client takes the new spec
        gate.set()
        r = await first
        assert r.error is not None and r.error.type == ErrorCode.UNAVAILABLE, r.error
        assert r.attempts == 1 and module.RUNS == ["v1"], (r.attempts, module.RUNS)
        kept = await joined  # what the key keeps: the effect may have happened
        assert kept.error is not None and kept.error.type == ErrorCode.OUTCOME_UNKNOWN, kept.error


@pytest.mark.parametrize("key", ["k", None])
async def test_a_retry_that_ran_new_code_with_side_effects_is_not_run_again(loader, key):
    """The other way round: the old code is pure, so its failure is retried, and the retry
    runs the new code, which has side effects (registered again while the first attempt ran;
    the client had not been called since). That attempt failed too, and the client, still
    holding the old spec, retried it again: the new code's effect ran twice. Keyed or not."""
    name, mod_name, load = loader
    module = load("v1", side_effects=False)
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        module.GATES["k"] = gate = asyncio.Event()
        first = asyncio.create_task(
            c.call(name, {"fail": True, "gate": "k"}, idempotency_key=key, deadline_s=30)
        )
        await _until(lambda: module.RUNS == ["v1"], "the old code's call did not start")
        load("v2", side_effects=True)
        reg.discover(mod_name)  # no call since: only the retries see it
        gate.set()
        r = await first
    assert r.error is not None and r.error.type == ErrorCode.UNAVAILABLE, r.error
    if key is None:
        assert module.RUNS == ["v1", "v2"], module.RUNS  # the new code's effect ran once
        assert r.attempts == 2
    else:  # a keyed execution goes to the code its key names only (the next test)
        assert module.RUNS == ["v1"] and r.attempts == 1, (module.RUNS, r.attempts)


async def test_no_hedge_is_sent_once_the_function_is_registered_again(loader):
    """A hedge fires a while after its primary was sent; the function registered again in
    between (new code, with side effects) had the hedge run the new code beside the old:
    the new code's effect, which its spec says must never be hedged."""
    name, mod_name, load = loader
    module = load("v1", side_effects=False)
    reg = Registry()
    reg.discover(mod_name)
    cfg = {"hedge": {"min_samples": 1, "min_delay_ms": 1000, "max_share": 1.0}}
    async with Client(backend="inproc", registry=reg, config=cfg) as c:
        assert (await c.call(name, {})).value == "v1"  # a latency to hedge after
        module.GATES["h"] = gate = asyncio.Event()
        primary = asyncio.create_task(c.call(name, {"gate": "h"}, deadline_s=30))
        await _until(lambda: module.RUNS == ["v1"], "the old code's call did not start")
        load("v2", side_effects=True)
        reg.discover(mod_name)
        clock = c._fns[name].hedge_clock
        # the hedge's time came (its callback ran) and went
        await _until(lambda: not clock._q and clock._timer is None, "the hedge's time did not come")
        gate.set()
        r = await primary
    assert r.ok and r.value == "v1", r.error
    assert module.RUNS == ["v1"] and c.metrics()[name]["hedges"] == 0, module.RUNS


@pytest.mark.parametrize("key", [None, "k"])
async def test_the_old_codes_answer_after_a_reregistration_does_not_close_the_new_codes_circuit(loader, key):
    """An old-code call that answered after the function was registered again reset the new
    code's failure count (the outcome's accounting closed the circuit on any answer, whatever
    code gave it), so the new code's open circuit let its calls through again."""
    name, mod_name, load = loader
    module = load("v1", attempts=1)
    reg = Registry()
    reg.discover(mod_name)
    cfg = {"breaker": {"failure_threshold": 1, "cooldown_s": 600}, "hedge": {"enabled": False}}
    async with Client(backend="inproc", registry=reg, config=cfg) as c:
        gate = module.GATES["old"] = asyncio.Event()
        old = asyncio.create_task(c.call(name, {"gate": "old"}, idempotency_key=key, deadline_s=30))
        await _until(lambda: module.RUNS == ["v1"], "the old code's call did not start")

        load("v2", attempts=1)
        reg.discover(mod_name)
        down = await c.call(name, {"fail": True})  # the new code fails: its circuit opens
        assert down.error is not None and down.error.type == ErrorCode.UNAVAILABLE, down.error
        refused = await c.call(name, {})
        assert refused.error is not None and refused.error.type == ErrorCode.CIRCUIT_OPEN, refused.error

        gate.set()  # the old code answers now
        r = await old
        assert r.ok and r.value == "v1", r.error
        still = await c.call(name, {})
        assert still.error is not None and still.error.type == ErrorCode.CIRCUIT_OPEN, still


# the same code registered again with other options (a config-driven decorator, a notebook
# registering a function object again): its version, a hash of its source, stays the same
_SAME_CODE_RUNS: list[str] = []
_SAME_CODE_GATES: dict[str, asyncio.Event] = {}


async def same_code_effect(fail: bool = False, gate: str = "") -> str:
    _SAME_CODE_RUNS.append(gate)  # the effect, before the wait: the run has begun
    if gate:
        await _SAME_CODE_GATES[gate].wait()
    if fail:
        raise Unavailable("down")
    return "done"


def _register_same_code(reg: Registry, side_effects: bool) -> str:
    reg.function(
        same_code_effect,
        name="same_code_effect",
        timeout_s=30,
        warm=0,
        side_effects=side_effects,
        retry={"max_attempts": 3, "initial_backoff_s": 0.001},
    )
    return "same_code_effect"


@pytest.fixture
def same_code():
    _SAME_CODE_RUNS.clear()
    _SAME_CODE_GATES.clear()
    yield _SAME_CODE_RUNS, _SAME_CODE_GATES
    _SAME_CODE_RUNS.clear()
    _SAME_CODE_GATES.clear()


@pytest.mark.parametrize("key", [None, "k"])
async def test_the_same_code_registered_again_with_side_effects_is_not_retried(same_code, key):
    """The first attempt ran code registered without side effects and failed in a way after
    which it may have run; the same code (same version) was then registered with
    side_effects=True. What the spec now says of that code holds for the attempt that ran
    it: the retry ran the effect a second time."""
    runs, gates = same_code
    reg = Registry()
    name = _register_same_code(reg, side_effects=False)
    version = reg.get(name).version
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        gates["r"] = gate = asyncio.Event()
        first = asyncio.create_task(c.call(name, {"fail": True, "gate": "r"}, idempotency_key=key))
        await _until(lambda: runs == ["r"], "the call did not start")
        _register_same_code(reg, side_effects=True)
        assert reg.get(name).version == version  # the same code
        gate.set()
        r = await first
        assert r.error is not None and r.error.type == ErrorCode.UNAVAILABLE, r.error
        assert runs == ["r"] and r.attempts == 1, (runs, r.attempts)
        if key is not None:  # what the key keeps: the effect may have happened
            kept = await c.call(name, {"fail": True, "gate": "r"}, idempotency_key=key)
            assert kept.error is not None and kept.error.type == ErrorCode.OUTCOME_UNKNOWN, kept.error
            assert runs == ["r"]


async def test_no_hedge_is_sent_once_the_same_code_is_registered_with_side_effects(same_code):
    """The hedge checked only that the code was the same: the same code registered again
    with side_effects=True after the primary went was hedged, its effect run twice."""
    runs, gates = same_code
    reg = Registry()
    name = _register_same_code(reg, side_effects=False)
    cfg = {"hedge": {"min_samples": 1, "min_delay_ms": 200, "max_share": 1.0}}
    async with Client(backend="inproc", registry=reg, config=cfg) as c:
        assert (await c.call(name, {})).value == "done"  # a latency to hedge after
        gates["h"] = gate = asyncio.Event()
        primary = asyncio.create_task(c.call(name, {"gate": "h"}, deadline_s=30))
        await _until(lambda: runs == ["", "h"], "the call did not start")
        _register_same_code(reg, side_effects=True)
        clock = c._fns[name].hedge_clock
        # the hedge's time came (its callback ran) and went
        await _until(lambda: not clock._q and clock._timer is None, "the hedge's time did not come")
        gate.set()
        r = await primary
    assert r.ok, r.error
    assert runs == ["", "h"] and c.metrics()[name]["hedges"] == 0, runs


async def test_a_keyed_execution_is_not_retried_under_code_its_key_does_not_name(loader):
    """The key names the code (name:version:key), so a caller after a re-registration gets
    an execution of its own under the new code. The old key's execution, its pure old code
    failed, was retried under the new code, which has side effects: two executions of the
    new code's effect beside each other under one idempotency key."""
    name, mod_name, load = loader
    module = load("v1", side_effects=False)
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        module.GATES["a"] = gate = asyncio.Event()
        payload = {"fail": True, "gate": "a"}
        first = asyncio.create_task(c.call(name, payload, idempotency_key="k", deadline_s=30))
        await _until(lambda: module.RUNS == ["v1"], "the old code's call did not start")

        load("v2", side_effects=True)
        reg.discover(mod_name)
        module.GATES["b"] = asyncio.Event()
        module.GATES["b"].set()
        later = await c.call(name, {"gate": "b"}, idempotency_key="k")  # the new code, its own key
        assert later.ok and later.value == "v2", later.error
        gate.set()
        r = await first
    assert r.error is not None and r.error.type == ErrorCode.UNAVAILABLE, r.error
    assert "registered again" in r.error.message, r.error.message
    assert module.RUNS == ["v1", "v2"] and r.attempts == 1, (module.RUNS, r.attempts)


async def test_a_keyed_execution_that_waited_for_a_slot_is_not_sent_to_new_code(loader):
    """The same, before the first attempt: the execution waited for a concurrency slot while
    the function was registered again, then sent its old key's call to the new code."""
    name, mod_name, load = loader
    module = load("v1", side_effects=True)
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        module.GATES["hold"] = hold = asyncio.Event()
        holder = asyncio.create_task(c.call(name, {"gate": "hold"}, deadline_s=30))
        await _until(lambda: module.RUNS == ["v1"], "the slot holder did not start")
        fn_slots = c._fns[name].sem
        # every other slot taken too, so that the keyed call waits for the holder's
        taken = 0
        while fn_slots.take_now():
            taken += 1
        module.GATES["a"] = asyncio.Event()
        module.GATES["a"].set()
        waiting = asyncio.create_task(c.call(name, {"gate": "a"}, idempotency_key="k", deadline_s=30))
        await _until(lambda: bool(fn_slots._waiters), "the keyed call did not wait for a slot")

        load("v2", side_effects=True)
        reg.discover(mod_name)
        hold.set()
        assert (await holder).value == "v1"
        for _ in range(taken):
            fn_slots.release()
        r = await waiting
    assert r.error is not None and r.error.type == ErrorCode.NOT_STARTED, r.error
    assert "registered again" in r.error.message, r.error.message
    assert module.RUNS == ["v1"], module.RUNS  # neither code ran under the old key
