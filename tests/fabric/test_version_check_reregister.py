"""The client's version check (``ClientConfig.version_check``) across re-registrations: an
answer is other code's only when its version is none that this client's registry held for
the function from the time the attempt was sent on. Code registered after the send is the
caller's too (the local backend hands a replaced pool's queued calls to the pool of the
function as registered then, on purpose); code registered only before the send, or never,
is other code (a deployment not redeployed)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import pytest
from lambda_helpers import lam
from rewritable_module import module_loader
from test_version_check import gateway
from version_fns import OLD

from fabric.backends.base import LocalConfig
from fabric.backends.inproc import InprocBackend
from fabric.backends.lambda_ import LambdaBackend
from fabric.backends.local import LocalBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import SPEC_ATTR, Registry

_CODE = """
import os
import time
import fabric

@fabric.function(name="{name}", timeout_s=30, max_concurrency=4, warm=1, retry={{"max_attempts": 1}})
def answer(started: str = "", release: str = "", die: bool = False) -> str:
    if started:
        open(started, "w").close()
    t_end = time.monotonic() + 20
    while release and not os.path.exists(release) and time.monotonic() < t_end:
        time.sleep(0.01)  # a run under way until the test lets it end
    if die:
        os._exit(7)  # the worker dies under this run: the calls queued behind it never ran
    return "{code}"
"""
_NAMES = itertools.count(1)


async def _until(predicate: Any, what: str, within_s: float = 15.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def held(backend: LocalBackend, name: str) -> int:
    """The calls the function's pool now holds, queued or sent to its worker."""
    stats = backend.stats()[name]
    return int(stats["pending"] + stats["inflight"])


def _mismatch_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not version" in r.getMessage()]


async def test_an_answer_of_code_registered_after_the_call_was_sent_is_no_mismatch(
    tmp_path, monkeypatch, caplog
):
    """A call sent under v1 queued behind the v1 pool's only worker; v2 registered (a new
    pool), the v1 worker died, and the queued call went to the v2 pool (the function's pool
    then), where it waited; v3 registered and called. The v2 pool answered it: code this
    client registered after the call was sent. Compared with v3 alone (the registry's now)
    and v1 (the send's), it was refused as VersionMismatch, "deployed before the function
    was edited?", on the local backend, which runs nothing but registered code."""
    name = f"vc_rereg_{next(_NAMES)}"
    files = {k: str(tmp_path / k) for k in ("started1", "release1", "started2", "release2")}
    reg = Registry()
    with module_loader(tmp_path, monkeypatch, f"vc_rereg_mod_{name}") as load:
        mod_name = load(_CODE.format(name=name, code="v1")).__name__
        reg.discover(mod_name)
        cfg = {"version_check": "refuse", "hedge": {"enabled": False}}
        backend = LocalBackend(reg, LocalConfig(max_workers=1))
        with caplog.at_level(logging.WARNING, logger="fabric.client"):
            async with Client(backend=backend, registry=reg, config=cfg) as c:
                assert (await c.call(name, {})).ok
                dying = asyncio.ensure_future(
                    c.call(name, {"started": files["started1"], "release": files["release1"], "die": True})
                )
                await _until(lambda: (tmp_path / "started1").exists(), "the v1 run to start")
                queued = asyncio.ensure_future(c.call(name, {}))  # sent under v1, queued there
                await _until(lambda: held(backend, name) == 2, "the call to queue on v1")

                load(_CODE.format(name=name, code="v2"))
                reg.discover(mod_name)
                busy = asyncio.ensure_future(
                    c.call(name, {"started": files["started2"], "release": files["release2"]})
                )
                await _until(lambda: (tmp_path / "started2").exists(), "the v2 run to start")
                (tmp_path / "release1").touch()  # the v1 worker dies: its queue goes to the v2 pool
                lost = await asyncio.wait_for(dying, 15)
                assert lost.error is not None and lost.error.type == ErrorCode.WORKER_LOST, lost
                await _until(lambda: held(backend, name) == 2, "the call to queue on v2")

                load(_CODE.format(name=name, code="v3"))
                reg.discover(mod_name)
                v3 = await c.call(name, {})
                assert v3.ok and v3.value == "v3", v3.error

                (tmp_path / "release2").touch()  # the v2 pool (retired) serves what it holds
                assert (await asyncio.wait_for(busy, 15)).value == "v2"
                r = await asyncio.wait_for(queued, 15)
                m = c.metrics()[name]
    assert r.ok and r.value == "v2", r.error
    assert m["version_mismatches"] == 0 and _mismatch_warnings(caplog) == []


