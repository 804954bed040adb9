"""JobConfig: every bad input is one clear error naming its key; the shipped examples load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.config import JobConfig
from core.errors import ConfigError
from fabric.errors import ConfigError as FabricConfigError
from fabric.protocol import Trajectory
from fabric.registry import Registry

ROOT = Path(__file__).resolve().parents[2]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(REPO.glob("examples/*/config.yaml"))

REG = Registry()


@REG.reward
def env_return(traj: Trajectory) -> float:
    return traj.env_reward or 0.0


@REG.reward
def exact_match(traj: Trajectory, *, ground_truth: str) -> float:
    return float(traj.final_text() == ground_truth)


@REG.tool
def calculator(expression: str) -> str:
    return expression


ENV_IDS = ["frozenlake-v1", "math-tools-v1"]


def base(**over):
    cfg = {
        "envs": [{"id": "frozenlake-v1", "tag": "frozenlake"}],
        "rewards": {"frozenlake": [{"function": "env_return"}]},
    }
    cfg.update(over)
    return cfg


def load(data) -> JobConfig:
    return JobConfig.from_dict(data, registry=REG, env_ids=ENV_IDS)


def problems(data) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as e:
        load(data)
    return e.value.problems


def test_a_minimal_config_gets_the_defaults():
    cfg = load(base())
    assert cfg.engine.backend == "torch" and cfg.alpha == 1 and cfg.fabric.backend == "local"
    assert cfg.envpool.runtime.type == "process"
    assert cfg.fabric.backend_config() == {"type": "local"}


def test_unknown_environment_names_the_entry_and_the_registered_ids():
    data = base(
        envs=[{"id": "frozenlake-v1", "tag": "frozenlake"}, {"id": "frozenlak-v1", "tag": "frozenlake"}]
    )
    [(key, msg)] = problems(data)
    assert key == "envs[1].id"
    assert "unknown environment 'frozenlak-v1'" in msg and "did you mean 'frozenlake-v1'" in msg
    assert "registered: frozenlake-v1, math-tools-v1" in msg


def test_unknown_reward_names_the_component_and_the_registered_rewards():
    data = base(rewards={"frozenlake": [{"function": "exact_mtch", "args": {"ground_truth": "1"}}]})
    [(key, msg)] = problems(data)
    assert key == "rewards.frozenlake[0].function"
    assert "unknown reward 'exact_mtch'" in msg and "did you mean 'exact_match'" in msg
    assert "registered: env_return, exact_match" in msg  # rewards only: the tool is not offered


def test_a_tool_is_not_a_reward():
    [(key, msg)] = problems(base(rewards={"frozenlake": [{"function": "calculator"}]}))
    assert key == "rewards.frozenlake[0].function" and "is a tool, not a reward" in msg


def test_reward_arguments_are_checked_against_the_signature():
    [(key, msg)] = problems(base(rewards={"frozenlake": [{"function": "exact_match"}]}))
    assert key == "rewards.frozenlake[0].args" and "missing 'ground_truth'" in msg
    # task_args fill a parameter too; an argument the function lacks is refused
    load(base(rewards={"frozenlake": [{"function": "exact_match", "task_args": {"ground_truth": "answer"}}]}))
    bad = {"function": "env_return", "args": {"scale": 2}}
    [(key, msg)] = problems(base(rewards={"frozenlake": [bad]}))
    assert key == "rewards.frozenlake[0].args" and "unexpected 'scale'" in msg


def test_unknown_engine():
    [(key, msg)] = problems(base(engine={"backend": "tensorrt"}))
    assert key == "engine.backend"
    assert msg == "unknown engine 'tensorrt'; known: torch, vllm, openai"


@pytest.mark.parametrize(
    ("over", "key", "text"),
    [
        ({"trainer": {"backend": "jax"}}, "trainer.backend", "unknown trainer 'jax'"),
        ({"fabric": {"backend": "lambda"}}, "fabric.backend", "unknown fabric backend 'lambda'"),
        ({"envpool": {"runtime": "vm"}}, "envpool.runtime.type", "unknown type 'vm'"),
    ],
)
def test_unknown_backends(over, key, text):
    [(k, msg)] = problems(base(**over))
    assert k == key and text in msg


def test_negative_alpha():
    assert problems(base(alpha=-1)) == [("alpha", "must be >= 0 (got -1)")]


@pytest.mark.parametrize(
    ("over", "key", "text"),
    [
        ({"redundancy": -2}, "redundancy", "must be >= 0"),
        ({"group_size": 1}, "group_size", "must be >= 2"),
        ({"batch_size": 0}, "batch_size", "must be >= 1"),
        ({"trainer": {"lr": 0}}, "trainer.lr", "must be > 0"),
        ({"engine": {"temperature": "hot"}}, "engine.temperature", "valid number"),
        ({"engine": {"recover_timeout_s": 0}}, "engine.recover_timeout_s", "must be > 0"),
        ({"engine": {"swap_timeout_s": -1}}, "engine.swap_timeout_s", "must be > 0"),
        ({"engine": {"start_timeout_s": 0}}, "engine.start_timeout_s", "must be > 0"),
        ({"engine": {"start_timeout_s": float("inf")}}, "engine.start_timeout_s", "finite"),
        ({"trainer": {"call_timeout_s": 0}}, "trainer.call_timeout_s", "must be > 0"),
        ({"trainer": {"entropy_target": -0.5}}, "trainer.entropy_target", "must be > 0"),
        ({"trainer": {"entropy_target": float("nan")}}, "trainer.entropy_target", "finite"),
        (
            {"trainer": {"entropy_target": 0.3, "entropy_coef": 0.2}},
            "trainer.entropy_coef_max",
            "0.1 is below entropy_coef 0.2, the starting coefficient",
        ),
    ],
)
def test_bounds_and_types(over, key, text):
    [(k, msg)] = problems(base(**over))
    assert k == key and text in msg


def test_an_entropy_target_above_what_constrained_replies_can_have_is_refused():
    # four actions: at most ln 4 = 1.39 nats a reply; the coefficient would only have risen
    four = {"id": "frozenlake-v1", "tag": "frozenlake", "actions": ["left", "right", "up", "down"]}
    [(key, msg)] = problems(base(envs=[four], trainer={"entropy_target": 1.4}))
    assert key == "trainer.entropy_target"
    assert "not below ln(4) = 1.39" in msg and "constrained to 4 actions (envs[0].actions)" in msg
    assert load(base(envs=[four], trainer={"entropy_target": 1.3})).trainer.entropy_target == 1.3
    # a free-text environment beside it: bounded by the vocabulary (the trainer checks it)
    free = {"id": "frozenlake-v1", "tag": "frozenlake"}
    assert load(base(envs=[four, free], trainer={"entropy_target": 1.4})).trainer.entropy_target == 1.4


def test_an_entropy_target_with_a_single_action_says_there_is_nothing_to_steer():
    # ln 1 = 0: every target (> 0) is refused, so "choose a lower target" cannot be followed
    one = {"id": "frozenlake-v1", "tag": "frozenlake", "actions": ["left", "left"]}
    [(key, msg)] = problems(base(envs=[one], trainer={"entropy_target": 0.1}))
    assert key == "trainer.entropy_target"
    assert "constrained to 1 action (envs[0].actions) has no entropy" in msg
    assert "remove entropy_target" in msg and "lower target" not in msg


def test_unknown_keys_at_any_depth_name_the_key_and_the_allowed_ones():
    [(key, msg)] = problems(base(aplha=1))
    assert key == "aplha" and "did you mean 'alpha'" in msg
    [(key, msg)] = problems(base(engine={"modle": "x"}))
    assert key == "engine.modle" and "did you mean 'model'" in msg and "allowed: backend, model" in msg
    [(key, msg)] = problems(base(rewards={"frozenlake": [{"function": "env_return", "wieght": 2}]}))
    assert key == "rewards.frozenlake[0].wieght" and "did you mean 'weight'" in msg


def test_a_tag_without_rewards():
    data = base(envs=[{"id": "frozenlake-v1", "tag": "frozenlake"}, {"id": "math-tools-v1", "tag": "math"}])
    [(key, msg)] = problems(data)
    assert key == "envs[1].tag" and "tag 'math' has no rewards" in msg and "rewards.math" in msg


def test_rewards_for_a_tag_no_environment_has():
    data = base(
        rewards={"frozenlake": [{"function": "env_return"}], "frozenlak": [{"function": "env_return"}]}
    )
    [(key, msg)] = problems(data)
    assert key == "rewards.frozenlak" and "no environment has tag 'frozenlak'" in msg


def test_reward_component_rules():
    twice = [{"function": "env_return"}, {"function": "env_return"}]
    [(key, msg)] = problems(base(rewards={"frozenlake": twice}))
    assert key == "rewards.frozenlake[1].name" and "appears twice" in msg
    named = [{"function": "env_return"}, {"function": "env_return", "name": "again"}]
    load(base(rewards={"frozenlake": named}))
    zero = [{"function": "env_return", "weight": 0}]
    assert problems(base(rewards={"frozenlake": zero}))[0][0] == "rewards.frozenlake"
    traj = [{"function": "env_return", "args": {"traj": 1}}]
    [(key, msg)] = problems(base(rewards={"frozenlake": traj}))
    assert key == "rewards.frozenlake[0]" and "'traj' is passed by the reward stream" in msg


def test_cross_field_rules():
    [(key, _)] = problems(
        base(engine={"hw_affinity": {"frozenlake": "H800", "default": "H20", "math": "H20"}})
    )
    assert key == "engine.hw_affinity.math"
    [(key, msg)] = problems(base(batch_size=2, group_size=4, trainer={"minibatch_size": 16}))
    assert key == "trainer.minibatch_size" and "16 is more than the 8" in msg


@pytest.mark.parametrize(
    ("engine", "trainer", "key", "text"),
    [
        (
            {"backend": "vllm", "model": "/m"},
            {},
            "trainer.backend",
            "torch trainer trains the torch engine's",
        ),
        ({}, {"backend": "megatron"}, "trainer.backend", "megatron trains a Hugging Face model"),
        (
            {"backend": "vllm", "model": "/m"},
            {"backend": "megatron"},
            "trainer.kwargs.hf_model",
            "engine.model '/m'",
        ),
    ],
)
def test_the_trainer_must_fit_the_engine(engine, trainer, key, text):
    over = {"engine": {**engine, "pretrain": {"steps": 0}}, "trainer": trainer}
    [(k, msg)] = problems(base(**over))
    assert k == key and text in msg
    if trainer.get("backend") == "megatron" and engine:  # what fits: the engine's checkpoint
        assert load(base(**{**over, "trainer": {**trainer, "kwargs": {"hf_model": "/m"}}})).trainer.gpus == 1


def test_the_torch_engines_kwargs_are_checked_not_dropped():
    # the engine takes the shape keys and its serving keys; anything else was silently
    # dropped, so `d_modl: 256` ran the default shape without a word
    [(key, msg)] = problems(base(engine={"kwargs": {"d_modl": 256}}))
    assert key == "engine.kwargs.d_modl" and "did you mean 'd_model'" in msg and "max_batch_size" in msg
    [(key, msg)] = problems(base(engine={"kwargs": {"max_batch": 512}}))
    assert key == "engine.kwargs.max_batch" and "did you mean 'max_batch_size'" in msg
    # and their values, before the corpus is played and the replicas started
    [(key, msg)] = problems(base(engine={"kwargs": {"max_batch_size": 0}}))
    assert key == "engine.kwargs.max_batch_size" and "must be >= 1" in msg
    [(key, msg)] = problems(base(engine={"kwargs": {"d_model": 12, "n_heads": 4}}))
    assert key == "engine.kwargs" and "not a valid tiny-lm shape" in msg and "must be even" in msg
    cfg = load(base(engine={"kwargs": {"d_model": 16, "n_heads": 2, "max_batch_size": 8, "num_threads": 1}}))
    assert cfg.engine.kwargs["max_batch_size"] == 8
    # another backend's kwargs are its own business
    load(
        base(
            engine={"backend": "vllm", "model": "/m", "kwargs": {"d_modl": 1}},
            trainer={"backend": "megatron", "kwargs": {"hf_model": "/m"}},
        )
    )


def test_the_torch_trainers_kwargs_are_checked_with_the_config():
    # checked only in the trainer actor's constructor: the job built (and pretrained) the
    # policy and started Ray before dying with an ActorDiedError traceback
    [(key, msg)] = problems(base(trainer={"kwargs": {"weight_decy": 0.1}}))
    assert key == "trainer.kwargs.weight_decy" and "did you mean 'weight_decay'" in msg
    got = dict(problems(base(trainer={"kwargs": {"weight_decay": -1, "num_threads": 0}})))
    assert "must be >= 0" in got["trainer.kwargs.weight_decay"] and "num_threads" in " ".join(got)
    # a job setting the backend bounds more tightly is named under its own key
    [(key, msg)] = problems(base(trainer={"clip_eps": 1.5}))
    assert key == "trainer.clip_eps" and "the torch trainer: must be < 1" in msg
    cfg = load(
        base(trainer={"kwargs": {"weight_decay": 0.01, "loss_agg": "seq_mean_token_mean", "num_threads": 1}})
    )
    assert cfg.trainer.kwargs["weight_decay"] == 0.01


def test_the_dual_clip_is_on_at_verls_default_reaches_both_backends_and_is_bounded_above_one():
    from core.config_backends import backend_config
    from core.config_megatron import MegatronTrainerConfig

    cfg = load(base())
    assert cfg.trainer.clip_ratio_c == 3.0
    options = backend_config(cfg.trainer, temperature=1.0, seed=0)
    assert options["clip_ratio_c"] == 3.0
    assert MegatronTrainerConfig.model_fields["clip_ratio_c"].default == 3.0
    assert load(base(trainer={"clip_ratio_c": None})).trainer.clip_ratio_c is None
    [(key, msg)] = problems(base(trainer={"clip_ratio_c": 1.0}))
    assert key == "trainer.clip_ratio_c" and msg.startswith("must be > 1")
    got = dict(problems(base(trainer={"kwargs": {"clip_ratio_c": 5.0}})))
    assert got["trainer.kwargs.clip_ratio_c"] == "set by the job from trainer.clip_ratio_c: set it there"


def test_trainer_kwargs_the_job_sets_itself_are_refused_naming_the_key_to_use():
    # taken silently: scale_advantages: false under kwargs still trained on std-normalised
    # advantages (the job computes them in build_batch from trainer.scale_advantages), and
    # clip_low there overrode trainer.clip_eps
    kwargs = {"scale_advantages": False, "clip_low": 0.1, "adv_eps": 1.0, "temperature": 0.5}
    got = dict(problems(base(trainer={"kwargs": kwargs})))
    assert (
        got["trainer.kwargs.scale_advantages"] == "set by the job from trainer.scale_advantages: set it there"
    )
    assert got["trainer.kwargs.clip_low"] == "set by the job from trainer.clip_eps: set it there"
    assert got["trainer.kwargs.temperature"] == "set by the job from engine.temperature: set it there"
    assert got["trainer.kwargs.adv_eps"].startswith("has no effect in a job")


def test_the_megatron_trainers_kwargs_are_checked_with_the_config():
    # checked only in the trainer actor: on a GPU machine, after the vLLM engine had started
    vllm = {"backend": "vllm", "model": "/m", "pretrain": {"steps": 0}}

    def megatron(**kwargs):
        return problems(
            base(engine=vllm, trainer={"backend": "megatron", "kwargs": {"hf_model": "/m", **kwargs}})
        )

    [(key, msg)] = megatron(tensor_paralel_size=2)
    assert key == "trainer.kwargs.tensor_paralel_size" and "did you mean 'tensor_parallel_size'" in msg
    [(key, msg)] = megatron(micro_batch_size=0)
    assert key == "trainer.kwargs.micro_batch_size" and "the megatron trainer: must be >= 1" in msg
    [(key, msg)] = megatron(tensor_parallel_size=2)
    assert key == "trainer.kwargs" and "hf_model needs tensor_parallel_size=1" in msg
    [(key, _)] = megatron(num_threads=2)  # the torch trainer's, not megatron's
    assert key == "trainer.kwargs.num_threads"
    [(key, msg)] = problems(
        base(engine=vllm, trainer={"backend": "megatron", "clip_eps": 1.5, "kwargs": {"hf_model": "/m"}})
    )
    assert key == "trainer.clip_eps" and "the megatron trainer: must be < 1" in msg
    cfg = load(base(engine=vllm, trainer={"backend": "megatron", "kwargs": {"hf_model": "/m", "bf16": True}}))
    assert cfg.trainer.kwargs["bf16"] is True


def test_the_config_checks_import_no_torch():
    code = "import sys, core.config, core.config_megatron; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0


def test_every_problem_is_reported_at_once():
    data = base(
        envs=[{"id": "nope-v1", "tag": "frozenlake"}],
        rewards={"frozenlake": [{"function": "nope"}, {"function": "exact_match"}]},
    )
    keys = [k for k, _ in problems(data)]
    assert keys == ["envs[0].id", "rewards.frozenlake[0].function", "rewards.frozenlake[1].args"]
    schema = problems(base(alpha=-1, steps=0, engine={"backend": "x"}))
    assert sorted(k for k, _ in schema) == ["alpha", "engine.backend", "steps"]


def test_the_error_is_readable_and_a_fabric_config_error():
    with pytest.raises(FabricConfigError) as e:
        load(base(alpha=-1))
    assert str(e.value) == "invalid job config (1 problem):\n  alpha: must be >= 0 (got -1)"


def test_yaml_edge(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config") as e:
        JobConfig.from_yaml(tmp_path / "missing.yaml")
    # a missing file says where a relative path was looked for and what a config looks like
    # (it said "No such file or directory" and no next step)
    with pytest.raises(ConfigError) as e:
        JobConfig.from_yaml("no/such/config.yaml")
    assert "no such file (a relative path is read from " in str(e.value), e.value
    assert "examples/frozenlake/config.yaml" in str(e.value), e.value
    bad = tmp_path / "bad.yaml"
    bad.write_text("envs: [\n")
    with pytest.raises(ConfigError, match="not valid YAML") as e:
        JobConfig.from_yaml(bad)
    assert str(bad) in str(e.value)
    # not UTF-8 (UTF-16 from an editor), or nested past the parser's recursion limit: were
    # UnicodeDecodeError and RecursionError, `fabric run`'s traceback
    utf16 = tmp_path / "utf16.yaml"
    utf16.write_bytes("steps: 3\n".encode("utf-16"))
    with pytest.raises(ConfigError, match="cannot read the config: not UTF-8 text"):
        JobConfig.from_yaml(utf16)
    deep = tmp_path / "deep.yaml"
    deep.write_text("envs: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="not valid YAML: nested too deeply"):
        JobConfig.from_yaml(deep)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="a mapping of keys, got int"):
        JobConfig.from_yaml(scalar)


@pytest.mark.parametrize("text", ["", "# steps: 10\n", "---\n"], ids=["empty", "comments", "document"])
def test_an_empty_config_file_is_said_so_with_a_minimal_config(tmp_path, text):
    """An empty file (or one of comments) said "envs: required key is missing", as if the
    file had other keys and lacked that one."""
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError) as e:
        JobConfig.from_yaml(empty)
    [(key, msg)] = e.value.problems
    assert key == "" and msg.startswith("the file is empty"), msg
    assert "examples/frozenlake/config.yaml" in msg
    # the keys it shows are a config that loads, against the real registries
    shown = "\n".join(msg.split("`")[1::2])
    assert JobConfig.from_dict(yaml.safe_load(shown)).envs[0].id == "frozenlake-v1"


def test_a_module_that_cannot_be_discovered_names_the_key():
    data = base(fabric={"discover": ["functions", "no_such_module_xyz"]})
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(data, env_ids=ENV_IDS)
    [(key, msg)] = e.value.problems
    assert key == "fabric.discover[1]" and "no_such_module_xyz" in msg


def test_a_discover_module_of_no_functions_is_warned_of(tmp_path):
    """A fabric.discover module whose rewards lack their decorator was silent (the -m of the
    CLI warned): the job went on to "unknown reward", or ran without the module's rewards."""
    from fabric.registry import NoFunctionsWarning

    mine = tmp_path / "undecorated_rewards.py"
    mine.write_text("def my_reward(traj: str) -> float:\n    return 1.0\n")
    data = base(fabric={"discover": ["functions", str(mine)]})
    with pytest.warns(NoFunctionsWarning, match=f"{str(mine)!r} defines no fabric function: decorate"):
        JobConfig.from_dict(data, env_ids=ENV_IDS)


