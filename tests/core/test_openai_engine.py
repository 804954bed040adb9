"""``OpenAIEngine`` against ``FakeOpenAI``, a real HTTP server on 127.0.0.1: the request it
sends, finish reasons, usage, token ids and logprobs (vLLM dialect), version stamping, abort,
retries, refusals, an unreachable server and the concurrency cap."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import pytest

from core.rollout.engines.base import (
    EngineClosedError,
    EngineError,
    GenerateRequest,
    PromptTooLongError,
    engine_registry,
)
from core.rollout.engines.openai_ import OpenAIEngine, OpenAIEngineConfig, OpenAIEngineError
from core.rollout.replicas import make_engine
from fabric.protocol import Message
from functions.fakes import FakeOpenAI, Scripted

REPLY = "go left"


@pytest.fixture
def srv():
    with FakeOpenAI(reply=REPLY, model="fake-policy") as s:
        yield s


def make(srv: FakeOpenAI, **cfg: Any) -> OpenAIEngine:
    cfg.setdefault("backoff_s", 0.001)
    cfg.setdefault("max_backoff_s", 0.01)  # caps Retry-After too: no test waits for real
    return OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key=srv.api_key, **cfg)


def chat(text: str = "where now?", **kw: Any) -> GenerateRequest:
    return GenerateRequest(messages=[Message(role="user", content=text)], **kw)


def error_body(message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error"}}).encode()


async def until(cond: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def test_generate_sends_a_chat_and_reads_the_reply(srv):
    msgs = [
        Message(role="system", content="You walk a frozen lake."),
        Message(role="assistant", content="right", policy_version=2),
        Message(role="user", content="where now?"),
    ]
    req = GenerateRequest(
        messages=msgs, max_new_tokens=16, temperature=0.0, stop=["\n"], seed=3, metadata={"traj": "t1"}
    )
    async with make(srv) as engine:
        c = await engine.generate(req)
    assert (c.text, c.finish_reason, c.policy_version) == (REPLY, "stop", 0)
    assert c.request_id == req.request_id and c.metadata == {"traj": "t1"}
    # the openai dialect gets no token ids, so no ids nor logprobs to pair
    assert c.token_ids == [] and c.logprobs == [] and c.prompt_ids == []
    (sent,) = srv.chat_requests
    body = sent.json
    assert body["model"] == "fake-policy" and body["max_tokens"] == 16 and body["temperature"] == 0.0
    assert body["stop"] == ["\n"] and body["seed"] == 3 and body["n"] == 1 and body["stream"] is False
    assert "logprobs" not in body and "return_token_ids" not in body
    # our version stamp is not part of the OpenAI message schema
    assert body["messages"][1] == {"role": "assistant", "content": "right"}
    assert sent.headers["authorization"] == "Bearer sk-fake"
    assert sent.headers["x-request-id"] == req.request_id


@pytest.mark.parametrize(
    ("server", "ours"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("abort", "abort"),
        ("tool_calls", "stop"),
        ("content_filter", "stop"),
        ("something_new", "stop"),
    ],
)
async def test_finish_reasons(srv, server, ours):
    srv.enqueue(Scripted(finish_reason=server))
    async with make(srv) as engine:
        assert (await engine.generate(chat())).finish_reason == ours


async def test_usage_is_summed_in_stats(srv):
    async with make(srv) as engine:
        await engine.generate(chat("abcdefgh"))  # 2 fake tokens
        await engine.generate(chat("abcdefghijkl"))  # 3
    reply_tokens = len(FakeOpenAI.tokenize(REPLY))
    assert engine.stats["prompt_tokens"] == 5
    assert engine.stats["completion_tokens"] == 2 * reply_tokens
    assert engine.stats["requests"] == 2 and engine.stats["retries"] == 0


async def test_vllm_dialect_carries_token_ids_and_logprobs(srv):
    async with make(srv, dialect="vllm") as engine:
        c = await engine.generate(chat("abcdefgh", allowed_token_ids=[5, 9]))
    body = srv.chat_requests[-1].json
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert body["allowed_token_ids"] == [5, 9]
    expected = FakeOpenAI.tokenize(REPLY)
    assert c.token_ids == [i for i, _, _ in expected]
    assert c.logprobs == [lp for _, lp, _ in expected]
    assert c.prompt_ids == [i for i, _, _ in FakeOpenAI.tokenize("abcdefgh")]
    assert c.allowed_token_ids == [5, 9] and c.text == REPLY


async def test_ids_inside_logprob_tokens_and_text_only_tokens(srv):
    # an older vLLM names ids only as "token_id:<id>" tokens
    async with make(srv, logprobs=True, extra_body={"return_tokens_as_token_ids": True}) as engine:
        c = await engine.generate(chat())
    assert c.token_ids == [i for i, _, _ in FakeOpenAI.tokenize(REPLY)] and len(c.logprobs) == len(
        c.token_ids
    )
    # a plain OpenAI server names tokens by text: nothing the trainer could pair with ids
    async with make(srv, logprobs=True) as engine:
        c = await engine.generate(chat())
    assert srv.chat_requests[-1].json["logprobs"] is True
    assert c.token_ids == [] and c.logprobs == [] and c.text == REPLY


async def test_requests_the_openai_dialect_cannot_serve(srv):
    async with make(srv) as engine:
        with pytest.raises(EngineError, match=r"cannot constrain sampling to allowed_token_ids.*`actions`"):
            await engine.generate(chat(allowed_token_ids=[1, 2]))
        with pytest.raises(EngineError, match="give messages, not prompt_ids"):
            await engine.generate(GenerateRequest(prompt_ids=[1, 2, 3]))
        assert engine.num_inflight == 0
    assert srv.chat_requests == []


async def test_versions_are_recorded_not_published(srv):
    async with make(srv) as engine:
        await engine.suspend()
        task = asyncio.create_task(engine.generate(chat()))
        await asyncio.sleep(0.05)
        assert not task.done() and srv.chat_requests == []  # held at the gate
        await engine.load_weights({"w": object()}, version=3)
        await engine.resume()
        c = await task
        assert c.policy_version == 3 and engine.version == 3
        assert len(srv.requests) == 1  # the weights went nowhere
        with pytest.raises(EngineError, match="older"):
            await engine.load_weights({}, version=2)


async def test_abort_cancels_the_http_request(srv):
    srv.hang_next(seconds=30)
    async with make(srv) as engine:
        req = chat()
        task = asyncio.create_task(engine.generate(req))
        await until(lambda: len(srv.chat_requests) == 1)
        t0 = time.monotonic()
        assert await engine.abort(req.request_id)
        c = await task
        assert time.monotonic() - t0 < 10  # the abort ended it, not the 30 s hang
        assert (c.finish_reason, c.text, c.token_ids) == ("abort", "", [])
        assert not await engine.abort(req.request_id)  # already over: idempotent
        assert engine.stats["aborts"] == 1
        # the engine is fine afterwards
        assert (await engine.generate(chat())).text == REPLY


async def test_close_aborts_what_is_in_flight(srv):
    srv.hang_next(seconds=30)
    engine = make(srv)
    await engine.start()
    task = asyncio.create_task(engine.generate(chat()))
    await until(lambda: len(srv.chat_requests) == 1)
    await engine.aclose()
    assert (await task).finish_reason == "abort"
    with pytest.raises(EngineClosedError):
        await engine.generate(chat())


async def test_a_nan_retry_after_is_ignored_not_slept_forever(srv):
    srv.fail_next(429, retry_after=float("nan"))  # asyncio.sleep(nan) never returns
    async with make(srv) as engine:
        c = await asyncio.wait_for(engine.generate(chat()), 5)
    assert c.text == REPLY and len(srv.chat_requests) == 2


async def test_retries_429_and_5xx_then_succeeds(srv):
    srv.fail_next(429, retry_after=30)  # capped at max_backoff_s
    srv.fail_next(500)
    srv.fail_next(503)
    t0 = time.monotonic()
    async with make(srv) as engine:
        c = await engine.generate(chat())
    assert c.text == REPLY and time.monotonic() - t0 < 5
    assert len(srv.chat_requests) == 4 and engine.stats["retries"] == 3


async def test_retries_run_out(srv):
    srv.fail_next(500, times=3)
    async with make(srv, max_retries=2) as engine:
        with pytest.raises(OpenAIEngineError, match=r"failed 3 attempts.*HTTP 500: fake failure 500") as e:
            await engine.generate(chat())
    assert e.value.retryable and e.value.status == 500


async def test_a_silent_server_times_out_and_is_retried(srv):
    srv.hang_next(times=2, seconds=30)
    async with make(srv, timeout_s=0.2, max_retries=1) as engine:
        with pytest.raises(OpenAIEngineError, match=r"failed 2 attempts.*no answer within timeout_s=0.2 s"):
            await engine.generate(chat())
        # both attempts were sent before the error; on a loaded machine the server's handler
        # thread may read the second one after the client's 0.2 s have run out
        deadline = time.monotonic() + 5
        while len(srv.chat_requests) < 2 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # a server thread records it: there is no event to await
        assert len(srv.chat_requests) == 2


async def test_4xx_fails_at_once_with_the_servers_message(srv):
    srv.enqueue(Scripted(status=400, body=error_body("temperature must be at most 2")))
    async with make(srv) as engine:
        with pytest.raises(OpenAIEngineError, match="HTTP 400: temperature must be at most 2") as e:
            await engine.generate(chat())
        assert e.value.status == 400 and not e.value.retryable
        assert len(srv.chat_requests) == 1  # never retried
        srv.enqueue(
            Scripted(
                status=400, body=error_body("This model's maximum context length is 8 tokens. However...")
            )
        )
        with pytest.raises(PromptTooLongError, match="maximum context length"):
            await engine.generate(chat())
        # not a web page (that is a wrong base_url's: test_openai_engine_review17.py)
        srv.enqueue(Scripted(body=b"502 Bad Gateway", headers={"Content-Type": "text/plain"}))
        with pytest.raises(OpenAIEngineError, match=r"not JSON \(text/plain\): 502 Bad Gateway"):
            await engine.generate(chat())
    async with OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key="sk-wrong") as engine:
        with pytest.raises(OpenAIEngineError, match=r"Incorrect API key.*check the API key"):
            await engine.generate(chat())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_server_down_is_an_error_after_retries():
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    async with OpenAIEngine(model="m", base_url=url, max_retries=2, backoff_s=0.001, max_backoff_s=0.01) as e:
        with pytest.raises(OpenAIEngineError, match=r"failed 3 attempts.*ConnectError") as err:
            await e.generate(chat())
    assert err.value.retryable and err.value.status is None
    assert e.stats["http_attempts"] == 3


async def test_concurrency_limit(srv):
    srv.enqueue(*(Scripted(hang_s=0.15) for _ in range(6)))
    async with make(srv, max_concurrency=2) as engine:
        out = await asyncio.gather(*(engine.generate(chat()) for _ in range(6)))
    assert [c.text for c in out] == [REPLY] * 6
    assert srv.max_inflight == 2


async def test_config_at_the_edge(srv, monkeypatch):
    with pytest.raises(EngineError, match="invalid openai engine options: base_url"):
        OpenAIEngine(model="m", base_url="localhost:8000")
    with pytest.raises(EngineError, match="invalid openai engine options: timeout_s"):
        OpenAIEngine(model="m", base_url=srv.base_url, timeout_s=0)
    with pytest.raises(EngineError, match="extra_body: may not set"):
        OpenAIEngine(model="m", base_url=srv.base_url, extra_body={"stream": True})
    with pytest.raises(EngineError, match="not both"):
        OpenAIEngine(OpenAIEngineConfig(model="m"), base_url=srv.base_url)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(EngineError, match="needs a key: set OPENAI_API_KEY"):
        OpenAIEngine(model="gpt-4o-mini")
    # the key from an environment variable
    monkeypatch.setenv("POLICY_KEY", "sk-fake")
    async with OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key_env="POLICY_KEY") as engine:
        assert (await engine.generate(chat())).text == REPLY


async def test_registered_and_built_by_make_engine(srv):
    assert "openai" in engine_registry.names()
    engine = make_engine(
        "openai", None, {"base_url": srv.base_url, "api_key": "sk-fake"}, seed=0, model=srv.model
    )
    assert isinstance(engine, OpenAIEngine) and engine.config.model == srv.model
    async with engine:
        assert (await engine.generate(chat())).text == REPLY
    with pytest.raises(ValueError, match=r"engine.model, not in engine.kwargs"):
        make_engine("openai", None, {"model": "x"}, seed=0, model="y")
