"""A reward whose own setup is wrong (``fabric.Misconfigured``: the judge's key refused, ...)
is never scored by ``failure_score``: the trajectory is masked (``reward_failed``) with the
message saying what to fix, as the job's give-up streak then stops it with; a failure the
response caused is still scored, a timeout of a call that never began is not."""

from __future__ import annotations

import pytest

from core.config import RewardConfig
from core.rewards import RewardStream
from core.sample import Sample
from fabric.client import Client
from fabric.errors import ErrorCode, Misconfigured
from fabric.protocol import Trajectory
from fabric.registry import Registry
from fabric.testing import FakeBackend, Fault
from functions.fakes import FakeOpenAI
from functions.rewards import judge as judge_mod

REG = Registry()
REG.discover("functions.rewards.judge")
CALLS: list[str] = []


@REG.reward
def needs_a_key(traj: Trajectory) -> float:
    CALLS.append(traj.id)
    raise Misconfigured("needs_a_key: set MY_API_KEY")


def traj(tid: str, answer: str = "Paris") -> Trajectory:
    t = Trajectory(
        id=tid,
        messages=[
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": answer},
        ],
        task={"tag": "t", "group_id": "g"},
    )
    t.info["start_version"] = 0
    return t


async def _score(
    client_env: dict[str, str], monkeypatch, rewards, *trajs: Trajectory
) -> tuple[dict[str, Sample], dict]:
    for k, v in client_env.items():
        monkeypatch.setenv(k, v)  # the judge's setup hook reads them
    got: list[Sample] = []
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, got.append) as stream:
        for t in trajs:
            stream.submit(t)
    return {s.id: s for s in got}, stream.metrics()


@pytest.fixture(autouse=True)
def _fresh():
    CALLS.clear()
    judge_mod._shared.clear()
    yield
    judge_mod._shared.clear()


async def test_a_judge_whose_key_is_refused_masks_instead_of_scoring_failure_score(monkeypatch):
    rewards = {"t": [RewardConfig(function="llm_judge", failure_score=0.0)]}
    with FakeOpenAI(api_key="sk-right") as s:
        env = {**s.env, "RL_FABRIC_JUDGE_API_KEY": "sk-wrong"}
        got, m = await _score(env, monkeypatch, rewards, traj("a"), traj("b"))
    for sample in got.values():
        assert sample.status == "reward_failed" and sample.masked and sample.reward is None
        assert "llm_judge: Misconfigured:" in (sample.error or "")
        assert "HTTP 401" in (sample.error or "") and "check the API key" in (sample.error or "")
    assert m["failure_scored"] == 0 and m["reward_failed"] == 2
    assert m["failures"] == {f"llm_judge:{ErrorCode.MISCONFIGURED}": 2}
    assert len(s.chat_requests) == 2  # final: neither the client nor the judge retried


async def test_a_reply_the_response_caused_is_still_scored_failure_score(monkeypatch):
    rewards = {"t": [RewardConfig(function="llm_judge", failure_score=0.0)]}
    with FakeOpenAI(reply="I refuse to grade this.") as s:
        got, m = await _score(s.env, monkeypatch, rewards, traj("a"))
    sample = got["a"]
    assert sample.status == "ok" and sample.reward is not None and sample.reward.score == 0.0
    assert "UserError: JudgeResponseError" in sample.reward.info["llm_judge"]["info"]["failed"]
    assert m["failure_scored"] == 1 and m["reward_failed"] == 0


async def test_a_function_raising_misconfigured_is_masked_not_retried(monkeypatch):
    rewards = {"t": [RewardConfig(function="needs_a_key", failure_score=-1.0)]}
    got, m = await _score({}, monkeypatch, rewards, traj("a"))
    assert got["a"].status == "reward_failed"
    assert got["a"].error == "needs_a_key: Misconfigured: needs_a_key: set MY_API_KEY"
    assert CALLS == ["a"] and m["failure_scored"] == 0


async def test_a_misconfigured_call_is_run_again_under_its_key_once_fixed(monkeypatch):
    # not the function's answer to the payload: not kept under the idempotency key, so a
    # resubmission after the fix (the stream scores a reward_failed trajectory anew) runs it
    rewards = {"t": [RewardConfig(function="needs_a_key")]}
    got: list[Sample] = []
    async with Client("inproc", registry=REG) as client, RewardStream(client, rewards, got.append) as stream:
        stream.submit(traj("a"))
        await stream.join()
        stream.submit(traj("a"))
    assert CALLS == ["a", "a"] and [s.status for s in got] == ["reward_failed", "reward_failed"]


@REG.reward
def fine(traj: Trajectory) -> float:
    return 1.0


@pytest.mark.parametrize(("started", "status"), [(False, "reward_failed"), (True, "ok")])
async def test_a_timeout_scores_failure_score_only_if_the_function_ran(started, status):
    """A FunctionTimeout that never began (a backend that found no thread, no worker, within
    the function's time) says nothing of the response: it is masked, not scored; one that ran
    on the response past its limit is still the response's fault."""
    fake = FakeBackend(REG)
    attempts = REG.get("fine").retry.max_attempts
    fake.inject("fine", *[Fault(ErrorCode.TIMEOUT, started=started) for _ in range(attempts)])
    rewards = {"t": [RewardConfig(function="fine", failure_score=-1.0)]}
    got: list[Sample] = []
    async with Client(fake, registry=REG) as client, RewardStream(client, rewards, got.append) as stream:
        stream.submit(traj("a"))
    [sample] = got
    assert sample.status == status, sample.error
    assert stream.metrics()["failure_scored"] == (1 if started else 0)
