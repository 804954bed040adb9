"""Review 17 of the rollout engines and the tool-call record.

* ``record_calls``: an environment that reports a call it ran with ``"refused": False`` (a
  flag, not a reason) had it recorded as refused (``"false"``, a truthy string), so the
  ``tool_use`` reward, which reads ``refused`` as a verdict, counted a good call as invalid.
* ``OpenAIEngine``: the OpenAI API names an over-long prompt by its error code,
  ``context_length_exceeded``, with a message that need not say "context length" ("Your
  input exceeds the context window of this model"): it was a generic ``OpenAIEngineError``,
  not the ``PromptTooLongError`` the other engines raise for the same request.
"""

from __future__ import annotations

import json

import pytest

from core.rollout.engines.base import GenerateRequest, PromptTooLongError
from core.rollout.engines.openai_ import OpenAIEngine
from core.rollout.tool_calls import record_calls
from fabric.protocol import Message
from functions.fakes import FakeOpenAI, Scripted


def test_a_call_flagged_refused_false_is_a_call_that_ran():
    info = {
        "calls": [
            {"name": "calculator", "arguments": '{"expression": "6*7"}', "output": "42", "refused": False},
            {"name": "", "arguments": "{oops", "output": "Bad tool call", "refused": "invalid JSON"},
        ]
    }
    ran, refused = record_calls(info)
    assert "refused" not in ran
    assert refused["refused"] == "invalid JSON"


async def test_openais_context_length_code_is_a_prompt_too_long():
    body = {
        "error": {
            "message": "Your input exceeds the context window of this model. Please adjust your input.",
            "type": "invalid_request_error",
            "param": "input",
            "code": "context_length_exceeded",
        }
    }
    with FakeOpenAI(reply="unused", model="fake-policy") as srv:
        srv.enqueue(Scripted(status=400, body=json.dumps(body).encode()))
        engine = OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key=srv.api_key, max_retries=0)
        async with engine:
            with pytest.raises(PromptTooLongError, match="context window"):
                await engine.generate(GenerateRequest(messages=[Message(role="user", content="hi")]))


def vllm_too_large(asked: int, window: int, prompt: int) -> bytes:
    """vLLM's OpenAI server's answer to a prompt that fits with a ``max_tokens`` that does not."""
    message = (
        f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum context "
        f"length is {window} tokens and your request has {prompt} input tokens "
        f"({asked} > {window} - {prompt})."
    )
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    ).encode()


async def test_a_vllm_server_near_the_context_end_generates_what_fits():
    """The prompt fits, ``max_new_tokens`` does not: the torch and vllm engines generate to
    the context's end (``finish_reason="length"``). vLLM's server refuses such a request with a
    400 that says "maximum context length", and the engine raised PromptTooLongError ("no room
    for a single new token"): a long episode's turn failed where the other engines play it."""
    with FakeOpenAI(reply="short", model="fake-policy") as srv:
        srv.enqueue(Scripted(status=400, body=vllm_too_large(64, 1024, 1000)))
        engine = OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key=srv.api_key, max_retries=0)
        async with engine:
            chat = GenerateRequest(messages=[Message(role="user", content="hi")], max_new_tokens=64)
            c = await engine.generate(chat)
            assert c.text == "short"
            assert [r.json["max_tokens"] for r in srv.chat_requests] == [64, 24]  # what fits
            # no room at all: the prompt is too long, as before
            srv.enqueue(Scripted(status=400, body=vllm_too_large(64, 1024, 1024)))
            with pytest.raises(PromptTooLongError, match="maximum context length"):
                await engine.generate(chat)
            assert [r.json["max_tokens"] for r in srv.chat_requests[2:]] == [64]
