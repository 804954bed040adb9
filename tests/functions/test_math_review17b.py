"""Review 17, second part, of the ``math_answer`` reward: answers in words against their
symbols, floor, ceiling, gcd, lcm, max, min and ``C(n, k)``, unions of touching intervals, and
a choice letter boxed in lowercase."""

from __future__ import annotations

import pytest

from functions.rewards.math import is_equivalent, math_answer

# ----------------------------------------------------------------------------- words as symbols


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        # the words stayed text, which matched no interval, set or symbol
        ("all real numbers", "(-\\infty, \\infty)"),
        ("All real numbers", "\\mathbb{R}"),
        ("all reals", "(-\\infty, \\infty)"),
        ("\\text{all real numbers}", "\\mathbb{R}"),
        ("(-\\infty, \\infty)", "all real numbers"),
        ("no solution", "\\emptyset"),
        ("No solutions", "\\varnothing"),
        ("no real solutions", "\\{\\}"),
        ("\\text{no solution}", "\\emptyset"),
        ("\\emptyset", "\\text{No solution}"),
        ("infinity", "\\infty"),
        ("\\infty", "Infinity"),
        ("negative infinity", "-\\infty"),
        # ... and the words for "no value" were three texts that never matched each other
        ("undefined", "DNE"),
        ("does not exist", "undefined"),
        ("DNE", "does not exist"),
        ("\\text{DNE}", "\\text{undefined}"),
    ],
)
def test_an_answer_in_words_matches_its_symbol(pred, gt):
    assert is_equivalent(pred, gt)[0] is True


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        ("all real numbers", "[0, \\infty)"),
        ("all real numbers", "\\emptyset"),
        ("no solution", "(-\\infty, \\infty)"),
        ("no solution", "0"),
        ("infinity", "-\\infty"),
        ("negative infinity", "\\infty"),
        ("undefined", "0"),
        ("undefined", "\\infty"),
        ("does not exist", "\\emptyset"),
        # a phrase is read whole: more words say something else
        ("all real numbers except 2", "(-\\infty, \\infty)"),
        ("all positive real numbers", "(-\\infty, \\infty)"),
    ],
)
def test_words_match_only_what_they_say(pred, gt):
    assert is_equivalent(pred, gt)[0] is False


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        ("The answer is all real numbers.", "(-\\infty, \\infty)"),
        ("So the final answer is: no solution", "\\emptyset"),
        ("\\boxed{\\text{DNE}}", "\\text{undefined}"),
    ],
)
def test_a_completion_in_words_scores(text, gt):
    assert math_answer(text, ground_truth=gt).score == 1.0


# ----------------------------------------------------------------------------- floor, gcd, C(n, k)


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        # each was unparsable, so a right answer in that form scored 0
        ("\\lfloor 3.7 \\rfloor", "3"),
        ("\\left\\lfloor \\frac{7}{2} \\right\\rfloor", "3"),
        ("\\lfloor -3.5 \\rfloor", "-4"),
        ("\\lceil 3.2 \\rceil", "4"),
        ("\u230a 3.7 \u230b", "3"),
        ("\\gcd(12, 18)", "6"),
        ("\\operatorname{lcm}(4, 6)", "12"),
        ("\\text{lcm}(4,6)", "12"),
        ("\\operatorname{gcd}(12, 18)", "6"),
        ("\\max(3, 5)", "5"),
        ("\\min(3, 5)", "3"),
        ("\\max\\{3, 5\\}", "5"),
        ("\\binom 5 2", "10"),
        ("\\dbinom52", "10"),
        ("C(5,2)", "10"),
        ("C(5, 2)", "10"),
        ("2C(5, 2)", "20"),
        ("C(n, 2)", "\\frac{n(n-1)}{2}"),
        ("\\lfloor x \\rfloor + 1", "\\lfloor x + 1 \\rfloor"),
    ],
)
def test_floor_gcd_max_and_binomials_are_read(pred, gt):
    assert is_equivalent(pred, gt)[0] is True


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        ("\\lfloor 3.7 \\rfloor", "4"),
        ("\\lceil 3.2 \\rceil", "3"),
        ("\\gcd(12, 18)", "36"),
        ("\\operatorname{lcm}(4, 6)", "24"),
        ("\\max(3, 5)", "3"),
        ("\\min(3, 5)", "5"),
        ("C(5,2)", "20"),
        ("\\lfloor x \\rfloor", "x"),
        # a comma outside these functions still lists nothing to sympy: 3(1, 2) is no number
        ("3(1, 2)", "9"),
        # C(5, 2) is not the point (5, 2)
        ("C(5,2)", "(5, 2)"),
    ],
)
def test_floor_gcd_max_and_binomials_are_their_values_only(pred, gt):
    assert is_equivalent(pred, gt)[0] is False


