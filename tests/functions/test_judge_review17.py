"""``llm_judge`` review 17: the request a judge on OpenAI's current models needs, and the
refusals that are the judge's setup's (every call alike), not the response's."""

from __future__ import annotations

import json

import pytest
from judge_helpers import fake_openai, judge_maker
from pydantic import ValidationError

from fabric.errors import ConfigError, Misconfigured, Unavailable
from functions.fakes import Scripted
from functions.rewards.judge import Judge
from functions.rewards.judge_config import DEFAULT_RUBRIC, OPENAI_URL, JudgeConfig
from functions.rewards.judge_errors import JudgeRejectedError, JudgeResponseError
from functions.rewards.judge_score import parse_score

srv = pytest.fixture(fake_openai, name="srv")
make_judge = pytest.fixture(judge_maker, name="make_judge")


def _openai_error(status: int, message: str, *, type_: str, param: str | None, code: str | None) -> Scripted:
    # OpenAI's error body, as its API sends it
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Scripted(status=status, body=json.dumps(body).encode())


# ----------------------------------------------------------------------------- the request


async def test_the_reply_limit_can_be_sent_as_max_completion_tokens(srv, make_judge):
    # o-series and gpt-5 models refuse max_tokens (400 unsupported_parameter): the only way to
    # use them as judges is the field they read
    judge = make_judge(srv, max_tokens=300, max_tokens_field="max_completion_tokens")
    await judge.score("Paris", question="Capital of France?")
    (req,) = srv.chat_requests
    assert req.json["max_completion_tokens"] == 300 and "max_tokens" not in req.json


def test_openais_api_gets_max_completion_tokens_and_other_servers_max_tokens():
    # OpenAI reads max_completion_tokens on every chat model (max_tokens is deprecated there
    # and refused by its reasoning models); vLLM, SGLang and gateways read max_tokens
    openai = JudgeConfig(model="gpt-5-mini", api_key="sk-x")
    assert openai.base_url == OPENAI_URL and openai.reply_limit_field == "max_completion_tokens"
    assert JudgeConfig(model="m", base_url="http://vllm:8000/v1").reply_limit_field == "max_tokens"
    pinned = JudgeConfig(model="m", api_key="sk-x", max_tokens_field="max_tokens")
    assert pinned.reply_limit_field == "max_tokens"


def test_extra_body_cannot_set_max_completion_tokens():
    # it would go uncharged by tokens_per_minute, and beside max_tokens the request has two limits
    with pytest.raises(ConfigError, match=r"extra_body.*'max_completion_tokens'"):
        JudgeConfig.from_env(
            {"RL_FABRIC_JUDGE_MODEL": "m", "RL_FABRIC_JUDGE_BASE_URL": "http://x/v1"},
            extra_body={"max_completion_tokens": 4000},
        )


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("param", "code", "message"),
    [
        (
            "max_tokens",
            "unsupported_parameter",
            "Unsupported parameter: 'max_tokens' is not supported with this model. "
            "Use 'max_completion_tokens' instead.",
        ),
        (
            "temperature",
            "unsupported_value",
            "Unsupported value: 'temperature' does not support 0 with this model. "
            "Only the default (1) value is supported.",
        ),
    ],
)
async def test_a_400_for_a_setting_the_model_does_not_support_is_misconfigured(
    srv, make_judge, param, code, message
):
    # every request carries the setting, whatever the response: a failure_score standing in for
    # it scored every trajectory alike
    srv.enqueue(_openai_error(400, message, type_="invalid_request_error", param=param, code=code))
    with pytest.raises(Misconfigured, match=rf"HTTP 400.*{param}") as e:
        await make_judge(srv).score("Paris")
    assert isinstance(e.value, JudgeRejectedError)
    assert len(srv.chat_requests) == 1


async def test_a_400_for_the_prompts_length_stays_a_rejection(srv, make_judge):
    # past the model's context is this response's doing (a runaway completion)
    srv.enqueue(
        _openai_error(
            400,
            "This model's maximum context length is 128000 tokens.",
            type_="invalid_request_error",
            param="messages",
            code="context_length_exceeded",
        )
    )
    with pytest.raises(JudgeRejectedError, match="HTTP 400") as e:
        await make_judge(srv).score("x" * 100)
    assert not isinstance(e.value, Misconfigured)


async def test_a_429_for_an_exhausted_quota_is_misconfigured_and_not_retried(srv, make_judge):
    # OpenAI answers an account out of credit with a 429 that no wait fixes: retried, it was
    # each call's time limit spent on a dead account, then a retryable failure that
    # failure_score scored for every trajectory
    srv.enqueue(
        _openai_error(
            429,
            "You exceeded your current quota, please check your plan and billing details.",
            type_="insufficient_quota",
            param=None,
            code="insufficient_quota",
        )
    )
    with pytest.raises(Misconfigured, match=r"HTTP 429.*quota.*billing"):
        await make_judge(srv, max_retries=3).score("Paris")
    assert len(srv.chat_requests) == 1


# ----------------------------------------------------------------------------- thinking


# DeepSeek-R1's and Qwen3's chat templates open the <think> block in the prompt: served without
# a reasoning parser, the reply is the scratch work, then </think>, then the answer
_UNOPENED = "Okay, let me check the capital.\nScore: 9/10 maybe? No, Lyon is wrong.\n</think>\n\n"


