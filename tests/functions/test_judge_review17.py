"""``llm_judge`` review 17: the request a judge on OpenAI's current models needs, and the
refusals that are the judge's setup's (every call alike), not the response's."""

from __future__ import annotations

import pytest
from judge_helpers import fake_openai, judge_maker

from fabric.errors import ConfigError
from functions.rewards.judge_config import OPENAI_URL, JudgeConfig

srv = pytest.fixture(fake_openai, name="srv")
make_judge = pytest.fixture(judge_maker, name="make_judge")


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
