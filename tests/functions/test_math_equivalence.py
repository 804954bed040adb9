"""The ``math_answer`` reward's equivalence, what is equal and what is not: no false
positives from infinities, huge numbers or rounding, exact integers, common spellings,
units and words next to numbers, functions, Greek letters and subscripts, the identity
test's points; unions, assignments, chains and inequalities. How a number is written
(spaces, thousands separators, percentages, Unicode signs, currency) is in
``test_math_equivalence_notation``."""

from __future__ import annotations

import pytest

from functions.rewards.math import is_equivalent, math_answer
from functions.rewards.math_fast import canonical

# ----------------------------------------------------------------------------- false positives


@pytest.mark.parametrize("gt", ["42", "\\frac{3}{7}", "2\\sqrt{3}", "\\pi/4", "0.5", "50\\%"])
@pytest.mark.parametrize("pred", ["\\infty", "-\\infty", "10^{10^{3}}", "e^{1000}"])
def test_infinity_or_an_overflowing_number_does_not_match_every_number(pred, gt):
    # complex(N(oo)) is inf and inf <= 1e-9 * inf: \boxed{\infty} used to match anything
    res = math_answer(f"so the result is \\boxed{{{pred}}}", ground_truth=gt)
    assert res.score == 0.0, res.info


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [("1e9999\\%", "0.5", False), ("1e4400%", "1/2", False), ("1e9999%", "1e9997", True)],
)
def test_a_huge_percentage_is_compared_not_a_crash(pred, gt, same):
    # its hundredth was written out with str(), over Python's 4300-digit limit: the policy's
    # answer made the reward raise ValueError (a failed call) instead of scoring it
    assert is_equivalent(pred, gt)[0] is same
    assert math_answer(f"\\boxed{{{pred}}}", ground_truth=gt).score == float(same)


