"""The version of the code that answered (``Result.version``), filled by every place that
runs a function, and the client's check of it against its own registry's
(``ClientConfig.version_check``): a deployment older than the caller's code (a function edited
and not redeployed, a ``fabric serve`` not restarted) is said, or refused, instead of its
answers passing, and being kept under the new code's idempotency keys, silently. A fabric serve
over real HTTP started from another registry; inproc for what the client keeps under a key."""

from __future__ import annotations

import logging

import pytest
from lambda_helpers import TOKEN, lam, transport_fixture  # noqa: F401 - by name=
from sample_fns import REG
from version_fns import NEW, OLD, RUNS

from fabric.backends.base import LocalConfig
from fabric.backends.inproc import InprocBackend
from fabric.backends.lambda_ import _as_result
from fabric.client import Client
from fabric.errors import ConfigError, ErrorCode, InvocationError
from fabric.protocol import Invocation, Result
from fabric.serve import Gateway, ServeConfig, TenantConfig

OLD_V = OLD.get("scale").version
NEW_V = NEW.get("scale").version


def gateway(registry) -> Gateway:
    cfg = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN, max_concurrency=64)},
        backend=LocalConfig(max_workers=2),
        warm=False,
    )
    return Gateway(cfg, registry)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "fabric.client" and r.levelno >= logging.WARNING
    ]


@pytest.fixture(autouse=True)
def _runs():
    assert OLD_V != NEW_V  # the premise: other code, another version
    RUNS.clear()
    yield
    RUNS.clear()


# ----------------------------------------------------------------------------- same code


@pytest.mark.parametrize("backend", ["local", "inproc"])
async def test_the_local_backends_answer_with_the_version_they_ran_and_nothing_is_said(backend, caplog):
    caplog.set_level(logging.WARNING, logger="fabric.client")
    async with Client(backend=backend, registry=REG) as c:
        ok = await c.call("add", {"a": 2, "b": 3})
        failed = await c.call("boom", {"x": 1})
        m = c.metrics()
    assert ok.ok and ok.version == REG.get("add").version
    # a failure of the code is that code's too
    assert failed.error.type == ErrorCode.USER_ERROR and failed.version == REG.get("boom").version
    assert m["add"]["version_mismatches"] == 0 and m["boom"]["version_mismatches"] == 0
    assert warnings(caplog) == []


async def test_a_fabric_serve_of_the_same_code_answers_with_the_caller_s_version(caplog):
    caplog.set_level(logging.WARNING, logger="fabric.client")
    async with gateway(NEW) as gw, Client(backend=lam(gw), registry=NEW) as c:
        r = await c.call("scale", {"x": 5})
        m = c.metrics()["scale"]
    assert r.ok and r.value == 15 and r.version == NEW_V
    assert m["version_mismatches"] == 0 and warnings(caplog) == []


# ----------------------------------------------------------------------------- other code


async def test_a_fabric_serve_of_older_code_is_said_once_per_function_and_counted(caplog, transport):
    """Before: the old code's answers came back as the new code's, and nothing was said."""
    caplog.set_level(logging.WARNING, logger="fabric.client")
    async with gateway(OLD) as gw, Client(backend=lam(gw, transport), registry=NEW) as c:
        first = await c.call("scale", {"x": 5})
        again = await c.call("scale", {"x": 6})
        m = c.metrics()["scale"]
    # warn (the default) gives the answer, and says whose it is
    assert first.ok and first.value == 10 and again.value == 12
    assert first.version == OLD_V and again.version == OLD_V
    assert m["version_mismatches"] == 2 and m["ok"] == 2
    [said] = warnings(caplog)
    assert "'scale'" in said and OLD_V in said and NEW_V in said
    assert "fabric deploy -f scale" in said and "restart" in said and "fabric serve" in said


