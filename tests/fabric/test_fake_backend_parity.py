"""``FakeBackend`` answers what the local backends answer for what a user's function does
wrong: a test written against the fake sees the error code, and so the retries, that the
deployed function gets."""

from __future__ import annotations

import importlib
import sys
import time

import pytest

from fabric.backends.inproc import InprocBackend
from fabric.errors import RETRYABLE, ErrorCode
from fabric.protocol import Invocation
from fabric.registry import Registry
from fabric.testing import FakeBackend

REG = Registry()


def broken_setup() -> object:
    raise RuntimeError("model file missing")


@REG.reward(setup=broken_setup)
def needs_setup(traj: str, ctx: object = None) -> float:
    return 1.0


@REG.reward(timeout_s=0.05)
def past_its_limit(traj: str) -> float:
    time.sleep(0.2)  # a worker is killed at 0.05 s
    return 1.0


@REG.reward
def quick(traj: str) -> float:
    return 1.0


BACKENDS = [FakeBackend, InprocBackend]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.kind)
async def test_a_setup_hook_that_raises_is_setup_failed_not_retried(backend):
    """The fake let the hook's exception out of _invoke: the client made it a retryable
    TransportError and ran the hook again on each retry."""
    async with backend(REG) as be:
        res = await be.invoke(Invocation(function="needs_setup", payload={"traj": "a"}))
    assert res.error is not None and res.error.type == ErrorCode.SETUP_FAILED
    assert "RuntimeError: model file missing" in res.error.message
    assert res.error.type not in RETRYABLE


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.kind)
async def test_a_synchronous_call_past_timeout_s_is_a_function_timeout(backend):
    """The fake answered it ok, after it ran to its end: a test of the caller's handling of
    a timeout (its retry, a reward's failure_score) saw none."""
    async with backend(REG) as be:
        res = await be.invoke(Invocation(function="past_its_limit", payload={"traj": "a"}))
    assert res.error is not None and res.error.type == ErrorCode.TIMEOUT
    assert "past_its_limit ran past its 0.05 s limit" in res.error.message


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.kind)
async def test_a_call_whose_deadline_passed_before_it_started_is_not_run(backend):
    """The fake ran it (ok, started=True): a test of what a caller does at its deadline saw
    the function's answer instead of DeadlineExceeded, and an execution the backends never make."""
    async with backend(REG) as be:
        inv = Invocation(function="quick", payload={"traj": "a"}, deadline=time.time() - 1)
        res = await be.invoke(inv)
    assert res.error is not None and res.error.type == ErrorCode.DEADLINE_EXCEEDED
    assert res.started is False


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.kind)
async def test_a_function_registered_again_runs_its_new_code(backend, tmp_path, monkeypatch):
    """A notebook cell run again, a module reloaded: the fake kept the first runner by name
    and answered with the old code, where the local backends run the new registration."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no stale .pyc of the same second
    mod_name = f"fake_parity_{backend.kind}"
    path = tmp_path / f"{mod_name}.py"
    source = "import fabric\n\n@fabric.function(name='parity_{kind}')\ndef answer() -> str:\n"
    source += "    return '{v}'\n"
    path.write_text(source.format(kind=backend.kind, v="v1"))
    reg = Registry()
    reg.discover(mod_name)
    try:
        async with backend(reg) as be:
            first = await be.invoke(Invocation(function=f"parity_{backend.kind}"))
            path.write_text(source.format(kind=backend.kind, v="v2"))
            importlib.invalidate_caches()
            importlib.reload(sys.modules[mod_name])
            reg.discover(mod_name)  # registered again: same entry, new code
            again = await be.invoke(Invocation(function=f"parity_{backend.kind}"))
    finally:
        sys.modules.pop(mod_name, None)
    assert (first.value, again.value) == ("v1", "v2")
