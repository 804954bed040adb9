"""The ``math_answer`` reward: the labelled equivalence table, the rules the module
documents, and the reward's result. Extraction, what is equal and what is not, linear time
on long input and the sympy child (its time limit, its confinement) have their own
test_math_*.py modules; the table is read in math_table.py."""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import pytest
from math_table import ROWS, judge

import fabric
from fabric.protocol import Message, RewardResult, Trajectory, encode_payload
from fabric.runner import FunctionRunner
from functions.rewards import math as math_reward
from functions.rewards import math_sympy
from functions.rewards.math import is_equivalent, math_answer
from functions.rewards.math_fast import canonical

# ----------------------------------------------------------------------------- the table


def test_table_is_large_and_balanced():
    assert len(ROWS) >= 220
    cats = defaultdict(set)
    for r in ROWS:
        assert set(r) == {"prediction", "ground_truth", "equivalent", "category"}
        cats[r["category"]].add(r["equivalent"])
    assert len(cats) >= 15
    assert all(labels == {True, False} for labels in cats.values()), cats


def test_accuracy_on_labelled_table():
    per_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    wrong = []
    for row in ROWS:
        ok = judge(row) == row["equivalent"]
        per_cat[row["category"]][0] += ok
        per_cat[row["category"]][1] += 1
        if not ok:
            wrong.append(row)
    for cat, (good, n) in sorted(per_cat.items()):
        print(f"{cat:14s} {good}/{n} = {good / n:.3f}")
    accuracy = 1 - len(wrong) / len(ROWS)
    print(f"overall accuracy {accuracy:.4f} over {len(ROWS)} rows; wrong: {wrong}")
    assert accuracy >= 0.99, wrong


# ----------------------------------------------------------------------------- documented rules


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        ("50%", "0.5", True),  # the other side is a decimal: 50% is 0.5
        ("50%", "50", True),  # the other side is an integer: 50% is 50
        ("50%", "5", False),
        ("0.5%", "0.5", False),
        ("\\frac{\\pi}{2}", "1.57", False),  # rounded decimals do not match exact values
        ("\\frac{\\pi}{2}", "1.5707963267949", True),  # ten significant digits do
        ("0.3333333333333", "1/3", True),
        ("(1,2)", "[1,2]", False),
        ("\\{2,1\\}", "\\{1,2\\}", True),
        ("(2,1)", "(1,2)", False),
    ],
)
def test_documented_rules(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # X% with a decimal was only X/100 unless the other side was an integer: 50% was 50 but
        # 37.5% was not 37.5
        ("37.5\\%", "37.5", True),
        ("37.5", "37.5\\%", True),
        ("12.5 \\text{ percent}", "12.5", True),
        ("\\frac{25}{2}\\%", "12.5", True),
        ("33\\frac{1}{3}\\%", "33\\frac{1}{3}", True),
        ("150\\%", "1.5", True),  # X/100 still, above 1 too
        ("37.6\\%", "37.5", False),
        ("37.5\\%", "3.75", False),
        # at most 1 in magnitude the other side is a fraction of the whole: X/100 only
        ("0.375", "37.5\\%", True),
        ("0.5", "50\\%", True),
        ("0.5\\%", "0.5", False),
        ("50\\%", "\\frac{1}{2}", True),
        ("\\frac{1}{2}\\%", "\\frac{1}{2}", False),
        # an integer: X only, as before
        ("50\\%", "50", True),
        ("5000\\%", "50", False),
        ("100\\%", "1", False),
    ],
)
def test_a_percentage_is_its_number_against_a_number_above_one(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


def test_fast_path_needs_no_child(monkeypatch):
    def no_fork(*a, **k):
        raise AssertionError("the fast path forked")

    monkeypatch.setattr(math_reward, "sympy_equivalent", no_fork)
    for pred, gt in [
        ("1/2", "0.5"),
        ("5 cm", "5"),
        ("\\{1,2\\}", "\\{2,1\\}"),
        ("1,000", "1e3"),
        ("12", "1/2"),
    ]:
        assert is_equivalent(pred, gt)[1] in {"string", "number", "structure", "text"}


def test_canonical_strips_presentation():
    assert canonical("\\$1,500.") == "1500"
    assert canonical("x = \\left( \\dfrac12 \\right)") == "( \\frac{1}{2} )"
    assert canonical("90^{\\circ}") == "90"
    assert canonical("10 \\text{ m}^2") == "10"


# ----------------------------------------------------------------------------- the reward


def test_reward_result_shape_for_a_trajectory():
    traj = Trajectory(
        messages=[
            Message(role="user", content="1/4 + 1/4?"),
            Message(role="assistant", content="so \\boxed{\\dfrac{1}{2}}", policy_version=3),
        ]
    )
    res = math_answer(traj, ground_truth="0.5")
    assert isinstance(res, RewardResult)
    assert res.score == 1.0
    assert res.components == {"correct": 1.0, "extracted": 1.0}
    assert res.info["extracted"] == "\\dfrac{1}{2}"
    assert res.info["extracted_by"] == "boxed"
    assert res.info["prediction"] == "\\frac{1}{2}"
    assert res.info["decided_by"] == "number"
    json.dumps(res.model_dump())  # JSON-safe


def test_reward_without_an_answer():
    res = math_answer("I give up.", ground_truth="3")
    assert res.score == 0.0
    assert res.components == {"correct": 0.0, "extracted": 0.0}
    assert res.info["decided_by"] == "no_answer"


def test_wrong_answer_scores_zero_with_sympy_rule():
    res = math_answer("\\boxed{3\\sqrt{2}}", ground_truth="\\sqrt{12}")
    assert res.score == 0.0
    assert res.components["extracted"] == 1.0
    assert res.info["decided_by"] == "sympy"


def test_missing_sympy_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(math_sympy, "_sympy", None)
    monkeypatch.setitem(sys.modules, "sympy", None)
    # the worker's setup, not the answer: Misconfigured (never scored by a failure_score)
    with pytest.raises(fabric.Misconfigured, match=r"rl-fabric\[rewards\]"):
        is_equivalent("2\\sqrt{2}", "\\sqrt{8}")
    assert is_equivalent("1/2", "0.5") == (True, "number")  # the fast path needs no sympy


@pytest.mark.parametrize("gt", ["", "   ", "$$", "$ $", "\\(\\)"])
def test_an_empty_ground_truth_is_a_clear_error(gt):
    # every answer silently scored 0 (decided_by: empty): a config error read as a bad policy
    with pytest.raises(ValueError, match=r"ground_truth .* is empty once canonicalised"):
        math_answer("\\boxed{3}", ground_truth=gt)
    runner = FunctionRunner.from_entry("functions.rewards.math:math_answer")
    ok, (code, message, _) = runner.run(encode_payload({"traj": "\\boxed{3}", "ground_truth": gt}))
    assert not ok and code == "UserError" and "is empty once canonicalised" in message
