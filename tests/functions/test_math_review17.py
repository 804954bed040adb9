"""Review 17 of the ``math_answer`` reward: a unit the completion states after its number is
part of its answer, a division by zero is no number, and the false accepts and misses a
review of real model outputs found (boxed answers, intervals, sets, fractions against
decimals, scientific notation, signs, trailing text)."""

from __future__ import annotations

import pytest

from functions.rewards.math import extract_final, is_equivalent, math_answer

# ----------------------------------------------------------------------------- units in prose


@pytest.mark.parametrize(
    "text",
    [
        # the last-number fallback read 5 alone, so the hours were never compared
        "It takes 5 hours.",
        "So the trip lasts 5 hours, door to door.",
        "The speed is 5 miles per hour.",
        # ... and the last math span read $5$ alone
        "It takes $5$ hours.",
        # ... and a box, the unit written after it
        "It takes \\boxed{5} hours.",
        "It takes $\\boxed{5}$ hours.",
        "It takes $\\boxed{5}\\text{ hours}$.",
    ],
)
def test_a_unit_after_the_number_must_agree_with_the_ground_truths(text):
    res = math_answer(text, ground_truth="5 \\text{ minutes}")
    assert res.score == 0.0, res.info


@pytest.mark.parametrize(
    ("text", "gt"),
    [
        ("It takes 5 minutes.", "5 \\text{ minutes}"),
        ("It takes 5 min.", "5 \\text{ minutes}"),
        ("It takes $5$ minutes.", "5 \\text{ minutes}"),
        ("It takes \\boxed{5} minutes.", "5 \\text{ minutes}"),
        ("The speed is 5 miles per hour.", "5 \\text{ mph}"),
        ("The area is 12 square feet.", "12 \\text{ ft}^2"),
        ("The angle is 30 degrees.", "30^\\circ"),
        # a bare number against a unit stays what it was: the number (see the table's units rows)
        ("It takes 5.", "5 \\text{ minutes}"),
        ("\\boxed{5}", "5 \\text{ minutes}"),
        # a unit against a bare ground truth, too
        ("It takes 5 hours.", "5"),
        ("It takes $5$ hours.", "5"),
        ("It takes 3.5 hours", "\\frac{7}{2}"),
        ("The speed is 3 \\times 10^8 m/s.", "3 \\times 10^8"),
        # a count noun is no unit, nor "in" (a word of prose)
        ("There are 5 apples.", "5 \\text{ cm}"),
        ("There are 5 in the box.", "5 \\text{ cm}"),
    ],
)
def test_a_unit_that_agrees_or_is_absent_leaves_the_number(text, gt):
    res = math_answer(text, ground_truth=gt)
    assert res.score == 1.0, res.info


def test_the_extracted_answer_carries_its_unit():
    assert extract_final("It takes 5 hours.") == ("5 hours", "last_number")
    assert extract_final("It takes $5$ hours.") == ("5 hours", "last_math")
    assert extract_final("There are 5 apples.") == ("5", "last_number")  # no unit named


# ----------------------------------------------------------------------------- division by zero


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        # sympy reads each as zoo (complex infinity), and zoo == zoo: 1/0 matched 2/0
        ("1/0", "2/0"),
        ("\\frac{1}{0}", "\\frac{2}{0}"),
        ("\\frac{1}{0}", "1/0"),
        ("\\frac{x}{0}", "\\frac{2x}{0}"),
        # 0/0 and \infty - \infty are nan, which sympy also called equal
        ("0/0", "\\infty - \\infty"),
        # an undefined value is not infinity either
        ("1/0", "\\infty"),
    ],
)
def test_a_division_by_zero_matches_no_other_answer(pred, gt):
    verdict = is_equivalent(pred, gt)
    assert verdict[0] is False, verdict
    assert is_equivalent(gt, pred)[0] is False


def test_a_division_by_zero_matches_its_own_text_only():
    # the fast path's string rule: the ground truth's own spelling is no value judgement
    assert is_equivalent("1/0", "1/0") == (True, "string")


# ----------------------------------------------------------------------------- inverse trigonometry


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # \sin^{-1} x is the inverse function, as every textbook and MATH write it: sympy read the
        # power -1 of \sin, so \sin^{-1} x matched \csc x and \tan^{-1}(1) matched \cot(1) ...
        ("\\sin^{-1} x", "\\csc x", False),
        ("\\tan^{-1}(1)", "\\cot(1)", False),
        ("\\frac{1}{\\sin x}", "\\sin^{-1} x", False),
        # ... and missed the angle it names
        ("\\sin^{-1}(1/2)", "\\frac{\\pi}{6}", True),
        ("\\tan^{-1} 1", "\\frac{\\pi}{4}", True),
        ("\\cos^{-1} 0", "\\frac{\\pi}{2}", True),
        # \arcsin and friends were unparsable
        ("\\arctan 1", "\\frac{\\pi}{4}", True),
        ("\\arcsin \\frac12", "\\frac{\\pi}{6}", True),
        ("\\arccos(0)", "\\frac{\\pi}{2}", True),
        ("\\tan^{-1} 2", "\\arctan 2", True),
        ("\\sin^{-1}(x)", "\\arcsin x", True),
        ("\\arctan(2)", "\\arctan(3)", False),
        # a power that is not -1 stays a power, and the reciprocal is written as one
        ("\\sin^2 x + \\cos^2 x", "1", True),
        ("(\\sin x)^{-1}", "\\csc x", True),
    ],
)
def test_an_inverse_trigonometric_function_is_the_inverse(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


# ----------------------------------------------------------------------------- scientific notation


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # "1.5 x 10^3", as typed: the last-number fallback read its power of ten alone (10^3),
        # which matched 1000 and missed 1500; the fast path already read the whole form
        ("It is about 1.5 x 10^3.", "1500", 1.0),
        ("It is about 1.5 x 10^3.", "1000", 0.0),
        ("We get 6.02 x 10^{23} atoms.", "6.02 \\times 10^{23}", 1.0),
        ("It is 2x10^3.", "2000", 1.0),
    ],
)
def test_a_typed_x_in_scientific_notation_is_one_number(text, gt, score):
    res = math_answer(text, ground_truth=gt)
    assert res.score == score, res.info


