"""The RL job end to end on the embedded default (a local Ray cluster, a tiny torch policy,
local fabric worker processes, process containers), and under faults: rewards that raise or
time out, containers that die mid-episode, an engine replica killed mid-run; and bad configs
refused before anything starts.

Every job is tiny (batch 2 x group 2, a few steps, one-token replies), so the whole module
stays well under two minutes on two cores. Faults are injected deterministically: reward
functions claim numbered slots in a directory (``job_faults_fns``), the failing container's
episode is picked by its seed, the replica is killed once the trainer published version 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
from pathlib import Path
from typing import Any

import job_faults_fns as faults
import pytest
import yaml
from test_env_images import COIN

from core.config import JobConfig
from core.errors import ConfigError, ProxyDiedError, RolloutError, TrainerTimeout
from core.job import EVAL_SEED_BASE, Job, load, main
from core.rollout.env_manager import task_key
from envpool.envs.frozenlake import FrozenLakeEnv

TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2, "max_len": 64}
LATENCY = {
    "id": "latency-v0",
    "tag": "latency",
    "max_turns": 2,
    "kwargs": {"mu_s": 0.01, "turns": 2},
    "actions": ["go", "wait"],
    "prompt": {"history": 0},
}
FROZENLAKE = {
    "id": "frozenlake-v1",
    "tag": "frozenlake",
    "max_turns": 4,
    "kwargs": {"size": 4, "slippery": False},
    "actions": ["left", "right", "up", "down"],
    "prompt": {"history": 0, "drop_lines": ["Legend:"]},
}
TRAIN_KEYS = {"step", "version", "reward_mean", "success", "staleness_mean", "time"}
DRIFT_KEYS = {"approx_kl", "clip_frac", "ratio_mean", "grad_norm"}
TIME_KEYS = {"wait_s", "train_s", "publish_s", "gen_s", "env_s", "reward_s"}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def job_config(tmp_path: Path, *, env: dict[str, Any] = LATENCY, rewards: list | None = None, **over: Any):
    data = {
        "engine": {"backend": "torch", "max_new_tokens": 1, "kwargs": TINY},
        "envs": [env],
        "rewards": {env["tag"]: rewards or [{"function": "env_return"}]},
        "batch_size": 2,
        "group_size": 2,
        "alpha": 1,
        "steps": 3,
        "trainer": {"lr": 1e-3},
        "rollout": {"eval_every": 0, "max_reruns": 3},
        "fabric": {"backend": "local", "workers": 1},
        "envpool": {
            "runtime": "process",
            "min_warm": 2,
            "max_containers": 32,
            "retry": {"attempts": 2, "initial_backoff_s": 0.01, "max_backoff_s": 0.05},
        },
        "run_dir": str(tmp_path / "run"),
        "seed": 0,
    }
    return JobConfig.from_dict(_merge(data, over), registry=faults.REG)


async def run_job(cfg: JobConfig) -> tuple[Job, dict[str, Any]]:
    job = Job(cfg, progress=False, registry=faults.REG)
    summary = await job.run()
    return job, summary


def check_invariants(summary: dict[str, Any], cfg: JobConfig) -> None:
    """What holds for every job, faults or not."""
    assert summary["steps"] == cfg.steps
    assert summary["aborted_trained"] == 0
    assert summary["masked_trained"] == 0
    assert summary["trajectories"].get("double_count", 0) == 0
    assert summary["rewards"]["duplicate"] == 0
    assert summary["buffer"]["dropped"].get("duplicate", 0) == 0
    assert summary["buffer"]["served_groups"] == cfg.steps * cfg.batch_size
    assert summary["buffer"]["served_samples"] == cfg.steps * cfg.batch_size * cfg.group_size
    # every trained trajectory within the asynchronous bound
    assert summary["buffer"]["staleness"]
    assert all(0 <= int(k) <= cfg.alpha for k in summary["buffer"]["staleness"])


def train_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


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


# ----------------------------------------------------------------------------- Ctrl-C


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_during_pretraining_stops_the_job_promptly(tmp_path, sig):
    # the policy build (corpus play, pretraining: a minute or more) ran inside Job.run's
    # coroutine: asyncio.run's first Ctrl-C only cancels the main task, at its next await,
    # so the job went on until pretraining was over (174 s measured on a loaded machine).
    # SIGTERM stops it the same way (it killed the process outright, the build's threads
    # and children with it)
    import signal
    import subprocess
    import sys

    data = {
        "engine": {
            "backend": "torch",
            "max_new_tokens": 1,
            "kwargs": {**TINY, "max_len": 256},
            "pretrain": {"steps": 1_000_000, "episodes": 50},
        },
        "envs": [{**FROZENLAKE, "max_turns": 2}],
        "rewards": {"frozenlake": [{"function": "env_return"}]},
        "steps": 1,
        "rollout": {"eval_every": 0},
        "run_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen(
        [sys.executable, "-m", "core.job", str(path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as in a terminal
    )
    try:
        assert p.stdout is not None
        seen = []
        for line in p.stdout:  # until pretraining runs (not a terminal: plain progress lines)
            seen.append(line)
            if line.startswith("pretrain 1/"):
                break
        assert seen and seen[-1].startswith("pretrain 1/"), "".join(seen)
        p.send_signal(getattr(signal, sig))
        # promptly: the stop (the build's next check, its threads and children ended, the
        # interpreter's exit) took 5-14 s on a loaded 2-core machine, and went past 15 s in a
        # full run; a job that went on with its 1,000,000 pretraining steps never stops
        try:
            rest, _ = p.communicate(timeout=45)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{sig} during pretraining did not stop the job within 45 s") from None
        assert p.returncode == 130 and rest.strip().endswith("interrupted"), rest
        assert "Traceback" not in rest, rest
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _descendants(pid: int) -> set[int]:
    """Every live process under ``pid`` (by parent links, read from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the command name may hold spaces and parentheses: the ppid is after the last ')'
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    out: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _alive(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


@pytest.mark.ray
def test_sigterm_during_training_stops_the_job_as_ctrl_c_does(tmp_path):
    # SIGTERM (kill, a scheduler's stop) met the signal handler Ray's core worker installs in
    # the driver: a C stack trace on stderr and the process gone at once (exit 143 or 134),
    # none of the job's shutdown run
    import signal
    import subprocess
    import sys
    import time

    data = {
        "engine": {"max_new_tokens": 1, "kwargs": TINY},
        "envs": [LATENCY],
        "rewards": {"latency": [{"function": "env_return"}]},
        "batch_size": 2,
        "group_size": 2,
        "steps": 1_000_000,
        "rollout": {"eval_every": 0},
        "fabric": {"workers": 1},
        "envpool": {"min_warm": 2},
        "run_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    root = Path(__file__).resolve().parents[2]
    metrics = tmp_path / "run" / "metrics.jsonl"
    p = subprocess.Popen(
        [sys.executable, "-m", "core.job", str(path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test's own SIGTERM handling is not the job's
    )
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            assert p.poll() is None, p.communicate()[1]
            assert time.monotonic() < deadline, "the job trained no step within 240 s"
            time.sleep(0.2)
        started = _descendants(p.pid)  # Ray's processes, its actors, the zygote, containers
        assert started
        p.send_signal(signal.SIGTERM)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM did not stop the job within 60 s") from None
        assert p.returncode == 130 and err.strip().endswith("interrupted"), err[-2000:]
        assert "SIGTERM received" not in err and "Traceback" not in err, err[-2000:]
        deadline = time.monotonic() + 20  # reaped by their own parents, which are going too
        while (left := {q for q in started if _alive(q)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"left running after SIGTERM: {sorted(left)}"
        assert metrics.read_text().count("\n") >= 2  # what it logged is kept
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ----------------------------------------------------------------------------- launch accounting


async def test_a_given_up_group_is_counted_out_of_the_launch_budget_once():
    # given up (out of re-runs), a group leaves the launch budget; left pending in the buffer,
    # its bound dropped it later as stale too, and each given-up group made the launcher
    # start one group more than its budget (one that could only go stale)
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.groups import GroupRunner

    cfg = group_job(group_size=2, max_reruns=0)
    j = Job(cfg, progress=False)
    manager = FakeManager(default=(0.001, "infra_failed"))
    j.runner = GroupRunner(cfg, manager, FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    j._start_group(j.runner)
    assert j._groups_live == 1
    async with asyncio.timeout(5):
        while not j.tally.counts["given_up_groups"]:  # noqa: ASYNC110 - no event for "given up"
            await asyncio.sleep(0.005)
    assert j._groups_live == 0
    assert j.buffer.advance(cfg.alpha + 1) == []  # the trainer moves past the group's version
    assert j.tally.counts["stale_groups"] == 0 and j._groups_live == 0
    await j.runner.aclose()


def _sync_job_whose_first_group_fails() -> tuple[Job, Any, Any]:
    """A sync-mode job (group_size 2, no reruns) whose first group's members fail on infra
    at once and every later member plays 60 s: the job, its fake manager, a turn barrier."""
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.env_manager import TurnBarrier
    from core.rollout.groups import GroupRunner

    cfg = group_job(group_size=2, max_reruns=0).model_copy(deep=True)
    cfg.rollout.mode = "sync"
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    manager = FakeManager(script=[(0.001, "infra_failed")] * 2, default=(60.0, "ok"))
    j.runner = GroupRunner(cfg, manager, FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    barrier = TurnBarrier()
    return j, manager, barrier


async def test_a_sync_mode_group_given_up_is_replaced_in_the_steps_lockstep():
    # sync mode: a step's groups move turn by turn together (one TurnBarrier); the group
    # started in place of one given up ran on its own, outside the batch-level baseline
    j, manager, barrier = _sync_job_whose_first_group_fails()
    j._start_group(j.runner, barrier)
    try:
        async with asyncio.timeout(5):
            while len(manager.launched) < 4:  # noqa: ASYNC110 - no event for "replaced"
                await asyncio.sleep(0.001)
        assert j.tally.counts["given_up_groups"] == 1
        assert [b for _, _, _, b in manager.launched[2:]] == [barrier, barrier]
        assert barrier._members == 2  # the replacement's members; the given-up ones left
    finally:
        await j.runner.aclose()


async def test_a_sync_mode_group_given_up_once_the_job_is_failing_is_not_replaced():
    # the group that sets the fatal RolloutError was not replaced, but every later one given
    # up (its streak already past the limit) was: new groups started while the job stopped,
    # each holding an environment session the shutdown then had to cancel
    j, _, barrier = _sync_job_whose_first_group_fails()
    try:
        j._start_group(j.runner, barrier)  # started before the job was failing
        assert j._groups_live == 1
        j._fatal.set_exception(RolloutError("8 groups in a row were given up"))
        async with asyncio.timeout(5):
            while not j.tally.counts["given_up_groups"]:  # noqa: ASYNC110 - no event for "given up"
                await asyncio.sleep(0.001)
        # a replacement starts within _given_up, before it returns
        assert j.runner.metrics["groups_started"] == 1, "a group started after the job's fatal error"
        assert j.runner.metrics["trajectories_started"] == 2 and j._groups_live == 0
        # nor does the step loop's own start (sync mode: a step's groups) add any
        j._start_group(j.runner, barrier)
        assert j.runner.metrics["groups_started"] == 1 and j._groups_live == 0
    finally:
        await j.runner.aclose()
        j._fatal.exception()


async def test_a_rollout_stopped_by_a_failing_reward_says_the_rewards_error():
    # a reward that always raises gives up every group; the RolloutError said "the last
    # trajectory error: none recorded" (the reason was on the sample, never copied)
    from test_groups import FakeManager, FakeProxy
    from test_groups import job as group_job

    from core.buffer import SampleBuffer
    from core.rollout.groups import GroupRunner
    from core.sample import Sample
    from fabric.protocol import Trajectory

    cfg = group_job(group_size=2, max_reruns=0)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    j.runner = GroupRunner(cfg, FakeManager(), FakeProxy(), submit=lambda t: None, on_given_up=j._given_up)  # type: ignore[arg-type]
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha, on_abort=j._on_abort)
    n = max(8, 2 * cfg.batch_size)  # the groups given up in a row that stop the job
    groups = [j.runner.start(cfg.envs[0], i, 0) for i in range(n)]
    async with asyncio.timeout(5):
        while j.runner.running():  # noqa: ASYNC110 - no event for "idle"
            await asyncio.sleep(0.005)
    for g in groups:  # each full, then losing a member to its reward with no re-run left
        j.buffer.open_group(g.id, 0)
        traj = Trajectory(id=f"t-{g.id}", status="ok", task={"tag": "lat", "group_id": g.id})
        s = Sample(traj=traj, tag="lat", group_id=g.id, version=0, status="reward_failed")
        s.error = "always_raises: UserError: ValueError: my reward is broken"
        j._deliver(s)
    assert j._fatal.done()
    text = str(j._fatal.exception())
    assert "rewards.lat: always_raises: UserError: ValueError: my reward is broken" in text
    assert f"{n} reward_failed" in text
    await j.runner.aclose()


async def test_a_step_stopped_while_it_waits_for_a_batch_takes_its_wait_along():
    # Ctrl-C (or SIGTERM) while the step loop waited for a batch cancelled only the wait for
    # "the batch or the fatal error": the batch's own wait stayed a waiter of the buffer,
    # pending past the job, to be handed the next complete groups
    from core.buffer import SampleBuffer

    cfg = job_config(Path("unused"))
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    buffer = SampleBuffer(cfg.group_size, cfg.alpha)
    step = asyncio.create_task(j._unless_fatal(buffer.get_batch(cfg.batch_size)))
    while not buffer.metrics()["waiters"]:  # noqa: ASYNC110 - the wait began
        await asyncio.sleep(0)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    assert buffer.metrics()["waiters"] == 0


async def test_a_run_that_fails_stops_the_evaluation_it_was_running(tmp_path, monkeypatch):
    # async mode: the step-1 evaluation plays while training goes on; the run failing
    # meanwhile (every group given up: RolloutError) left it playing, its sessions open while
    # the job wrote failure.json and closed the pool and the cluster under it
    from core.report import JobProgress, RunDir
    from fabric.protocol import Message, Trajectory

    cfg = job_config(tmp_path, steps=3, rollout={"eval_every": 1, "eval_episodes": 1})
    j = Job(cfg, progress=False)
    fatal = j._fatal = asyncio.get_running_loop().create_future()

    class Manager:  # the step-0 evaluation ends; the step-1 one plays until stopped
        playing: list[asyncio.Future[None]] = []

        async def run(self, task: Any, *, version: int) -> Trajectory:
            if task.group_id == "eval-0":
                msgs = [Message(role="user", content="m")]
                return Trajectory(status="ok", env_reward=0.0, messages=msgs)
            if not fatal.done():
                fatal.set_exception(RolloutError("every group given up"))
            fut = asyncio.get_running_loop().create_future()
            self.playing.append(fut)
            await fut
            raise AssertionError("never resolved")

    class Runner:  # what the step loop and the launcher use of a GroupRunner: nothing runs
        changed = asyncio.Event()
        aborted_ids: set[str] = set()

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    class Stream:
        def metrics(self) -> dict[str, Any]:
            return {"scored": 0, "reward_ms": {"total": 0.0}}

    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = _one_batch(cfg)  # step 1 trains, step 2 waits and fails
    manager = Manager()
    with pytest.raises(RolloutError):
        await j._train(
            manager,  # type: ignore[arg-type]
            Runner(),  # type: ignore[arg-type]
            buffer,
            Stream(),  # type: ignore[arg-type]
            RunDir(tmp_path / "run"),
            JobProgress(cfg.steps, enabled=False),
        )
    assert manager.playing and all(f.cancelled() for f in manager.playing)


def _stand_in_cluster(j: Job, monkeypatch: Any) -> None:
    """What the step loop uses of the job's Ray actors: a trainer whose steps publish
    version 1, a proxy that takes the weights; and no batch to build."""
    from types import SimpleNamespace

    import core.job

    def done(value: Any) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(value)
        return fut

    class Trainer:
        class step:  # the Ray handle's method
            @staticmethod
            def options(num_returns: int) -> Any:
                return SimpleNamespace(remote=lambda batch: (done({"version": 1}), None))

    async def call(aw: Any) -> None:
        pass  # the step loop's trainer calls need no answer here

    update = SimpleNamespace(remote=lambda version, refs: None)
    j.cluster = SimpleNamespace(  # type: ignore[assignment]
        trainer=Trainer, proxy=SimpleNamespace(update_weights=update), remote_proxy=SimpleNamespace(call=call)
    )
    monkeypatch.setattr(core.job, "build_batch", lambda groups, cfg, **kw: [])


def _one_batch(cfg: JobConfig) -> Any:
    """A buffer holding one batch of complete groups (one step's worth)."""
    from core.buffer import SampleBuffer
    from core.sample import Sample
    from fabric.protocol import RewardResult, Trajectory

    buffer = SampleBuffer(cfg.group_size, cfg.alpha)
    for g in range(cfg.batch_size):
        for i in range(cfg.group_size):
            t = Trajectory(id=f"{g}-{i}", status="ok", env_reward=1.0)
            buffer.put(
                Sample(traj=t, tag="latency", group_id=f"g{g}", version=0, reward=RewardResult(score=1.0))
            )
    return buffer


async def test_the_final_evaluation_plays_with_the_rollouts_stopped(tmp_path, monkeypatch):
    # async mode: once the last step is trained nothing the rollouts play can be trained,
    # yet they ran on through the final evaluation (sharing the engines with it, re-running
    # their failures, sending what finished to be scored and waiting for it in the drain)
    # and were stopped only after it
    from core.report import JobProgress, RunDir
    from core.rewards import RewardStream
    from fabric.protocol import Message, Trajectory

    cfg = job_config(tmp_path, steps=1, rollout={"eval_every": 1, "eval_episodes": 1})
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = _one_batch(cfg)

    class Runner:  # what the job uses of a GroupRunner; "rolling" until it is closed
        changed = asyncio.Event()
        aborted_ids: set[str] = set()
        metrics: dict[str, int] = {}
        closed = False

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            self.closed = True

    runner = j.runner = Runner()  # type: ignore[assignment]
    rolling_at: dict[str, bool] = {}

    class Manager:
        async def run(self, task: Any, *, version: int) -> Trajectory:
            rolling_at[task.group_id] = not runner.closed
            return Trajectory(status="ok", env_reward=0.0, messages=[Message(role="user", content="m")])

    stream = j.stream = RewardStream(None, cfg.rewards, j._deliver)  # type: ignore[arg-type]
    summary = await j._rollout(
        Manager(),  # type: ignore[arg-type]
        runner,  # type: ignore[arg-type]
        buffer,
        stream,
        RunDir(tmp_path / "run"),
        JobProgress(cfg.steps, enabled=False),
        0.0,
    )
    assert summary["steps"] == 1 and [e["step"] for e in summary["evals"]] == [0, 1]
    assert rolling_at == {"eval-0": True, "eval-1": False}


@pytest.mark.parametrize("fails", [True, False])
async def test_a_run_stops_its_rollouts_before_it_waits_for_its_last_checkpoint(tmp_path, monkeypatch, fails):
    # a run that ends (its last step trained, or failed) waits for the checkpoint being
    # written (up to trainer.call_timeout_s, an hour by default), and its rollouts ran on
    # all that while: groups played, re-run and scored that nothing would ever train on
    from core.buffer import SampleBuffer
    from core.report import JobProgress, RunDir

    cfg = job_config(tmp_path, steps=1)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    # failing: no batch, step 1 waits and meets the fatal error; else step 1 trains
    buffer = j.buffer = SampleBuffer(cfg.group_size, cfg.alpha) if fails else _one_batch(cfg)
    closed = asyncio.Event()

    class Runner:  # what the step loop uses of a GroupRunner; "rolling" until closed
        changed = asyncio.Event()
        aborted_ids: set[str] = set()

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            closed.set()

    class Stream:
        def metrics(self) -> dict[str, Any]:
            return {"scored": 0, "reward_ms": {"total": 0.0}}

    rolling_while_written: list[bool] = []

    async def written() -> None:  # the checkpoint's write, as long as the rollouts go on
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):
                await closed.wait()
        rolling_while_written.append(not closed.is_set())

    j._checkpoint_task = asyncio.create_task(written())
    train = j._train(
        None,  # type: ignore[arg-type]
        Runner(),  # type: ignore[arg-type]
        buffer,
        Stream(),  # type: ignore[arg-type]
        RunDir(tmp_path / "run"),
        JobProgress(cfg.steps, enabled=False),
    )
    if fails:
        j._fatal.set_exception(RolloutError("every group given up"))
        with pytest.raises(RolloutError):
            await train
    else:
        await train
        assert j.step == 1
    assert rolling_while_written == [False]


async def test_a_run_that_fails_in_its_first_evaluation_leaves_no_launcher_running(tmp_path):
    # async mode: the launcher starts before the untrained policy's evaluation, which ran
    # outside the step loop's cleanup: an evaluation that failed (a dead proxy) or a Ctrl-C
    # during it left the launcher task pending, starting groups on a closed runner
    from core.buffer import SampleBuffer
    from core.report import JobProgress, RunDir

    cfg = job_config(tmp_path, steps=1, rollout={"eval_every": 1, "eval_episodes": 1})
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    j.buffer = SampleBuffer(cfg.group_size, cfg.alpha)

    class Runner:
        changed = asyncio.Event()

        def rolling_groups(self) -> int:
            return 1 << 30

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    class Manager:
        async def run(self, task: Any, *, version: int) -> Any:
            raise ProxyDiedError("the LLM proxy actor died")

    with pytest.raises(ProxyDiedError):
        await j._train(
            Manager(),  # type: ignore[arg-type]
            Runner(),  # type: ignore[arg-type]
            j.buffer,
            None,  # type: ignore[arg-type]
            RunDir(tmp_path / "run"),
            JobProgress(cfg.steps, enabled=False),
        )
    leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
    assert leftover == []


async def test_the_summary_counts_what_the_reward_stream_scored_while_it_drained(tmp_path, monkeypatch):
    # a run that finishes drains its reward stream (every trajectory in flight is scored
    # and delivered), but the summary's counts were taken before: what was scored in the
    # drain was missing from summary.json (rewards.scored, the buffer's accepted samples)
    from core.report import JobProgress, RunDir
    from core.rewards import RewardStream
    from fabric.protocol import Result, Trajectory

    cfg = job_config(tmp_path, steps=1)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = _one_batch(cfg)
    accepted_before = buffer.metrics()["accepted"]
    closing = asyncio.Event()

    class Client:  # a reward that answers only once the stream drains
        async def call(self, function: str, payload: Any, **kw: Any) -> Result:
            await closing.wait()
            return Result(ok=True, function=function, value=1.0)

    class Stream(RewardStream):
        async def aclose(self, **kw: Any) -> None:
            closing.set()
            await super().aclose(**kw)

    class Runner:  # nothing runs: the late trajectory below is the rollout's last
        changed = asyncio.Event()
        aborted_ids: set[str] = set()
        metrics: dict[str, int] = {}

        def rolling_groups(self) -> int:
            return 1 << 30

        def forget_aborted_before(self, version: int) -> None:
            pass  # the stand-in buffer keeps no aborted ones

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    runner = j.runner = Runner()  # type: ignore[assignment]
    stream = j.stream = Stream(Client(), cfg.rewards, j._deliver)  # type: ignore[arg-type]
    late = Trajectory(id="late", status="ok", env_reward=1.0, task={"tag": "latency", "group_id": "late"})
    stream.submit(late, version=1)
    summary = await j._rollout(
        None,  # type: ignore[arg-type]
        runner,  # type: ignore[arg-type]
        buffer,
        stream,
        RunDir(tmp_path / "run"),
        JobProgress(cfg.steps, enabled=False),
        0.0,
    )
    assert stream.metrics()["scored"] == 1  # the drain scored it
    assert summary["rewards"]["scored"] == 1 and summary["rewards"]["in_flight"] == 0
    assert summary["buffer"]["accepted"] == accepted_before + 1


async def test_failure_json_counts_what_the_reward_stream_had_in_flight_as_cancelled(tmp_path, monkeypatch):
    # a run that fails stops its reward stream without a drain: what it was scoring is
    # cancelled (and counted so). failure.json was written before, inside the stream's
    # block: it said the trajectory was still in flight and left it out of the cancelled,
    # so its counts did not add up as a summary's do (submitted = scored + reward_failed +
    # cancelled + passed_masked, nothing in flight)
    from core.buffer import SampleBuffer
    from core.report import JobProgress, RunDir
    from core.rewards import RewardStream
    from fabric.protocol import Result, Trajectory

    cfg = job_config(tmp_path, steps=1)
    j = Job(cfg, progress=False)
    j._fatal = asyncio.get_running_loop().create_future()
    _stand_in_cluster(j, monkeypatch)
    buffer = j.buffer = SampleBuffer(cfg.group_size, cfg.alpha)  # no batch: step 1 waits
    calling = asyncio.Event()

    class Client:  # a reward that is being scored when the run fails
        async def call(self, function: str, payload: Any, **kw: Any) -> Result:
            calling.set()
            await asyncio.Event().wait()
            raise AssertionError("never answered")

    class Runner:
        changed = asyncio.Event()
        aborted_ids: set[str] = set()
        metrics: dict[str, int] = {}

        def rolling_groups(self) -> int:
            return 1 << 30

        async def aclose(self) -> None:
            pass  # the stand-in holds nothing to close

    runner = j.runner = Runner()  # type: ignore[assignment]
    stream = j.stream = RewardStream(Client(), cfg.rewards, j._deliver)  # type: ignore[arg-type]

    async def fail_while_scoring() -> None:
        await calling.wait()
        assert j._fatal is not None
        j._fatal.set_exception(RolloutError("every group given up"))

    stream.submit(
        Trajectory(id="t", status="ok", env_reward=1.0, task={"tag": "latency", "group_id": "g"}), version=0
    )
    failing = asyncio.create_task(fail_while_scoring())
    run_dir = RunDir(tmp_path / "run")
    with pytest.raises(RolloutError):
        await j._rollout(
            None,  # type: ignore[arg-type]
            runner,  # type: ignore[arg-type]
            buffer,
            stream,
            run_dir,
            JobProgress(cfg.steps, enabled=False),
            0.0,
        )
    await failing
    rewards = json.loads((run_dir.path / "failure.json").read_text())["rewards"]
    assert rewards == json.loads(json.dumps(stream.metrics()))  # what the stream counted in the end
    assert rewards["in_flight"] == 0 and rewards["cancelled"] == 1


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
async def test_a_rollout_where_every_group_fails_stops_with_the_cause(tmp_path, ray_cluster):
    # the map prompt (~66 tokens) does not fit a 64-token context: every trajectory fails the
    # same way, so the job must stop and say why instead of re-running groups forever
    cfg = job_config(tmp_path, env=FROZENLAKE, steps=2)
    with pytest.raises(RolloutError) as e:
        await run_job(cfg)
    assert "groups in a row were given up" in str(e.value)
    assert "PromptTooLongError" in str(e.value) and "context is 64" in str(e.value)
    # the run directory says so too, with the counts: never a summary.json (a finished run)
    run = tmp_path / "run"
    assert not (run / "summary.json").exists()
    failure = json.loads((run / "failure.json").read_text())
    assert failure["error"].startswith("RolloutError: ") and "PromptTooLongError" in failure["error"]
    assert failure["steps"] == 0 and failure["groups"]["given_up"] >= 8
    assert failure["trajectories"]["infra_failed"] > 0
    assert any("PromptTooLongError" in k for k in failure["trajectories"]["errors"])


# ----------------------------------------------------------------------------- the happy path


@pytest.mark.ray
async def test_the_job_trains_end_to_end_and_leaves_its_run_directory(tmp_path, ray_cluster):
    cfg = job_config(
        tmp_path,
        env=FROZENLAKE,
        steps=4,
        # the map prompt is ~66 tokens; a few pretraining steps: the wiring, not the learning
        engine={"kwargs": {"max_len": 128}, "pretrain": {"steps": 3, "episodes": 10}},
        # async: the step-2 evaluation holds version 3 back until it ends
        rollout={"eval_every": 2, "eval_episodes": 8, "eval_exact": True},
    )
    job, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    pre = summary["pretrain"]
    assert pre["steps"] == 3 and pre["held_out_loss_after"] < pre["held_out_loss_before"]
    run_dir = tmp_path / "run"
    for name in ("metrics.jsonl", "summary.json", "config.yaml", "reward.png", "time.png"):
        assert (run_dir / name).stat().st_size > 0, name
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert JobConfig.from_yaml(run_dir / "config.yaml", registry=faults.REG) == cfg
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["version"] for r in rows] == [1, 2, 3, 4]  # one new version per step
    for r in rows:
        assert TRAIN_KEYS <= r.keys() and TIME_KEYS <= r["time"].keys()
        assert all(r[k] is not None and r[k] >= 0 for k in DRIFT_KEYS), r
        assert 0 <= r["staleness_mean"] <= cfg.alpha
        assert 0.0 <= r["success"] <= 1.0 and r["trajectories"] == 4
    assert job.version == 4 and summary["buffer"]["version"] == 4
    # evaluations: untrained, after step 2, final (greedy, held-out seeds)
    assert [e["step"] for e in summary["evals"]] == [0, 2, 4]
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in evals if e.get("kind") == "eval") == [0, 2, 4]
    assert all(e["versions"] == [e["version"]] * 2 for e in evals if e.get("kind") == "eval"), evals
    assert [e["versions"] for e in summary["evals"]] == [[0, 0], [2, 2], [4, 4]]
    assert summary["untrained_success"] is not None and summary["final_success"] is not None
    # the unseen split: the evaluation tasks (maps) no pretraining or training episode had,
    # worked out here from the environment itself
    env = FrozenLakeEnv(**FROZENLAKE["kwargs"])
    keys = [task_key(env.reset(seed=EVAL_SEED_BASE + i)[0].text) for i in range(8)]
    # every map pretraining played (seeds 0..199: 10 episodes asked, the corpus's 200 played)
    assert {task_key(env.reset(seed=s)[0].text) for s in range(200)} <= job.evaluator.trained_tasks
    final = next(e for e in evals if e.get("kind") == "eval" and e["step"] == 4)
    assert (
        final["episodes_unseen"]
        == sum(k not in job.evaluator.trained_tasks for k in keys)
        <= final["episodes"]
    )
    assert (final["success_unseen"] is None) == (final["episodes_unseen"] == 0)
    assert summary["final_unseen_episodes"] == final["episodes_unseen"]


@pytest.mark.ray
async def test_the_job_trains_on_a_users_environment_from_an_image_directory(tmp_path, ray_cluster):
    # the env was registered by a fabric.discover module: accepted, then "unknown environment
    # 'coin-v0'" in the corpus child, and no image could be used (the pool had no image cache)
    image = tmp_path / "coin"
    image.mkdir()
    (image / "job_coin.py").write_text(COIN.replace("{id}", "job-coin-v0").replace("{module}", "job_coin"))
    (image / "envpool.json").write_text('{"modules": ["job_coin"]}')
    env = {
        "id": "job-coin-v0",
        "tag": "coin",
        "max_turns": 1,
        "actions": ["heads", "tails"],
        "image": str(image),
    }
    cfg = job_config(tmp_path, env=env, steps=2, rollout={"eval_every": 2, "eval_episodes": 2})
    job = Job(cfg, progress=False, registry=faults.REG)
    finished: list[Any] = []
    record = job.tally.finished
    job.tally.finished = lambda traj: (finished.append(traj), record(traj))[1]  # type: ignore[method-assign]
    summary = await job.run()
    check_invariants(summary, cfg)
    [ref] = summary["images"].values()
    assert summary["images"] == {str(image): ref} and ref.startswith("coin@sha256:")
    # the corpus child played it: the tokenizer knows its words
    vocab = json.loads((tmp_path / "run" / "policy-init" / "tokenizer.json").read_text())
    assert {"heads", "tails", "coin", "win", "lose"} <= set(vocab["vocab"]), vocab["vocab"]
    # the pool played it: every trajectory is the user's environment, and those were trained
    assert finished and {t.task["env_id"] for t in finished} == {"job-coin-v0"}
    assert {t.messages[0].content for t in finished} == {"Call the coin: heads or tails."}
    assert task_key("Call the coin: heads or tails.") in job.evaluator.trained_tasks
    assert all(r["trajectories"] == 4 for r in train_rows(tmp_path / "run"))
    # and so did the evaluation (through the pool too)
    assert [e["step"] for e in summary["evals"]] == [0, 2] and job.evals[-1]["episodes"] == 2
    assert "job-coin-v0" not in __import__("envpool").default_registry  # nothing of it ran here


@pytest.mark.ray
async def test_sync_mode_runs_too(tmp_path, ray_cluster):
    cfg = job_config(tmp_path, rollout={"mode": "sync"})
    _, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    assert summary["mode"] == "sync"
    # a step's groups start together under the version being trained: never stale
    assert set(summary["buffer"]["staleness"]) == {0}
    assert summary["groups"]["groups_started"] == cfg.steps * cfg.batch_size
    rows = train_rows(tmp_path / "run")
    assert [r["version"] for r in rows] == [1, 2, 3]
    # never stale, so the trainer's first logprobs are the engine's own (same weights): the
    # drift gauge reads numerical noise only. A replica serving older weights reads far more
    assert all(r["approx_kl"] < 1e-4 for r in rows), [r["approx_kl"] for r in rows]


@pytest.mark.ray
@pytest.mark.parametrize(
    ("scheduler", "placement"),
    [
        ("fcfs", "affinity"),
        ("rr", "least_load"),
        ("sjf", "cache_affinity"),
        ("pps", "presorted_dp"),
        ("cmlfq", "affinity"),
    ],
)
async def test_the_job_runs_under_each_scheduler(tmp_path, ray_cluster, scheduler, placement):
    # one slot per replica: every turn after the first waits in the scheduler's queue
    rollout = {"scheduler": scheduler, "placement": placement, "slots_per_replica": 1, "trace": True}
    cfg = job_config(tmp_path, steps=2, rollout=rollout)
    _, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    sched = summary["proxy"]["scheduler"]
    assert (sched["scheduler"], sched["placement"]) == (scheduler, placement)
    assert sched["turns_queued"] > 0  # (turns may still wait: groups run on past the last step)
    assert sched["turns_admitted"] >= summary["proxy"]["turns"]
    assert sched["predictor_trained_on"] > 0  # finished trajectories taught the length predictor
    rows = [json.loads(line) for line in (tmp_path / "run" / "trace.jsonl").read_text().splitlines()]
    assert len(rows) >= summary["proxy"]["turns"] > 0  # and turns ran on until shutdown
    assert all(r["ready"] <= r["start"] <= r["end"] for r in rows)


@pytest.mark.ray
async def test_redundant_rollouts_are_aborted_and_never_trained(tmp_path, ray_cluster):
    cfg = job_config(tmp_path, redundancy=2)
    _, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    groups = summary["groups"]
    assert groups["redundant_aborted"] > 0
    assert groups["trajectories_started"] >= groups["groups_started"] * (cfg.group_size + cfg.redundancy)
    # a member asked to stop either stops ("aborted") or, on a loaded machine, finishes in
    # the race first ("extra"): which of the two is timing, that it is one of them is not.
    # tests/core/test_groups.py pins the abort itself with controlled timing
    assert groups.get("aborted", 0) + groups.get("extra", 0) > 0
    # every batch was checked against their ids (check_invariants: aborted_trained is 0)
    assert summary["aborted_trained"] == 0


# ----------------------------------------------------------------------------- faults


@pytest.mark.ray
async def test_a_reward_that_raises_masks_and_reruns_the_member(tmp_path, ray_cluster):
    state = tmp_path / "state"
    state.mkdir()
    rewards = [{"function": "raise_first", "args": {"state_dir": str(state), "n": 2}}]
    cfg = job_config(tmp_path, rewards=rewards)
    _, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    failed = faults.claimed(state, "raised")
    assert len(set(failed)) == 2
    assert summary["trajectories"]["reward_failed"] == 2
    assert summary["rewards"]["reward_failed"] == 2
    assert summary["rewards"]["failures"] == {"raise_first:UserError": 2}
    assert summary["buffer"]["dropped"]["reward_failed"] == 2  # masked, not a zero reward
    assert summary["groups"]["reruns"] >= 2  # each failed member replaced
    assert summary["rewards"]["scored"] >= cfg.steps * cfg.batch_size * cfg.group_size


@pytest.mark.ray
async def test_a_reward_that_times_out_is_retried_and_scored(tmp_path, ray_cluster):
    state = tmp_path / "state"
    state.mkdir()
    rewards = [{"function": "slow_once", "args": {"state_dir": str(state), "n": 1}}]
    cfg = job_config(tmp_path, rewards=rewards)
    job, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    [slow] = faults.claimed(state, "slow")
    assert (state / f"scored-{slow}").exists()  # the retry scored the same trajectory
    assert summary["rewards"]["reward_failed"] == 0
    assert job.stream is not None
    assert job.stream.client.metrics()["slow_once"]["retries"] >= 1  # the timeout, counted


@pytest.mark.ray
async def test_a_final_reward_timeout_masks_the_trajectory_and_replaces_it(tmp_path, ray_cluster):
    state = tmp_path / "state"
    state.mkdir()
    rewards = [{"function": "slow_no_retry", "args": {"state_dir": str(state), "n": 1}}]
    cfg = job_config(tmp_path, rewards=rewards)
    _, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    [slow] = faults.claimed(state, "slow")
    assert not (state / f"scored-{slow}").exists()
    assert summary["rewards"]["failures"] == {"slow_no_retry:FunctionTimeout": 1}
    assert summary["trajectories"]["reward_failed"] == 1
    assert summary["buffer"]["dropped"]["reward_failed"] == 1
    assert summary["groups"]["reruns"] >= 1


async def _past_its_first_step(cfg: JobConfig) -> tuple[Job, asyncio.Future[Any]]:
    """The job started, and polled until it trained one step (still running): the faults
    of the tests below strike a job in its stride."""
    job = Job(cfg, progress=False, registry=faults.REG)
    task = asyncio.ensure_future(job.run())
    while job.version < 1 and not task.done():  # noqa: ASYNC110 - polls another task's progress
        await asyncio.sleep(0.02)
    assert not task.done()
    return job, task


def _latency_fails(seed: int, fail_prob: float) -> bool:
    rng = random.Random(seed)  # LatencyEnv.reset: the slow draw, then the fail draw
    rng.random()
    return rng.random() < fail_prob


def _job_seed_whose_first_group_fails(fail_prob: float, clean_after: int) -> int:
    """A job seed whose first group's episode kills its container and whose next
    ``clean_after`` groups do not (the job draws one task seed per group from its rng)."""
    for job_seed in range(100_000):
        rng = random.Random(job_seed)
        seeds = [rng.randrange(EVAL_SEED_BASE) for _ in range(1 + clean_after)]
        if _latency_fails(seeds[0], fail_prob) and not any(_latency_fails(s, fail_prob) for s in seeds[1:]):
            return job_seed
    raise AssertionError("no such seed")


@pytest.mark.ray
async def test_a_container_that_dies_mid_episode_is_masked_not_scored(tmp_path, ray_cluster):
    fail_prob = 0.2
    seed = _job_seed_whose_first_group_fails(fail_prob, clean_after=24)
    env = {**LATENCY, "kwargs": {"mu_s": 0.01, "turns": 2, "fail_prob": fail_prob}}
    cfg = job_config(tmp_path, env=env, seed=seed, rollout={"max_reruns": 1})
    _, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    failed = summary["trajectories"]["infra_failed"]
    # the first group replays its failing episode: both members fail, and its one re-run
    # fails too, or is aborted when the group is given up (the second failure leaves it no
    # way to reach group_size), whichever comes first
    assert cfg.group_size <= failed <= cfg.group_size + 1
    assert summary["trajectories"]["errors"] == {"SessionLost": failed}  # what ended them
    assert summary["groups"]["given_up"] == 1 and summary["groups"]["reruns"] == 1
    assert train_rows(tmp_path / "run")[-1]["given_up_groups"] == 1  # metrics.jsonl counts it too
    assert summary["buffer"]["dropped"]["infra_failed"] == failed  # masked, never a zero
    assert summary["rewards"]["passed_masked"] >= failed  # never sent to a reward function
    assert summary["rewards"]["reward_failed"] == 0


@pytest.mark.ray
async def test_a_killed_engine_replica_restarts_and_gets_the_latest_weights(tmp_path, ray_cluster):
    ray = ray_cluster
    # enough steps that the job outlives the restart (a new worker process loading torch)
    job, task = await _past_its_first_step(job_config(tmp_path, steps=40))
    [replica] = job.replicas
    pid = await replica.pid.remote()
    killed_at = job.version
    ray.kill(replica, no_restart=False)  # Ray restarts it (engine.max_restarts)
    seen: dict[str, Any] = {}
    while not task.done():
        with contextlib.suppress(Exception):
            stats = await asyncio.wait_for(replica.stats.remote(), 5)
            new_pid = await asyncio.wait_for(replica.pid.remote(), 5)
            if new_pid != pid and stats["version"] >= killed_at:
                seen = {"pid": new_pid, "version": stats["version"]}
                break
        await asyncio.sleep(0.05)
    summary = await task
    check_invariants(summary, job.cfg)
    assert [r["version"] for r in train_rows(tmp_path / "run")] == list(range(1, job.cfg.steps + 1))
    # the restarted process was given the weights it lost (it starts from the initial ones):
    # the proxy's record says so; the poll above may miss the moment on a loaded machine (a
    # reply slower than its 5 s wait), so what it saw, if anything, is checked on top
    proxy = summary["proxy"]
    assert proxy.get("replicas_recovered", 0) >= 1 and proxy.get("weights_reloaded", 0) >= 1, proxy
    assert proxy.get("replicas_removed", 0) == 0, proxy
    if seen:
        assert seen["version"] >= killed_at and seen["pid"] != pid
    assert summary["trajectories"].get("infra_failed", 0) == 0  # the lost turns were re-run


@pytest.mark.ray
async def test_a_trainer_that_hangs_stops_the_job_with_an_error_naming_its_deadline(tmp_path, ray_cluster):
    # the step loop awaited the trainer's step with no limit: a trainer actor stuck in a
    # step (a hung collective) held the job, and its run directory said nothing, for ever
    import threading

    job, task = await _past_its_first_step(
        job_config(tmp_path, steps=40, trainer={"lr": 1e-3, "call_timeout_s": 600})
    )
    # the deadline is read at each call: lowered only now, a first step slowed by a loaded
    # machine cannot be what times out
    job.cfg.trainer.call_timeout_s = 3

    def wedge(actor: Any) -> None:  # holds the actor's one thread: the next step waits for ever
        threading.Event().wait()

    job.trainer_handle.__ray_call__.remote(wedge)
    with pytest.raises(TrainerTimeout) as e:
        await asyncio.wait_for(task, 60)
    assert "trainer.call_timeout_s=3" in str(e.value) and "step" in str(e.value)
    failure = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert failure["error"].startswith("TrainerTimeout: ") and "trainer.call_timeout_s" in failure["error"]
    assert failure["steps"] >= 1 and not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.ray
async def test_a_dead_proxy_stops_the_job_at_once_with_an_error_that_says_so(tmp_path, ray_cluster, caplog):
    # the proxy actor is not restarted (a new one would not know the published weights, the
    # trajectories' affinities or the turns in flight): its death stops the job. It showed
    # as Ray's ActorDiedError in every trajectory (a traceback logged for each, re-run, given
    # up), and the job stopped only when a streak of groups was given up or the step loop
    # met it, with an error that did not say what to do
    ray = ray_cluster
    job, task = await _past_its_first_step(job_config(tmp_path, steps=40))
    ray.kill(job.proxy_handle, no_restart=True)
    with pytest.raises(ProxyDiedError) as e:
        await asyncio.wait_for(task, 60)
    assert "the LLM proxy actor died" in str(e.value) and "--resume" in str(e.value)
    failure = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert failure["error"].startswith("ProxyDiedError: ")
    assert failure["groups"].get("given_up", 0) == 0  # stopped at once, not after a streak
    assert not [r for r in caplog.records if r.name == "core.rollout.groups" and r.levelname == "ERROR"]


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


def test_the_cli_error_of_a_failed_run_points_to_its_failure_json(tmp_path):
    from core.job import failure_note
    from core.report import RunDir

    assert failure_note(None) == ""  # the config did not load: no run directory
    j = Job(job_config(tmp_path), progress=False)
    assert failure_note(j) == ""  # stopped before its run directory
    j.run_dir = RunDir(tmp_path / "run")
    assert failure_note(j) == ""  # a run directory, and no failure written
    j.run_dir.fail({"error": "RolloutError: ..."})
    assert failure_note(j) == f" (the counts: {tmp_path / 'run' / 'failure.json'})"
    assert not (tmp_path / "run" / "summary.json").exists()