@pytest.mark.parametrize("gt", ["x+1", "\\sin(x)", "2n+1", "-7", "\\frac{x^2-1}{x+1}"])
def test_a_huge_finite_number_does_not_match_every_expression(gt):
    # 9^{999} is finite, but complex(N(9^999)) overflowed at the identity test's points
    res = math_answer("\\boxed{9^{999}}", ground_truth=gt)
    assert res.score == 0.0, res.info


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # an irrational answer near a huge exact rational: 20 of 31 digits agreeing is not equal
        ("10^{30}+\\sqrt{2}", "10^{30}+7", False),
        ("18446744073709551616 + \\pi/100", "2^{64}", False),
        # exact expressions that are the rational still are
        ("2^{64}(\\sin^2(1)+\\cos^2(1))", "2^{64}", True),
        ("\\log_2(2^{100})", "100", True),
        ("\\cos(\\pi/7)+\\cos(3\\pi/7)+\\cos(5\\pi/7)", "1/2", True),
    ],
)
def test_an_irrational_answer_does_not_match_a_huge_rational_within_its_relative_tolerance(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal


def test_a_tuple_of_huge_numbers_does_not_match_every_interval():
    assert math_answer("\\boxed{(9^{999}, 9^{999})}", ground_truth="(1,2)").score == 0.0


def test_infinities_equal_only_themselves():
    assert is_equivalent("-\\infty", "\\infty")[0] is False
    assert is_equivalent("\\infty", "-\\infty")[0] is False
    assert is_equivalent("+\\infty", "\\infty")[0] is True
    assert is_equivalent("-\\infty", "-\\infty")[0] is True
    assert is_equivalent("9^{999}", "9^{999}+1")[0] is False  # exact: no tolerance
    assert is_equivalent("e^{1000}", "e^{1000}")[0] is True


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        ("123456789013", "123456789012", False),  # an off-by-one count
        ("1099511627000", "1099511627776", False),  # 2^40 with the last digits wrong
        ("1099511627000", "2^{40}", False),
        ("10^{30}+1", "10^{30}", False),
        ("10000000000000001", "10000000000000000", False),
        ("123456789013.0", "123456789012", False),  # a decimal is good to its last place
        ("\\frac{1}{3}", "\\frac{333333333334}{1000000000000}", False),
        ("0.6666666666", "2/3", True),  # a decimal rounded (or cut) at ten digits still matches
        ("1.5 \\times 10^{3}", "1500", True),
    ],
)
def test_exact_integers_are_compared_exactly(pred, gt, equal):
    # the 1e-9 relative tolerance was applied to two exact values
    assert is_equivalent(pred, gt)[0] is equal


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # a decimal rounded to fewer digits than an exact integer has: the fast path took any
        # value within one unit of the decimal's last place (10^10 here), sympy any within 1e-9
        ("1.844674407 \\times 10^{19}", "18446744073709551616", False),  # 2^64 to 10 digits
        ("1.8446744073709552e19", "18446744073709551616", False),  # the float nearest 2^64
        ("1.8446744073709552e19", "2^{64}", False),
        ("1.844674407 \\times 10^{19}", "2^{64}", False),
        ("1.23456789013e11", "123456789012", False),  # last place 1: off by one
        ("(123456789013.0)", "123456789012", False),  # sympy: any expression with a decimal
        ("123456789013.0 + 0", "123456789012", False),
        ("123456789100.0\\cdot 1", "123456789012", False),  # off by 88
        ("1.763668414 \\times 10^{13}", "\\frac{123456789012345}{7}", False),
        # honest: a decimal that spells the exact value, or one good to its last place against
        # a ground truth that is not an integer (a fraction, an irrational, a decimal)
        ("18446744073709551616.0", "2^{64}", True),
        ("341.3333333333", "\\frac{2^{10}}{3}", True),
        ("(123456789012.0)", "123456789012", True),
        ("123456789012.0 + 0", "123456789012", True),
        ("1.5 \\times 10^{3}", "1500", True),
        ("1.5 \\cdot 10^{3} + 0", "1500", True),
        ("0.5", "\\frac{1}{2}", True),
        ("(0.5)", "\\frac{1}{2}", True),
        ("0.3333333333", "\\frac{1}{3}", True),
        ("0.1428571429", "1/7", True),
        ("3.14159265358979", "\\pi", True),  # 15 digits of an irrational
        ("1.4142135624", "\\sqrt{2}", True),
        ("2^{64}", "1.8446744073709552e19", True),  # the ground truth itself is rounded
        ("18446744073709551616", "1.8446744073709552e19", True),
        ("0.33333333333", "0.3333333333", True),
    ],
)
def test_a_rounded_decimal_does_not_match_an_exact_integer(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # \pm is the list of both signs
        ("\\pm 2", "2, -2", True),
        ("2, -2", "\\pm 2", True),
        ("x = \\pm 2", "\\{-2, 2\\}", True),
        ("\\frac{1 \\pm \\sqrt{5}}{2}", "\\frac{1+\\sqrt{5}}{2}, \\frac{1-\\sqrt{5}}{2}", True),
        ("\\pm 2", "2", False),  # two answers for one
        ("\\pm 2", "-2", False),
        # a control word ends before a digit: \pm5 is \pm 5
        ("\\pm5", "5, -5", True),
        ("x = \\pm5", "\\{-5, 5\\}", True),
        ("\\mp3", "\\pm 3", True),
        ("\\pm5", "5", False),
        # ... in a list, each element on its own; a subscript with a comma names both roots
        ("x_{1,2} = 1 \\pm \\sqrt{2}", "1+\\sqrt{2}, 1-\\sqrt{2}", True),
        ("\\pm 2, \\pm 3", "2,-2,3,-3", True),
        ("\\pm 2, 3", "2,-2,3", True),
        ("\\pm 2, 3", "2,3", False),
        ("(\\pm 1, 2)", "(1,2), (-1,2)", True),  # two points
        ("(\\pm 1, 2)", "(1,2)", False),
        ("\\{\\pm 1, 2\\}", "\\{1,-1,2\\}", True),  # a set: its elements
        ("\\pm 1 \\pm 2, 3", "3", False),  # two signs in one element: left as written
        # a row break with spaces around it (\\ ) was read as a spacing command (\ )
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
        ("\\begin{matrix} 1 & 2 \\\\ 3 & 4 \\end{matrix}", "\\begin{matrix}1&2\\\\3&4\\end{matrix}", True),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}", False),
        # an AMC answer names its choice first
        ("\\textbf{(C) }12", "C", True),
        ("$\\textbf{(B)}\\ 7$", "B", True),
        ("\\textbf{(C) }12", "D", False),
        ("(C) or (D)", "C", False),
        ("(C) 12 (D) 15", "D", False),
        # other spellings
        ("f(x) = 2x+1", "2x+1", True),
        ("f(x) = 2x+1", "2x+2", False),
        ("\\log_2 8", "3", True),
        ("\\log_{10} 1000", "3", True),
        ("\\log_2 8", "4", False),
        ("\\binom{5}{2}", "10", True),
        ("\\binom{5}{2}", "20", False),
        # \dbinom, \tbinom and {n \choose k} are \binom, \lbrace \rbrace are set braces
        # a one-token argument, as TeX reads it: \frac\pi2 is \frac{\pi}{2}
        ("\\frac\\pi2", "\\pi/2", True),
        ("\\dfrac\\pi 4", "\\frac{\\pi}{4}", True),
        ("\\frac{\\pi}3", "\\frac{\\pi}{3}", True),
        ("\\frac a b", "a/b", True),
        ("\\sqrt\\pi", "\\pi^{1/2}", True),
        ("\\frac\\theta2", "\\theta/2", True),
        ("\\frac\\pi2", "\\pi/3", False),
        ("\\dbinom{5}{2}", "10", True),
        ("\\tbinom{5}{2}", "10", True),
        ("{5 \\choose 2}", "10", True),
        ("\\dbinom{5}{2}", "20", False),
        ("\\lbrace 1, 2 \\rbrace", "\\{2, 1\\}", True),
        ("\\left\\lbrace 1, 2 \\right\\rbrace", "1, 2", True),
        ("\\lbrace 1, 2 \\rbrace", "(1, 2)", False),
        ("\\cfrac{1}{2}", "0.5", True),
        ("0.\\overline{3}", "\\frac{1}{3}", True),
        ("1.2\\overline{45}", "\\frac{137}{110}", True),
        ("0.\\overline{3}", "0.33", False),
        ("\\emptyset", "\\varnothing", True),
        ("\\{\\}", "\\emptyset", True),
        ("3\u200b", "3", True),  # a zero-width space is not there
        ("\u200b3", "3", True),
        ("12 m/s", "12", True),
    ],
)
def test_common_spellings_of_an_answer(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # \text{} next to a number was deleted whatever it said
        ("\\text{not } 3", "3", False),
        ("\\text{anything but }3", "3", False),
        ("3 \\text{ (or 5)}", "3", False),
        ("\\text{-}3", "3", False),
        ("\\text{-}3", "-3", True),
        ("5 \\text{ or } 6", "5", False),
        ("5 \\text{ and } 6", "5", False),
        # units are still units, and "and" joins the parts of one answer
        ("5 \\text{ cm}", "5", True),
        ("10 \\text{ m}^2", "10", True),
        ("3 \\text{ miles per hour}", "3", True),
        ("12 \\text{ dogs}", "12", True),
        ("\\text{5 cm}", "5", True),
        ("x=1 \\text{ and } y=2", "(1,2)", True),
        ("5 \\text{ and } 6", "6, 5", True),
        ("\\text{Tuesday}", "Tuesday", True),
    ],
)
def test_text_next_to_a_number_is_dropped_only_when_it_is_a_unit(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # the bare units m s h g l were stripped: variables went with them
        ("\\frac{b}{2}", "\\frac{1}{2} b h", False),
        ("2\\pi r", "2 \\pi r h", False),
        ("2 \\pi r h", "2\\pi r", False),
        ("4", "4 s", False),
        ("4 s", "4", False),
        ("3 m", "3", False),
        ("3 cm", "3 m", False),
        ("x^2 + 1 h", "x^2+1", False),
        ("\\frac{1}{2} m", "\\frac{1}{2}", False),
        ("\\frac{1}{2}", "\\frac{1}{2} m", False),
        ("\\frac{1}{2} b hours", "\\frac{b}{2}", False),  # a unit word after a variable stays
        # ... and an honest formula with them scored 0
        ("\\frac{1}{3} \\pi r^2 h", "\\frac{\\pi r^2 h}{3}", True),
        ("2 \\pi r h", "2\\pi rh", True),
        ("\\frac{1}{2} b h", "\\frac{1}{2}bh", True),
        ("4 s", "4s", True),
        # units after a number still go; one letter only inside \\text{} / \\mathrm{}
        ("3 cm", "3", True),
        ("x = 5 cm", "5", True),
        ("4\\text{ m}", "4", True),
        ("4 \\mathrm{s}", "4", True),
        ("\\text{4 s}", "4", True),
        ("2\\sqrt{3} cm", "\\sqrt{12}", True),
        ("12 m/s", "12", True),
    ],
)
def test_a_bare_unit_word_is_stripped_only_after_a_number_with_no_variable(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        ("on", "no", False),  # sympy read short words as products of symbols: o*n == n*o
        ("act", "cat", False),
        ("god", "dog", False),
        ("sey", "yes", False),
        ("ab", "ba", False),  # two words; a product is written as one: a \cdot b, 2ab
        ("a b", "b", False),  # "a" was an article wherever it stood
        ("the cat", "cat", True),  # a leading one before a word still goes
        ("Yes", "yes", True),
        ("ab", "b \\cdot a", True),
        # but e alone is Euler's number, as everywhere else: it never matched a decimal
        ("2.718281828459", "e", True),
        ("e", "2.718281828459", True),
        ("e", "3", False),
        ("2.72", "e", False),  # a rounded decimal, as against \pi
        ("E", "2.718281828459", False),  # a capital E alone is a choice
        ("2ab", "2ba", True),
    ],
)
def test_short_words_are_text_not_products_of_symbols(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # "\ln 2" was written "log2", the product 2*g*l*o: wrong answers matched, right ones not
        ("4 \\log 2", "\\log 8", False),
        ("2 \\ln 4", "\\ln 8", False),
        ("\\ln 16", "2\\ln 2", False),
        ("2\\sin 30", "\\sin 60", False),
        ("\\sin 60", "\\sin 30", False),
        ("3\\ln 2", "\\ln 8", True),
        ("\\ln{2}", "\\ln 2", True),
        ("\\ln 2", "\\log(2)", True),
        ("\\cos 0", "1", True),
        ("\\ln 2", "0.693147180559945", True),
        ("\\sin 30", "\\sin 30", True),
        ("\\sin 30", "\\frac{1}{2}", False),  # radians, as sympy reads it: no degrees invented
        ("\\ln x + 1", "1 + \\log x", True),
        ("\\log_2 16", "4", True),
        ("2\\log_2 3", "\\log_2 9", True),
    ],
)
def test_a_function_is_applied_to_the_argument_after_a_space(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt", "equal"),
    [
        # Greek letters and subscripts are symbols: any expression with one was unparsable, so
        # every right answer written another way scored 0
        ("2\\theta", "\\theta + \\theta", True),
        ("\\theta/2", "\\frac{\\theta}{2}", True),
        ("\\alpha + \\beta", "\\beta + \\alpha", True),
        ("\\sin\\theta\\cos\\theta", "\\frac{\\sin(2\\theta)}{2}", True),
        ("2\\lambda", "\\lambda \\cdot 2", True),
        ("\\varepsilon^2", "\\epsilon \\cdot \\epsilon", True),
        ("\\eta\\mu", "\\mu \\cdot \\eta", True),
        ("x_1 + x_2", "x_2 + x_1", True),
        ("2a_{12}", "a_{12} \\cdot 2", True),
        ("x_1x_2", "x_2 \\cdot x_1", True),
        ("\\theta_1 + \\theta_2", "\\theta_2 + \\theta_1", True),
        ("\\alpha", "\\beta", False),
        ("2\\theta", "\\theta", False),
        ("\\theta", "\\Theta", False),
        ("\\theta2", "2\\theta", True),  # TeX: a control word ends at the digit
        ("\\eta", "e \\cdot t \\cdot a", False),  # not the word "eta"
        ("x_1 + x_2", "x_1 + x_3", False),
        ("x_{12}", "x_1 \\cdot 2", False),
        ("x_12", "x_{12}", True),  # a run of digits, as in x_10 = 3 (not TeX's x_1 2)
        ("a_n", "a \\cdot n", False),
    ],
)
def test_greek_letters_and_subscripts_are_symbols(pred, gt, equal):
    assert is_equivalent(pred, gt)[0] is equal, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt"),
    [
        # vanishes at the three public points of the identity test: it matched x^2
        ("x^2 + (x-0.5381)(x-1.9127)(x+1.3163)", "x^2"),
        ("x^2 + 10^{6}(x-0.5381)(x-1.9127)(x+1.3163)", "x^2"),
        # finite (0) at one point only, infinite where it differs: that one point decided
        ("x^{\\infty}", "0"),
    ],
)
def test_the_identity_test_cannot_be_passed_at_its_public_points(pred, gt):
    for _ in range(3):
        assert is_equivalent(pred, gt) == (False, "sympy")