# ----------------------------------------------------------------------------- unions


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        # a union was compared part by part, so the same set written in fewer parts missed
        ("[0,1] \\cup [1,2]", "[0,2]"),
        ("[0, 2]", "[0, 1] \\cup [1, 2]"),
        ("[0, 1) \\cup [1, 2]", "[0, 2]"),
        ("(0, 1] \\cup (1, 2)", "(0, 2)"),
        ("(0, 3) \\cup (1, 2)", "(0, 3)"),
        ("(-\\infty, 1] \\cup [0, \\infty)", "(-\\infty, \\infty)"),
        ("(-\\infty, 1] \\cup [0, \\infty)", "\\mathbb{R}"),
        ("(-\\infty, 0) \\cup [0, 1] \\cup (5, 6)", "(-\\infty, 1] \\cup (5, 6)"),
        ("[\\frac{1}{2}, 1] \\cup [1, 2]", "[0.5, 2]"),
        ("x \\in [0, 1] \\cup [1, 2]", "[0, 2]"),
    ],
)
def test_touching_or_overlapping_intervals_are_their_union(pred, gt):
    assert is_equivalent(pred, gt)[0] is True


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        # a point both leave out is a gap
        ("(0, 1) \\cup (1, 2)", "(0, 2)"),
        ("[0, 1) \\cup (1, 2]", "[0, 2]"),
        ("[0, 1] \\cup [2, 3]", "[0, 3]"),
        ("[0, 1] \\cup [1, 2]", "[0, 2)"),
        ("[0, 1] \\cup [1, 2]", "[0, 1] \\cup [2, 3]"),
    ],
)
def test_a_gap_keeps_a_union_apart(pred, gt):
    assert is_equivalent(pred, gt)[0] is False


# ----------------------------------------------------------------------------- a choice in lowercase


@pytest.mark.parametrize(
    "text",
    [
        # a lone letter keeps its case, so a choice boxed in lowercase missed its capital
        "The options are (A) 1, (B) 2, (C) 3, (D) 4. So \\boxed{d}",
        "Option d is the only one that works: \\boxed{d}.",
        "<think>Check the choices: (a) fails, (b) fails, (c) fails.</think>\n\\boxed{d}",
        "A) 1\nB) 2\nC) 3\nD) 4\n\nThe answer is \\boxed{\\text{d}}",
        # a choice label in parentheses is a choice however it is written
        "\\boxed{(d)}",
        "The answer is (d).",
    ],
)
def test_a_choice_in_lowercase_is_its_capital(text):
    res = math_answer(text, ground_truth="D")
    assert res.score == 1.0, res.info
    assert math_answer(text, ground_truth="(D)").score == 1.0
    assert math_answer(text, ground_truth="C").score == 0.0


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        # no choice in sight: a lone letter is a variable or a point, and keeps its case
        ("\\boxed{d}", "D"),
        ("So the distance is \\boxed{d}.", "D"),
        ("The options are (A) 1, (B) 2, (C) 3. \\boxed{x}", "X"),
        # only a single capital A-E is a choice
        ("The options are (a), (b), (f). \\boxed{f}", "F"),
        ("The options are (a) and (b). \\boxed{a + b}", "A + B"),
    ],
)
def test_a_lowercase_letter_without_a_choice_keeps_its_case(text, gt):
    assert math_answer(text, ground_truth=gt).score == 0.0


def test_a_lowercase_choice_label_against_a_choice():
    assert is_equivalent("(d)", "D") == (True, "choice")
    assert is_equivalent("\\textbf{(c) }12", "C") == (True, "choice")
    assert is_equivalent("(d)", "C") == (False, "choice")
    assert is_equivalent("(c) or (d)", "C")[0] is False
    # the letter alone, as before: the reward's context decides, not the two answers
    assert is_equivalent("d", "D")[0] is False
    assert is_equivalent("x", "X")[0] is False
