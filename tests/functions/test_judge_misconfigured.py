"""A setup fault of a built-in reward (the judge's key refused, its model or URL unknown, a
rubric without ``{response}``, no model configured, a tool not installed) fails as
``Misconfigured``, which no ``failure_score`` scores, saying what to fix; a fault of the
response (a judge reply with no score, a request the endpoint refuses for its size) stays a
``UserError``."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from judge_helpers import ENTRY, fake_openai, judge_maker, traj

from fabric.errors import ErrorCode, Misconfigured
from fabric.protocol import encode_payload
from fabric.runner import FunctionRunner
from functions.fakes import FakeOpenAI
from functions.fakes.openai_server import Scripted
from functions.rewards import judge as judge_mod
from functions.rewards import math_sympy
from functions.rewards.judge_errors import JudgeRejectedError, JudgeResponseError
from functions.verifiers import languages

srv = pytest.fixture(fake_openai, name="srv")
make_judge = pytest.fixture(judge_maker, name="make_judge")


def _error(status: int, message: str) -> Scripted:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()
    return Scripted(status=status, body=body, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("status", "hint"),
    [
        (401, r"check the API key \(OPENAI_API_KEY"),
        (403, "not allowed to use this model"),
        (404, r"check base_url .* and the model name"),
    ],
)
async def test_a_refusal_of_the_key_model_or_url_is_misconfigured(srv, make_judge, status, hint):
    srv.enqueue(_error(status, "refused"))
    judge = make_judge(srv)
    with pytest.raises(Misconfigured, match=rf"HTTP {status}.*{hint}") as e:
        await judge.score("Paris", question="Capital of France?")
    assert isinstance(e.value, JudgeRejectedError)  # still what callers of Judge catch
    assert len(srv.chat_requests) == 1  # not retried


async def test_a_refusal_the_request_may_cause_stays_a_rejection(srv, make_judge):
    # a 400 may be this response's own (past the model's context): not a setup fault
    srv.enqueue(_error(400, "maximum context length exceeded"))
    judge = make_judge(srv)
    with pytest.raises(JudgeRejectedError, match="HTTP 400") as e:
        await judge.score("x" * 100)
    assert not isinstance(e.value, Misconfigured)


async def test_a_rubric_without_response_given_with_the_call_is_misconfigured(srv, make_judge):
    judge = make_judge(srv)
    with pytest.raises(Misconfigured, match=r"must contain \{response\}.*fix the rubric argument"):
        await judge.score("Paris", rubric="Rate it from {min_score} to {max_score}.")
    assert srv.chat_requests == []


def _run(payload: dict) -> tuple[bool, object]:
    import asyncio

    runner = FunctionRunner.from_entry(ENTRY)
    return asyncio.run(runner.run_async(encode_payload(payload), 30.0))


def _judged(monkeypatch, env: dict[str, str], **fake: Any) -> tuple[str, str]:
    """The failed run's error code and message, the judge's config from ``env`` beside the
    fake endpoint's (its own shared client made afresh)."""
    with FakeOpenAI(**fake) as s:
        for k, v in {**s.env, **env}.items():
            monkeypatch.setenv(k, v)
        judge_mod._shared.clear()
        ok, out = _run({"traj": traj("Capital of France?", "Paris")})
    judge_mod._shared.clear()
    assert not ok
    code, message, _ = out  # type: ignore[misc]
    return code, message


def test_the_reward_reports_a_refused_key_as_misconfigured(monkeypatch):
    code, message = _judged(monkeypatch, {"RL_FABRIC_JUDGE_API_KEY": "sk-wrong"}, api_key="sk-right")
    assert code == ErrorCode.MISCONFIGURED and "HTTP 401" in message and "check the API key" in message


def test_the_reward_without_a_model_configured_is_misconfigured(monkeypatch):
    # a direct call (no setup hook ran: a composite's component) reads the config at the call
    monkeypatch.delenv("RL_FABRIC_JUDGE_MODEL", raising=False)
    monkeypatch.setenv("RL_FABRIC_JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
    judge_mod._shared.clear()
    ok, out = _run({"traj": "Paris"})
    judge_mod._shared.clear()
    assert not ok
    code, message, _ = out  # type: ignore[misc]
    assert code == ErrorCode.MISCONFIGURED and "set RL_FABRIC_JUDGE_MODEL" in message


def test_a_reply_with_no_score_is_still_the_responses_user_error(monkeypatch):
    code, message = _judged(monkeypatch, {}, reply="I will not grade this.")
    assert code == ErrorCode.USER_ERROR and JudgeResponseError.__name__ in message


def test_a_composite_with_a_misconfigured_judge_component_is_misconfigured(monkeypatch):
    from functions.rewards import compose

    monkeypatch.delenv("RL_FABRIC_JUDGE_MODEL", raising=False)
    monkeypatch.setattr(compose, "_runners", {})
    spec = {"components": [{"name": "judge", "function": "llm_judge"}]}
    runner = FunctionRunner.from_entry("functions.rewards.compose:composite")
    ok, out = runner.run(encode_payload({"traj": traj("q?", "a").model_dump(), "spec": spec}))
    assert not ok
    code, message, _ = out
    assert code == ErrorCode.MISCONFIGURED and "llm_judge" in message and "RL_FABRIC_JUDGE_MODEL" in message


def test_a_language_whose_tool_is_not_installed_is_misconfigured(monkeypatch):
    monkeypatch.setattr(languages.Language, "tool", lambda self: None)
    with pytest.raises(Misconfigured, match="not installed on this worker; install it"):
        languages.get_language("cpp")
    with pytest.raises(ValueError, match="unknown language"):  # the task's, not the worker's
        languages.get_language("cobol")


def test_math_without_sympy_is_misconfigured(monkeypatch):
    monkeypatch.setattr(math_sympy, "_sympy", None)
    monkeypatch.setitem(sys.modules, "sympy", None)  # import sympy raises ImportError
    with pytest.raises(Misconfigured, match="needs sympy"):
        math_sympy._load_sympy()
