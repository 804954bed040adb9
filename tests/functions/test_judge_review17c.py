"""Review 17 (c) of ``llm_judge``: a 429's ``Retry-After`` was waited exactly, so the calls
that got a 429 together (a burst over the endpoint's rate limit) retried together, at the
same instant, and met the same limit again. A small random jitter now goes on top of it:
never less than the server asked, at most a fifth of it more and never more than 1 s more.
The random source is injectable (``Judge(rng=...)``), so these tests are deterministic."""

from __future__ import annotations

import asyncio
import random

import pytest
from judge_helpers import FakeTime, fake_openai

from functions.rewards.judge import Judge
from functions.rewards.judge_config import JudgeConfig

srv = pytest.fixture(fake_openai, name="srv")


def config(srv, **cfg) -> JudgeConfig:
    return JudgeConfig(model=srv.model, base_url=srv.base_url, api_key=srv.api_key, **cfg)


async def test_calls_429d_together_do_not_retry_together(srv):
    t = FakeTime()
    srv.fail_next(429, times=4, retry_after=5)
    async with Judge(config(srv), clock=t.clock, sleep=t.sleep, rng=random.Random(3)) as judge:
        results = await asyncio.gather(*(judge.score(f"x{i}") for i in range(4)))
    # each 429 is one wait and one more attempt, whichever call it met: a retry (the fake
    # clock sleeps at once) may reach the server before another call's first attempt does
    assert all(r.score == 0.8 for r in results)
    assert sum(r.info["attempts"] for r in results) == 8
    assert len(t.sleeps) == 4
    assert all(5.0 <= s <= 6.0 for s in t.sleeps), t.sleeps  # never sooner than asked, a fifth more at most
    assert len(set(t.sleeps)) == 4  # the herd is spread, not sent back at one instant


async def test_the_jitter_is_at_most_one_second(srv):
    t = FakeTime()
    srv.fail_next(429, times=3, retry_after=40)
    async with Judge(config(srv), clock=t.clock, sleep=t.sleep, rng=random.Random(1)) as judge:
        r = await judge.score("x")
    assert r.info["attempts"] == 4
    assert all(40.0 <= s <= 41.0 for s in t.sleeps) and len(set(t.sleeps)) == 3, t.sleeps


async def test_a_seeded_source_gives_the_same_waits(srv):
    waits = []
    for _ in range(2):
        t = FakeTime()
        srv.fail_next(429, times=2, retry_after=2)
        async with Judge(config(srv), clock=t.clock, sleep=t.sleep, rng=random.Random(7)) as judge:
            await judge.score("x")
        waits.append(t.sleeps)
    assert waits[0] == waits[1] and waits[0][0] > 2.0
