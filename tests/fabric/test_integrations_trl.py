"""fabric.integrations for TRL (1.16.0; see docs/integrations.md): its reward functions
called exactly as GRPOTrainer calls them, against real worker processes with the built-ins and
a user function; the failure paths (with FakeBackend) that every adapter shares; and the TRL
example trained for two steps where TRL is installed."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time

import integ_fns
import pytest
from integ_fns import REG
from integ_helpers import LOCAL1, call_trl, fake_backend, msgs, trl_kwargs

from fabric.errors import ConfigError, ErrorCode, UnknownFunctionError
from fabric.integrations import (
    BadBatchError,
    IntegrationConfig,
    MissingArgumentError,
    RewardCallError,
    UnexpectedArgumentError,
)
from fabric.integrations.openrlhf import OpenRLHFReward, RewardServer
from fabric.integrations.trl import TRL_EXTRAS, trl_async_reward, trl_reward
from fabric.integrations.verl import VerlReward
from fabric.protocol import Trajectory
from fabric.registry import Registry
from fabric.testing import FakeBackend

# integ_helpers: a FakeBackend over integ_fns.REG
fake = pytest.fixture(fake_backend, name="fake")


# ----------------------------------------------------------------------------- TRL


def test_trl_conversational_batch_with_math_answer_on_local_workers():
    prompts = [[{"role": "user", "content": "What is 6 * 7?"}]] * 4
    completions = [
        msgs("6 * 7 = 42, so the answer is \\boxed{42}."),
        msgs("The answer is 41."),
        msgs("I think it's \\frac{84}{2}"),
        [{"role": "assistant", "content": [{"type": "text", "text": "Answer: 42"}]}],  # content parts
    ]
    kw = trl_kwargs(4, ground_truth=["42"] * 4, source=["gsm8k"] * 4)
    with trl_reward("math_answer", registry=Registry(), backend=LOCAL1) as reward:
        assert reward.__name__ == "math_answer"  # TRL logs rewards/<__name__>/mean
        out, metrics = call_trl(reward, prompts, completions, **kw)
        assert out == [1.0, 0.0, 1.0, 1.0]
        names = dict(metrics)
        assert names["math_answer/failed"] == 0.0
        assert names["math_answer/correct"] == 0.75 and names["math_answer/extracted"] == 1.0
        assert reward.adapter.stats == {"batches": 1, "samples": 4, "failed": 0, "failure_scored": 0}
    assert not reward._bridge.started


def test_trl_standard_strings_exact_match_and_the_async_variant():
    prompts = ["Capital of France?", "Capital of Italy?"]
    completions = [" The answer is: Paris.", " Milan"]
    reward = trl_async_reward("exact_match", registry=Registry(), backend=LOCAL1)
    try:
        # TRL 1.16 tells async reward functions by inspect.iscoroutinefunction(func.__call__)
        assert inspect.iscoroutinefunction(reward.__call__)
        kw = trl_kwargs(2, ground_truth=["paris", "rome"])
        kw.pop("_metrics")

        async def on_trl_loop():  # TRL awaits it on its own loop thread
            return await reward(prompts=prompts, completions=completions, **kw)

        assert asyncio.run(on_trl_loop()) == [1.0, 0.0]
        assert asyncio.run(on_trl_loop()) == [1.0, 0.0]  # a new loop each time: the client is not on it
    finally:
        reward.close()


def test_trl_user_function_columns_by_name_or_args_and_components():
    prompts = ["q1", "q2", "q3"]
    completions = [msgs("x is 7"), msgs("no idea"), msgs("7!")]
    with trl_reward(integ_fns.contains, registry=REG, backend=LOCAL1, args={"answer": "label"}) as reward:
        out, metrics = call_trl(reward, prompts, completions, **trl_kwargs(3, label=["7", "7", "8"]))
        assert out == [1.0, 0.0, 0.0]
        assert dict(metrics)["contains/turns"] == 2.0  # the prompt's user turn + the completion
    # the text form: a parameter annotated str gets the completion's text
    with trl_reward("length", registry=REG, backend=LOCAL1) as reward:
        out, _ = call_trl(reward, ["p"] * 5, ["a" * i for i in range(5)], **trl_kwargs(5))
        assert out == [0.0, 1.0, 2.0, 3.0, 4.0]  # input order


def test_trl_failures_are_none_never_zero(fake, caplog):
    completions = ["fine", "boom", "fine", "fine"]
    with trl_reward("explode", registry=REG, backend_instance=fake) as reward:
        fake.fail_next("explode", ErrorCode.WORKER_LOST)  # infrastructure; explode has 1 attempt
        with caplog.at_level(logging.WARNING, "fabric.integrations"):
            out, metrics = call_trl(reward, ["p"] * 4, completions, **trl_kwargs(4, ground_truth=["g"] * 4))
        # calls run concurrently, so which "fine" sample met the injected fault is not fixed
        assert out.count(None) == 2 and out[1] is None and out.count(1.0) == 2
        assert dict(metrics)["explode/failed"] == 0.5
        assert "2 of 4 calls failed, no reward (None)" in caplog.text
    with trl_reward("explode", registry=REG, backend_instance=FakeBackend(REG), failure_score=-1.0) as reward:
        out, _ = call_trl(reward, ["p"] * 2, ["boom", "ok"], **trl_kwargs(2, ground_truth=["g"] * 2))
        assert out == [-1.0, 1.0]
        assert reward.adapter.stats["failure_scored"] == 1


def test_a_column_of_the_wrong_type_is_a_bad_batch_not_a_failed_call(fake):
    # GSM8K answers parsed as ints: every sample fails InvalidArguments; as None (TRL) or
    # failure_score the trainer learned nothing and only one WARNING said so
    for options in ({}, {"failure_score": -1.0}):
        with trl_reward("contains", registry=REG, backend_instance=fake, **options) as reward:
            with pytest.raises(BadBatchError) as e:
                call_trl(reward, ["p", "p"], ["4", "6"], **trl_kwargs(2, answer=[4, 6]))
            text = str(e.value)
            assert "contains(traj, answer)" in text and "2 of 2 samples" in text
            assert "#0 InvalidArguments" in text and "answer" in text
    v = VerlReward("contains", registry=REG, backend_instance=fake, args={"answer": "ground_truth"})
    try:
        with pytest.raises(BadBatchError, match="1 of 1 samples"):
            v.compute_score("d", "has 5", 5, {})
    finally:
        v.close()
    with OpenRLHFReward("explode", registry=REG, backend_instance=fake, failure_score=0.0) as reward_func:
        with pytest.raises(BadBatchError, match=r"explode\(traj, ground_truth\) refused .* 1 of 2 samples"):
            reward_func(["p a", "p b"], ["p", "p"], ["g", 7])  # ground_truth <- label


async def test_openrlhf_http_a_label_of_the_wrong_type_is_400_not_502():
    import aiohttp

    cfg = IntegrationConfig(function="explode", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server, aiohttp.ClientSession() as http:
        body = {"query": ["p a", "p b"], "prompts": ["p", "p"], "labels": [4, 6]}
        async with http.post(server.url, json=body) as resp:
            assert resp.status == 400  # a 502 is retried 5 times, then the samples go unrewarded
            assert "InvalidArguments" in (await resp.json())["error"]


def test_a_null_in_a_required_column_fails_its_row_only(fake, caplog):
    # a mixed dataset (parquet, HF datasets) has a null where a row lacks the column: it was
    # sent, refused (InvalidArguments) and the whole batch raised, the other rows unscored
    with trl_reward("with_tests", registry=REG, backend_instance=fake) as reward:
        with caplog.at_level(logging.WARNING, "fabric.integrations"):
            out, metrics = call_trl(
                reward, ["p"] * 3, ["a", "a", "b"], **trl_kwargs(3, tests=[["a"], None, ["a"]])
            )
        assert out == [1.0, None, 0.0]  # TRL's "no reward" for that row; the others scored
        assert dict(metrics)["with_tests/failed"] == pytest.approx(1 / 3)
        assert sorted(inv.payload["tests"][0] for inv in fake.invocations) == ["a", "a"]  # not sent
        nulls = [r for r in caplog.records if "null" in r.getMessage()]
        assert len(nulls) == 1, caplog.text  # said once, naming the row and the column
        assert "#1" in nulls[0].getMessage() and "'tests'" in nulls[0].getMessage()
        assert reward.adapter.stats["failed"] == 1
    scored = {"backend_instance": FakeBackend(REG), "failure_score": -1.0}
    with trl_reward("with_tests", registry=REG, **scored) as reward:
        out, _ = call_trl(reward, ["p"] * 2, ["a", "a"], **trl_kwargs(2, tests=[None, ["a"]]))
        assert out == [-1.0, 1.0]  # the failure score stands in for it
        assert reward.adapter.stats["failure_scored"] == 1
    with trl_reward("with_tests", registry=REG, backend_instance=FakeBackend(REG)) as reward:
        assert reward(prompts=["p"], completions=["a"], tests=[None]) == [None]  # every row null
    reward = trl_async_reward("with_tests", registry=REG, backend_instance=FakeBackend(REG))
    try:  # the async variant alike
        out = asyncio.run(reward(prompts=["p"] * 2, completions=["a"] * 2, tests=[["a"], None]))
        assert out == [1.0, None]
    finally:
        reward.close()


def test_trl_batch_goes_out_concurrently_within_its_deadline(fake):
    with trl_reward("slow_length", registry=REG, backend_instance=fake) as reward:
        t0 = time.monotonic()
        out, _ = call_trl(reward, ["p"] * 8, [f"{'x' * i}" for i in range(8)], **trl_kwargs(8))
        assert out == [float(i) for i in range(8)]
        assert time.monotonic() - t0 < 8 * 0.3  # the calls overlapped (an async function)
    # the deadline travels with the calls: the local backend answers DeadlineExceeded at it
    slow = {"delay_s": 5.0}
    with trl_reward("slow_length", registry=REG, backend=LOCAL1, deadline_s=1.0, constants=slow) as reward:
        t0 = time.monotonic()
        out, _ = call_trl(reward, ["p", "p"], ["a", "b"], **trl_kwargs(2))
        assert out == [None, None]
        assert time.monotonic() - t0 < 4.0


def test_missing_parameter_is_one_clear_error_before_any_call(fake):
    with trl_reward("contains", registry=REG, backend_instance=fake) as reward:
        with pytest.raises(MissingArgumentError) as e:
            call_trl(reward, ["p"], ["a"], **trl_kwargs(1, solution=["1"]))
        text = str(e.value)
        assert "contains(traj, answer)" in text and "'answer'" in text and "'solution'" in text
        assert "trainer_state" not in text  # TRL's own kwargs are not columns
        assert fake.invocations == []
    with pytest.raises(MissingArgumentError, match=r"args maps 'answer' .* 'nope'"):
        with trl_reward("contains", registry=REG, backend_instance=fake, args={"answer": "nope"}) as r:
            call_trl(r, ["p"], ["a"], **trl_kwargs(1))
    # a name the function does not take is not a missing one: it was refused as
    # MissingArgumentError (still caught as one: UnexpectedArgumentError is a subclass)
    with pytest.raises(UnexpectedArgumentError, match="constants names 'lang'"):
        trl_reward("contains", registry=REG, backend_instance=fake, constants={"lang": "x"})
    with pytest.raises(UnexpectedArgumentError, match="args names 'nope'"):
        trl_reward("contains", registry=REG, backend_instance=fake, args={"nope": "answer"})


def test_unknown_function_and_bad_options_are_refused_at_construction():
    with pytest.raises(UnknownFunctionError) as e:
        trl_reward("math_answr", registry=Registry())
    assert "math_answer" in str(e.value) and "exact_match" in str(e.value)
    with pytest.raises(ConfigError, match="failure_score"):
        trl_reward("exact_match", registry=Registry(), failure_score=float("nan"))
    with pytest.raises(ConfigError, match="deadline_s"):
        trl_reward("exact_match", registry=Registry(), deadline_s=0)
    with pytest.raises(ConfigError, match="for backend 'lambda'"):
        trl_reward("exact_match", registry=Registry(), backend="local", endpoint_url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match="bad fabric integration config: unknown"):
        trl_reward("exact_match", registry=Registry(), unknown=1)


def test_bad_trl_batches_are_refused_before_sending(fake):
    with trl_reward("contains", registry=REG, backend_instance=fake) as reward:
        with pytest.raises(BadBatchError, match="column 'answer' has 1 values for 2"):
            call_trl(reward, ["p", "p"], ["a", "b"], **trl_kwargs(2, answer=["1"]))
        with pytest.raises(BadBatchError, match="3 prompts but 2 completions"):
            call_trl(reward, ["p"] * 3, ["a", "b"], **trl_kwargs(2, answer=["1", "1"]))
        with pytest.raises(BadBatchError, match="completion #1 must be a string or a list of chat messages"):
            call_trl(reward, ["p", "p"], ["a", 7], **trl_kwargs(2, answer=["1", "1"]))
        with pytest.raises(BadBatchError, match="not a chat message"):
            call_trl(reward, ["p"], [[{"role": "robot", "content": "x"}]], **trl_kwargs(1, answer=["1"]))
        assert fake.invocations == []
        assert TRL_EXTRAS >= {"completion_ids", "trainer_state", "log_extra", "log_metric"}


def test_an_oversized_payload_fails_its_sample_and_keeps_the_others(caplog):
    huge = "x" * (7 * 1024 * 1024)
    with trl_reward("contains", registry=REG, backend="inproc") as reward:
        with caplog.at_level(logging.WARNING, "fabric.integrations"):
            out, _ = call_trl(reward, ["p"] * 3, ["a 1", huge, "b"], **trl_kwargs(3, answer=["1"] * 3))
        assert out == [1.0, None, 0.0]
        assert "PayloadTooLarge" in caplog.text
    v = VerlReward("contains", registry=REG, backend="inproc", args={"answer": "ground_truth"})
    try:
        with pytest.raises(RewardCallError, match=r"#1 PayloadTooLarge"):
            v.compute_score_batch(["d", "d"], ["1", huge], ["1", "1"], [{}, {}])
    finally:
        v.close()


def test_a_non_reward_answer_is_a_failure_not_a_score(fake):
    with trl_reward("not_a_reward", registry=REG, backend_instance=fake) as reward:
        out, _ = call_trl(reward, ["p"], ["a"], **trl_kwargs(1))
        assert out == [None]


def test_a_score_too_large_for_a_float_fails_its_sample_only(fake):
    # float(10**400) raises OverflowError: it took the whole batch down, the others unscored
    with trl_reward("huge", registry=REG, backend_instance=fake) as reward:
        out, _ = call_trl(reward, ["p"] * 3, ["ok", "big", "big component"], **trl_kwargs(3))
        assert out == [1.0, None, None]
        assert reward.adapter.stats["failed"] == 2


def test_an_answer_whose_components_are_not_a_mapping_fails_its_sample_only():
    # {"score": 1.0, "components": [...]} (a plain dict, which nothing checks on the way)
    # raised AttributeError in the adapter: the whole batch was lost, the others unscored
    reg = Registry()

    @reg.reward(warm=0)
    def listed(traj: Trajectory) -> dict:
        if traj.final_text() == "list":
            return {"score": 1.0, "components": [1.0, 2.0]}
        return {"score": 0.5, "components": {"x": 1.0}}

    with trl_reward("listed", registry=reg, backend_instance=FakeBackend(reg), builtins=False) as reward:
        out, _ = call_trl(reward, ["p"] * 3, ["ok", "list", "ok"], **trl_kwargs(3))
        assert out == [0.5, None, 0.5]
        assert reward.adapter.stats["failed"] == 1


def test_the_trl_example_trains_two_steps():
    pytest.importorskip("trl")  # not a dependency: run it by hand in a venv with TRL (see the file)
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "examples/trl_grpo.py", "--steps", "2"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'batches': 2" in done.stdout
