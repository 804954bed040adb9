"""A run stopped after its last step (in its final evaluation, or while it wrote its summary)
gets its summary by ``--resume`` at the same ``steps``: the final evaluation is run (once)
and ``summary.json`` written, with no step trained again."""

from __future__ import annotations

import json
from pathlib import Path

import job_faults_fns as faults
import pytest
from job_helpers import job_config, run_job, train_rows

from core.checkpoint import Checkpoints, start_problems
from core.job import Job, interrupted_note


def _evals(run_dir: Path) -> list[int]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r.get("kind") == "eval"]


def test_a_resume_at_the_checkpoints_step_is_not_refused_but_one_below_it_is(tmp_path):
    # refused before: "steps: is 2, the checkpoint is at step 2: raise it to go on", so the
    # summary of a run stopped in its final evaluation could only be had by training more
    cfg = job_config(tmp_path, steps=2, checkpoint={"every": 2})
    ckpts = Checkpoints(cfg.run_dir)
    part = ckpts.prepare(2)
    (part / "trainer.pt").write_bytes(b"")
    ckpts.commit(
        part,
        2,
        {"step": 2, "version": 2, "config": cfg.to_yaml(), "rng": None, "counts": {}, "trained_tasks": []},
    )
    (Path(cfg.run_dir) / "policy-init").mkdir()
    problems, resume_from, _ = start_problems(cfg, ckpts, resume=True)
    assert problems == [] and resume_from is not None and resume_from[1]["step"] == 2
    lower = job_config(tmp_path, steps=1, checkpoint={"every": 2})
    problems, _, _ = start_problems(lower, Checkpoints(lower.run_dir), resume=True)
    assert problems == [("steps", "is 1, the checkpoint is at step 2: raise it to go on (--steps N)")]
    # and the note of a run stopped there says what the resume does
    note = interrupted_note(Job(cfg))
    latest = ckpts.latest()
    assert note == (
        "interrupted after its last step; --resume runs its final evaluation and writes its summary "
        f"(--resume --steps N, N > 2, trains on) from {latest}"
    ), note


# three jobs, each its own start of actors, pools and workers (its training is a fraction of
# a second, so fewer steps or episodes save nothing): ~5 s a start alone, 25 s on a loaded
# machine; with the module's Ray start, a loaded full run passed the suite's 120 s (29 s of
# set-up, then a job still waiting for its actors at 91 s). The bound is for a hang only
@pytest.mark.timeout(360)
@pytest.mark.ray
async def test_a_run_stopped_in_its_final_evaluation_gets_its_summary_by_resume(tmp_path, ray_cluster):
    cfg = job_config(
        tmp_path, steps=2, checkpoint={"every": 2}, rollout={"eval_every": 2, "eval_episodes": 2}
    )
    _, first = await run_job(cfg)
    run_dir = Path(cfg.run_dir)
    assert first["final_success"] is not None and _evals(run_dir) == [0, 2]
    # as if stopped in the final evaluation: the last step trained and checkpointed, the
    # final evaluation never logged, no summary nor plots
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    final = [x for x in lines if json.loads(x).get("kind") == "eval" and json.loads(x)["step"] == 2]
    metrics.write_text("".join(x + "\n" for x in lines if x not in final))
    for name in ("summary.json", "reward.png", "time.png"):
        (run_dir / name).unlink()
    assert _evals(run_dir) == [0]
    before = train_rows(run_dir)

    job = Job(cfg, progress=False, registry=faults.REG, resume=True)
    summary = await job.run()
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 2
    assert summary["final_success"] is not None and [e["step"] for e in summary["evals"]] == [0, 2]
    assert json.loads((run_dir / "summary.json").read_text())["final_success"] == summary["final_success"]
    assert (run_dir / "reward.png").exists()
    assert train_rows(run_dir) == before  # no step trained again
    assert _evals(run_dir) == [0, 2]

    # resumed once more (a summary already there): the final evaluation is the one logged,
    # not run and logged a second time
    again = await Job(cfg, progress=False, registry=faults.REG, resume=True).run()
    assert _evals(run_dir) == [0, 2] and [e["step"] for e in again["evals"]] == [0, 2]
    assert again["final_success"] == summary["final_success"]
