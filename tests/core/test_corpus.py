"""The tokenizer corpus is played in child processes: an environment that kills its process
(or cannot be played at all) never takes the driver with it."""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from core.config import JobConfig
from core.errors import ConfigError, StoppedError
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


def test_a_kwarg_value_the_environment_refuses_is_a_config_error_naming_the_kwargs():
    # the ValueError blamed envs[0].id, which was right: the value was not
    cfg = _cfg({"id": "latency-v0", "kwargs": {"turns": 0}})
    with pytest.raises(ConfigError) as e:
        env_corpus(cfg, episodes=5)
    [(key, msg)] = e.value.problems
    assert key == "envs[0].kwargs"
    assert "refused kwargs {'turns': 0}: ValueError: need mu_s >= 0" in msg


def test_kwargs_the_environment_does_not_take_are_a_config_error_naming_them():
    # the TypeError blamed envs[0].id (the id was right; the kwargs had a typo)
    cfg = _cfg({"id": "frozenlake-v1", "kwargs": {"sizee": 4}})
    with pytest.raises(ConfigError) as e:
        env_corpus(cfg, episodes=5)
    [(key, msg)] = e.value.problems
    assert key == "envs[0].kwargs"
    assert "does not take kwargs {'sizee': 4}: TypeError: " in msg and "'sizee'" in msg


def test_episodes_leave_no_work_dirs_behind(monkeypatch, tmp_path):
    # each episode is a forked process that ends in os._exit: code-repair's work dir (made
    # in the temp dir at reset) stayed there, one per episode
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the corpus child's temp dir
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the driver's
    played = corpus.play_envs(_cfg({"id": "code-repair-v1"}), 8)
    assert len(played.episodes) == 8
    assert list(tmp_path.iterdir()) == []


def _session_alive(sid: int) -> list[int]:
    """Processes of session ``sid`` that still run (zombies are dead: an orphan's wait is
    init's business)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            alive.append(int(stat.parent.name))
    return alive


def test_a_stop_kills_the_child_and_its_episodes_and_removes_their_directory(monkeypatch):
    # the job interrupted (Ctrl-C) during corpus play: the driver must not wait for minutes
    # of episodes, nor leave them playing on
    children: list[subprocess.Popen] = []
    dirs: list[str] = []

    class Recorded(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            children.append(self)

    class Tmp(tempfile.TemporaryDirectory):  # type: ignore[type-arg]
        def __enter__(self) -> str:
            dirs.append(self.name)
            return self.name

    monkeypatch.setattr(corpus.subprocess, "Popen", Recorded)
    monkeypatch.setattr(corpus.tempfile, "TemporaryDirectory", Tmp)
    # every step sleeps 10 s: 64 episodes at once, each of them for tens of seconds (a stop
    # that waited for one step would take 10 s: the bound below has room for a loaded machine)
    cfg = _cfg({"id": "latency-v0", "kwargs": {"mu_s": 0.02, "slow_prob": 1.0, "slow_factor": 500.0}})
    stop = threading.Event()
    failed: list[BaseException] = []

    def play() -> None:
        try:
            corpus.play_envs(cfg, 64, stop=stop)
        except BaseException as e:
            failed.append(e)

    worker = threading.Thread(target=play)
    worker.start()
    deadline = time.monotonic() + 30
    while not (children and len(_session_alive(children[0].pid)) > 1):  # the episodes run
        assert time.monotonic() < deadline, "the corpus child never started its episodes"
        time.sleep(0.02)
    t0 = time.monotonic()
    stop.set()
    worker.join(20)
    assert not worker.is_alive() and time.monotonic() - t0 < 5
    assert len(failed) == 1 and isinstance(failed[0], StoppedError), failed
    assert children[0].returncode is not None
    while _session_alive(children[0].pid):  # SIGKILL is delivered at once; dying takes a moment
        assert time.monotonic() - t0 < 5, f"left running: {_session_alive(children[0].pid)}"
        time.sleep(0.02)
    assert dirs and not os.path.exists(dirs[0])


def test_an_episode_that_hangs_is_cut_off_and_skipped(monkeypatch):
    monkeypatch.setattr(corpus, "EPISODE_TIMEOUT_S", 1)
    # slow_prob 1 x slow_factor 100 x mu 0.02 s: every step sleeps 2 s, past the limit
    cfg = _cfg({"id": "latency-v0", "kwargs": {"mu_s": 0.02, "slow_prob": 1.0, "slow_factor": 100.0}})
    with pytest.raises(ConfigError) as e:
        env_corpus(cfg, episodes=2)
    assert "killed by signal 14" in str(e.value)  # SIGALRM


_HELPER_COIN = """
import os, subprocess, sys
import envpool

# a simulator the module starts at import: it inherits the corpus child's stdout and stderr
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.environ["HELPER_PID_FILE"], "w") as f:
    f.write(str(helper.pid))


class Coin(envpool.Env):
    example_actions = ("heads", "tails")

    def reset(self, *, seed=None, options=None):
        return "Call the coin: heads or tails.", {}

    def step(self, action):
        return envpool.StepResult(obs=envpool.Observation(text="done"), reward=1.0, terminated=True)


envpool.register("helper-coin-v0", entry_point="helper_coin:Coin", max_episode_steps=2)
"""


def test_an_environment_that_starts_a_helper_neither_holds_up_the_corpus_nor_leaves_it(monkeypatch, tmp_path):
    # the child's output was read to EOF, which the helper (holding the pipes) never gave:
    # the whole CHILD_TIMEOUT_S (300 s), then a refusal, and the helper left running
    bundle = tmp_path / "img"
    bundle.mkdir()
    (bundle / "helper_coin.py").write_text(_HELPER_COIN)
    (bundle / "envpool.json").write_text('{"modules": ["helper_coin"]}')
    pid_file = tmp_path / "helper.pid"
    monkeypatch.setenv("HELPER_PID_FILE", str(pid_file))
    monkeypatch.setattr(corpus, "CHILD_TIMEOUT_S", 30.0)
    spec = {
        "id": "helper-coin-v0",
        "bundle": str(bundle),
        "kwargs": {},
        "actions": None,
        "salt": "3-0",
        "episodes": 3,
        "episode_timeout_s": 10,
        "parallel": 2,
    }
    t0 = time.monotonic()
    code, stdout, _ = corpus._run_child(spec, None)
    assert code == 0 and "Call the coin" in stdout and time.monotonic() - t0 < 20
    helper = int(pid_file.read_text())
    deadline = time.monotonic() + 5  # killed with the child's group; a zombie until reaped
    while time.monotonic() < deadline and _alive(helper):
        time.sleep(0.01)
    assert not _alive(helper), "the environment's helper outlived the corpus child"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_the_child_loads_no_job_config():
    # every job start runs one child per environment (and every run of pretraining's corpus):
    # core.config, imported at the top for a type hint, was half of the child's CPU time
    # before its first episode (its pydantic models, envpool's image tiers, httpx)
    import sys

    code = "import sys, core.policy.corpus; sys.exit(1 if 'core.config' in sys.modules else 0)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
