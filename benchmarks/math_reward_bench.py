"""Accuracy and latency of the ``math_answer`` reward on the labelled equivalence table.

    .venv/bin/python benchmarks/math_reward_bench.py [--repeat 3] [--timeout 2.0]

Calls run in-process and warm (sympy imported and warmed once before timing): rows of the
``extraction`` category go through the whole reward, the others through ``is_equivalent``.
Latency is per call, over ``--repeat`` passes of the table, split into the in-process fast
path and calls that forked a sympy child. Pathological inputs (huge powers, a 200-deep
``\\frac``) are timed against the sympy time limit. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from functions.rewards.math import is_equivalent, math_answer
from functions.rewards.math_fast import Verdict

TABLE = Path(__file__).resolve().parent.parent / "tests" / "data" / "math_equivalence.jsonl"
FAST_RULES = {"string", "number", "structure", "text", "empty"}


def _nested(depth: int) -> str:
    s = "2"
    for _ in range(depth):
        s = "\\frac{1}{" + s + "}"
    return s


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _judge(row: dict[str, Any], timeout: float) -> Verdict:  # None: undecided (counts as wrong)
    if row["category"] == "extraction":
        res = math_answer(row["prediction"], ground_truth=row["ground_truth"], sympy_timeout_s=timeout)
        return res.score == 1.0, str(res.info["decided_by"])
    return is_equivalent(row["prediction"], row["ground_truth"], timeout_s=timeout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args()
    rows = [json.loads(line) for line in TABLE.read_text().splitlines() if line.strip()]

    is_equivalent("2\\sqrt{2}", "\\sqrt{8}")  # warm: imports sympy in this process
    correct = 0
    all_ms: list[float] = []
    fast_ms: list[float] = []
    sympy_ms: list[float] = []
    for rep in range(args.repeat):
        for row in rows:
            t0 = time.perf_counter()
            verdict, rule = _judge(row, args.timeout)
            ms = (time.perf_counter() - t0) * 1e3
            all_ms.append(ms)
            (fast_ms if rule in FAST_RULES else sympy_ms).append(ms)
            if rep == 0:
                correct += verdict == row["equivalent"]

    pathological = {}
    for name, pred in [
        ("10^{10^{10}}", "10^{10^{10}}"),
        ("9**9**9", "9**9**9"),
        ("nested \\frac x200", _nested(200)),
    ]:
        t0 = time.perf_counter()
        res = math_answer(f"\\boxed{{{pred}}}", ground_truth="7", sympy_timeout_s=args.timeout)
        pathological[name] = {
            "seconds": round(time.perf_counter() - t0, 3),
            "decided_by": res.info["decided_by"],
            "score": res.score,
        }

    def summary(xs: list[float]) -> dict[str, Any]:
        if not xs:
            return {"calls": 0}
        return {
            "calls": len(xs),
            "p50_ms": round(_pct(xs, 0.5), 3),
            "p99_ms": round(_pct(xs, 0.99), 3),
            "mean_ms": round(statistics.fmean(xs), 3),
        }

    print(
        json.dumps(
            {
                "rows": len(rows),
                "accuracy": round(correct / len(rows), 4),
                "latency": summary(all_ms),
                "latency_fast_path": summary(fast_ms),
                "latency_sympy_child": summary(sympy_ms),
                "timeout_s": args.timeout,
                "pathological": pathological,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
