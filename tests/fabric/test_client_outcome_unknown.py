"""``OutcomeUnknown`` across a re-registration. An idempotency key names the code
(``name:version:key``), so what a key keeps is not seen once the function is registered
again with new code. For an answer that is right: it is that code's answer. But an
``OutcomeUnknown`` is no answer: it says a side effect may have happened in the world, and
new code does not make that known. Kept under the old code's key only, a caller retrying
with the same key after the re-registration ran the effect again."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from rewritable_module import module_loader

from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.registry import Registry

# RUNS outlives a reload (it runs the new source in the same module dict): each code's runs
# are counted in one place
_SOURCE = """
import fabric
from fabric.errors import Unavailable

RUNS = globals().setdefault("RUNS", [])

@fabric.function(name="{name}", warm=0, side_effects={side_effects})
async def charge(fail: bool = False) -> str:
    RUNS.append("{code}")  # the effect happens, then its dependency fails: it may have run
    if fail:
        raise Unavailable("the payment service went away mid-call")
    return "{code}"
"""

_NAMES = itertools.count(1)

Load = Callable[[str, bool], ModuleType]


@pytest.fixture
def loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[tuple[str, str, Load]]:
    """The function's name, its module's, and ``load(code, side_effects)``: writes the module
    and imports it, or reloads it (registered again once discovered again)."""
    mod_name = f"unknown_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    fn_name = f"charge_{next(_NAMES)}"  # the decorator registers it in the default registry too
    with module_loader(tmp_path, monkeypatch, mod_name) as write:

        def load(code: str, side_effects: bool = True) -> ModuleType:
            return write(_SOURCE.format(name=fn_name, code=code, side_effects=side_effects))

        yield fn_name, mod_name, load


async def _unknown_then_new_code(loader, side_effects_after: bool, key_after: str = "k"):
    name, mod_name, load = loader
    module = load("v1")
    module.RUNS.clear()
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        first = await c.call(name, {"fail": True}, idempotency_key="k")
        assert first.error is not None and first.error.type == ErrorCode.UNAVAILABLE, first.error
        kept = await c.call(name, {}, idempotency_key="k")
        assert kept.error is not None and kept.error.type == ErrorCode.OUTCOME_UNKNOWN, kept.error
        v1 = reg.get(name).version
        load("v2", side_effects_after)  # new code, same name
        reg.discover(mod_name)
        assert reg.get(name).version != v1
        r = await c.call(name, {}, idempotency_key=key_after)
        return r, c.metrics()[name], module.RUNS


async def test_an_outcome_unknown_is_kept_for_the_new_code_of_a_side_effect(loader):
    r, m, runs = await _unknown_then_new_code(loader, side_effects_after=True)
    assert runs == ["v1"], f"the effect ran again under new code: {runs}"
    assert r.error is not None and r.error.type == ErrorCode.OUTCOME_UNKNOWN and r.cached, r.error
    assert "may have run" in r.error.message and "new idempotency key" in r.error.message
    assert m["cache_hits"] == 2


async def test_new_code_without_side_effects_runs_under_the_key(loader):
    """Nothing to apply twice: new code declared without side effects runs under the key
    (its answer is its own)."""
    r, _, runs = await _unknown_then_new_code(loader, side_effects_after=False)
    assert r.ok and r.value == "v2" and runs == ["v1", "v2"], (r.error, runs)


async def test_a_new_key_runs_the_new_code(loader):
    r, _, runs = await _unknown_then_new_code(loader, side_effects_after=True, key_after="k2")
    assert r.ok and r.value == "v2" and runs == ["v1", "v2"], (r.error, runs)


async def test_an_answer_kept_for_old_code_is_not_the_new_codes(loader):
    """What stays per code: a kept answer (here a success) is the answer of the code that
    gave it; the new code's caller gets the new code's (docs/fabric.md says why)."""
    name, mod_name, load = loader
    module = load("v1")
    module.RUNS.clear()
    reg = Registry()
    reg.discover(mod_name)
    async with Client(backend="inproc", registry=reg, config={"hedge": {"enabled": False}}) as c:
        assert (await c.call(name, {}, idempotency_key="k")).value == "v1"
        load("v2")
        reg.discover(mod_name)
        r = await c.call(name, {}, idempotency_key="k")
    assert r.ok and r.value == "v2" and not r.cached and module.RUNS == ["v1", "v2"]
