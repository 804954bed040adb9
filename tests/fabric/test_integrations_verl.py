"""fabric.integrations for veRL (0.9.1; see docs/integrations.md): ``compute_score`` and
its async and batch forms called exactly as veRL's reward managers call them, against real
worker processes; the file loaded by path and pickled to another process; extra_info,
failures and settings from the environment (with FakeBackend)."""

from __future__ import annotations

import asyncio
import json

import pytest
from integ_fns import REG
from integ_helpers import LOCAL1, fake_backend

from fabric.errors import ConfigError, ErrorCode
from fabric.integrations import BadBatchError, IntegrationConfig, MissingArgumentError, RewardCallError, _verl
from fabric.integrations import verl as verl_mod
from fabric.integrations.openrlhf import OpenRLHFReward
from fabric.integrations.trl import trl_reward
from fabric.integrations.verl import VerlReward
from fabric.protocol import Trajectory
from fabric.testing import FakeBackend

# integ_helpers: a FakeBackend over integ_fns.REG
fake = pytest.fixture(fake_backend, name="fake")


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


def test_a_null_for_an_optional_parameter_leaves_its_default(fake):
    # a mixed dataset as parquet and HF datasets load it: a row without the key has it as a
    # null (extra_info's struct, a TRL column), which was sent, refused (InvalidArguments:
    # language is a str) and failed the whole batch as a column of the wrong type
    v = VerlReward("with_tests", registry=REG, backend_instance=fake)
    try:
        py, cpp = {"tests": ["a"], "language": None}, {"tests": ["a"], "language": "cpp"}
        out = v.compute_score_batch(["d"] * 2, ["a", "a"], [None] * 2, [py, cpp])
        assert [r["score"] for r in out] == [1.0, 1.0]
        # left out: the function's default ("python") applies
        assert sorted(i.payload.get("language", "left out") for i in fake.invocations) == ["cpp", "left out"]
    finally:
        v.close()
    with trl_reward("with_tests", registry=REG, backend_instance=FakeBackend(REG)) as reward:
        out = reward(prompts=["p"] * 2, completions=["a"] * 2, tests=[["a"]] * 2, language=[None, "cpp"])
        assert out == [1.0, 1.0]
    # OpenRLHF: a JSON label's null is the default too, not the label's text (the alias)
    with OpenRLHFReward("graded_if_given", registry=REG, backend_instance=(fb := FakeBackend(REG))) as rf:
        assert rf(["p x", "p y"], ["p", "p"], [json.dumps({"ground_truth": None}), None])["rewards"] == [
            1.0,
            1.0,
        ]
        assert all("ground_truth" not in i.payload for i in fb.invocations)
    # a required one's null is still sent to veRL's function, and refused: no default stands in
    # for it (TRL scores that row as failed: test_a_null_in_a_required_column_fails_its_row_only)
    v = VerlReward("with_tests", registry=REG, backend_instance=FakeBackend(REG))
    try:
        with pytest.raises(BadBatchError, match="1 of 2 samples"):
            v.compute_score_batch(["d"] * 2, ["a", "a"], [None] * 2, [{"tests": ["a"]}, {"tests": None}])
    finally:
        v.close()


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


def test_a_misspelt_reward_kwargs_key_names_the_setting_it_meant():
    # it said pydantic's "failure_scroe: Extra inputs are not permitted", unlike a misspelt
    # FABRIC_* variable (above) or a client config key, which name the setting meant
    with pytest.raises(ConfigError) as e:
        IntegrationConfig.parse({"function": "exact_match", "failure_scroe": 0.0}, env={})
    said = str(e.value)
    assert "failure_scroe: unknown key (did you mean 'failure_score'?)" in said
    assert "deadline_s" in said and "Extra inputs" not in said
    with pytest.raises(ConfigError, match=r"deadline_s: must be > 0.0 \(got 0\)"):
        IntegrationConfig.parse({"function": "exact_match", "deadline_s": 0}, env={})
    # a token typed wrong is not shown back
    with pytest.raises(ConfigError) as e:
        IntegrationConfig.parse({"function": "exact_match", "token": 12345}, env={})
    assert "12345" not in str(e.value)