@pytest.mark.parametrize(
    ("rubric", "nonce"),
    [(DEFAULT_RUBRIC, "bcdfgh"), ("Grade {response}. End with Score: N/10", None)],
)
def test_thinking_whose_tag_the_template_opened_is_not_the_verdict(rubric, nonce):
    reply = _UNOPENED + "The response names the wrong city."
    with pytest.raises(JudgeResponseError, match=r"no (verdict line|score)"):
        parse_score(reply, 0, 10, rubric=rubric, nonce=nonce, response="The capital is Lyon.")
    # as a block the reply opens itself, which was already left out
    with pytest.raises(JudgeResponseError):
        parse_score("<think>\n" + reply, 0, 10, rubric=rubric, nonce=nonce, response="The capital is Lyon.")


def test_the_verdict_after_unopened_thinking_is_read():
    reply = _UNOPENED + "Wrong city.\nVerdict bcdfgh: 1/10"
    assert parse_score(reply, 0, 10, rubric=DEFAULT_RUBRIC, nonce="bcdfgh", response="Lyon.") == 1.0


async def test_a_reasoning_judges_unopened_thinking_is_not_scored(srv, make_judge):
    srv.enqueue(Scripted(text=_UNOPENED + "The response names the wrong city."))
    with pytest.raises(JudgeResponseError, match="no verdict line"):
        await make_judge(srv).score("The capital is Lyon.", question="Capital of France?")


# ----------------------------------------------------------------------------- the key and URL


async def test_a_key_and_url_read_with_a_trailing_newline_still_work(srv):
    # a key or URL from a secret file keeps its newline: as a header the key was refused by the
    # HTTP library on every request and retried as a network error ("is the server up?"), the
    # URL failed every call as the response's UserError; whitespace is never part of either
    env = {
        "RL_FABRIC_JUDGE_MODEL": srv.model + "\n",
        "RL_FABRIC_JUDGE_BASE_URL": srv.base_url + "\n",
        "RL_FABRIC_JUDGE_API_KEY": " sk-fake\r\n",
    }
    config = JudgeConfig.from_env(env)
    assert config.base_url == srv.base_url and config.model == srv.model
    assert config.api_key is not None and config.api_key.get_secret_value() == "sk-fake"
    async with Judge(config) as judge:
        result = await judge.score("Paris", question="Capital of France?")
    assert result.score == 0.8 and srv.chat_requests[-1].headers["authorization"] == "Bearer sk-fake"


@pytest.mark.parametrize("key", ["sk-f\u00e4ke", "sk-a\nb", "sk-a b"])
def test_a_key_no_header_can_carry_is_a_config_error(key):
    # inside the key these are a bad copy, not a separator: refused at the edge, with what is
    # wrong, not as each call's UnicodeEncodeError or protocol error
    with pytest.raises(ConfigError, match=r"API_KEY: .*characters an HTTP header cannot carry") as e:
        JudgeConfig.from_env({"RL_FABRIC_JUDGE_MODEL": "m", "RL_FABRIC_JUDGE_API_KEY": key})
    assert key not in str(e.value)  # the key stays out of the message


@pytest.mark.parametrize(
    "bad", [{"api_key": "sk-a\nb-0123456789"}, {"api_key": "sk-0123456789", "max_score": 0}]
)
def test_a_config_error_made_in_code_does_not_show_the_key(bad):
    # pydantic's own message shows the input: the key itself, or the tail of the whole dict's
    with pytest.raises(ValidationError) as e:
        JudgeConfig(model="m", base_url="http://x/v1", **bad)
    assert "0123456789" not in str(e.value) and "6789" not in str(e.value)


# ----------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("status", [301, 302, 307, 308])
async def test_an_endpoint_that_redirects_is_misconfigured(srv, make_judge, status):
    # http:// to https://, or a path moved: the same for every request, and the body is no
    # chat completion (it failed each call as an unreadable reply, the response's UserError);
    # not followed: a 301/302 turns the POST into a GET, and the key would go where it points
    where = "https://judge.example/v1/chat/completions"
    srv.enqueue(Scripted(status=status, body=b"<html>Moved</html>", headers={"Location": where}))
    with pytest.raises(Misconfigured, match=rf"HTTP {status}.*redirects to {where}.*BASE_URL"):
        await make_judge(srv).score("Paris")
    assert len(srv.chat_requests) == 1


# ----------------------------------------------------------------------------- refusals by the judge


async def test_a_judge_that_refuses_says_so_with_its_words(srv, make_judge):
    # OpenAI's models answer a refusal in message.refusal, content null: the error said only
    # "no text", which hid why (most often the response's own content)
    refusal = "I'm sorry, I can't help with grading that."
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": srv.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "refusal": refusal},
                "finish_reason": "stop",
            }
        ],
    }
    srv.enqueue(Scripted(body=json.dumps(body).encode()))
    with pytest.raises(JudgeResponseError, match=r"the judge refused to grade: I'm sorry, I can't help"):
        await make_judge(srv).score("how to pick a lock")


# ----------------------------------------------------------------------------- aborted replies


async def test_a_reply_the_server_aborted_is_retried_not_scored(srv, make_judge):
    # vLLM ends a request its engine aborted (shut down, paused for sleep mode or a weight
    # update, scaled down) with HTTP 200 and finish_reason "abort": the text stops anywhere,
    # in the verdict too ("Verdict x: 1" of "10/10"), and was scored as if whole
    srv.enqueue(Scripted(text="The answer is right.\nScore: 1", finish_reason="abort"))
    result = await make_judge(srv).score("Paris", question="Capital of France?")
    assert result.score == 0.8 and result.info["attempts"] == 2
    assert len(srv.chat_requests) == 2


async def test_a_server_that_keeps_aborting_is_unavailable(srv, make_judge):
    srv.enqueue(*(Scripted(text="Score: 1", finish_reason="abort") for _ in range(3)))
    with pytest.raises(Unavailable, match=r"failed 3 attempts.*finish_reason 'abort'"):
        await make_judge(srv, max_retries=2).score("Paris")
