"""A reward's fixed ``args`` and its ``function`` name are checked with the config, each bad
one a ``ConfigError`` naming its key and the fix, before Ray or the policy starts: a value of
the wrong type was found by the first calls instead (every trajectory ``InvalidArguments``,
then a ``RolloutError`` after 8 groups of re-runs), and a built-in left out of
``fabric.discover`` was reported as if it did not exist."""

from __future__ import annotations

from typing import Annotated, Any

import pytest
from pydantic import Field

from core.config import JobConfig
from core.errors import ConfigError
from core.job import Job
from fabric.protocol import Trajectory
from fabric.registry import Registry

REG = Registry()


@REG.reward
def exact_match(traj: Trajectory, *, ground_truth: str) -> float:
    return float(traj.final_text() == ground_truth)


@REG.reward
def scaled(traj: Trajectory, *, scale: Annotated[float, Field(gt=0)] = 1.0, names: list[str] = []) -> float:  # noqa: B006
    return scale * len(names)


@REG.reward
def loose(traj: Trajectory, ctx: Any = None, **kwargs: Any) -> float:
    return 0.0


ENV_IDS = ["frozenlake-v1"]


def config(*rewards: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {"envs": [{"id": "frozenlake-v1", "tag": "coin"}], "rewards": {"coin": list(rewards)}, **over}


def problems(data: dict[str, Any], **kw: Any) -> list[tuple[str, str]]:
    kw.setdefault("env_ids", ENV_IDS)
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(data, **kw)
    return e.value.problems


# ---------------------------------------------------------------- the values of args


def test_a_fixed_argument_of_the_wrong_type_names_its_key_and_the_type():
    [(key, msg)] = problems(config({"function": "exact_match", "args": {"ground_truth": 5}}), registry=REG)
    assert key == "rewards.coin[0].args.ground_truth"
    assert "exact_match takes ground_truth: str" in msg and "valid string (got 5)" in msg
    assert "quote it" in msg  # a YAML number where a str is wanted: the fix


def test_the_built_in_exact_match_is_checked_through_discovery():
    # the reported case, against the registry `fabric.discover` finds (the built-ins)
    [(key, msg)] = problems(config({"function": "exact_match", "args": {"ground_truth": 5}}))
    assert key == "rewards.coin[0].args.ground_truth" and "valid string" in msg


def test_values_are_checked_as_the_worker_checks_them():
    # the function's own constraints (Annotated Field) and nested types, as the call would
    got = dict(
        problems(
            config(
                {"function": "scaled", "args": {"scale": 0, "names": ["a", 3]}},
                {"function": "exact_match", "name": "b", "args": {"ground_truth": ["x"]}},
            ),
            registry=REG,
        )
    )
    assert set(got) == {
        "rewards.coin[0].args.scale",
        "rewards.coin[0].args.names[1]",
        "rewards.coin[1].args.ground_truth",
    }
    assert "must be > 0" in got["rewards.coin[0].args.scale"]
    assert "quote it" not in got["rewards.coin[1].args.ground_truth"]  # a list: quoting is no fix


def test_a_value_json_cannot_carry_is_refused():
    [(key, msg)] = problems(config({"function": "scaled", "args": {"scale": float("nan")}}), registry=REG)
    assert key == "rewards.coin[0].args" and "NaN" in msg


def test_every_problem_of_the_rewards_is_listed_at_once():
    got = problems(
        config(
            {"function": "exact_mtch"},
            {"function": "exact_match", "args": {"ground_truth": 5}},
            {"function": "scaled", "args": {"scale": -1, "sclae": 2}},
        ),
        registry=REG,
    )
    keys = [k for k, _ in got]
    assert keys == [
        "rewards.coin[0].function",
        "rewards.coin[1].args.ground_truth",
        "rewards.coin[2].args",  # the unknown key, named with the signature
        "rewards.coin[2].args.scale",
    ]
    assert "unexpected 'sclae'" in dict(got)["rewards.coin[2].args"]


def test_good_arguments_pass_as_they_are():
    data = config(
        {"function": "exact_match", "args": {"ground_truth": "5"}},
        {"function": "scaled", "args": {"scale": 2, "names": ["a"]}},  # an int is a float
        {"function": "loose", "args": {"anything": {"goes": [1]}}},  # **kwargs takes any key
        {"function": "exact_match", "name": "t", "task_args": {"ground_truth": "answer"}},
    )
    cfg = JobConfig.from_dict(data, registry=REG, env_ids=ENV_IDS)
    assert cfg.rewards["coin"][1].args == {"scale": 2, "names": ["a"]}  # not coerced in the config


# ---------------------------------------------------------------- keys the job passes itself


def test_an_argument_the_job_passes_per_call_is_refused():
    [(key, msg)] = problems(config({"function": "exact_match", "args": {"traj": 1}}), registry=REG)
    assert key == "rewards.coin[0]" and "'traj' is passed by the reward stream" in msg
    both = {"function": "exact_match", "args": {"ground_truth": "a"}, "task_args": {"ground_truth": "b"}}
    [(key, msg)] = problems(config(both), registry=REG)
    assert key == "rewards.coin[0]" and "set in both args and task_args" in msg


def test_ctx_is_the_setup_hooks_not_an_argument():
    # **kwargs lets any key through, but a function that takes ctx gets its setup hook's value
    # there: the worker overwrote the config's silently
    [(key, msg)] = problems(config({"function": "loose", "args": {"ctx": 1}}), registry=REG)
    assert key == "rewards.coin[0].args.ctx" and "setup hook" in msg
    [(key, _)] = problems(config({"function": "loose", "task_args": {"ctx": "k"}}), registry=REG)
    assert key == "rewards.coin[0].task_args.ctx"


# ---------------------------------------------------------------- built-ins left out


@pytest.fixture(scope="module")
def my_rewards(tmp_path_factory: pytest.TempPathFactory) -> str:
    # once: the decorator also registers it in the default registry, where a second file
    # defining the same name is refused
    path = tmp_path_factory.mktemp("discover") / "my_rewards_args.py"
    path.write_text(
        "import fabric\n\n@fabric.reward\ndef my_rm(traj: fabric.Trajectory) -> float:\n    return 0.0\n"
    )
    return str(path)


def test_a_built_in_left_out_of_discover_says_to_add_functions(my_rewards):
    data = config({"function": "env_return"}, fabric={"discover": [my_rewards]})
    [(key, msg)] = problems(data)
    assert key == "rewards.coin[0].function"
    assert "'env_return' is a built-in reward" in msg
    assert f"add functions to fabric.discover: [functions, {my_rewards}]" in msg


def test_a_discover_list_naming_only_some_built_ins_is_told_the_same():
    data = config({"function": "env_return"}, fabric={"discover": ["functions.rewards.exact_match"]})
    [(_, msg)] = problems(data)
    assert "built-in" in msg and "[functions, functions.rewards.exact_match]" in msg
    # a module:attr entry registers that function only
    one = {"function": "exact_match", "task_args": {"ground_truth": "a"}}
    [(_, msg)] = problems(config(one, fabric={"discover": ["functions.rewards.env_return:env_return"]}))
    assert "'exact_match' is a built-in reward" in msg


def test_a_name_that_is_no_built_in_keeps_the_plain_message(my_rewards):
    [(_, msg)] = problems(config({"function": "nope"}, fabric={"discover": [my_rewards]}))
    assert msg == "unknown reward 'nope'; registered: my_rm"
    # discover lists the built-ins, the registry is the caller's: adding them would not help
    [(_, msg)] = problems(config({"function": "env_return"}), registry=REG)
    assert "built-in" not in msg and "registered: exact_match, loose, scaled" in msg


# ---------------------------------------------------------------- before anything starts


async def test_a_job_given_its_own_registry_refuses_before_the_policy_or_ray(tmp_path, monkeypatch):
    data = config({"function": "exact_match", "args": {"ground_truth": 5}}, run_dir=str(tmp_path / "run"))
    cfg = JobConfig.from_dict(data, check_references=False)
    job = Job(cfg, progress=False, registry=REG)

    def started(*_: Any, **__: Any) -> Any:
        raise AssertionError("started past the config check")

    monkeypatch.setattr(job, "_build_policy", started)
    monkeypatch.setattr(job.cluster, "start", started)
    with pytest.raises(ConfigError) as e:
        await job.run()
    assert [k for k, _ in e.value.problems] == ["rewards.coin[0].args.ground_truth"]
    assert not (tmp_path / "run").exists()
