"""The labelled equivalence table of the ``math_answer`` reward
(tests/data/math_equivalence.jsonl), and how a row is judged: what test_math_reward.py
scores and test_math_sympy_child.py runs through the sympy child."""

from __future__ import annotations

import json
from pathlib import Path

from functions.rewards.math import is_equivalent, math_answer

TABLE = Path(__file__).parent.parent / "data" / "math_equivalence.jsonl"
ROWS = [json.loads(line) for line in TABLE.read_text().splitlines() if line.strip()]


def judge(row: dict) -> bool:
    """Whole completions (the extraction rows) go through the reward; the rest are answers."""
    if row["category"] == "extraction":
        return math_answer(row["prediction"], ground_truth=row["ground_truth"]).score == 1.0
    return is_equivalent(row["prediction"], row["ground_truth"])[0]
