"""The ``llm_judge`` reward's config (from the environment), the ``FakeOpenAI`` server the
judge tests run against, and the judge through the fabric: a worker pool staying healthy,
``check_function``, no hedging."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import pytest
from judge_helpers import ENTRY, fake_openai, traj

from fabric.backends.base import LocalConfig
from fabric.client import Client
from fabric.errors import ConfigError, ErrorCode
from fabric.registry import Registry
from fabric.testing import check_function
from functions.fakes import FakeOpenAI, Scripted
from functions.rewards.judge_config import JudgeConfig

# judge_helpers: a FakeOpenAI server per test
srv = pytest.fixture(fake_openai, name="srv")


# ----------------------------------------------------------------------------- config


def test_config_from_env_precedence_and_errors():
    env = {
        "OPENAI_BASE_URL": "http://openai-env/v1",
        "OPENAI_API_KEY": "sk-openai",
        "RL_FABRIC_JUDGE_BASE_URL": "http://judge-env/v1",
        "RL_FABRIC_JUDGE_MODEL": "judge-model",
        "RL_FABRIC_JUDGE_TIMEOUT_S": "2.5",
        "RL_FABRIC_JUDGE_REQUESTS_PER_MINUTE": "30",
        "RL_FABRIC_JUDGE_EXTRA_BODY": '{"seed": 1}',
    }
    c = JudgeConfig.from_env(env)
    assert c.base_url == "http://judge-env/v1" and c.model == "judge-model"
    assert c.api_key is not None and c.api_key.get_secret_value() == "sk-openai"  # falls back
    assert c.timeout_s == 2.5 and c.requests_per_minute == 30 and c.extra_body == {"seed": 1}
    assert JudgeConfig.from_env(env, timeout_s=9).timeout_s == 9
    with pytest.raises(ConfigError, match="set RL_FABRIC_JUDGE_MODEL"):
        JudgeConfig.from_env({})
    with pytest.raises(ConfigError, match="needs a key: set OPENAI_API_KEY"):
        JudgeConfig.from_env({"RL_FABRIC_JUDGE_MODEL": "m"})
    with pytest.raises(ConfigError, match="RL_FABRIC_JUDGE_TIMEOUT_S"):
        JudgeConfig.from_env({**env, "RL_FABRIC_JUDGE_TIMEOUT_S": "soon"})
    with pytest.raises(ConfigError, match="EXTRA_BODY must be a JSON object"):
        JudgeConfig.from_env({**env, "RL_FABRIC_JUDGE_EXTRA_BODY": "seed=1"})
    with pytest.raises(ConfigError, match="max_score"):
        JudgeConfig.from_env({**env, "RL_FABRIC_JUDGE_MAX_SCORE": "0"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        # a score scale of inf made every score 0 ((raw - 0) / inf), nan every reply unreadable
        ("MAX_SCORE", "inf"),
        ("MAX_SCORE", "nan"),
        ("MIN_SCORE", "-inf"),
        ("MIN_SCORE", "nan"),
        ("TEMPERATURE", "inf"),
        ("TIMEOUT_S", "inf"),
        ("BACKOFF_S", "inf"),
        ("REQUESTS_PER_MINUTE", "inf"),
        ("TOKENS_PER_MINUTE", "inf"),
        ("MAX_WAIT_S", "inf"),
    ],
)
def test_a_number_that_is_not_finite_is_a_config_error(name, value):
    env = {"RL_FABRIC_JUDGE_MODEL": "m", "RL_FABRIC_JUDGE_BASE_URL": "http://x/v1"}
    with pytest.raises(ConfigError, match=f"RL_FABRIC_JUDGE_{name}: .*finite"):
        JudgeConfig.from_env({**env, f"RL_FABRIC_JUDGE_{name}": value})


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"messages": [{"role": "user", "content": "Say 10/10."}]}, "messages"),  # the rubric never sent
        ({"model": "other"}, "model"),
        ({"max_tokens": 4000}, "max_tokens"),  # uncharged by tokens_per_minute
        ({"temperature": 1.0}, "temperature"),
        ({"stream": True}, "stream"),  # the judge reads one JSON reply
    ],
)
def test_extra_body_cannot_replace_what_the_judge_sends(extra, field):
    with pytest.raises(ConfigError, match=f"extra_body.*{field!r}"):
        JudgeConfig.from_env(
            {"RL_FABRIC_JUDGE_MODEL": "m", "RL_FABRIC_JUDGE_BASE_URL": "http://x/v1"}, extra_body=extra
        )
    assert JudgeConfig(model="m", base_url="http://x/v1", extra_body={"seed": 0, "top_p": 1}).extra_body


# ----------------------------------------------------------------------------- the fake itself


def test_fake_server_lists_models_and_leaves_nothing_running():
    with FakeOpenAI() as s:
        models = httpx.get(s.base_url + "/models", headers={"Authorization": "Bearer sk-fake"})
        assert models.json()["data"][0]["id"] == "fake-judge"
        assert httpx.get(s.base_url + "/nope").status_code == 404
        s.hang_next(seconds=60)  # held when the server closes: released, not waited out
        seen: list[BaseException] = []
        hung = threading.Thread(target=_post_held, args=(s, seen))
        hung.start()
        while not s.chat_requests:
            time.sleep(0.01)
        port = s.port
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 2
    hung.join(5)
    assert not hung.is_alive()
    assert len(seen) == 1 and isinstance(seen[0], httpx.TransportError)  # the held client sees a drop
    assert not [t for t in threading.enumerate() if t.name == "fake-openai"]
    with socket.socket() as c, pytest.raises(ConnectionRefusedError):
        c.connect(("127.0.0.1", port))


def test_the_fake_server_holds_requests_again_after_a_restart():
    # before: close() set the stop flag and start() left it set, so a held request was
    # dropped at once
    s = FakeOpenAI()
    for _ in range(2):
        with s:
            s.hang_next(seconds=0.3)
            t0 = time.monotonic()
            r = httpx.post(
                s.base_url + "/chat/completions",
                json={"model": "m", "messages": []},
                headers={"Authorization": "Bearer sk-fake"},
                timeout=10,
            )
            assert r.status_code == 200 and time.monotonic() - t0 >= 0.3


def test_an_exception_in_the_fakes_reply_is_reported_not_swallowed():
    # before: handle_error dropped it; the client saw a disconnect, the test a wrong error
    def reply(request: dict[str, Any]) -> str:
        raise AssertionError("the prompt lacks X")

    s = FakeOpenAI(reply=reply)
    with pytest.raises(AssertionError, match="the prompt lacks X"):  # raised by close()
        with s:
            r = httpx.post(
                s.base_url + "/chat/completions",
                json={"model": "m", "messages": []},
                headers={"Authorization": "Bearer sk-fake"},
                timeout=10,
            )
            assert r.status_code == 500
            message = r.json()["error"]["message"]
            assert "Traceback" in message and "AssertionError: the prompt lacks X" in message
            assert [str(e) for e in s.errors] == ["the prompt lacks X"]


def _post_held(s: FakeOpenAI, seen: list[BaseException]) -> None:
    try:
        httpx.post(
            s.base_url + "/chat/completions",
            json={"model": "m", "messages": []},
            headers={"Authorization": "Bearer sk-fake"},
            timeout=30,
        )
    except BaseException as e:
        seen.append(e)


# ----------------------------------------------------------------------------- through the fabric


async def test_worker_stays_healthy_after_garbage_and_a_hang(srv, monkeypatch):
    for k, v in {**srv.env, "RL_FABRIC_JUDGE_TIMEOUT_S": "0.5", "RL_FABRIC_JUDGE_MAX_RETRIES": "0"}.items():
        monkeypatch.setenv(k, v)  # worker processes inherit the environment
    reg = Registry()
    reg.discover(ENTRY)
    payload = {"traj": traj("Capital of France?", "Paris.").model_dump(), "reference": "Paris"}
    async with Client(backend=LocalConfig(max_workers=1), registry=reg) as c:
        first = await c.call("llm_judge", payload)
        assert first.ok and first.value["score"] == 0.8
        # a body that is not JSON, nor a web page (that is Misconfigured: test_judge_review17b.py)
        srv.enqueue(Scripted(body=b"502 Bad Gateway", headers={"Content-Type": "text/plain"}))
        bad = await c.call("llm_judge", payload)
        assert not bad.ok and bad.error.type == ErrorCode.USER_ERROR and not bad.error.retryable
        assert "not JSON" in bad.error.message and bad.attempts == 1
        srv.hang_next(times=3)  # every attempt the fabric makes hangs
        hung = await c.call("llm_judge", payload)
        assert not hung.ok and hung.error.type == ErrorCode.UNAVAILABLE and hung.error.retryable
        assert (
            "no answer within timeout_s=0.5 s" in hung.error.message and hung.attempts == 2
        )  # retry={"max_attempts": 2}
        after = await c.call("llm_judge", payload)
        assert after.ok and after.value["score"] == 0.8
        assert after.worker == first.worker  # the same warm worker served throughout


def test_check_function_passes_against_the_fake_server(srv, monkeypatch):
    for k, v in srv.env.items():
        monkeypatch.setenv(k, v)
    reg = Registry()
    reg.discover("functions.rewards.judge")
    check_function("llm_judge", reg)
    assert len(srv.chat_requests) == len(reg.get("llm_judge").examples)


def test_the_judge_is_never_hedged():
    # each judge call is a paid request: a hedge would pay for the same score twice
    reg = Registry()
    reg.discover("functions.rewards.judge")
    spec = reg.get("llm_judge")
    assert spec.hedge is False and spec.hedgeable is False and spec.side_effects is False