async def test_refuse_fails_an_answer_of_other_code_final_and_started(caplog):
    async with (
        gateway(OLD) as gw,
        Client(backend=lam(gw), registry=NEW, config={"version_check": "refuse"}) as c,
    ):
        r = await c.call("scale", {"x": 5})
        m = c.metrics()["scale"]
    assert not r.ok and r.error.type == ErrorCode.VERSION_MISMATCH
    assert not r.retryable and r.attempts == 1  # another attempt runs the same old code
    assert r.started is True  # it did run there, effects and all
    assert r.version == OLD_V and r.value is None
    msg = r.error.message
    assert OLD_V in msg and NEW_V in msg and "fabric deploy -f scale" in msg and "fabric serve" in msg
    assert m["errors"] == {ErrorCode.VERSION_MISMATCH: 1} and m["version_mismatches"] == 1
    with pytest.raises(InvocationError, match="VersionMismatch"):
        r.unwrap()


async def test_off_checks_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="fabric.client")
    async with (
        gateway(OLD) as gw,
        Client(backend=lam(gw), registry=NEW, config={"version_check": "off"}) as c,
    ):
        r = await c.call("scale", {"x": 5})
        m = c.metrics()["scale"]
    assert r.ok and r.value == 10 and r.version == OLD_V  # still said on the answer
    assert m["version_mismatches"] == 0 and warnings(caplog) == []


def test_version_check_is_validated():
    with pytest.raises(ConfigError, match="version_check") as e:
        Client(backend="inproc", registry=REG, config={"version_check": "strict"})
    assert "'warn'" in str(e.value) and "'refuse'" in str(e.value) and "'off'" in str(e.value)


async def test_an_older_peer_says_no_version_and_nothing_is_checked(caplog):
    """A handler deployed from code older than the field sends no version: None, as
    ``Result.started``; the check is skipped, refuse or not."""
    older = {"ok": True, "function": "scale", "request_id": "r", "value": 10, "timings": {}, "worker": "w"}
    assert _as_result(older).version is None

    class OlderPeer(InprocBackend):
        async def _invoke(self, inv: Invocation) -> Result:
            r = await super()._invoke(inv)
            r.version = None
            return r

    caplog.set_level(logging.WARNING, logger="fabric.client")
    async with Client(backend=OlderPeer(OLD), registry=NEW, config={"version_check": "refuse"}) as c:
        r = await c.call("scale", {"x": 5})
    assert r.ok and r.value == 10 and warnings(caplog) == []


# ----------------------------------------------------------------------------- idempotency keys


@pytest.mark.parametrize("check", ["warn", "refuse"])
async def test_an_answer_of_other_code_is_not_kept_under_a_key_that_names_the_caller_s_code(check):
    """The key is name:version:key with the caller's version. Before: the old code's answer was
    kept under it, and served as the new code's answer to every later call with the key, even
    after a redeploy. For a pure function the key stays free (a call after the redeploy runs
    the new code); nothing ran twice that should not have."""
    async with Client(backend=InprocBackend(OLD), registry=NEW, config={"version_check": check}) as c:
        first = await c.call("scale", {"x": 1}, idempotency_key="traj-1")
        again = await c.call("scale", {"x": 1}, idempotency_key="traj-1")
    assert RUNS == ["old", "old"]
    assert not again.cached and again.version == OLD_V
    assert first.ok == again.ok == (check == "warn")


@pytest.mark.parametrize("check", ["warn", "refuse"])
async def test_a_side_effect_of_other_code_is_kept_and_says_which_code_ran(check):
    """A tool with side effects ran (the old code's effect happened): not run again under the
    key; what the key keeps says the version that ran, never the key's."""
    async with Client(backend=InprocBackend(OLD), registry=NEW, config={"version_check": check}) as c:
        first = await c.call("send", {"x": 1}, idempotency_key="traj-2")
        again = await c.call("send", {"x": 1}, idempotency_key="traj-2")
    assert RUNS == ["send-old"]
    assert again.cached and again.version == first.version == OLD.get("send").version
    if check == "refuse":
        assert again.error.type == ErrorCode.VERSION_MISMATCH
    else:
        assert again.ok
