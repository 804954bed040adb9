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
