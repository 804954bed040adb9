"""The tokenizer corpus is played in child processes: an environment that kills its process
(or cannot be played at all) never takes the driver with it."""

from __future__ import annotations

import os

import pytest

from core.config import JobConfig
from core.errors import ConfigError
from core.policy import corpus
from core.policy.corpus import env_corpus


def _cfg(env: dict) -> JobConfig:
    env = {"tag": "t", **env}
    return JobConfig.from_dict({"envs": [env], "rewards": {"t": [{"function": "env_return"}]}, "seed": 3})


def _latency_fails(seed: int, fail_prob: float) -> bool:
    import random

    rng = random.Random(seed)  # LatencyEnv.reset: the slow draw, then the fail draw
    rng.random()
    return rng.random() < fail_prob


def test_the_corpus_is_deterministic_and_holds_the_action_words_once():
    cfg = _cfg({"id": "frozenlake-v1", "kwargs": {"size": 4}, "actions": ["left", "right", "up", "down"]})
    a = env_corpus(cfg, episodes=5)
    assert a == env_corpus(cfg, episodes=5)
    assert a[0] == "left right up down" and a.count("left right up down") == 1
    assert any("FrozenLake 4x4" in t for t in a)


def test_an_environment_that_kills_its_process_loses_only_that_episode():
    fail_prob = 0.3
    episodes = 20
    dying = [s for s in range(episodes) if _latency_fails(s, fail_prob)]
    assert 1 <= len(dying) < episodes  # the seeds give this test something to survive
    cfg = _cfg({"id": "latency-v0", "kwargs": {"mu_s": 0.0, "turns": 2, "fail_prob": fail_prob}})
    pid = os.getpid()
    texts = env_corpus(cfg, episodes=episodes)
    assert os.getpid() == pid  # still here: the episodes ran elsewhere
    # every episode that lives resets ("step 0") and finishes ("step 2"); one that dies at
    # its first step leaves nothing
    assert texts.count("step 0 of 2: say go") == episodes - len(dying)
    assert texts.count("step 2 of 2: say go") == episodes - len(dying)


def test_an_environment_whose_every_episode_dies_is_a_config_error():
    cfg = _cfg({"id": "latency-v0", "kwargs": {"mu_s": 0.0, "turns": 2, "fail_prob": 1.0}})
    with pytest.raises(ConfigError) as e:
        env_corpus(cfg, episodes=5)
    [(key, msg)] = e.value.problems
    assert key == "envs[0].id" and "cannot play latency-v0" in msg
    assert "every episode failed (seed 0: exit code 17)" in msg


def test_an_environment_that_cannot_be_built_is_a_config_error():
    cfg = _cfg({"id": "latency-v0", "kwargs": {"turns": 0}})
    with pytest.raises(ConfigError) as e:
        env_corpus(cfg, episodes=5)
    [(key, msg)] = e.value.problems
    assert key == "envs[0].id" and "ValueError: need mu_s >= 0" in msg


def test_an_episode_that_hangs_is_cut_off_and_skipped(monkeypatch):
    monkeypatch.setattr(corpus, "EPISODE_TIMEOUT_S", 1)
    # slow_prob 1 x slow_factor 100 x mu 0.02 s: every step sleeps 2 s, past the limit
    cfg = _cfg({"id": "latency-v0", "kwargs": {"mu_s": 0.02, "slow_prob": 1.0, "slow_factor": 100.0}})
    with pytest.raises(ConfigError) as e:
        env_corpus(cfg, episodes=2)
    assert "killed by signal 14" in str(e.value)  # SIGALRM
