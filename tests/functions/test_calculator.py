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
