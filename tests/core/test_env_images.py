"""A user's own environment: ``envs[].image`` as a directory with an envpool.json (or a
published reference), checked at the edge, built into the job's image cache once, and played
from that image by the tokenizer's corpus child and by the pool.

The job end to end on such an image is in test_job.py."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import envpool
from core.config import JobConfig
from core.env_images import JobImages
from core.errors import ConfigError
from core.policy.corpus import env_corpus
from envpool import EnvPool
from envpool.images import digest_of
from fabric.protocol import Trajectory
from fabric.registry import Registry

REG = Registry()


@REG.reward
def env_return(traj: Trajectory) -> float:
    return traj.env_reward or 0.0


REPO = Path(__file__).resolve().parents[2]

COIN = """
import envpool


class Coin(envpool.Env):
    example_actions = ("heads", "tails")

    def reset(self, *, seed=None, options=None):
        return "Call the coin: heads or tails.", {}

    def step(self, action):
        won = action.strip() == "heads"
        text = "Heads: you win." if won else "Tails: you lose."
        return envpool.StepResult(obs=envpool.Observation(text=text), reward=float(won), terminated=True)


envpool.register("{id}", entry_point="{module}:Coin", max_episode_steps=2)
"""


def coin_image(root: Path, *, env_id: str = "user-coin-v0", module: str = "user_coin") -> Path:
    root.mkdir(parents=True)
    (root / f"{module}.py").write_text(COIN.replace("{id}", env_id).replace("{module}", module))
    (root / "envpool.json").write_text(json.dumps({"modules": [module]}))
    return root


def config(tmp_path: Path, *envs: dict[str, Any], **over: Any) -> dict[str, Any]:
    envs = envs or ({"id": "user-coin-v0", "tag": "coin", "image": str(tmp_path / "coin")},)
    return {
        "envs": [{"max_turns": 1, "actions": ["heads", "tails"], **e} for e in envs],
        "rewards": {tag: [{"function": "env_return"}] for tag in {e["tag"] for e in envs}},
        "run_dir": str(tmp_path / "run"),
        **over,
    }


def problems(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(data, registry=REG)
    return e.value.problems


# ----------------------------------------------------------------------------- the config


def test_a_relative_image_directory_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    coin_image(tmp_path / "coin")
    monkeypatch.chdir(tmp_path)
    data = config(tmp_path)
    data["envs"][0]["image"] = "coin"
    cfg = JobConfig.from_dict(data, registry=REG)
    assert cfg.envs[0].image == str(tmp_path / "coin")  # as run_dir: the working directory
    # what the run directory records loads back to the same directory from anywhere
    monkeypatch.chdir(REPO)
    assert JobConfig.from_dict(yaml.safe_load(cfg.to_yaml()), registry=REG) == cfg


def test_validation_knows_what_an_image_registers_without_importing_it(tmp_path):
    coin_image(tmp_path / "coin")
    cfg = JobConfig.from_dict(config(tmp_path), registry=REG)
    assert cfg.envs[0].id == "user-coin-v0"
    # the image's module ran in a child: this process's registry and modules are as they were
    assert "user-coin-v0" not in envpool.default_registry and "user_coin" not in sys.modules


def test_an_image_directory_that_is_missing_is_one_error(tmp_path):
    [(key, msg)] = problems(config(tmp_path))
    assert key == "envs[0].image"
    assert f"{tmp_path / 'coin'} does not exist: an image is a directory holding" in msg
    assert "relative path is taken from the working directory" in msg and "name@sha256:" in msg
    assert not (tmp_path / "run").exists()  # nothing made on the way to the error


def test_an_image_directory_without_a_manifest_says_what_to_add(tmp_path):
    (tmp_path / "coin").mkdir()
    (tmp_path / "coin" / "user_coin.py").write_text("")
    [(key, msg)] = problems(config(tmp_path))
    assert key == "envs[0].image"
    assert "has no envpool.json: add one" in msg and '{"modules": ["my_env"]}' in msg


def test_an_image_manifest_that_is_not_json_is_one_error(tmp_path):
    coin_image(tmp_path / "coin")
    (tmp_path / "coin" / "envpool.json").write_text('{"modules": [user_coin]}')
    [(key, msg)] = problems(config(tmp_path))
    assert key == "envs[0].image" and "envpool.json is not valid JSON" in msg


def test_an_image_whose_module_does_not_import_is_one_error(tmp_path):
    coin_image(tmp_path / "coin")
    (tmp_path / "coin" / "user_coin.py").write_text("import numpyy\n")
    [(key, msg)] = problems(config(tmp_path))
    assert key == "envs[0].image"
    assert "modules[0] 'user_coin' does not import: ModuleNotFoundError: No module named 'numpyy'" in msg
    assert not (tmp_path / "run").exists()


def test_every_problem_is_reported_at_once(tmp_path):
    data = config(tmp_path)
    data["rewards"]["coin"] = [{"function": "env_retrun"}]
    assert [k for k, _ in problems(data)] == ["envs[0].image", "rewards.coin[0].function"]


def test_an_entry_point_typo_is_one_error(tmp_path):
    coin_image(tmp_path / "coin")
    text = (tmp_path / "coin" / "user_coin.py").read_text().replace("user_coin:Coin", "user_coin:Con")
    (tmp_path / "coin" / "user_coin.py").write_text(text)
    [(key, msg)] = problems(config(tmp_path))
    assert key == "envs[0].image" and "entry point 'user_coin:Con', which does not load" in msg


def test_an_id_the_image_does_not_register_names_the_id_the_image_and_what_it_registers(tmp_path):
    coin_image(tmp_path / "coin")
    [(key, msg)] = problems(
        config(tmp_path, {"id": "user-coin-v1", "tag": "coin", "image": str(tmp_path / "coin")})
    )
    assert key == "envs[0].id"
    assert f"'user-coin-v1' is neither built in nor registered by image {tmp_path / 'coin'}" in msg
    assert "(did you mean 'user-coin-v0'?)" in msg and "the image registers: user-coin-v0" in msg


def test_a_built_in_id_with_an_image_still_plays_the_built_in(tmp_path):
    coin_image(tmp_path / "coin")
    JobConfig.from_dict(
        config(tmp_path, {"id": "frozenlake-v1", "tag": "fl", "image": str(tmp_path / "coin")}), registry=REG
    )


def test_two_images_that_define_one_id_differently_are_refused(tmp_path):
    coin_image(tmp_path / "a", module="coin_a")
    coin_image(tmp_path / "b", module="coin_b")
    a = {"id": "user-coin-v0", "tag": "a", "image": str(tmp_path / "a")}
    b = {"id": "user-coin-v0", "tag": "b", "image": str(tmp_path / "b")}
    [(key, msg)] = problems(config(tmp_path, a, b))
    assert key == "envs[1].id"
    assert f"'user-coin-v0' is defined by image {tmp_path / 'b'} (entry point coin_b:Coin" in msg
    assert f"and by image {tmp_path / 'a'} (entry point coin_a:Coin" in msg and "in envs[0]" in msg
    # the same image under two tags is one environment
    JobConfig.from_dict(config(tmp_path, a, {**a, "tag": "b", "weight": 2}), registry=REG)


def test_an_entry_that_forgot_the_image_another_entry_names_is_told_to_add_it(tmp_path):
    coin_image(tmp_path / "coin")
    a = {"id": "user-coin-v0", "tag": "a", "image": str(tmp_path / "coin")}
    [(key, msg)] = problems(config(tmp_path, a, {"id": "user-coin-v0", "tag": "b"}))
    assert key == "envs[1].id" and f"add `image: {tmp_path / 'coin'}` to envs[1]" in msg


def test_an_env_registered_only_by_a_discover_module_is_refused_with_the_image_line(tmp_path):
    # the review's reproducer: fabric.discover imports my_env (which registers coin-v0) in
    # the driver only; the job accepted it, then the corpus child could not play it
    (tmp_path / "my_disc_env.py").write_text(
        COIN.replace("{id}", "disc-coin-v0").replace("{module}", "my_disc_env")
    )
    data = {
        "envs": [{"id": "disc-coin-v0", "tag": "coin", "max_turns": 1}],
        "rewards": {"coin": [{"function": "env_return"}]},
        "fabric": {"discover": ["functions", "my_disc_env"]},
        "run_dir": "run",
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [sys.executable, "-m", "core.job", "job.yaml", "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    said = "envs[0].id: 'disc-coin-v0' is registered by 'my_disc_env', a fabric.discover module"
    assert said in proc.stderr
    assert (
        '{"modules": ["my_disc_env"]}' in proc.stderr
        and "add to envs[0]: `image: my_disc_env_image`" in proc.stderr
    )
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- published refs


async def test_a_published_reference_is_found_in_the_cache_and_checked_like_a_directory(tmp_path):
    coin_image(tmp_path / "coin")
    cfg = JobConfig.from_dict(config(tmp_path, images={"dir": str(tmp_path / "cache")}), registry=REG)
    async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as images:
        ref = images.refs[str(tmp_path / "coin")]
    data = config(
        tmp_path, {"id": "user-coin-v0", "tag": "coin", "image": ref}, images={"dir": str(tmp_path / "cache")}
    )
    assert JobConfig.from_dict(data, registry=REG).envs[0].image == ref
    missing = "coin@sha256:" + "0" * 64
    data["envs"][0]["image"] = missing
    [(key, msg)] = problems(data)
    assert (
        key == "envs[0].image" and f"image {missing}: image sha256:{'0' * 64} is in none of the tiers" in msg
    )


# ----------------------------------------------------------------------------- built once, played


async def test_an_unchanged_directory_is_built_once_and_the_same_image(tmp_path):
    coin_image(tmp_path / "coin")
    cfg = JobConfig.from_dict(config(tmp_path), registry=REG)
    src = str(tmp_path / "coin")
    async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as first:
        assert first.published == 1
        ref = first.refs[src]
        assert ref.startswith("coin@sha256:")
        bundle = first.bundles[src]
        assert (bundle / "user_coin.py").is_file() and (bundle / "envpool.json").is_file()
        assert first.cache.metrics()["unpacked"]["pinned"] == 1  # never evicted while the job runs
    cache = tmp_path / "run" / "images"  # the default: under the run directory
    assert len(list((cache / "blobs" / "sha256").iterdir())) == 1
    async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as again:
        assert again.published == 0 and again.refs[src] == ref and again.bundles[src] == bundle
    (tmp_path / "coin" / "notes.txt").write_text("changed")
    async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as changed:
        assert changed.published == 1 and changed.refs[src] != ref
    assert len(list((cache / "unpacked" / "sha256").iterdir())) == 2


async def test_a_directory_whose_cached_blob_went_bad_is_published_again(tmp_path):
    # the disk tier lists the digest, but its copy is cut short (a bad disk, a crash before
    # the write reached it) or went (another run sharing images.dir evicted it), and no
    # unpacked copy is left: the bundle is in hand, the job must not fail as "in no tier"
    coin_image(tmp_path / "coin")
    cfg = JobConfig.from_dict(config(tmp_path), registry=REG)
    src = str(tmp_path / "coin")
    async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as first:
        ref = first.refs[src]
    cache = tmp_path / "run" / "images"
    [blob] = (cache / "blobs" / "sha256").iterdir()
    blob.write_bytes(blob.read_bytes()[:100])
    for unpacked in (cache / "unpacked" / "sha256").iterdir():
        shutil.rmtree(unpacked)
    async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as again:
        assert again.refs[src] == ref and again.published == 1
        assert (again.bundles[src] / "user_coin.py").is_file()
    assert digest_of(blob.read_bytes()) == ref.partition("@")[2]  # the good copy is back


async def test_the_corpus_and_the_pool_play_the_users_environment_from_its_image(tmp_path):
    coin_image(tmp_path / "coin")
    cfg = JobConfig.from_dict(config(tmp_path), registry=REG)
    async with JobImages(cfg.envs, cfg.images, cfg.run_dir) as images:
        # the tokenizer's corpus child loads the unpacked bundle, as a container does
        texts = await asyncio.to_thread(env_corpus, cfg, 3, bundles=images.bundles)
        assert texts[0] == "heads tails" and "Call the coin: heads or tails." in texts
        assert {"Heads: you win.", "Tails: you lose."} & set(texts)
        ref = images.refs[str(tmp_path / "coin")]
        async with (
            EnvPool({"min_warm": 0, "max_containers": 2}, images=images.cache) as pool,
            pool.session("user-coin-v0", image=ref) as s,
        ):
            obs, _ = await s.reset(seed=1)
            res = await s.step("heads")
            assert obs.text == "Call the coin: heads or tails." and res.reward == 1.0 and res.terminated
    with pytest.raises(ConfigError) as e:  # an image entry is never played from the built-ins
        env_corpus(cfg, 3)
    assert e.value.problems[0][0] == "envs[0].image"


def test_the_image_tiers_are_checked_with_the_config(tmp_path):
    tiers = [{"type": "origin", "url": "http://127.0.0.1:9"}, {"type": "origin", "url": "http://127.0.0.1:8"}]
    [(key, msg)] = problems(config(tmp_path, images={"tiers": tiers}))
    assert key == "images" and "tier names must be unique (give each a name): origin twice" in msg