def test_honest_identities_hold_at_the_random_points_too():
    for _ in range(5):
        assert is_equivalent("x^2-1", "(x-1)(x+1)") == (True, "sympy")
        assert is_equivalent("\\sin^2 x + \\cos^2 x", "1") == (True, "sympy")
        assert is_equivalent("\\frac{x^2-1}{x-1}", "x+1") == (True, "sympy")
        assert is_equivalent("\\sqrt{x^2}", "|x|") == (True, "sympy")
        assert is_equivalent("|x|", "x") == (False, "sympy")  # a fixed point is negative


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("(3,4)\\cup(1,2)", "(1,2)\\cup(3,4)", True),  # a union's parts are unordered
        ("(3,4]\\cup[1,2)", "[1,2)\\cup(3,4]", True),
        ("(3,4)\\cup[1,2)", "(1,2)\\cup(3,4)", False),  # but each part keeps its brackets
        ("(1,2)\\cup(3,5)", "(1,2)\\cup(3,4)", False),
        ("(1,2)", "(1,2)\\cup(3,4)", False),
    ],
)
def test_unions_match_in_any_order(pred, gt, same):
    assert is_equivalent(pred, gt)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("x=1, y=2", "1, 2", True),  # a solution of a system is the point, variables in order
        ("x = 1, y = 2", "(1, 2)", True),
        ("y=2, x=1", "(1,2)", True),
        ("y=1, x=2", "(1,2)", False),  # the values go with their variables
        ("y=1, x=2", "1, 2", False),  # against assignments a bare list is a point, not a set
        ("x=\\frac{1}{2}, y=0.5", "(0.5, 1/2)", True),
        ("x_{10}=1, x_2=2", "(2, 1)", True),  # x_2 before x_10
        ("a=1, b=2", "x=1, y=2", False),  # different variables
        ("y=2, x=1", "x=1, y=2", True),
        ("x=1, y=2", "x=1, y=3", False),
        ("x=1, y=2, z=3", "(1, 2)", False),
        ("x=1, y=2", "[1, 2]", False),  # an interval is not a point
        ("x=1, x=2", "2, 1", True),  # the solutions of one unknown stay a set
        ("x=1, x=2", "1, 3", False),
        ("x = 5", "5", True),
    ],
)
def test_a_list_of_assignments_is_the_point_it_names(pred, gt, same):
    assert is_equivalent(pred, gt)[0] is same
    if "=" not in gt:  # the other way round too
        assert is_equivalent(gt, pred)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        # a boxed chain or a named value states its last side, as a stated chain already did;
        # each was unparsable, so a right answer written so scored 0
        ("2+1=3", "3", True),
        ("(2+3) \\cdot 2 = 10", "10", True),
        ("\\sqrt{4} = 2", "2", True),
        ("x = 2 \\cdot 3 = 6", "6", True),
        ("AB = 5", "5", True),
        ("\\text{Area} = 12 \\text{ cm}^2", "12", True),
        ("f(2) = 5", "5", True),
        ("P(A) = \\frac{1}{2}", "0.5", True),
        ("m\\angle A = 30^\\circ", "30", True),
        ("S_{10} = 55", "55", True),
        ("AB = 5", "6", False),
        ("2+1=3", "4", False),
        # the ground truth's side too, when the prediction names no value
        ("5", "AB = 5", True),
        # an equation with an expression of a variable on the left stays whole: 2x = 10 says
        # x is 5, and x + y = 5 is not the value 5
        ("2x = 10", "10", False),
        ("2(x+1) = 10", "10", False),
        ("\\pi r^2 = 10", "10", False),
        ("x + y = 5", "5", False),
        ("x^2 + y^2 = 25", "25", False),
        ("5 = x", "5", False),
        ("x = 1, y = 2", "2", False),
        ("x \\le 3 = y", "3", False),
        ("x = 5", "x = 5", True),
    ],
)
def test_a_chain_or_a_named_value_states_its_last_side(pred, gt, same):
    assert is_equivalent(pred, gt)[0] is same, is_equivalent(pred, gt)


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        # an inequality in one variable is the interval it describes: against an interval the
        # right answer scored 0 (a structure mismatch, or unparsable)
        ("x \\le 3", "(-\\infty, 3]", True),
        ("x < 3", "(-\\infty,3)", True),
        ("x > -2", "(-2, \\infty)", True),
        ("x \\geq \\frac{1}{2}", "[0.5, \\infty)", True),
        ("1 \\le x \\le 3", "[1, 3]", True),
        ("1 < x \\leq 3", "(1, 3]", True),
        ("3 \\ge x", "x \\le 3", True),
        ("3 > x > 1", "(1, 3)", True),
        ("x \\ge 2", "[2,\\infty)", True),
        ("t \\ge 2", "x \\ge 2", True),  # the interval, whatever the variable is called
        ("x \\le 3", "(-\\infty, 3)", False),  # closed is not open
        ("x < 3", "(3, \\infty)", False),
        ("1 < x < 3", "[1, 3]", False),
        ("x < 3", "3", False),
        ("x > y", "(y, \\infty)", False),  # a bound in a variable: left as written
        ("1 < x > 0", "(1, \\infty)", False),  # not one interval
        ("x \\le 3", "x \\le 3", True),
    ],
)
def test_an_inequality_in_one_variable_is_an_interval(pred, gt, same):
    assert is_equivalent(pred, gt)[0] is same, (is_equivalent(pred, gt), canonical(pred))