def test_shipped_examples_exist():
    assert {p.parent.name for p in EXAMPLES} >= {"frozenlake", "math_tools", "own_env", "gpu"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_shipped_examples_load_against_the_real_registries(path, monkeypatch):
    monkeypatch.chdir(REPO)  # they are run from the repository root: their paths start there
    cfg = JobConfig.from_yaml(path)  # discovers `functions`, envpool's built-ins, their images
    gpu = path.parent.name == "gpu"  # vLLM and megatron; the others run on the CPU default
    assert cfg.engine.backend == ("vllm" if gpu else "torch") and cfg.fabric.backend == "local"
    assert cfg.trainer.backend == ("megatron" if gpu else "torch")
    assert cfg.envpool.runtime.type == "process"
    for env in cfg.envs:
        assert cfg.rewards[env.tag]
    # the run directory records the full config: it must load back to the same thing
    again = JobConfig.from_dict(yaml.safe_load(cfg.to_yaml()), check_references=False)
    assert again == cfg


def test_a_tilde_in_a_path_field_is_the_home_directory(monkeypatch, tmp_path):
    # taken as written, run_dir: ~/runs/x (and the images.dir the docs recommend) made a
    # directory named "~" in the working directory
    from core.config_megatron import MegatronTrainerConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load(base(run_dir="~/runs/x", images={"dir": "~/.cache/rl-fabric/images"}))
    assert cfg.run_dir == tmp_path / "runs/x"
    assert cfg.images.dir == tmp_path / ".cache/rl-fabric/images"
    assert load(base()).run_dir == Path("runs/job")  # a relative path stays relative
    assert MegatronTrainerConfig(hf_model="~/models/q").hf_model == tmp_path / "models/q"  # type: ignore[arg-type]
    assert MegatronTrainerConfig(checkpoint="~/ck.pt").checkpoint == tmp_path / "ck.pt"  # type: ignore[arg-type]
