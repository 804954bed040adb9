"""Bad job configs refused before anything starts (at the CLI entry, in overrides, at
the job's own edges), and what only a start can find (a reward whose setup fails, an
image whose containers do not start, GPUs the cluster lacks).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace
from typing import Any

import job_faults_fns as faults
import pytest
import yaml
from job_helpers import (
    LATENCY,
    TINY,
    _merge,
    job_config,
)

from core.config import JobConfig
from core.errors import ConfigError
from core.job import Job, load, main

# ----------------------------------------------------------------------------- bad configs
# test_config.py covers each of these at JobConfig.from_dict; here: the job's own edges (the
# CLI entry, overrides, what only the job can check) refuse them before anything starts.


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"envs": [{**LATENCY, "id": "latency-v9"}]}, "envs[0].id"),
        ({"rewards": {"latency": [{"function": "env_retrun"}]}}, "rewards.latency[0].function"),
        ({"engine": {"backend": "tensorrt"}}, "engine.backend"),
        ({"alpha": -1}, "alpha"),
        ({"engine": {"pretrain": {"steps": -1}}}, "engine.pretrain.steps"),
        ({"engine": {"model": "runs/old/policy", "pretrain": {"steps": 5}}}, "engine.pretrain.steps"),
    ],
)
def test_the_cli_refuses_a_bad_config_before_anything_starts(tmp_path, capsys, over, key):
    data = _merge(
        {
            "envs": [LATENCY],
            "rewards": {"latency": [{"function": "env_return"}]},
            "run_dir": str(tmp_path / "run"),
        },
        over,
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main([str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{key}: " in err and str(path) in err
    assert err.startswith("error: ")  # worded as fabric run's
    assert not (tmp_path / "run").exists()


def test_overrides_are_validated_too(tmp_path):
    path = tmp_path / "job.yaml"
    data = {"envs": [LATENCY], "rewards": {"latency": [{"function": "env_return"}]}}
    path.write_text(yaml.safe_dump(data))
    assert load(str(path), steps=4, run_dir=str(tmp_path / "r")).steps == 4
    with pytest.raises(ConfigError) as e:
        load(str(path), steps=0)
    assert [k for k, _ in e.value.problems] == ["steps"]


def test_a_reward_module_in_the_working_directory_is_found_by_either_entry_point(tmp_path, monkeypatch):
    # python -m core.job puts the working directory on sys.path, the installed `fabric`
    # script does not: `fabric run job.yaml` beside my_rewards.py failed with
    # "fabric.discover[0]: cannot import 'my_rewards_cwd' ...: ModuleNotFoundError"
    import sys

    (tmp_path / "my_rewards_cwd.py").write_text(
        "from fabric.registry import Registry\n"
        "REG = Registry()\n\n\n"
        "@REG.reward\n"
        "def mine(traj) -> float:\n"
        "    return 1.0\n"
    )
    data = {
        "envs": [LATENCY],
        "rewards": {"latency": [{"function": "mine"}]},
        "fabric": {"discover": ["my_rewards_cwd"]},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # as `fabric`
    monkeypatch.delitem(sys.modules, "my_rewards_cwd", raising=False)
    cfg = load("job.yaml")
    assert cfg.rewards["latency"][0].function == "mine"
    assert "mine" in cfg.discover_functions()
    assert sys.path[-1] == str(tmp_path)  # searched last: it shadows no installed package
    sys.modules.pop("my_rewards_cwd", None)


@pytest.mark.parametrize("under", [False, True])
def test_a_run_dir_that_cannot_be_a_directory_is_refused_before_the_policy_is_built(
    tmp_path, capsys, monkeypatch, under
):
    # mkdir's FileExistsError / NotADirectoryError escaped as a traceback (exit 1), after the
    # policy build (with engine.pretrain, a minute of pretraining lost)
    import core._job_setup

    def no_build(*a: Any, **kw: Any) -> None:
        raise AssertionError("the policy was built before the run directory was checked")

    monkeypatch.setattr(core._job_setup, "build_policy", no_build)  # where Job._build_policy finds it
    taken = tmp_path / "taken"
    taken.write_text("a file")
    data = {
        "engine": {"max_new_tokens": 1, "kwargs": TINY},
        "envs": [LATENCY],
        "rewards": {"latency": [{"function": "env_return"}]},
        "steps": 1,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    run_dir = taken / "run" if under else taken
    assert main([str(path), "--run-dir", str(run_dir), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"run_dir: {str(taken)!r} is a file, not a directory; choose another" in err
    assert f"invalid job config in {path} (1 problem)" in err  # found after the load: the file named too
    assert "Traceback" not in err and taken.read_text() == "a file"


async def test_constrained_actions_without_the_torch_engine_fail_before_the_run_dir(tmp_path):
    cfg = job_config(
        tmp_path,
        engine={"backend": "openai", "kwargs": {"base_url": "http://127.0.0.1:9"}},
        # the server's weights are not ours: any trainer fits (megatron's needs a model named)
        trainer={"backend": "megatron", "kwargs": {"hf_model": str(tmp_path)}},
    )
    with pytest.raises(ConfigError) as e:
        await Job(cfg, progress=False, registry=faults.REG, source="job.yaml").run()
    assert [k for k, _ in e.value.problems] == ["envs[0].actions"]
    assert e.value.source == "job.yaml" and str(e.value).startswith("invalid job config in job.yaml")
    assert not (tmp_path / "run").exists()


class _WarmClient:
    """What ``_warm_rewards`` uses of a fabric client: ``warmup``, failing as scripted."""

    def __init__(self, fail: dict[str, BaseException], *, times: dict[str, int] | None = None):
        self.fail = fail
        self.times = times or {}  # how many warmups of a function fail (default: all)
        self.warmed: list[str] = []

    async def warmup(self, names: list[str] | None = None) -> None:
        assert names is not None and len(names) == 1
        self.warmed += names
        name = names[0]
        if name in self.fail and self.warmed.count(name) <= self.times.get(name, 1_000):
            raise self.fail[name]


async def test_a_reward_whose_setup_raises_is_a_config_error_at_start(caplog, monkeypatch):
    # found by the calls instead, it masked every trajectory and the job stopped only after
    # 8 groups x max_reruns with a RolloutError that did not say why
    from fabric.errors import BackendError, SetupFailedError

    tb = (
        "Traceback (most recent call last):\n"
        '  File "/w/fabric/worker.py", line 231, in main\n    runner.setup()\n'
        '  File "/home/u/setup_rewards.py", line 4, in load_model\n    raise FileNotFoundError(...)\n'
        "FileNotFoundError: /models/rm.bin not found\n"
    )
    rewards = [{"function": "rm_reward"}, {"function": "env_return"}, {"function": "slow", "name": "s"}]
    cfg = JobConfig.from_dict({"envs": [LATENCY], "rewards": {"latency": rewards}}, check_references=False)
    client = _WarmClient(
        {
            "rm_reward": SetupFailedError("rm_reward: worker setup failed: FileNotFoundError: nope", tb),
            "slow": BackendError("slow: 0 of 1 warm workers ready after 30 s"),  # infra: the calls retry
        }
    )
    monkeypatch.setattr(Job, "warm_retry_s", 0.01)
    with pytest.raises(ConfigError) as e:
        await Job(cfg, progress=False)._warm_rewards(client)
    # a setup failure is tried WARM_ATTEMPTS (3) times before it is the config's; a slow
    # start (the machinery) is left to the calls
    assert sorted(client.warmed) == ["env_return"] + ["rm_reward"] * 3 + ["slow"]
    assert [k for k, _ in e.value.problems] == ["rewards.latency[0].function"]
    assert "FileNotFoundError: nope (setup_rewards.py, line 4, in load_model)" in str(e.value)
    assert "warming up reward slow failed" in caplog.text
    await Job(cfg, progress=False)._warm_rewards(_WarmClient({}))  # all start: nothing raised
    # a setup that fails once (a download cut off) is no config error: tried again, it starts
    once = _WarmClient(
        {"rm_reward": SetupFailedError("rm_reward: worker setup failed: ConnectionError", tb)},
        times={"rm_reward": 1},
    )
    await Job(cfg, progress=False)._warm_rewards(once)
    assert once.warmed.count("rm_reward") == 2 and "trying again" in caplog.text
    # an import that fails is the code's: not tried again
    imp = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'rm_deps'\n"
    broken = _WarmClient({"rm_reward": SetupFailedError("rm_reward: cannot import", imp)})
    with pytest.raises(ConfigError):
        await Job(cfg, progress=False)._warm_rewards(broken)
    assert broken.warmed.count("rm_reward") == 1


class _NoStartPool:
    """A pool whose containers of one image never start (its module raises in them)."""

    def __init__(self, bad: str | None):
        self.bad, self.warmed = bad, []

    async def prewarm(self, image: str | None) -> None:
        from envpool.errors import ContainerStartError

        self.warmed.append(image)
        if image == self.bad:
            raise ContainerStartError("container p1-1 failed to start: RuntimeError: no licence server")


async def test_an_image_whose_containers_do_not_start_is_a_config_error_naming_its_entries(tmp_path):
    # it passed the start-up check (its module imports in a child) but fails in every
    # container: a raw ContainerStartError traceback out of the job, naming no entry
    envs = [
        {**LATENCY, "tag": "latency"},
        {"id": "coin-v0", "tag": "latency", "image": "img_a"},
        {"id": "coin-v0", "tag": "latency", "image": "img_b"},
        {"id": "coin-v0", "tag": "latency", "image": "img_a"},
    ]
    cfg = JobConfig.from_dict(
        {"envs": envs, "rewards": {"latency": [{"function": "env_return"}]}}, check_references=False
    )
    refs = {cfg.envs[1].image: "a@sha256:1", cfg.envs[2].image: "b@sha256:2"}  # paths made absolute
    images = type("Images", (), {"refs": refs})()
    pool = _NoStartPool("a@sha256:1")
    with pytest.raises(ConfigError) as e:
        await Job(cfg, progress=False)._prewarm(pool, images)  # type: ignore[arg-type]
    assert [k for k, _ in e.value.problems] == ["envs[1].image", "envs[3].image"]
    assert "its containers do not start: container p1-1 failed to start" in str(e.value)
    assert pool.warmed == [None, "a@sha256:1"]  # each image once, in the entries' order
    await Job(cfg, progress=False)._prewarm(_NoStartPool("c@sha256:3"), images)  # type: ignore[arg-type]
    # a built-in's start failure is the host's trouble: not a config error
    from envpool.errors import ContainerStartError

    with pytest.raises(ContainerStartError):
        await Job(cfg, progress=False)._prewarm(_NoStartPool(None), images)  # type: ignore[arg-type]


def test_python_m_core_job_says_which_environments_containers_do_not_start(monkeypatch, capsys):
    # `fabric run` said it and exited with 2; `python -m core.job`, the same job, ended with a
    # raw ContainerStartError traceback (exit 1)
    import core.job
    from envpool.errors import ContainerStartError

    class StandIn:
        def __init__(self, cfg: Any, **kw: Any) -> None:
            pass  # only its run is under test

        async def run(self) -> None:
            raise ContainerStartError("container p1-1 failed to start: RuntimeError: can't start new thread")

    envs = [SimpleNamespace(id="frozenlake-v1"), SimpleNamespace(id="coin-v0"), SimpleNamespace(id="coin-v0")]
    monkeypatch.setattr(core.job, "load", lambda *a, **kw: SimpleNamespace(envs=envs))
    monkeypatch.setattr(core.job, "Job", StandIn)
    assert main(["job.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "the environments' containers do not start (frozenlake-v1, coin-v0): "
        "container p1-1 failed to start: RuntimeError: can't start new thread\n"
    ), err


@pytest.mark.ray
async def test_a_reward_missing_from_the_jobs_registry_is_refused_before_anything_starts(
    tmp_path, ray_cluster
):
    data = {
        "envs": [LATENCY],
        "rewards": {"latency": [{"function": "no_such_reward"}]},
        "run_dir": str(tmp_path / "run"),
        "engine": {"kwargs": TINY, "max_new_tokens": 1},
    }
    cfg = JobConfig.from_dict(data, check_references=False)
    task = asyncio.ensure_future(Job(cfg, progress=False, registry=faults.REG).run())
    config_written = tmp_path / "run" / "config.yaml"
    for _ in range(600):
        if task.done() or config_written.exists():
            break
        await asyncio.sleep(0.05)
    started = config_written.exists()
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ConfigError):
        await task
    assert not started
    assert isinstance(task.exception(), ConfigError)
    assert "rewards.latency[0].function" in str(task.exception())


@pytest.mark.ray
async def test_an_affinity_no_node_offers_is_a_config_error(tmp_path, ray_cluster):
    cfg = job_config(tmp_path, engine={"hw_affinity": {"latency": "H800"}})
    with pytest.raises(ConfigError) as e:
        await Job(cfg, progress=False, registry=faults.REG).run()
    [(key, msg)] = e.value.problems
    assert key == "engine.hw_affinity" and "H800" in msg


@pytest.mark.ray
@pytest.mark.parametrize(
    ("over", "key", "text"),
    [
        (
            {"trainer": {"num_gpus": 1}},
            "trainer.num_gpus",
            "reserves 1 GPU(s) (1 engine replica(s) x 0 + trainer 1)",
        ),
        ({"engine": {"num_gpus": 0.5, "replicas": 2}}, "engine.num_gpus", "reserves 1 GPU(s)"),
    ],
)
async def test_gpus_the_cluster_lacks_are_a_config_error_not_a_hang(tmp_path, ray_cluster, over, key, text):
    cfg = job_config(tmp_path, **over)
    with pytest.raises(ConfigError) as e:
        await Job(cfg, progress=False, registry=faults.REG).run()
    [(got_key, msg)] = e.value.problems
    assert got_key == key and text in msg and "the Ray cluster has 0" in msg


def test_gpu_reservations_default_by_backend():
    from core.config import EngineConfig, TrainerConfig

    assert EngineConfig().gpus == 0 and EngineConfig(backend="vllm").gpus == 1
    assert EngineConfig(backend="vllm", num_gpus=0.5).gpus == 0.5
    assert TrainerConfig().gpus == 0 and TrainerConfig(backend="megatron").gpus == 1
    assert TrainerConfig(backend="megatron", num_gpus=0.5).gpus == 0.5
    # a vLLM replica spread over GPUs reserves them all (it saw one and failed at each turn)
    tp2 = EngineConfig(backend="vllm", kwargs={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    assert tp2.gpus == 4
    with pytest.raises(ValueError, match="num_gpus 1 is below the 2 GPUs a replica's tensor_parallel_size"):
        EngineConfig(backend="vllm", num_gpus=1, kwargs={"tensor_parallel_size": 2})


def test_each_vllm_replica_gets_the_jobs_seed(monkeypatch):
    # every replica sampled from vLLM's seed 0; the engine itself needs vllm (not here), so
    # what make_engine hands the registry is checked
    import core.rollout.replicas as replicas

    given: list[dict] = []
    monkeypatch.setattr(replicas.engine_registry, "create", lambda name, **kw: given.append(kw))
    replicas.make_engine("vllm", None, {}, seed=8, model="m")
    replicas.make_engine("vllm", None, {"seed": 3}, seed=8, model="m")
    replicas.make_engine("openai", None, {"base_url": "http://127.0.0.1:1"}, seed=8, model="m")
    assert [kw.get("seed") for kw in given] == [8, 3, None]


@pytest.mark.parametrize(
    ("shares", "cards", "text"),
    [
        ([0.6, 0.6, 0.6], [2], "above half a card (0.6, 0.6, 0.6) need 3 cards of their own"),
        ([2, 0.6], [2], "need 3 cards"),
        ([4, 0.2], [2, 2, 2], "a reservation of 4 GPUs needs one node with that many; the largest has 2"),
        ([0.5, 0.5, 0.5, 0.5], [2], None),  # two per card
        ([0.6, 0.4, 0.6, 0.4], [2], None),
        ([1, 1, 0.3], [1, 2], None),
        ([0, 0, 1], [1], None),
    ],
)
def test_gpu_reservations_no_card_by_card_placement_can_meet_are_refused(shares, cards, text):
    from core.cluster import gpu_packing_problem

    got = gpu_packing_problem(shares, cards)
    assert (got is None) if text is None else (got is not None and text in got), got
