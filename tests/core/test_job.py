"""The RL job end to end on the embedded default (a local Ray cluster, a tiny torch policy,
local fabric worker processes, process containers): the run directory, evaluations, a
user's environment image, sync mode, each scheduler, redundant rollouts.
"""

from __future__ import annotations

import json
from typing import Any

import job_faults_fns as faults
import pytest
from job_helpers import (
    DRIFT_KEYS,
    FROZENLAKE,
    TIME_KEYS,
    TRAIN_KEYS,
    check_invariants,
    job_config,
    run_job,
    train_rows,
)
from test_env_images import COIN

from core.config import JobConfig
from core.job import EVAL_SEED_BASE, Job
from core.rollout.env_manager import task_key
from envpool.envs.frozenlake import FrozenLakeEnv

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
