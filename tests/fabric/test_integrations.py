"""fabric.integrations: each adapter called exactly as its framework calls it (TRL 1.16.0,
veRL 0.9.1, OpenRLHF 0.11.2; see docs/integrations.md), against real worker processes with
the built-ins and a user function, and the failure paths with FakeBackend."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import threading
import time
from pathlib import Path

import integ_fns
import pytest
from integ_fns import REG
from test_local_backend import alive

from fabric.errors import ConfigError, ErrorCode, UnknownFunctionError
from fabric.integrations import (
    BadBatchError,
    IntegrationConfig,
    MissingArgumentError,
    RewardCallError,
    _verl,
    build_trajectory,
)
from fabric.integrations import verl as verl_mod
from fabric.integrations.openrlhf import OpenRLHFReward, RewardServer
from fabric.integrations.trl import TRL_EXTRAS, trl_async_reward, trl_reward
from fabric.integrations.verl import VerlReward
from fabric.protocol import Trajectory
from fabric.registry import Registry
from fabric.testing import FakeBackend

LOCAL1 = {"type": "local", "max_workers": 1}


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def trl_kwargs(n: int, **columns: list) -> dict:
    """What GRPOTrainer._calculate_rewards adds to every call besides the dataset columns."""
    metrics: list[tuple[str, float]] = []
    return {
        "completion_ids": [[5, 6, 7]] * n,
        "trainer_state": object(),
        "log_extra": lambda column, values: None,
        "log_metric": lambda name, value: metrics.append((name, value)),
        **columns,
        "_metrics": metrics,
    }


def call_trl(reward, prompts, completions, **kw):
    kw = dict(kw)
    metrics = kw.pop("_metrics", None)
    out = reward(prompts=prompts, completions=completions, **kw)
    return out, metrics


@pytest.fixture
def fake():
    return FakeBackend(REG)


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
    with pytest.raises(MissingArgumentError, match="constants names 'lang'"):
        trl_reward("contains", registry=REG, backend_instance=fake, constants={"lang": "x"})


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


# ----------------------------------------------------------------------------- veRL


@pytest.fixture
def verl_rewards():
    yield verl_mod
    verl_mod.close_all()


def test_verl_compute_score_as_the_naive_manager_calls_it(verl_rewards):
    kwargs = {"function": "math_answer", "backend": LOCAL1}  # custom_reward_function.reward_kwargs
    extra = {"index": 3, "num_turns": None, "rollout_reward_scores": {}}
    a = verl_mod.compute_score(
        data_source="openai/gsm8k",
        solution_str="... so the answer is \\boxed{18}",
        ground_truth="18",
        extra_info=extra,
        **kwargs,
    )
    b = verl_mod.compute_score(
        data_source="openai/gsm8k",
        solution_str="no number here",
        ground_truth="18",
        extra_info=extra,
        **kwargs,
    )
    assert a == {"score": 1.0, "correct": 1.0, "extracted": 1.0}
    assert b == {"score": 0.0, "correct": 0.0, "extracted": 0.0}  # same keys: veRL stacks them by key
    assert len(_verl._REWARDS) == 1  # one adapter per distinct reward_kwargs


def test_the_verl_file_loaded_by_path_pickles_to_another_process(verl_rewards, tmp_path):
    """veRL loads verl.py by file path, as a module of another name, and its remote reward
    manager pickles the function for a Ray actor: defined in that file, the function was
    pickled by value with the module's pools and failed ("cannot pickle '_asyncio.Future'")."""
    import importlib.util
    import subprocess
    import sys

    cloudpickle = pytest.importorskip("ray.cloudpickle")  # what Ray pickles a task's function with
    spec = importlib.util.spec_from_file_location("custom_module_123", verl_mod.__file__)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)  # not in sys.modules: nobody imports it by name
    spec.loader.exec_module(loaded)
    raw = loaded.compute_score
    kwargs = {"function": "exact_match", "backend": LOCAL1}

    def wrapped(*args, **kw):  # veRL's get_custom_reward_fn merges reward_kwargs the same way
        return raw(*args, **kw, **kwargs)

    assert wrapped("d", "Answer: 4", "4") == {"score": 1.0}  # used (a pool started) before pickling
    blob = cloudpickle.dumps(wrapped)
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import pickle, sys; f = pickle.loads(sys.stdin.buffer.read()); print(f('d', 'Answer: 4', '4'))",
        ],
        input=blob,
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    assert child.stdout.decode().strip() == "{'score': 1.0}"


