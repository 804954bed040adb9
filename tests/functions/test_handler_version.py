"""The Lambda handler says which version of a function it ran (``Result.version``, what the
client checks against its own registry's): on an answer, on the function's own failure, and
on an answer kept under an idempotency key, on the OutcomeUnknown of a side effect that may
have run; nothing on a refusal, where nothing ran. The
Modal runtime says so too."""

from __future__ import annotations

import pytest

pytest.importorskip("aws_lambda_powertools")

import handler_fns
from handler_fixtures import aws_fixture, lambda_env_fixture, table_fixture  # noqa: F401 - by name=
from handler_fns import CALLS, LambdaContext
from handler_helpers import invoke

from fabric.errors import ErrorCode
from fabric.protocol import Invocation


def test_an_answer_and_a_failure_say_the_version_that_ran() -> None:
    ok = invoke("counted", {"key": "a"})
    assert ok.ok and ok.version == handler_fns.REG.get("counted").version
    failed = invoke("broken", {"key": "b"})
    assert failed.error.type == ErrorCode.USER_ERROR
    assert failed.version == handler_fns.REG.get("broken").version
    # refused before anything ran: no code answered
    assert invoke("no_such_function").version is None


def test_a_kept_answer_says_the_version_that_ran(table) -> None:
    first = invoke("counted", {"key": "k"}, idempotency_key="K1")
    again = invoke("counted", {"key": "k"}, idempotency_key="K1")
    assert CALLS["counted:k"] == 1
    assert again.version == first.version == handler_fns.REG.get("counted").version


def test_an_effect_that_may_have_run_says_the_version_that_ran(table) -> None:
    # the OutcomeUnknown that replaces a cut side effect's Timeout was built afresh, with no
    # version: an answer of code that ran read as one no code gave, and the client's check
    # of the version that ran had nothing to check
    version = handler_fns.REG.get("async_effect").version
    payload = {"key": "v7", "seconds": 1.0}
    cut = invoke("async_effect", payload, idempotency_key="order-v7", ctx=LambdaContext(remaining_ms=700))
    assert cut.error is not None and cut.error.type == ErrorCode.OUTCOME_UNKNOWN
    assert cut.version == version
    kept = invoke("async_effect", payload, idempotency_key="order-v7")
    assert kept.cached and kept.version == version


def test_the_modal_runtime_says_the_version_that_ran() -> None:
    from sample_fns import REG

    from fabric.deploy import modal_runtime

    try:
        inv = Invocation(function="add", payload={"a": 1, "b": 2})
        out = modal_runtime.run("add", "sample_fns", inv.model_dump(mode="json"))
    finally:
        modal_runtime.reset()
    assert out["ok"] and out["value"] == 3 and out["version"] == REG.get("add").version
