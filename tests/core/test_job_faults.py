"""The job under faults: rewards that raise or time out, containers that die mid-episode,
an engine replica killed mid-run, a trainer that hangs, a dead proxy, a rollout where
every group fails. Faults are injected deterministically: reward functions claim
numbered slots in a directory (``job_faults_fns``), the failing container's episode is
picked by its seed, the replica is killed once the trainer published version 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import Any

import job_faults_fns as faults
import pytest
from job_helpers import (
    FROZENLAKE,
    LATENCY,
    check_invariants,
    job_config,
    run_job,
    train_rows,
)

from core.config import JobConfig
from core.errors import ProxyDiedError, RolloutError, TrainerTimeout
from core.job import EVAL_SEED_BASE, Job


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
    # sync mode: a step waits for its whole batch, so the failing group is given up (and
    # replaced) before the first step trains, whatever the machine's load. In async mode the
    # clean groups trained the steps meanwhile: under a loaded make test the job once ended
    # with that group still in flight (3 steps; its fresh containers are process starts),
    # and with 8 steps a clean clone's run once counted 1 infra_failed where the group has
    # at least 2. The runner's re-runs and give-ups are the same code in both modes
    cfg = job_config(tmp_path, env=env, seed=seed, steps=3, rollout={"mode": "sync", "max_reruns": 1})
    assert cfg.batch_size * cfg.steps + 1 <= 24  # the groups started, the replacement with them
    _, summary = await run_job(cfg)
    check_invariants(summary, cfg)
    failed = summary["trajectories"].get("infra_failed", 0)
    # the first group replays its failing episode: both members fail, and its one re-run
    # fails too, or is aborted when the group is given up (the second failure leaves it no
    # way to reach group_size), whichever comes first
    seen = {"trajectories": summary["trajectories"], "groups": summary["groups"]}
    assert cfg.group_size <= failed <= cfg.group_size + 1, seen
    assert summary["trajectories"]["errors"] == {"SessionLost": failed}  # what ended them
    assert summary["groups"]["given_up"] == 1 and summary["groups"]["reruns"] == 1, seen
    assert train_rows(tmp_path / "run")[-1]["given_up_groups"] == 1  # metrics.jsonl counts it too
    assert summary["buffer"]["dropped"]["infra_failed"] == failed  # masked, never a zero
    assert summary["rewards"]["passed_masked"] >= failed  # never sent to a reward function
    assert summary["rewards"]["reward_failed"] == 0


@pytest.mark.ray
async def test_a_killed_engine_replica_restarts_and_gets_the_latest_weights(tmp_path, ray_cluster):
    ray = ray_cluster
    # enough steps that the job outlives the restart (a new worker process loading torch):
    # its one replica gone, no step past the one or two the buffer holds (alpha 1) trains
    # before the restart and the reload, so a dozen do (40 trained on for seconds after them)
    job, task = await _past_its_first_step(job_config(tmp_path, steps=12))
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