def test_verl_async_and_batch_forms(verl_rewards):
    kwargs = {"function": "exact_match", "backend": LOCAL1}

    async def reward_loop():  # the reward loop's naive manager awaits an async compute_score
        return await asyncio.gather(
            *(
                verl_mod.compute_score_async(
                    data_source="x",
                    solution_str=f"The answer is {i}.",
                    ground_truth="2",
                    extra_info={},
                    **kwargs,
                )
                for i in range(4)
            )
        )

    assert [r["score"] for r in asyncio.run(reward_loop())] == [0.0, 0.0, 1.0, 0.0]
    # the batch manager: data_sources, solution_strs, ground_truths, extra_infos, **reward_kwargs
    import numpy as np  # veRL hands non-tensor batches over as numpy object arrays

    out = verl_mod.compute_score_batch(
        data_sources=np.array(["a", "b"], dtype=object),
        solution_strs=["Answer: blue", "Answer: red"],
        ground_truths=[np.str_("blue"), "blue"],
        extra_infos=[{"rollout_reward_scores": {}}, {"rollout_reward_scores": {}}],
        **kwargs,
    )
    assert out == [{"score": 1.0}, {"score": 0.0}]
    with pytest.raises(BadBatchError, match="2 solution_strs but 1 ground_truths"):
        verl_mod.compute_score_batch(["a", "b"], ["x", "y"], ["1"], [{}, {}], **kwargs)


def test_verl_extra_info_feeds_parameters_and_failures_raise_or_score(fake):
    v = VerlReward("with_tests", registry=REG, backend_instance=fake)
    try:
        # a parameter is found in extra_info by name; veRL's own keys there are ignored
        r = v.compute_score("code", "prints a, c", None, {"tests": ["a", "b", "c", "d"], "num_turns": 1})
        assert r == {"score": 0.5, "passed": 2.0}
        with pytest.raises(MissingArgumentError, match="sample #0 has no 'tests'"):
            v.compute_score("code", "x", None, {"index": 1})
    finally:
        v.close()
    v = VerlReward("explode", registry=REG, backend_instance=fake)
    try:
        with pytest.raises(
            RewardCallError, match=r"explode failed on 1 of 1 samples .*UserError: ValueError"
        ):
            v.compute_score("d", "boom", "gt", {})
    finally:
        v.close()
    v = VerlReward(
        "contains", registry=REG, backend_instance=fake, args={"answer": "ground_truth"}, failure_score=0.0
    )
    try:
        assert v.compute_score("d", "has 5", "5", {}) == {
            "score": 1.0,
            "hit": 1.0,
            "turns": 1.0,
            "fabric_failed": 0.0,
        }
        fake.fail_next("contains", ErrorCode.WORKER_LOST, times=3)  # every attempt
        r = v.compute_score("d", "has 5", "5", {})
        assert r["score"] == 0.0 and r["fabric_failed"] == 1.0 and r["hit"] != r["hit"]  # NaN, same keys
    finally:
        v.close()


def test_an_optional_parameter_follows_each_sample_not_the_first(fake):
    # a mixed dataset: the plan was made from the first sample, so an optional parameter it
    # lacked was never sent (a cpp sample graded as python) and one it had was required after
    v = VerlReward("with_tests", registry=REG, backend_instance=fake)
    try:
        py, cpp = {"tests": ["a"]}, {"tests": ["a"], "language": "cpp"}
        v.compute_score_batch(["d"] * 3, ["a 0", "a 1", "a 2"], [None] * 3, [py, cpp, py])
        v.compute_score("d", "a 3", None, cpp)
        sent = {
            Trajectory.model_validate(i.payload["traj"]).final_text(): i.payload.get("language")
            for i in fake.invocations
        }
        assert sent == {"a 0": None, "a 1": "cpp", "a 2": None, "a 3": "cpp"}
    finally:
        v.close()
    v = VerlReward("with_tests", registry=REG, backend_instance=FakeBackend(REG))
    try:
        assert v.compute_score("d", "a", None, cpp)["score"] == 1.0
        assert v.compute_score("d", "a", None, py)["score"] == 1.0  # raised MissingArgumentError
    finally:
        v.close()
    # OpenRLHF: ground_truth from a JSON label's key where it has one, else the label itself
    with OpenRLHFReward("explode", registry=REG, backend_instance=(fb := FakeBackend(REG))) as reward_func:
        reward_func(["p x", "p y"], ["p", "p"], [json.dumps({"ground_truth": "7"}), "8"])
        assert sorted(inv.payload["ground_truth"] for inv in fb.invocations) == ["7", "8"]


