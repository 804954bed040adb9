"""When did each run learn? Reads run directories of `fabric run` and prints one JSON object.

    .venv/bin/python benchmarks/learning_report.py runs/a runs/b runs/c [--bar 0.7] [--budget-s 600]

Per run: the set-up time (tokenizer, pretraining, cluster start), the first held-out
evaluation whose greedy success reaches ``--bar`` (its step and its wall time counted from
the start of the run, set-up included), the success at the last evaluation within
``--budget-s`` of the start, and the final and best evaluations, with the final success on
the evaluation tasks training never saw (``success_unseen``: held-out seeds can give a task
training saw). Then how many runs reached the bar within the budget. The wall time of an
evaluation is when it finished (it runs next to the training steps after the one it follows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def report(run: Path, bar: float, budget_s: float) -> dict[str, Any]:
    summary_file = run / "summary.json"
    if not summary_file.is_file():
        raise SystemExit(f"{run}: no summary.json (the run did not finish); finished runs only")
    summary = json.loads(summary_file.read_text())
    setup = float(summary["setup_s"])
    evals = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "eval":
            evals.append(row)
    # an eval row's wall_s is when it finished, counted from the start of training
    curve = [(e["step"], round(setup + e["wall_s"], 1), e["success"]) for e in evals]
    unseen = [(e.get("success_unseen"), e.get("episodes_unseen")) for e in evals]
    # success None: an evaluation with no episode to score (every one infra_failed), which
    # measured nothing: skipped by the bar, the budget's figure and the best
    reached = next(((s, w) for s, w, ok in curve if ok is not None and ok >= bar), None)
    within = [ok for _, w, ok in curve if w <= budget_s and ok is not None]
    return {
        "run": str(run),
        "setup_s": setup,
        "pretrain": summary.get("pretrain"),
        "bar_step": reached[0] if reached else None,
        "bar_wall_s": reached[1] if reached else None,
        "success_at_budget": within[-1] if within else None,
        "best_success": max((ok for *_, ok in curve if ok is not None), default=None),
        "final_success": curve[-1][2] if curve else None,
        "final_success_unseen": unseen[-1][0] if unseen else None,
        "final_unseen_episodes": unseen[-1][1] if unseen else None,
        "steps": summary["steps"],
        "wall_s": summary["wall_s"],
        "curve": [
            {"step": s, "wall_s": w, "success": ok, "success_unseen": u, "episodes_unseen": n}
            for (s, w, ok), (u, n) in zip(curve, unseen, strict=True)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--bar", type=float, default=0.7, help="held-out greedy success to reach")
    ap.add_argument(
        "--budget-s", type=float, default=600.0, help="wall-time budget from the start of the run"
    )
    ap.add_argument("--curves", action="store_true", help="include every evaluation")
    args = ap.parse_args(argv)
    rows = [report(r, args.bar, args.budget_s) for r in args.runs]
    if not args.curves:
        for r in rows:
            r.pop("curve")
    ok = [r for r in rows if r["bar_wall_s"] is not None and r["bar_wall_s"] <= args.budget_s]
    out = {
        "bar": args.bar,
        "budget_s": args.budget_s,
        "runs": len(rows),
        "reached_bar_within_budget": len(ok),
        "bar_wall_s": sorted(r["bar_wall_s"] for r in ok),
        "per_run": rows,
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
