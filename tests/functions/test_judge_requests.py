"""The ``llm_judge`` reward's requests against ``FakeOpenAI``, a real HTTP server on
127.0.0.1: retries and Retry-After, timeouts, garbage replies, auth and what a request
carries, and rate limits. Waits are checked with an injected clock/sleep, not by waiting."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import pytest
from judge_helpers import ENTRY, FakeTime, fake_openai, judge_maker

from fabric.errors import RETRYABLE, ConfigError, ErrorCode, Unavailable
from fabric.protocol import encode_payload
from fabric.runner import FunctionRunner
from functions.fakes import FakeOpenAI, Scripted
from functions.rewards.judge import Judge
from functions.rewards.judge_config import JudgeConfig
from functions.rewards.judge_errors import JudgeRejectedError, JudgeResponseError
from functions.rewards.judge_ratelimit import RateLimiter, estimate_tokens

# judge_helpers: a FakeOpenAI server per test, and judges closed after it
srv = pytest.fixture(fake_openai, name="srv")
make_judge = pytest.fixture(judge_maker, name="make_judge")


# ----------------------------------------------------------------------------- retries


async def test_429_is_retried_after_the_servers_retry_after(srv, make_judge):
    t = FakeTime()
    srv.fail_next(429, times=2, retry_after=7)
    r = await make_judge(srv, t).score("x")
    assert r.score == 0.8 and r.info["attempts"] == 3
    # Retry-After (and its jitter, at most 1 s: test_judge_review17c.py), not the (much
    # shorter) backoff
    assert len(t.sleeps) == 2 and all(7.0 <= s <= 8.0 for s in t.sleeps), t.sleeps
    assert len(srv.chat_requests) == 3


async def test_retry_after_is_really_waited(srv, make_judge):
    srv.fail_next(429, retry_after=0.2)
    r = await make_judge(srv).score("x")
    first, second = srv.chat_requests
    assert r.info["attempts"] == 2 and second.at - first.at >= 0.2


async def test_a_retry_after_over_the_cap_fails_at_once(srv, make_judge):
    srv.fail_next(429, retry_after=3600)
    with pytest.raises(Unavailable, match="retry after 3600 s, over max_retry_after_s=60"):
        await make_judge(srv, FakeTime()).score("x")
    assert len(srv.chat_requests) == 1


async def test_a_nan_retry_after_falls_back_to_the_backoff(srv, make_judge):
    t = FakeTime()  # a nan would be passed to sleep as is, and asyncio.sleep(nan) never returns
    srv.fail_next(429, retry_after=float("nan"))
    r = await make_judge(srv, t, backoff_s=1.0).score("x")
    assert r.score == 0.8 and len(t.sleeps) == 1 and 0 <= t.sleeps[0] <= 1.0


async def test_5xx_until_retries_run_out_is_a_retryable_error(srv, make_judge):
    t = FakeTime()
    srv.fail_next(500, times=5)
    with pytest.raises(Unavailable, match=r"failed 3 attempts; last: HTTP 500: fake failure 500"):
        await make_judge(srv, t, max_retries=2, backoff_s=1.0).score("x")
    assert len(srv.chat_requests) == 3
    # exponential backoff with full jitter: up to 1 s, then up to 2 s
    assert 0 <= t.sleeps[0] <= 1.0 and 0 <= t.sleeps[1] <= 2.0
    # through the function runner it is a failed result that the fabric may retry
    srv.fail_next(503, times=3)
    runner = FunctionRunner.from_entry(ENTRY)
    runner.ctx = make_judge(srv, max_retries=2)
    ok, (code, message, _) = await runner.run_async(encode_payload({"traj": "x"}), 10)
    assert not ok and code == ErrorCode.UNAVAILABLE and code in RETRYABLE
    assert "HTTP 503" in message


async def test_a_hung_endpoint_times_out_within_the_configured_timeout(srv, make_judge):
    srv.hang_next(times=2)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match=r"failed 2 attempts; last: no answer within timeout_s=0.3 s"):
        await make_judge(srv, timeout_s=0.3, max_retries=1).score("x")
    assert 0.6 <= time.monotonic() - t0 < 3.0  # two timeouts of 0.3 s, not the 60 s hang
    srv.hang_next()  # one slow answer, then a good one
    r = await make_judge(srv, timeout_s=0.3, max_retries=1).score("x")
    assert r.score == 0.8 and r.info["attempts"] == 2


@pytest.mark.parametrize("failure", ["retry_after", "hang"])
async def test_retries_stop_within_the_runs_limit_with_the_judges_own_error(srv, make_judge, failure):
    # the judge's retries (and the Retry-After it honours, and each attempt's own timeout_s)
    # ran past the reward's limit: the caller got a bare FunctionTimeout instead of the
    # judge's Unavailable saying what happened
    if failure == "retry_after":
        srv.fail_next(503, times=20, retry_after=0.6)
    else:
        srv.hang_next(times=20, seconds=30)
    runner = FunctionRunner.from_entry(ENTRY)
    runner.ctx = make_judge(srv, max_retries=10, timeout_s=60)
    t0 = time.monotonic()
    ok, (code, message, _) = await runner.run_async(encode_payload({"traj": "x"}), 2.0)
    took = time.monotonic() - t0
    assert not ok and code == ErrorCode.UNAVAILABLE, message
    assert took < 2.0  # its own error, before the run's limit
    assert re.search(
        r"llm_judge: the judge was unavailable for (\d+\.\d) s: \S+ failed \d+ attempts?", message
    )
    said = float(re.search(r"unavailable for (\d+\.\d) s", message)[1])  # type: ignore[index]
    assert 0.5 <= said <= took + 0.1
    assert "the call's time limit" in message
    if failure == "retry_after":
        assert len(srv.chat_requests) >= 2 and "HTTP 503" in message
    else:
        assert "no answer within" in message


async def test_a_retry_after_past_the_runs_limit_is_not_waited(srv, make_judge):
    srv.fail_next(429, times=3, retry_after=30)
    runner = FunctionRunner.from_entry(ENTRY)
    runner.ctx = make_judge(srv)
    ok, (code, message, _) = await runner.run_async(encode_payload({"traj": "x"}), 5.0)
    assert not ok and code == ErrorCode.UNAVAILABLE, message
    assert "its retry after 30 s would pass the call's time limit" in message, message
    assert len(srv.chat_requests) == 1


async def test_a_rate_limit_wait_past_the_runs_limit_says_so(srv, make_judge):
    # the rate limiter's wait is bounded by what the run has left, and its refusal blamed
    # max_wait_s with that bound as its value ("over max_wait_s=1.7"), a setting nobody made
    runner = FunctionRunner.from_entry(ENTRY)
    runner.ctx = make_judge(srv, requests_per_minute=1, max_wait_s=600)
    ok, _ = await runner.run_async(encode_payload({"traj": "x"}), 5.0)
    assert ok  # the first request goes at once
    ok, (code, message, _) = await runner.run_async(encode_payload({"traj": "x"}), 2.0)
    assert not ok and code == ErrorCode.UNAVAILABLE, message
    assert "max_wait_s" not in message and "the call's time limit" in message, message
    assert len(srv.chat_requests) == 1


async def test_an_unreachable_endpoint_says_where_it_looked():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = JudgeConfig(model="m", base_url=f"http://127.0.0.1:{port}/v1", max_retries=0)
    async with Judge(config) as judge:
        with pytest.raises(Unavailable, match=rf"ConnectError.*BASE_URL=http://127.0.0.1:{port}/v1"):
            await judge.score("x")


# ----------------------------------------------------------------------------- bad replies


async def test_garbage_is_a_final_error_and_not_retried(srv, make_judge):
    # not a web page (that is the judge's setup's: test_judge_review17b.py)
    srv.enqueue(Scripted(body=b"502 Bad Gateway", headers={"Content-Type": "text/plain"}))
    runner = FunctionRunner.from_entry(ENTRY)
    runner.ctx = make_judge(srv)
    ok, (code, message, _) = await runner.run_async(encode_payload({"traj": "x"}), 10)
    assert not ok and code == ErrorCode.USER_ERROR and code not in RETRYABLE
    assert "JudgeResponseError" in message and "not JSON (text/plain)" in message
    assert "502 Bad Gateway" in message and "ending in /v1" in message
    assert len(srv.chat_requests) == 1  # the same garbage would come back: no retry


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (Scripted(body=b'{"object": "list"}'), "not a chat completion"),
        (Scripted(body=b"[1, 2]"), "not an object"),
        (Scripted(text=""), "returned no text"),
    ],
)
async def test_json_that_is_not_a_completion_is_a_clear_error(srv, answer, error, make_judge):
    srv.enqueue(answer)
    with pytest.raises(JudgeResponseError, match=error):
        await make_judge(srv).score("x")


# ----------------------------------------------------------------------------- auth and request


async def test_the_request_carries_the_key_model_and_settings(make_judge):
    with FakeOpenAI(api_key="sk-test") as s:
        judge = make_judge(s, extra_body={"seed": 3}, max_tokens=64)
        await judge.score("It is Paris.", question="Capital of France?", reference="Paris")
        (req,) = s.chat_requests
        assert req.headers["authorization"] == "Bearer sk-test"
        body = req.json
        assert body["model"] == "fake-judge" and body["temperature"] == 0
        assert body["max_tokens"] == 64 and body["seed"] == 3
        prompt = body["messages"][0]["content"]
        assert "Capital of France?" in prompt and "Paris" in prompt and "It is Paris." in prompt


async def test_a_wrong_key_is_refused_with_what_to_check():
    with FakeOpenAI(api_key="sk-right") as s:
        config = JudgeConfig(model="m", base_url=s.base_url, api_key="sk-wrong")
        async with Judge(config) as judge:
            with pytest.raises(JudgeRejectedError, match=r"HTTP 401.*check the API key \(OPENAI_API_KEY"):
                await judge.score("x")
        assert len(s.chat_requests) == 1  # a 4xx is not retried
        assert "sk-wrong" not in repr(config)  # the key stays out of logs


# ----------------------------------------------------------------------------- rate limits


def test_token_bucket_queues_requests_and_tokens():
    t = FakeTime()
    lim = RateLimiter(requests_per_minute=2, tokens_per_minute=None, clock=t.clock)
    assert [lim.reserve(1), lim.reserve(1), lim.reserve(1)] == [0.0, 0.0, 30.0]
    t.now += 30
    assert lim.reserve(1) == 30.0  # the earlier waiter keeps its place
    lim = RateLimiter(requests_per_minute=None, tokens_per_minute=600, clock=t.clock)
    assert lim.reserve(400) == 0.0
    assert lim.reserve(400) == pytest.approx(20.0)  # 200 tokens short at 10 tokens/s
    lim.settle(estimated=400, actual=100)  # the reply used fewer: the difference comes back
    assert lim.reserve(100) == pytest.approx(0.0)


def test_token_bucket_refuses_long_waits_and_impossible_requests():
    t = FakeTime()
    lim = RateLimiter(requests_per_minute=1, tokens_per_minute=1000, clock=t.clock)
    assert lim.reserve(10, max_wait_s=5) == 0.0
    with pytest.raises(Unavailable, match=r"next request slot is 60\.0 s away"):
        lim.reserve(10, max_wait_s=5)
    t.now += 60
    assert lim.reserve(10, max_wait_s=5) == 0.0  # the refused reservation took nothing
    with pytest.raises(ValueError, match="more than tokens_per_minute=1000"):
        lim.reserve(5000)


def test_a_fractional_request_rate_sends_the_first_request_at_once():
    # a bucket of under one request (0.5 a minute: 0.5) made even the first request wait
    t = FakeTime()
    lim = RateLimiter(requests_per_minute=0.5, tokens_per_minute=None, clock=t.clock)
    assert lim.reserve(1) == 0.0
    assert lim.reserve(1) == pytest.approx(120.0)  # one request every two minutes
    t.now += 240
    assert lim.reserve(1) == 0.0  # the queued one went at +120; a whole slot has passed since
    assert lim.reserve(1) == pytest.approx(120.0)  # no burst past one request
    lim = RateLimiter(requests_per_minute=1.5, tokens_per_minute=None, clock=t.clock)
    assert [lim.reserve(1), lim.reserve(1)] == [0.0, pytest.approx(20.0)]  # 1.5 burst, 40 s apart


async def test_the_judges_first_request_under_a_fractional_rate_goes_at_once(srv, make_judge):
    t = FakeTime(advance=False)
    judge = make_judge(srv, t, requests_per_minute=0.5, max_wait_s=300)
    await judge.score("x")
    assert t.sleeps == []
    await judge.score("x")
    assert t.sleeps == [pytest.approx(120.0)]


@pytest.mark.parametrize("value", ["0", "-1", "-0.5"])
def test_a_request_rate_of_zero_or_less_is_a_config_error(value):
    env = {"RL_FABRIC_JUDGE_MODEL": "m", "RL_FABRIC_JUDGE_BASE_URL": "http://x/v1"}
    with pytest.raises(ConfigError, match=r"REQUESTS_PER_MINUTE: .*must be above 0.*leave it unset"):
        JudgeConfig.from_env({**env, "RL_FABRIC_JUDGE_REQUESTS_PER_MINUTE": value})
    with pytest.raises(ConfigError, match=r"TOKENS_PER_MINUTE: .*must be above 0.*leave it unset"):
        JudgeConfig.from_env({**env, "RL_FABRIC_JUDGE_TOKENS_PER_MINUTE": value})
    # the limiter itself: 0 silently meant no cap, a negative rate a bucket that never fills
    with pytest.raises(ValueError, match="requests_per_minute must be above 0"):
        RateLimiter(requests_per_minute=float(value), tokens_per_minute=None)
    with pytest.raises(ValueError, match="tokens_per_minute must be above 0"):
        RateLimiter(requests_per_minute=None, tokens_per_minute=float(value))


async def test_the_judge_is_throttled_by_requests_per_minute(srv, make_judge):
    t = FakeTime(advance=False)  # all calls reserve at the same instant
    judge = make_judge(srv, t, requests_per_minute=1)
    results = await asyncio.gather(*(judge.score("x") for _ in range(3)))
    assert all(r.score == 0.8 for r in results)
    assert sorted(t.sleeps) == [60.0, 120.0]  # one request a minute, queued in order
    assert len(srv.chat_requests) == 3


async def test_usage_settles_the_token_estimate(srv, make_judge):
    t = FakeTime()
    judge = make_judge(srv, t, tokens_per_minute=2000, max_tokens=1000)
    assert estimate_tokens("", 1000) > 1000  # max_tokens alone: two estimates exceed the minute...
    await judge.score("x")
    await judge.score("x")
    assert t.sleeps == []  # ...but the replies' usage (~120 tokens each) was charged instead
    assert judge.limiter.tokens is not None and judge.limiter.tokens.level > 1500


async def test_a_refused_request_gives_its_token_estimate_back(srv, make_judge):
    t = FakeTime()
    judge = make_judge(srv, t, tokens_per_minute=2000, max_tokens=1000)
    for _ in range(3):  # three estimates of ~1000 would overdraw the minute if they stayed charged
        srv.fail_next(400)
        with pytest.raises(JudgeRejectedError, match="HTTP 400"):
            await judge.score("x")
    assert t.sleeps == []
    assert judge.limiter.tokens is not None and judge.limiter.tokens.level == pytest.approx(2000)


async def test_a_response_too_long_for_the_token_budget_is_named_as_the_cause(srv, make_judge):
    # a policy's runaway completion is what no longer fits tokens_per_minute: the error told
    # the user to raise the budget or lower max_tokens, which is neither the cause nor the fix
    with pytest.raises(ValueError, match=r"the response \(100000 characters\)") as e:
        await make_judge(srv, tokens_per_minute=10_000).score("x" * 100_000, question="q")
    assert "lower max_tokens" not in str(e.value)
    assert srv.chat_requests == []


def test_max_tokens_over_the_token_budget_is_a_config_error():
    with pytest.raises(ConfigError, match=r"max_tokens \(1000\) must be below tokens_per_minute"):
        JudgeConfig.from_env(
            {"RL_FABRIC_JUDGE_MODEL": "m", "RL_FABRIC_JUDGE_BASE_URL": "http://x/v1"},
            tokens_per_minute=1000,
            max_tokens=1000,
        )
