"""benchmarks/learning_report.py reads finished run directories (the README's learning table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "learning_report.py"


def _run_dir(
    path: Path,
    setup_s: float,
    evals: list[tuple[int, float]],
    step_s: float = 2.0,
    eval_s: float = 3.0,
    unseen: bool = True,
) -> Path:
    path.mkdir()
    rows = []
    for step in range(1, max(s for s, _ in evals) + 1):
        rows.append({"kind": "train", "step": step, "wall_s": step * step_s})
    # an evaluation row is written when it finishes: eval_s after the step it follows
    rows += [
        {"kind": "eval", "step": s, "success": ok, "success_sampled": ok, "wall_s": s * step_s + eval_s}
        | ({"success_unseen": ok / 2, "episodes_unseen": 10} if unseen else {})
        for s, ok in evals
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"setup_s": setup_s, "steps": len(rows), "wall_s": 999.0, "pretrain": {"steps": 4}}
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_the_bar_is_timed_from_the_start_of_the_run_set_up_included(tmp_path):
    fast = _run_dir(tmp_path / "fast", 80.0, [(0, 0.0), (20, 0.73), (40, 0.9)])
    # reaches the bar at step 300: 80 s + 600 s, past the 10-minute budget
    slow = _run_dir(tmp_path / "slow", 80.0, [(0, 0.0), (200, 0.5), (300, 0.8)])
    out = _report(str(fast), str(slow))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["runs"] == 2 and data["reached_bar_within_budget"] == 1 and data["bar_wall_s"] == [123.0]
    by = {Path(r["run"]).name: r for r in data["per_run"]}
    assert by["fast"]["bar_step"] == 20 and by["fast"]["best_success"] == 0.9
    assert by["fast"]["final_success_unseen"] == 0.45 and by["fast"]["final_unseen_episodes"] == 10
    assert by["slow"]["bar_step"] == 300 and by["slow"]["bar_wall_s"] == 683.0
    assert (
        by["slow"]["success_at_budget"] == 0.5
    )  # the last evaluation within 600 s (step 200, done at 483 s)


def test_an_unfinished_run_is_refused_by_name(tmp_path):
    run = _run_dir(tmp_path / "killed", 80.0, [(0, 0.0)])
    (run / "summary.json").unlink()
    out = _report(str(run))
    assert out.returncode != 0 and "no summary.json" in out.stderr and "killed" in out.stderr


def test_runs_from_before_the_unseen_split_still_report(tmp_path):
    old = _run_dir(tmp_path / "old", 80.0, [(0, 0.0), (20, 0.8)], unseen=False)
    out = _report(str(old))
    assert out.returncode == 0, out.stderr
    run = json.loads(out.stdout)["per_run"][0]
    assert run["bar_step"] == 20 and run["final_success_unseen"] is None


def test_an_evaluation_with_no_episode_to_score_is_skipped_not_compared(tmp_path):
    # success None (every episode infra_failed): `None >= bar` stopped the report with a
    # TypeError; it is no measure, so neither the bar, the budget's figure nor the best
    run = _run_dir(tmp_path / "gap", 80.0, [(0, 0.0), (10, 0.4), (20, 0.8), (30, 0.9)], unseen=False)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if r.get("kind") == "eval" and r["step"] in (20, 30):
            r["success"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _report(str(run), "--curves")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)["per_run"][0]
    assert got["bar_step"] is None and got["best_success"] == 0.4 and got["success_at_budget"] == 0.4
    # the last evaluation measured nothing: said as such, not as the last one that did
    assert got["final_success"] is None and got["curve"][-1]["success"] is None
