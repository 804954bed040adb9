"""The calculator tool's refusals (its values and the rest are in tests/envpool/test_envs.py)."""

from __future__ import annotations

import pytest

from functions.tools.calculator import calculator


@pytest.mark.parametrize("expression", ["(10 ** 3000) ** 2", "(-(10 ** 40)) ** 3000", "3 ** (2 ** 5000)"])
def test_a_refused_power_does_not_print_its_operands_in_full(expression):
    # the message went back to the policy with both operands in full: up to ~6,000 digits of
    # context for one refusal of a 500-character expression
    with pytest.raises(ValueError, match="too large") as e:
        calculator(expression)
    assert len(str(e.value)) < 200, str(e.value)


def test_a_refused_power_says_how_long_its_operand_is():
    with pytest.raises(ValueError, match=r"^\(a 3,001-digit number\) \*\* 2 is too large"):
        calculator("(10 ** 3000) ** 2")


def test_a_refused_power_of_short_operands_still_names_them():
    with pytest.raises(ValueError, match=r"9 \*\* 387420489 is too large"):
        calculator("9**9**9")


@pytest.mark.parametrize(
    "expression",
    [
        "1/3**-1000",  # 3 ** 1000: its divisor underflowed to 0.0
        "1 / (2 ** -2000)",
        "1 / -(3 ** -1000)",  # a sign does not lose it
        "1 / (1e-200 * 1e-200)",
        "1 / (0.5 ** 2000)",
        "1 / (2 ** -2000 / 7 + 0)",
        "5 % 3 ** -1000",
        "7 // 2 ** -2000",
        "(2 ** -2000) ** -1",
        "1 / 2 ** -(10 ** 3000)",
        # scaled back up it may well be in range (7.6e-178), and 0 is no answer
        "3 ** -1000 * 1e300",
        "3 ** -1000 / 1e-300",
        "(2 ** -2000) ** 0.5",
    ],
)
def test_dividing_by_a_number_that_underflowed_is_out_of_range_not_a_division_by_zero(expression):
    # the divisor is no zero: a number too small for a float, which reads 0.0; the policy was
    # told "division by zero" of 1 / 3 ** -1000 (which is 3 ** 1000), and 0 of 3 ** -1000 * 1e300
    with pytest.raises(ValueError, match=r"^the result is out of range: .* too small for a float"):
        calculator(expression)


@pytest.mark.parametrize(
    "expression",
    ["1 / 0", "1 / (2 ** -2000 * 0)", "1 / (0.5 - 0.5)", "1 / -(1 - 1.0)", "5 % (3 ** -1000 * 0.0)"],
)
def test_a_divisor_that_is_zero_is_still_a_division_by_zero(expression):
    with pytest.raises(ValueError, match=r"^division by zero$"):
        calculator(expression)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1e308 * 10", r"^the result is too large for a float \(over about 1\.8e308\)$"),
        ("2.0 ** 5000", r"^the result is too large for a float \(over about 1\.8e308\)$"),
        ("0.5 ** -(10 ** 3000)", r"^the result is too large for a float \(over about 1\.8e308\)$"),
        ("10 ** 400 * 1.0", r"^the result is too large for a float \(over about 1\.8e308\)$"),
        (
            "10 ** 400 / 3",
            r"^the result is too large for a float .*; use // for a quotient in whole numbers$",
        ),
        ("9 ** 9 ** 9", r"^9 \*\* 387420489 is too large \(over 10,000 bits\)$"),
        # an exponent too large for a float to size the power with: the refusal named a float
        # for a power of whole numbers
        ("2 ** 10 ** 400", r"^2 \*\* \(a 401-digit number\) is too large \(over 10,000 bits\)$"),
        ("-3 ** 10 ** 400", r"^3 \*\* \(a 401-digit number\) is too large \(over 10,000 bits\)$"),
    ],
)
def test_a_result_too_large_says_for_what(expression, message):
    # "the result is too large" did not say that a float tops out at 1.8e308, nor that an
    # integer quotient stays exact with //
    with pytest.raises(ValueError, match=message):
        calculator(expression)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 / 1e-300", "1e+300"),
        ("1e-320 * 1", "9.99988867182683e-321"),  # a subnormal: a float holds it
        ("3 ** -1000", "0"),  # a tiny result reads 0, as a float gives it
        ("3 ** -1000 * 0.5", "0"),
        ("3 ** -1000 / 7", "0"),
        ("(2 ** -2000) ** 2", "0"),
        ("3 ** -1000 + 1", "1"),
        ("2 ** (3 ** -1000)", "1"),
        ("-(2 ** -2000) // 7", "-1"),  # the floor of a tiny negative quotient
        ("-(2 ** -2000) % 7", "7"),
        ("10 ** 400 // 3", str(10**400 // 3)),
    ],
)
def test_what_a_float_can_say_of_a_tiny_number_is_answered(expression, value):
    assert calculator(expression) == value


# what an LLM policy writes: the tool's whole call goes through the worker's runner, so each
# bad input must come back as an error the policy reads (or a value), never a crash


def _call(raw: bytes) -> tuple[bool, object]:
    from fabric.runner import FunctionRunner

    return FunctionRunner.from_entry("functions.tools.calculator:calculator").run(raw)


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        # the symbols a model types for minus, times and divide, and full-width forms: one
        # meaning each, refused as "invalid character (U+2212)"
        ("5 \u2212 3", "2"),
        ("2 \u00d7 3", "6"),
        ("7 \u00f7 2", "3.5"),
        ("\uff12\uff0b\uff13", "5"),
        ("2\u00a0+\u20093", "5"),  # no-break and thin spaces
    ],
)
def test_unicode_operators_mean_what_they_show(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        # the policy's whole JSON arguments inside the string: "Dict is not allowed" told it nothing
        (b'{"expression": "{\\"expression\\": \\"2 + 3\\"}"}', "pass the expression itself"),
        # a superscript is a power: "invalid character" did not say how to write one
        ('{"expression": "3\u00b2"}'.encode(), "write a power with **"),
        (b'{"expression": 5}', "valid string"),
        (b'{"expression": ""}', "empty expression"),
        (b'{"expression": "\\u0000"}', "null bytes"),
    ],
)
def test_bad_inputs_are_errors_the_policy_reads(raw, message):
    ok, out = _call(raw)
    assert not ok and message in out[1], out
