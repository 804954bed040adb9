"""The ``math_answer`` reward's equivalence across the ways a number is written: spaces that
do or do not separate numbers, thousands separators (in an argument, an arithmetic expression,
a percentage), large percentages, the Unicode minus, operator signs and math symbols, and
currency signs."""

from __future__ import annotations

import pytest

from functions.rewards.math import is_equivalent


@pytest.mark.parametrize(
    ("pred", "gt"),
    [("1 2", "12"), ("5 \\text{ or } 6", "56"), ("5 \\text{ or } 6", "30"), ("2^3 4", "2^34"), ("2 3", "6")],
)
def test_separate_numbers_are_not_glued_together(pred, gt):
    # _fast_scalar's string rule dropped every space ("1 2" == "12"), and sympy read two
    # numbers side by side as a product ("5 6" == 30)
    assert is_equivalent(pred, gt)[0] is False


@pytest.mark.parametrize(
    ("pred", "gt"),
    [("1 000 000", "1000000"), ("x + 1", "x+1"), ("2 \\sqrt{3}", "\\sqrt{12}"), ("2 x", "x+x")],
)
def test_spaces_that_do_not_separate_numbers_still_do_not_matter(pred, gt):
    assert is_equivalent(pred, gt)[0] is True


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("\\frac{1,000}{2}", "500", True),
        ("\\dfrac{3,000}{4}", "750", True),
        ("\\frac{1}{2,000}", "0.0005", True),  # the denominator too
        ("\\frac{1,000,000}{1,000}", "1000", True),
        ("\\sqrt{1,000,000}", "1000", True),
        ("\\frac{1,000 + 500}{3}", "500", True),  # a comma in an argument lists nothing
        ("\\frac{1,000}{3}", "500", False),
        ("\\frac{1,000}{2}", "0.5", False),  # not 1.000: a group of three digits is thousands
        ("\\frac{1,0000}{2}", "5000", False),  # not groups of three: no separator
        ("\\{1,000\\}", "1000", False),  # a set's comma lists its elements: {1, 0}
        ("(1,000)", "1000", False),  # and so does a point's
    ],
)
def test_thousands_separators_inside_an_argument_are_not_commas(pred, gt, same):
    # the separators were removed only from a number written alone: \\frac{1,000}{2} reached
    # sympy with its comma and was unparsable, so not 500
    assert is_equivalent(pred, gt)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("2 \\times 1,000", "2000", True),
        ("1,000 \\times 2", "2000", True),
        ("3 \\cdot 1,250", "3750", True),
        ("1,000 + 500", "1500", True),
        ("2,000 - 1", "1999", True),
        ("1,000,000 / 1,000", "1000", True),
        ("2 \\times 1,000.5", "2001", True),
        ("3 \\times 1,000 = 3,000", "3000", True),
        ("2 \\times 1,000", "2", False),
        ("2 \\times 1,000", "2000.5", False),
        ("2 \\times 1,0000", "20000", False),  # not groups of three: no separator
        ("2 \\times 1,000, 3", "2000", False),  # another comma lists: a list of two
        ("\\{2 \\times 1,000\\}", "2000", False),  # a set's comma lists its elements
        ("(2, 1,000 + 5)", "1007", False),  # and a point's
    ],
)
def test_thousands_separators_in_an_arithmetic_expression_are_not_commas(pred, gt, same):
    # the separators were removed only from a number alone or in an argument of \\frac, \\sqrt
    # or \\binom: 2 \\times 1,000 was the list 2 \\times 1, 000, so not 2000
    assert is_equivalent(pred, gt)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt"),
    [("1,000\\%", "1000\\%"), ("1,250%", "12.5"), ("-1,000 percent", "-10.0"), ("1 000\\%", "1000%")],
)
def test_a_percentage_written_with_thousands_separators_is_its_number(pred, gt):
    # the separators were removed only from a number with nothing after it: "1,000%" stayed a
    # comma list, the set {1, 000%}, and matched no percentage at all
    assert is_equivalent(pred, gt)[0] is True


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        # against an integer a percentage is its number (the question asked for the percent):
        # 200% is 200, not 2, as 5000% is not 50 (a table row); 1,000% is 1000, not 10
        ("200%", "2", False),
        ("1,000%", "10", False),
        ("1,000\\%", "1000", True),
        # against a decimal or fraction above 1 either reading (150% is 1.5): 200% is 2.0
        ("200%", "2.0", True),
        ("1,000%", "10.0", True),
        ("1,000%", "\\frac{20}{2}", True),
    ],
)
def test_a_large_percentage_follows_the_percentage_rule(pred, gt, same):
    assert is_equivalent(pred, gt)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("\u22125", "-5", True),  # the Unicode minus sign
        ("\u2212\\frac{1}{2}", "-0.5", True),
        ("3\u22125", "-2", True),
        ("\uff0d7", "-7", True),  # full-width
        ("3\u20135", "-2", False),  # an en dash is a range, not a minus
        ("\u22125", "5", False),
    ],
)
def test_the_unicode_minus_sign_is_a_minus(pred, gt, same):
    assert is_equivalent(pred, gt)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("1\u00d710^3", "1000", True),  # the multiplication sign
        ("1.5 \u00d7 10^{-3}", "0.0015", True),
        ("6\u00d77", "42", True),
        ("2\u22c53", "6", True),  # the dot operator
        ("2\u22c53", "5", False),
        ("2\u00b73", "6", True),  # the middle dot, as a product is usually typed
        ("2\u00b73", "5", False),
        ("2\u00b73\u00b77", "42", True),
        ("x\u00b7y", "y \\cdot x", True),
        ("3\u00b714", "3.14", False),  # a product, not the British decimal point
        ("6\u00f72", "3", True),  # the division sign
        ("6\u00d77", "67", False),
    ],
)
def test_the_unicode_operator_signs_are_their_operators(pred, gt, same):
    # sympy could not parse them: 1\u00d710^3 was "unparsable", so not 1000
    assert is_equivalent(pred, gt)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("2\u03c0", "2\\pi", True),  # pi
        ("\u03c0r^2", "\\pi r^2", True),
        ("\u221a2", "\\sqrt{2}", True),  # the square root sign
        ("2\u221a2", "\\sqrt{8}", True),
        ("\u221a(x+1)", "\\sqrt{x+1}", True),  # the root of what its parentheses hold
        ("\u221a(x+1)", "\\sqrt{x}+1", False),
        ("\u221a(x)+1", "\\sqrt{x}+1", True),
        ("\u221a(2)", "\\sqrt{2}", True),
        ("2\u221a(3)", "\\sqrt{12}", True),
        ("\u221a((x+1)(x-1))", "\\sqrt{x^2-1}", True),
        ("\u221a(\u221a(16))", "2", True),
        ("\u221a(x+1", "\\sqrt{x+1}", False),  # never closed: no root of anything
        ("\u221a2", "2", False),
        ("(3, \u221e)", "x > 3", True),  # infinity
        ("\u2212\u221e", "-\\infty", True),
        ("5\u00b2", "25", True),  # superscript digits
        ("10\u2076\u2074", "10^{64}", True),
        ("2\u207b\u00b9", "0.5", True),
        ("x\u00b2", "x^2", True),
        ("\u00bd", "0.5", True),  # vulgar fractions
        ("3\u00bd", "3.5", True),
        ("\u2154", "\\frac{2}{3}", True),
        ("3\u00bd", "31/2", False),
        ("10\u2076\u2074", "10^{6}", False),
        ("5 cm\u00b2", "5", True),  # a unit's square stays a unit
    ],
)
def test_unicode_math_symbols_are_their_latex(pred, gt, same):
    # sympy could not parse them, and pi alone was a symbol named so: 2\u03c0 was not 2\\pi
    assert is_equivalent(pred, gt)[0] is same


@pytest.mark.parametrize(
    ("pred", "gt", "same"),
    [
        ("\u20ac5", "5", True),
        ("5\u20ac", "5", True),
        ("\u00a31,200", "1200", True),
        ("\u00a5300", "300", True),
        ("-\u20ac5", "5", False),
    ],
)
def test_a_currency_sign_is_dropped_as_the_dollar_is(pred, gt, same):
    # "\\$5" was 5, but the euro, pound and yen signs were left in: unparsable, so not 5
    assert is_equivalent(pred, gt)[0] is same