def test_verl_settings_from_the_environment_and_typos(verl_rewards, monkeypatch):
    monkeypatch.setenv("FABRIC_FUNCTION", "exact_match")
    monkeypatch.setenv("FABRIC_BACKEND", "inproc")
    assert verl_mod.compute_score("d", "Answer: 4", "4", None) == {"score": 1.0}
    with pytest.raises(ConfigError, match="functon"):
        verl_mod.compute_score("d", "4", "4", None, functon="exact_match")
    # veRL's own extras (a reward model's router) are not settings
    assert verl_mod.compute_score("d", "Answer: 4", "4", None, reward_router_address=None)["score"] == 1.0
    monkeypatch.setenv("FABRIC_ARGS", "not json")
    with pytest.raises(ConfigError, match="FABRIC_ARGS must be a JSON object"):
        IntegrationConfig.parse()


def test_a_misspelt_environment_variable_is_refused_not_ignored():
    # OpenRLHF's file form reads its settings from the environment only: a typo left the
    # default in silence (failures raised instead of scoring; the deadline stayed 300 s)
    base = {"FABRIC_FUNCTION": "exact_match", "FABRIC_WORKER_FD": "3", "OTHER": "x"}
    for typo, meant in [
        ("FABRIC_FAILURE_SCROE", "FABRIC_FAILURE_SCORE"),
        ("FABRIC_DEADLINE", "FABRIC_DEADLINE_S"),
        ("FABRIC_ENDPOINT", "FABRIC_ENDPOINT_URL"),
        ("FABRIC_TOKEN", "RL_FABRIC_TOKEN"),
    ]:
        with pytest.raises(ConfigError, match=rf"\${typo} is not .* did you mean \${meant}\?"):
            IntegrationConfig.parse(env={**base, typo: "1"})
    assert IntegrationConfig.parse(env={**base, "FABRIC_UNRELATED_TOOL": "1"}).function == "exact_match"
    # the backend may be a config mapping there too, as docs/integrations.md says it may
    cfg = IntegrationConfig.parse(env={**base, "FABRIC_BACKEND": '{"type": "local", "max_workers": 4}'})
    assert cfg.backend_config().type == "local" and cfg.backend_config().max_workers == 4  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="FABRIC_BACKEND must be a backend name or a JSON object"):
        IntegrationConfig.parse(env={**base, "FABRIC_BACKEND": "{local"})
    # every setting has its variable, builtins too (OpenRLHF's file form has no other way)
    assert IntegrationConfig.parse(env={**base, "FABRIC_BUILTINS": "false"}).builtins is False
    with pytest.raises(ConfigError, match=r"\$FABRIC_BUILTIN is not .* did you mean \$FABRIC_BUILTINS\?"):
        IntegrationConfig.parse(env={**base, "FABRIC_BUILTIN": "0"})


# ----------------------------------------------------------------------------- OpenRLHF

PROMPT = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


def test_openrlhf_reward_func_as_the_single_turn_executor_calls_it():
    with OpenRLHFReward("math_answer", registry=Registry(), backend=LOCAL1) as reward_func:
        # one sample per call, lists; the query is the decoded prompt + response, special tokens kept
        out = reward_func([PROMPT + "2+3 = 5, so the answer is 5.<|im_end|>"], [PROMPT], ["5"])
        assert out == {
            "rewards": [1.0],
            "scores": [1.0],
            "extra_logs": {"correct": [1.0], "extracted": [1.0]},
        }
        assert reward_func.response(PROMPT + "x<|endoftext|>", PROMPT) == "x"
        with pytest.raises(BadBatchError, match="2 queries, 1 prompts and 1 labels"):
            reward_func(["a", "b"], [PROMPT], ["5"])