# ----------------------------------------------------------------------------- a percent sign after a box


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # the box read 25 alone, which matched only 25: the percent sign outside it is the
        # writer's as much as a unit is
        ("So $\\boxed{25}\\%$ of them.", "0.25", 1.0),
        ("So \\boxed{25}%.", "\\frac{1}{4}", 1.0),
        ("So $\\boxed{25}\\%$ of them.", "25\\%", 1.0),
        ("So $\\boxed{25}\\%$ of them.", "25", 1.0),  # against an integer, X% is X
        ("So $\\boxed{25}\\%$ of them.", "2.5", 0.0),
        ("It is $25$\\%.", "0.25", 1.0),
        ("It is $25$ percent.", "0.25", 1.0),
    ],
)
def test_a_percent_sign_after_the_value_read_is_its(text, gt, score):
    res = math_answer(text, ground_truth=gt)
    assert res.score == score, res.info


# ----------------------------------------------------------------------------- lists with "and"


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # the Oxford comma: \text{ and } is a comma, so "1, 2, \text{ and } 3" had an empty
        # element ("1, 2, , 3") and matched no list
        ("1, 2, \\text{ and } 3", "\\{1,2,3\\}", True),
        ("1, 2, \\text{and } 3", "1, 2, 3", True),
        ("1, 2, \\text{ and } 4", "1, 2, 3", False),
        # ... and a bare "and" between values is one too (it was unparsable)
        ("1, 2, and 3", "1, 2, 3", True),
        ("2 and 3", "2, 3", True),
        ("-2 and \\frac{1}{2}", "\\{\\frac12, -2\\}", True),
        ("2 and 3", "5", False),
        ("2 and 3", "2", False),
        # "or" offers a choice, not a list
        ("1, 2, or 3", "1, 2, 3", False),
    ],
)
def test_and_in_a_list_is_a_comma(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


# ----------------------------------------------------------------------------- unions of inequalities


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # an inequality was read as its interval, but two joined by "or" stayed a list of
        # inequalities (\text{ or } is a comma), which matched no union
        ("x < -2 \\text{ or } x > 3", "(-\\infty,-2)\\cup(3,\\infty)", True),
        ("x \\le -2 \\text{ or } x \\ge 3", "(-\\infty,-2]\\cup[3,\\infty)", True),
        ("x < -2 or x > 3", "(-\\infty,-2)\\cup(3,\\infty)", True),
        ("x < -2 \\text{ or } x > 3", "x > 3 \\text{ or } x < -2", True),
        ("x < -2 \\text{ or } x > 4", "(-\\infty,-2)\\cup(3,\\infty)", False),
        ("x < -2 \\text{ or } x \\ge 3", "(-\\infty,-2)\\cup(3,\\infty)", False),
        # two variables are no union of one variable's values
        ("x < -2 \\text{ or } y > 3", "(-\\infty,-2)\\cup(3,\\infty)", False),
        # "and" is an intersection, not a union
        ("x > -2 \\text{ and } x < 3", "(-\\infty,-2)\\cup(3,\\infty)", False),
    ],
)
def test_inequalities_joined_by_or_are_a_union(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


# ----------------------------------------------------------------------------- a unit's exponent


@pytest.mark.parametrize(
    ("text", "gt", "score"),
    [
        # the exponent of a unit (cm², cm^2, cm$^2$) is no number: the last-number fallback read
        # its 2, which matched 2, and the last math span read "^2", which matched nothing
        ("The area is 12 cm².", "2", 0.0),
        ("The area is 12 cm².", "12", 1.0),
        ("The area is 12 cm^2.", "12", 1.0),
        ("The area is 12 cm².", "12 \\text{ cm}^2", 1.0),
        ("The area is 12 cm².", "12 \\text{ cm}", 0.0),
        ("The area is $12$ cm$^2$.", "12", 1.0),
        ("The area is $12$ cm$^2$.", "12 \\text{ cm}^2", 1.0),
        ("The area is $12$ cm$^2$.", "2", 0.0),
        # nor is a variable's: "x^{-2}" states no -2
        ("The result is proportional to x^{-2}.", "-2", 0.0),
        # a power of a number is still one number
        ("The value is 2^{10}.", "1024", 1.0),
    ],
)
def test_an_exponent_after_a_unit_or_a_variable_is_no_answer(text, gt, score):
    res = math_answer(text, ground_truth=gt)
    assert res.score == score, res.info


# ----------------------------------------------------------------------------- odd roots of negatives


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # an odd root of a negative number is the real one, as answers mean it: sympy's
        # principal root of -8 is 1 + i\sqrt{3}, so \sqrt[3]{-8} missed -2
        ("\\sqrt[3]{-8}", "-2", True),
        ("\\sqrt[3]{-2}", "-\\sqrt[3]{2}", True),
        ("\\sqrt[5]{-32}", "-2", True),
        ("\\sqrt[3]{-8}", "2", False),
        ("\\sqrt[3]{x^3}", "x", True),
        # an even root of a negative number stays imaginary
        ("\\sqrt[4]{-16}", "-2", False),
        ("\\sqrt[3]{8}", "2", True),
    ],
)
def test_an_odd_root_of_a_negative_number_is_real(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)
