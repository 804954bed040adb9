"""``OpenAIEngine``: a reply that calls a tool (a server given ``tools`` through
``extra_body``: OpenAI, vLLM with a tool parser) answers with ``content: null`` and the call
in ``message.tool_calls``. The engine read the content alone, so the turn's text (the
action the environment gets) was empty: every tool call of the policy was lost, the
environment answered "no tool call found", and the trajectory never showed what the model
did. The call is the turn's text now, as the JSON the environments read
(``{"name": ..., "arguments": "<json>"}``, OpenAI's own form, which math-tools takes)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import envpool
from core.rollout.engines.base import GenerateRequest
from core.rollout.engines.openai_ import OpenAIEngine
from fabric.protocol import Message
from functions.fakes import FakeOpenAI, Scripted


def completion(message: dict[str, Any], finish: str = "tool_calls") -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}
    return json.dumps({"id": "c1", "object": "chat.completion", "choices": [choice]}).encode()


def call(name: str, arguments: str, i: int = 0) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture
def srv():
    with FakeOpenAI(reply="unused", model="fake-policy") as s:
        yield s


async def generate(srv: FakeOpenAI, body: bytes) -> str:
    srv.enqueue(Scripted(body=body))
    engine = OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key=srv.api_key)
    async with engine:
        c = await engine.generate(GenerateRequest(messages=[Message(role="user", content="6*7?")]))
    assert c.finish_reason == "stop"
    return c.text


async def test_a_tool_call_reply_is_the_turns_text(srv):
    body = completion({"content": None, "tool_calls": [call("calculator", '{"expression": "6*7"}')]})
    text = await generate(srv, body)
    assert json.loads(text) == {"name": "calculator", "arguments": '{"expression": "6*7"}'}
    # ...which the environment takes as the call it is
    env = envpool.make("math-tools-v1")
    env.reset(seed=1)
    assert env.step(text).obs.text == "42"


async def test_text_and_several_calls_are_all_kept(srv):
    calls = [call("calculator", '{"expression": "1+1"}'), call("search", '{"query": "x"}', 1)]
    text = await generate(srv, completion({"content": "Let me compute.", "tool_calls": calls}))
    first, *rest = text.split("\n")
    assert first == "Let me compute."
    assert [json.loads(line)["name"] for line in rest] == ["calculator", "search"]


async def test_a_plain_reply_is_unchanged(srv):
    assert await generate(srv, completion({"content": "Answer: 42"}, "stop")) == "Answer: 42"