def test_openrlhf_a_left_truncated_prompt_is_not_scored_as_the_response(fake):
    # OpenRLHF keeps a long prompt's last tokens: the query no longer holds the whole prompt,
    # and the whole query (a few-shot answer included) was scored as the response
    prompt = (
        "<|im_start|>user\nExample: 3+4? Answer: 7\n" + "filler " * 50 + "\nNow: 2+5?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    response = "I don't know.<|im_end|>"
    with OpenRLHFReward("contains", registry=REG, backend_instance=fake, args={"answer": "label"}) as r:
        for cut in (20, 45, 200, len(prompt) - 30, len(prompt) - 3):  # in the filler too; a short end
            assert r.response(prompt[cut:] + response, prompt) == "I don't know.", cut
        assert r([prompt[20:] + response], [prompt], ["7"])["rewards"] == [0.0]
        assert r([prompt + "7<|im_end|>"], [prompt], ["7"])["rewards"] == [1.0]
        # nothing of the prompt in the query: all of it is the response, as before
        assert r.response("7 it is", prompt) == "7 it is"
        long = "ab" * 50_000  # repetitive: every offset is a candidate
        assert r.response(long[1001:] + "zz", long) == "zz"


def test_openrlhf_json_labels_and_failures(fake):
    label = json.dumps({"tests": ["a", "c"], "difficulty": 3})
    with OpenRLHFReward("with_tests", registry=REG, backend_instance=fake) as reward_func:
        out = reward_func(["p: a b c"], ["p:"], [label])
        assert out["rewards"] == [1.0] and out["extra_logs"] == {"passed": [2.0]}
    with OpenRLHFReward("explode", registry=REG, backend_instance=fake) as reward_func:
        with pytest.raises(RewardCallError, match="UserError"):
            reward_func(["p boom"], ["p"], ["g"])  # ground_truth <- label
    with OpenRLHFReward("explode", registry=REG, backend_instance=fake, failure_score=-0.5) as reward_func:
        out = reward_func(["p boom", "p ok"], ["p", "p"], ["g", "g"])
        assert out["rewards"] == [-0.5, 1.0] and out["extra_logs"] == {"fabric_failed": [1.0, 0.0]}


async def test_openrlhf_http_form_over_a_socket():
    import aiohttp

    cfg = IntegrationConfig(function="explode", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG, max_body_bytes=64 * 1024) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/get_reward")
        async with aiohttp.ClientSession() as http:
            # what OpenRLHF's _fetch_rewards_via_http posts
            body = {"query": ["p fine", "p also fine"], "prompts": ["p", "p"], "labels": ["g", "g"]}
            async with http.post(server.url, json=body) as resp:
                assert resp.status == 200
                assert await resp.json() == {"rewards": [1.0, 1.0], "scores": [1.0, 1.0], "extra_logs": {}}
            async with http.post(server.url, json={**body, "query": ["p boom", "p"]}) as resp:
                assert resp.status == 502  # OpenRLHF retries, then leaves the sample unrewarded
                data = await resp.json()
                assert data["failures"][0]["index"] == 0 and data["failures"][0]["type"] == "UserError"
            async with http.post(server.url, json={**body, "labels": ["g"]}) as resp:
                assert (
                    resp.status == 400 and "2 queries, 2 prompts and 1 labels" in (await resp.json())["error"]
                )
            async with http.post(server.url, data=b"[1, 2") as resp:
                assert resp.status == 400
            async with http.post(server.url, json={**body, "query": ["x" * 100_000, "y"]}) as resp:
                assert resp.status == 413
            async with http.get(server.url.replace("/get_reward", "/healthz")) as resp:
                assert (await resp.json())["function"] == "explode"


async def test_openrlhf_http_a_micro_batch_over_6_mib_is_scored_not_413():
    # older OpenRLHF posts a whole micro-batch to one server: 100 samples of 70 KB are 7 MB
    # together, each far under the 6 MiB call limit, and were refused whole with 413
    import aiohttp

    cfg = IntegrationConfig(function="length", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server, aiohttp.ClientSession() as http:
        n, size = 100, 70_000
        body = {"query": ["p" + "x" * size] * n, "prompts": ["p"] * n, "labels": [""] * n}
        async with http.post(server.url, json=body) as resp:
            assert resp.status == 200 and (await resp.json())["rewards"] == [float(size)] * n
        # the per-call limit still holds for one sample: it fails (502: no failure_score)
        body = {"query": ["p" + "x" * (7 * 1024 * 1024), "p"], "prompts": ["p", "p"], "labels": ["", ""]}
        async with http.post(server.url, json=body) as resp:
            assert resp.status == 502
            assert [f["type"] for f in (await resp.json())["failures"]] == ["PayloadTooLarge"]


async def test_openrlhf_http_a_request_whose_client_hung_up_is_cancelled():
    # OpenRLHF gives up on a request after 180 s and posts it again, 5 times: the calls of a
    # request nobody waits for any more ran on, one more copy in the pool at each retry
    import aiohttp

    cfg = IntegrationConfig(function="waits", backend="inproc", builtins=False)
    async with RewardServer(cfg, port=0, registry=REG) as server:
        async with aiohttp.ClientSession() as http:
            body = {"query": ["q"], "prompts": [""], "labels": ["hung-up"]}
            with pytest.raises(asyncio.TimeoutError):
                async with http.post(server.url, json=body, timeout=aiohttp.ClientTimeout(total=0.5)):
                    pass  # never reached: the client gives up on the hung reward first
        for _ in range(400):  # the function would finish at 5 s; wait up to 20
            if "hung-up" in integ_fns.OUTCOMES:
                break
            await asyncio.sleep(0.05)
        assert integ_fns.OUTCOMES.get("hung-up") == "cancelled"
    # and the command's deadline comes before OpenRLHF's 180 s (aiohttp ClientTimeout(total=180))
    from fabric.cli import openrlhf_serve

    assert inspect.signature(openrlhf_serve).parameters["deadline_s"].default < 180


async def test_openrlhf_http_close_drains_then_a_second_signal_cancels():
    """Ctrl-C waited silently for aiohttp's 60 s shutdown timeout; a second one did nothing."""
    import aiohttp

    from fabric.serve.drain import close_in_two_steps

    async def until_in_flight(server: RewardServer) -> None:
        for _ in range(3000):
            if server.requests:
                return
            await asyncio.sleep(0.01)
        pytest.fail("the request never reached the server")

    def body(label: str) -> dict:
        return {"query": ["q"], "prompts": [""], "labels": [label]}

    quick = IntegrationConfig(function="waits", backend="inproc", builtins=False, constants={"delay_s": 0.5})
    server = RewardServer(quick, port=0, registry=REG, drain_s=60)
    await server.start()
    async with aiohttp.ClientSession() as http:
        finishing = asyncio.create_task(http.post(server.url, json=body("drained")))
        await until_in_flight(server)
        await close_in_two_steps(server.aclose(), asyncio.Event(), server.requests.cancel)
        assert (await finishing).status == 200 and integ_fns.OUTCOMES["drained"] == "done"  # it had 60 s

    slow = IntegrationConfig(function="waits", backend="inproc", builtins=False)  # 5 s a call
    server = RewardServer(slow, port=0, registry=REG, drain_s=60)
    await server.start()
    async with aiohttp.ClientSession() as http:
        hanging = asyncio.create_task(http.post(server.url, json=body("cut-short")))
        await until_in_flight(server)
        t0 = time.monotonic()
        again = asyncio.Event()
        closing = asyncio.create_task(close_in_two_steps(server.aclose(), again, server.requests.cancel))
        await asyncio.sleep(0.2)
        assert not closing.done()  # draining: the call has 60 s
        again.set()  # Ctrl-C again
        await closing
        assert time.monotonic() - t0 < 4  # not the call's 5 s, nor the 60 s drain
        with pytest.raises(aiohttp.ClientError):
            await hanging
    assert integ_fns.OUTCOMES["cut-short"] == "cancelled"


async def test_openrlhf_http_a_zero_drain_cancels_at_once():
    """drain_s 0 went to aiohttp's shutdown_timeout, where 0 is no limit: the close waited
    for the call to end."""
    import aiohttp

    slow = IntegrationConfig(function="waits", backend="inproc", builtins=False, constants={"delay_s": 20})
    server = RewardServer(slow, port=0, registry=REG, drain_s=0)
    await server.start()
    async with aiohttp.ClientSession() as http:
        hanging = asyncio.create_task(http.post(server.url, json={"query": ["q"], "labels": ["zero-drain"]}))
        for _ in range(3000):
            if server.requests:
                break
            await asyncio.sleep(0.01)
        assert server.requests
        t0 = time.monotonic()
        await server.aclose()
        assert time.monotonic() - t0 < 10  # not the call's 20 s
        with pytest.raises(aiohttp.ClientError):
            await hanging
    assert integ_fns.OUTCOMES["zero-drain"] == "cancelled"


def test_cli_openrlhf_serve_serves_until_interrupted(tmp_path):
    import signal
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    SERVE = [sys.executable, "-m", "fabric.cli", "integrate", "openrlhf-serve"]
    here = str(Path(__file__).parent)  # not relative: the working directory may be anywhere
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [
            *SERVE,
            "-f",
            "contains",
            "-m",
            "integ_fns",
            "--port",
            "0",
            "--backend",
            "inproc",
            "--arg",
            "answer=label",
            "--max-body-mb",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        url = json.loads(line)["url"]
        req = urllib.request.Request(
            url,
            data=json.dumps({"query": ["p 5"], "prompts": ["p"], "labels": ["5"]}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["rewards"] == [1.0]
        big = {"query": ["p " + "x" * 600_000] * 2, "prompts": ["p"] * 2, "labels": ["5"] * 2}
        req = urllib.request.Request(url, data=json.dumps(big).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 413  # --max-body-mb 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    bad = subprocess.run(
        [*SERVE, "-f", "nope", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown function 'nope'" in bad.stderr and "math_answer" in bad.stderr


# ----------------------------------------------------------------------------- the bridge


def test_bridge_starts_lazily_closes_workers_and_restarts():
    reward = trl_reward("contains", registry=REG, backend={"type": "local", "max_workers": 1, "warm": 1})
    assert not reward._bridge.started  # nothing runs until the first call
    assert not any(t.name == "fabric-trl-contains" for t in threading.enumerate())
    out, _ = call_trl(reward, ["p"], ["1"], **trl_kwargs(1, answer=["1"]))
    assert out == [1.0]
    pids = reward.adapter._client.backend.stats()["contains"]["pids"]
    assert pids and all(alive(p) for p in pids)
    reward.close()
    assert not any(t.name == "fabric-trl-contains" for t in threading.enumerate())
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    reward.close()  # idempotent
    out, _ = call_trl(reward, ["p"], ["2"], **trl_kwargs(1, answer=["1"]))  # starts again
    assert out == [0.0]
    reward.close()


EXIT_WITHOUT_CLOSE = """
import json, sys
sys.path.insert(0, {here!r})
import integ_fns
from fabric.integrations.trl import trl_reward
backend = {"type": "local", "max_workers": 1, "warm": 1}
reward = trl_reward("contains", registry=integ_fns.REG, backend=backend)
assert reward(prompts=["p"], completions=["1"], answer=["1"]) == [1.0]
print(json.dumps(reward.adapter._client.backend.stats()["contains"]["pids"]), flush=True)
# no close(): the exit backstop ends the bridge and its workers
"""


def test_the_exit_backstop_closes_a_bridge_left_open(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", EXIT_WITHOUT_CLOSE.replace("{here!r}", repr(str(Path(__file__).parent)))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    # an atexit hook ran after concurrent.futures' own: "cannot schedule new futures after
    # interpreter shutdown" from the pool's close, with a traceback, at every such exit
    assert "Traceback" not in done.stderr and "closing the fabric client failed" not in done.stderr, (
        done.stderr
    )
    pids = json.loads(done.stdout)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids and not any(alive(p) for p in pids)


@pytest.mark.parametrize("state", ["open", "never_started", "closed"])
def test_a_fork_while_another_thread_holds_the_bridge_lock_does_not_hang_the_child(state):
    # open: its lock reset in the child; never started or closed: not in _OPEN while the lock
    # is held (inside _ensure, or close() waiting for the workers), which once hung the child
    import multiprocessing as mp
    import queue

    reward = trl_reward("contains", registry=REG, backend="inproc")
    try:
        if state != "never_started":
            assert call_trl(reward, ["p"], ["1"], **trl_kwargs(1, answer=["1"]))[0] == [1.0]
        if state == "closed":
            reward.close()
        ctx = mp.get_context("fork")
        answers = ctx.Queue()

        def child() -> None:
            answers.put(call_trl(reward, ["p"], ["2"], **trl_kwargs(1, answer=["2"]))[0])

        with reward._bridge._lock:  # as when another thread is starting or closing the bridge
            proc = ctx.Process(target=child, daemon=True)
            proc.start()
        try:
            assert answers.get(timeout=60) == [1.0]  # the child's lock was never released
        except queue.Empty:
            pytest.fail(f"the forked child waited forever on a lock the parent held at the fork ({state})")
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    finally:
        reward.close()


def test_a_fork_while_the_module_level_rewards_are_being_built_does_not_hang_the_child():
    # veRL's reward_for and OpenRLHF's reward_func hold a module lock while building the first
    # reward (registry discovery, imports): a child forked then must not inherit it held
    import multiprocessing as mp

    from fabric.integrations import _verl
    from fabric.integrations import openrlhf as openrlhf_mod

    ctx = mp.get_context("fork")
    for module in (_verl, openrlhf_mod):
        answers = ctx.Queue()

        def child(module=module, answers=answers) -> None:
            answers.put(module._LOCK.acquire(timeout=5))

        with module._LOCK:
            proc = ctx.Process(target=child, daemon=True)
            proc.start()
        try:
            assert answers.get(timeout=20) is True, f"{module.__name__}._LOCK was still held in the child"
        finally:
            proc.join(10)


def test_trajectories_from_prompts_and_completions():
    t = build_trajectory(msgs("hi"), [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert [m.role for m in t.messages] == ["system", "user", "assistant"] and t.final_text() == "hi"
    t = build_trajectory(
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
            }
        ],
        "prompt",
    )
    assert [m.role for m in t.messages] == [
        "user",
        "assistant",
    ]  # a tool call of another shape is kept as a turn


def test_the_trl_example_trains_two_steps():
    pytest.importorskip("trl")  # not a dependency: run it by hand in a venv with TRL (see the file)
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "examples/trl_grpo.py", "--steps", "2"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'batches': 2" in done.stdout


def test_a_trl_reward_can_be_sent_to_another_process():
    """TRL's experimental AsyncGRPOTrainer pickles its reward functions into a spawned child:
    the bridge's lock, loop thread and client made a TRLReward unpicklable. A copy is rebuilt
    from the function and options, and starts its own bridge on first use."""
    import pickle

    prompts, completions = ["Capital of France?"], ["Paris"]
    for make in (trl_reward, trl_async_reward):
        original = make("exact_match", backend=LOCAL1)
        copy = pickle.loads(pickle.dumps(original))
        assert type(copy) is type(original) and copy.__name__ == "exact_match"
        try:
            call = copy(prompts, completions, ground_truth=["paris"])
            out = asyncio.run(call) if inspect.iscoroutine(call) else call
            assert out == [1.0]
        finally:
            copy.close()
            original.close()
    with pytest.raises(TypeError, match="registry= or backend_instance="):
        pickle.dumps(trl_reward("exact_match", registry=Registry(), backend=LOCAL1))


async def test_arun_cancelled_in_the_loop_turn_its_scores_arrive_is_cancelled(fake, monkeypatch):
    # asyncio.wait_for (Python 3.11) returns a result that lands in the loop turn its caller
    # is cancelled and drops the cancellation: a trainer's task cancelled (a step aborted, a
    # shutdown) just as its batch's scores came back went on as if never cancelled
    import concurrent.futures

    reward = trl_async_reward("contains", registry=REG, backend_instance=fake)
    try:
        # started first: arun starts a bridge on a thread of its own, and a cancel landing in
        # that wait (not the one for the scores) passed with wait_for too
        await asyncio.to_thread(reward._bridge._ensure)
        scores: concurrent.futures.Future[list] = concurrent.futures.Future()
        submitted: list[bool] = []

        def submit(coro: object) -> concurrent.futures.Future[list]:
            submitted.append(True)
            return scores

        monkeypatch.setattr(reward._bridge, "_submit", submit)  # the bridge's loop, played
        task = asyncio.ensure_future(reward._bridge.arun([]))
        await asyncio.sleep(0)  # it waits for the scores
        assert submitted, "arun is not waiting for the scores yet"
        scores.set_result([])  # handed to this loop in its next turn
        task.cancel()  # in that same turn
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        reward.close()


def _held_reward() -> tuple[Registry, threading.Event, threading.Event]:
    """A reward that runs until cancelled: (its registry, entered, cancelled)."""
    reg = Registry()
    entered, cancelled = threading.Event(), threading.Event()

    @reg.reward(name="held", warm=0, timeout_s=60, retry={"max_attempts": 1})
    async def held(traj: Trajectory) -> float:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1.0

    return reg, entered, cancelled


def test_ctrl_c_during_a_synchronous_batch_cancels_it_on_the_bridge():
    """A KeyboardInterrupt in ``SyncBridge.run`` (Ctrl-C while the trainer waits for its
    rewards) left the batch running on the bridge's loop: its calls held their workers until
    they ended by themselves. It is cancelled there now."""
    import signal

    from fabric.integrations import RewardAdapter, Sample, SyncBridge

    reg, entered, cancelled = _held_reward()
    cfg = IntegrationConfig(function="held", builtins=False)
    bridge = SyncBridge(RewardAdapter(cfg, registry=reg, backend=FakeBackend(reg)))

    def ctrl_c() -> None:
        if entered.wait(30):
            os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupter = threading.Thread(target=ctrl_c)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            bridge.run([Sample(build_trajectory("hi"))])
        assert cancelled.wait(10), "the batch ran on after Ctrl-C"
    finally:
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
        bridge.close()


async def test_arun_starts_the_bridge_without_blocking_the_callers_loop():
    """The first ``arun`` started the bridge (its loop, the client, a local backend's pools)
    synchronously, on the caller's event loop: the trainer's loop stood still until the
    client was up. It starts off that loop now."""
    from fabric.integrations import RewardAdapter, Sample, SyncBridge

    entered, go = threading.Event(), threading.Event()
    waited: list[bool] = []

    class SlowStart(FakeBackend):
        async def _start(self) -> None:
            entered.set()
            waited.append(await asyncio.get_running_loop().run_in_executor(None, go.wait, 10))

    cfg = IntegrationConfig(function="length", builtins=False)
    bridge = SyncBridge(RewardAdapter(cfg, registry=REG, backend=SlowStart(REG)))
    try:
        task = asyncio.ensure_future(bridge.arun([Sample(build_trajectory("four"))]))
        await asyncio.to_thread(entered.wait, 10)  # this loop runs on while the bridge starts
        go.set()
        scores = await task
        assert waited == [True], "the caller's loop stood still while the bridge started"
        assert [s.value for s in scores] == [4.0]
    finally:
        await asyncio.to_thread(bridge.close)


def test_closing_a_reward_while_a_batch_runs_cancels_it_and_the_caller_hears_at_once():
    """``close()`` (or the exit backstop) while another thread waited for a batch stopped the
    bridge's loop under the batch: its calls ran on, never finished, and the caller waited
    for the whole deadline and its grace (330 s by default; at exit, a non-daemon thread
    still scoring held the interpreter that long). The batch is cancelled now, and its
    caller gets ``RewardClosedError``."""
    from fabric.integrations import RewardAdapter, RewardClosedError, Sample, SyncBridge

    reg, entered, cancelled = _held_reward()
    cfg = IntegrationConfig(function="held", builtins=False)
    bridge = SyncBridge(RewardAdapter(cfg, registry=reg, backend=FakeBackend(reg)))
    outcome: list[BaseException | list] = []

    def score() -> None:
        try:
            outcome.append(bridge.run([Sample(build_trajectory("hi"))]))
        except BaseException as e:
            outcome.append(e)

    caller = threading.Thread(target=score, daemon=True)
    caller.start()
    try:
        assert entered.wait(30)
        bridge.close()
        assert cancelled.is_set(), "the batch ran on after close()"
        caller.join(30)
        assert not caller.is_alive(), "the caller still waits for a batch of a closed reward"
        [err] = outcome
        assert isinstance(err, RewardClosedError) and "held" in str(err), err
    finally:
        bridge.close()