def _registered(reg: Registry, fn: Any, version: str) -> None:
    """``fn`` registered again in ``reg`` as code of ``version`` (as a module edited and reloaded)."""
    setattr(fn, SPEC_ATTR, getattr(fn, SPEC_ATTR).model_copy(update={"version": version}))
    reg.add(fn)


def _plain(x: int) -> int:
    return x


class AnswersAs(InprocBackend):
    """Answers with ``version``, after ``during()`` (registrations made while the first call
    runs)."""

    def __init__(self, reg: Registry, version: str, during: Any = None) -> None:
        super().__init__(reg)
        self.version, self.during = version, during

    async def _run(self, inv: Invocation, keyed: Any) -> Result:
        if self.during is not None:
            self.during, during = None, self.during
            during()
        r = Result(ok=True, value=inv.payload["x"], function=inv.function, request_id=inv.request_id)
        r.version = self.version
        return r


@pytest.mark.parametrize(
    ("ran", "mismatch"),
    [
        ("v3", False),  # registered while the call ran, since replaced: the caller's code too
        ("v4", False),  # the code registered now
        ("v1", True),  # registered before the one the call was sent to: a stale deployment
        ("v0", True),  # never registered here
    ],
)
async def test_a_mismatch_is_an_answer_of_no_code_registered_since_the_send(ran, mismatch, caplog):
    reg = Registry()
    reg.function(name="plain", warm=0)(_plain)
    _registered(reg, _plain, "v1")
    _registered(reg, _plain, "v2")  # the call is sent to v2

    def during() -> None:
        _registered(reg, _plain, "v3")
        _registered(reg, _plain, "v4")

    backend = AnswersAs(reg, ran, during)
    with caplog.at_level(logging.WARNING, logger="fabric.client"):
        async with Client(backend=backend, registry=reg, config={"version_check": "refuse"}) as c:
            r = await c.call("plain", {"x": 1})
            again = await c.call("plain", {"x": 2})  # sent to v4: only v4 is its code
            m = c.metrics()["plain"]
    assert r.ok is not mismatch and r.version == ran
    if mismatch:
        assert r.error.type == ErrorCode.VERSION_MISMATCH
    assert again.ok is (ran == "v4")
    assert m["version_mismatches"] == int(mismatch) + int(ran != "v4")


# ----------------------------------------------------------------------------- a deployment


def _scale_here(x: int) -> int:
    return x * 3  # never run: the fabric serve below runs OLD's code


class EditedMeanwhile(LambdaBackend):
    """A lambda backend (to a fabric serve) whose first call is sent, then ``during()`` runs:
    the caller's edits while its call is out."""

    def __init__(self, reg: Registry, config: Any, during: Any) -> None:
        super().__init__(reg, config)
        self.during = during

    async def _invoke(self, inv: Invocation) -> Result:
        call = asyncio.ensure_future(super()._invoke(inv))
        if self.during is not None:
            self.during, during = None, self.during
            during()
        return await call


async def test_a_deployment_of_code_registered_here_for_a_while_since_the_send_is_other_code(caplog):
    """A fabric serve of the old code (OLD, as a Lambda not redeployed); the caller's code is
    v2, and a call goes out. Meanwhile the caller's edit is undone and done again (a stash
    and its pop: the old code registered here again, then v2). The deployment's answer, the
    old code's, was taken as code registered since the send, "the caller's too": but a
    deployment does not follow the caller's registry (only the local backends run what it
    holds, and hand a queued call to the code registered since). Its code is neither what the
    call was sent to nor what is registered now, and under refuse its answer was given."""
    reg = Registry()
    reg.function(name="scale", warm=0)(_scale_here)
    spec = getattr(_scale_here, SPEC_ATTR)
    old_v = OLD.get("scale").version
    assert spec.version != old_v

    def during() -> None:
        try:
            _registered(reg, _scale_here, old_v)  # the edit undone (the old code, registered here)
            _registered(reg, _scale_here, spec.version)  # and done again
        finally:
            setattr(_scale_here, SPEC_ATTR, spec)

    cfg = {"version_check": "refuse", "hedge": {"enabled": False}}
    with caplog.at_level(logging.WARNING, logger="fabric.client"):
        async with (
            gateway(OLD) as gw,
            EditedMeanwhile(reg, lam(gw, "http"), during) as backend,
            Client(backend=backend, registry=reg, config=cfg) as c,
        ):
            r = await c.call("scale", {"x": 5})
            again = await c.call("scale", {"x": 6})  # sent to v2 alone: refused as ever
            m = c.metrics()["scale"]
    assert reg.versions("scale") == [spec.version, old_v, spec.version]
    assert r.version == old_v and again.version == old_v
    assert not r.ok and r.error.type == ErrorCode.VERSION_MISMATCH, r
    assert again.error.type == ErrorCode.VERSION_MISMATCH
    assert m["version_mismatches"] == 2
