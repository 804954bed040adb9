"""Review 17 of ``OpenAIEngine`` against OpenAI's own API and a wrong ``base_url``.

* OpenAI's reasoning models (o-series, gpt-5) refuse ``max_tokens`` (400
  ``unsupported_parameter``): they read ``max_completion_tokens``, and the engine always sent
  ``max_tokens``, so a policy served by one failed every turn. ``max_tokens_field`` chooses the
  field, ``max_completion_tokens`` for OpenAI's API by default (as the LLM judge does).
* A ``base_url`` at a web UI (its index answers every path 200 with HTML) failed each turn
  with a generic "body that is not JSON" error: it is the endpoint's setup, said so, naming
  the URL and the page, and not retried (as the judge's ``Misconfigured`` for the same page).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.rollout.engines.base import EngineError, GenerateRequest
from core.rollout.engines.openai_ import OPENAI_URL, OpenAIEngine, OpenAIEngineConfig, OpenAIEngineError
from fabric.protocol import Message
from functions.fakes import FakeOpenAI, Scripted


@pytest.fixture
def srv():
    with FakeOpenAI(reply="go left", model="fake-policy") as s:
        yield s


def make(srv: FakeOpenAI, **cfg: Any) -> OpenAIEngine:
    cfg.setdefault("max_retries", 0)
    return OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key=srv.api_key, **cfg)


def chat(max_new_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(messages=[Message(role="user", content="hi")], max_new_tokens=max_new_tokens)


def test_openais_api_gets_max_completion_tokens_other_servers_max_tokens():
    assert OpenAIEngineConfig(model="gpt-5").reply_limit_field == "max_completion_tokens"
    assert (
        OpenAIEngineConfig(model="o3", base_url=OPENAI_URL + "/").reply_limit_field == "max_completion_tokens"
    )
    assert OpenAIEngineConfig(model="m", base_url="http://gpu-3:8000/v1").reply_limit_field == "max_tokens"
    cfg = OpenAIEngineConfig(
        model="m", base_url="http://gpu-3:8000/v1", max_tokens_field="max_completion_tokens"
    )
    assert cfg.reply_limit_field == "max_completion_tokens"
    cfg = OpenAIEngineConfig(model="gpt-4o", max_tokens_field="max_tokens")
    assert cfg.reply_limit_field == "max_tokens"


def test_the_body_for_openais_api_carries_max_completion_tokens():
    engine = OpenAIEngine(model="gpt-5", api_key="sk-test")  # base_url: OpenAI's
    body = engine._body(chat(32))
    assert body["max_completion_tokens"] == 32 and "max_tokens" not in body


async def test_max_tokens_field_names_the_field_sent(srv):
    async with make(srv) as engine:
        await engine.generate(chat(16))
    async with make(srv, max_tokens_field="max_completion_tokens") as engine:
        await engine.generate(chat(16))
    first, second = (r.json for r in srv.chat_requests)
    assert first["max_tokens"] == 16 and "max_completion_tokens" not in first
    assert second["max_completion_tokens"] == 16 and "max_tokens" not in second


async def test_what_fits_is_asked_for_in_the_same_field(srv):
    message = (
        "'max_tokens' or 'max_completion_tokens' is too large: 64. This model's maximum context "
        "length is 1024 tokens and your request has 1000 input tokens (64 > 1024 - 1000)."
    )
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}})
    srv.enqueue(Scripted(status=400, body=body.encode()))
    async with make(srv, max_tokens_field="max_completion_tokens") as engine:
        await engine.generate(chat(64))
    assert [r.json.get("max_completion_tokens") for r in srv.chat_requests] == [64, 24]
    assert all("max_tokens" not in r.json for r in srv.chat_requests)


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_extra_body_may_not_set_the_reply_limit(key):
    # it went beside (or was overwritten by) the engine's own, max_new_tokens silently not the limit
    with pytest.raises(EngineError, match="extra_body: may not set"):
        OpenAIEngine(model="m", base_url="http://127.0.0.1:9/v1", extra_body={key: 8})


@pytest.mark.parametrize(
    "headers",
    [{"Content-Type": "text/html; charset=utf-8"}, {"Content-Type": "application/octet-stream"}],
    ids=["by its content type", "by its opening tag"],
)
async def test_a_web_page_is_a_misconfigured_base_url(srv, headers):
    page = b"<!doctype html><html><head><title>Open WebUI</title></head><body>sign in</body></html>"
    srv.enqueue(Scripted(body=page, headers=headers))
    async with make(srv, max_retries=3) as engine:
        with pytest.raises(OpenAIEngineError) as e:
            await engine.generate(chat())
    message = str(e.value)
    assert f"{srv.base_url}/chat/completions answered 200 with a web page" in message
    assert "<!doctype html><html><head><title>Open WebUI</title>" in message  # the page's start
    assert "set base_url to the OpenAI-compatible API root (ending in /v1)" in message
    assert not e.value.retryable and e.value.status == 200
    assert len(srv.chat_requests) == 1  # every retry would get the same page


async def test_a_body_neither_json_nor_a_page_stays_not_json(srv):
    srv.enqueue(Scripted(body=b"upstream connect error", headers={"Content-Type": "text/plain"}))
    async with make(srv) as engine:
        with pytest.raises(OpenAIEngineError, match=r"not JSON \(text/plain\): upstream connect error") as e:
            await engine.generate(chat())
    assert "web page" not in str(e.value)
