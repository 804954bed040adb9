"""``calculator``: safe arithmetic for tool-using policies.

The expression is parsed with ``ast`` and only numbers, ``+ - * / // % **``, unary signs
and parentheses are evaluated: no names, calls, attributes or subscripts, so nothing the
policy writes can reach Python. Sizes are bounded before the work is done (``9**9**9`` is
refused at once instead of computing a number with 370 million digits). The signs a model
types for them (the minus sign, times, divide, full-width forms, no-break spaces) read as the
ASCII operators; a superscript, a percent sign, a factorial, a number before ``(`` (``2(3)``),
a thousands separator, an ``=``, a currency sign or the tool's JSON arguments passed as the
expression, is refused saying what to write instead.

The result is printed as text: an integer in full, a float to 15 significant digits
(``0.1 + 0.2`` is ``0.3``, ``0.5 + 123456789012`` is ``123456789012.5``), a whole float below
2**53 as an integer (``6 / 3`` is ``2``). A float result over about 1.8e308 is refused as too
large; one under about 5e-324 reads 0, but an expression that divides by it or scales it back
up (``1 / 3 ** -1000``) is refused as out of range, never answered "division by zero" or 0.
An int past a float's range with a float, or to a float power, is worked out without
converting it first, so only a result too large for a float is refused (``10 ** 400 * 1e-300``
is ``1e+100``, ``(10 ** 400) ** 0.5`` is ``1e+200``, ``(10 ** 400) ** -0.5`` is ``1e-200``).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import fabric
from functions.tools._args import holds_json_arguments

#: Longest expression accepted, in characters.
MAX_EXPRESSION_CHARS = 500
#: Largest integer (in bits, about 3,000 decimal digits) an intermediate result may have.
MAX_INT_BITS = 10_000

_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# one meaning each, as a model types them: the minus sign, times and divide, the operator
# forms of * and /, full-width ASCII (U+FF01-FF5E), and the spaces Python does not take
_UNICODE = str.maketrans(
    {"\u2212": "-", "\u00d7": "*", "\u00f7": "/", "\u2217": "*", "\u22c5": "*", "\u2215": "/"}
    | {chr(c): chr(c - 0xFEE0) for c in range(0xFF01, 0xFF5F)}
    | dict.fromkeys(["\u00a0", *map(chr, range(0x2000, 0x200B)), "\u202f", "\u205f", "\u3000"], " ")
)
_SUPERSCRIPTS = frozenset("\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")
# what a model types that Python cannot parse, read only of a syntax error: a percent sign
# after its number (not a remainder: one of those parses), a factorial, an equation, money
_SYNTAX_HINTS = (
    (
        re.compile(r"%\s*(?:$|[)*/%+]|[^\W\d_])"),
        "; '%' is the remainder, not a percentage: divide by 100 (15% of 80 is 15 / 100 * 80)",
    ),
    (re.compile(r"!(?!=)"), "; '!' (factorial) is not supported: multiply it out (5! is 1 * 2 * 3 * 4 * 5)"),
    (
        re.compile(r"(?<![=!<>])=(?!=)"),
        "; write only the expression, no '=' (2 + 3, not 2 + 3 = or x = 2 + 3)",
    ),
    (re.compile("[$\u00a2-\u00a5\u20a0-\u20c0]"), "; leave out currency signs and units ($5 + 3 is 5 + 3)"),
)
_HINTS: dict[type[ast.AST], str] = {
    ast.BitXor: "'^' is not a power; use '**'",
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attributes are not allowed",
    # 1,234 is the tuple (1, 234) to Python
    ast.Tuple: "',' is not allowed: write numbers without thousands separators (1234, not 1,234)",
}

#: The OpenAI-style tool schema a policy is shown (envpool's math environment offers it).
OPENAI_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses. "
            "Returns the result as text."
        ),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example: (17 + 25) * 3 / 4"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}


TOO_LARGE_FOR_A_FLOAT = "the result is too large for a float (over about 1.8e308)"


class _Tiny(float):
    """A zero that stands for a nonzero number too small for a float (``2 ** -2000``,
    ``1e-200 * 1e-200``: under about 5e-324 it reads 0.0, its sign kept). As the result it
    prints 0, as a float gives it; but the operations that would read it as 0 are refused as
    out of range: a division by it (``1 / 3 ** -1000`` is ``3 ** 1000``, and was answered
    "division by zero") or a product that scales it up (``3 ** -1000 * 1e300`` is 7.6e-178,
    not 0). Arithmetic on it gives a plain float: ``_with_tiny`` and ``_underflowed`` say
    which results are tiny again."""


def _negative(x: float) -> bool:
    return math.copysign(1.0, x) < 0  # (a tiny keeps its sign in its zero's: -0.0)


def _out_of_range(how: str) -> ValueError:
    return ValueError(
        f"the result is out of range: it {how} a number too small for a float to tell from 0 "
        "(it underflowed, under about 5e-324); write it without so small an intermediate "
        "result (1 / 3 ** -1000 is 3 ** 1000)"
    )


def _with_tiny(op: ast.operator, left: Any, right: Any) -> Any:
    """``left op right``, one of them (or both) a ``_Tiny``: the value where a float can say
    it (a sum, a product or power that keeps it tiny, a floor or remainder, whose sign is
    what counts), else an out-of-range error; never what reading the tiny as 0 gives."""
    if isinstance(op, ast.Add | ast.Sub):
        # x + tiny is x to a float's precision; a tiny sum (tiny + 0, tiny - tiny) stays one
        value = _BINOPS[type(op)](left, right)
        return _Tiny(value) if value == 0 else value
    if isinstance(right, _Tiny) and not isinstance(op, ast.Mult | ast.Pow):
        raise _out_of_range("divides by")
    if isinstance(op, ast.Pow):
        if not isinstance(left, _Tiny):  # x ** tiny: x ** 0 to a float's precision
            if left <= 0:
                raise _out_of_range("raises 0 or a negative number to the power of")
            return 1.0
        if right == 0 and not isinstance(right, _Tiny):
            return 1.0
        if isinstance(right, _Tiny) or right < 1:
            raise _out_of_range("takes a power under 1 of")
        if _negative(left) and isinstance(right, float) and not right.is_integer():
            raise ValueError("the result is not a real number")
        odd = right % 2 == 1  # (not float(right): an int exponent may be too large for one)
        return _Tiny(-0.0 if _negative(left) and odd else 0.0)  # |tiny| ** y <= |tiny|
    if isinstance(op, ast.Mult):
        other = right if isinstance(left, _Tiny) else left
        if other == 0 and not isinstance(other, _Tiny):
            return left * right  # 0, exactly
        if abs(other) > 1:
            raise _out_of_range("scales up")
        return _Tiny(left * right)
    if right == 0:
        raise ZeroDivisionError
    # signs, not left / right: an int divisor may be too large for a float
    same_sign = _negative(left) == (right < 0)
    if isinstance(op, ast.Div):
        if abs(right) < 1:
            raise _out_of_range("scales up")
        return _Tiny(0.0 if same_sign else -0.0)
    if isinstance(op, ast.FloorDiv):  # the floor of a tiny quotient: 0 or -1
        return 0.0 if same_sign else -1.0
    return _Tiny(left) if same_sign else float(right)  # a remainder: tiny, or right + tiny


def _underflowed(op: ast.operator, left: Any, right: Any, value: Any) -> bool:
    """Whether ``value``, ``left op right`` of numbers a float holds, is 0 standing for a
    number too small for one: a product, quotient or power of nonzero numbers, none of
    which is ever 0 exactly (``1e-200 * 1e-200``, ``3 ** -1000``, ``1 / 10 ** 400``)."""
    return (
        isinstance(value, float)
        and value == 0
        and isinstance(op, ast.Mult | ast.Div | ast.Pow)
        and left != 0
        and right != 0
    )


def _check_size(value: Any) -> Any:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(TOO_LARGE_FOR_A_FLOAT)
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"the result is too large (over {MAX_INT_BITS:,} bits)")
    return value


def _brief(n: int) -> str:
    """``n`` for a message the policy reads: in full when short, else its size (an operand may
    have 3,000 digits)."""
    text = str(n)
    return text if len(text) <= 20 else f"({'-' if n < 0 else ''}a {len(text.lstrip('-')):,}-digit number)"


def _power(base: Any, exp: Any) -> Any:
    # bound the result before computing it: log2|base| * exp is its size in bits
    if isinstance(base, int) and isinstance(exp, int) and exp > 0 and abs(base) > 1:
        # (an exponent past MAX_INT_BITS is too large already: |base| >= 2, and log2 * 10 ** 400
        # would overflow a float, refused as a float's result)
        if exp > MAX_INT_BITS or math.log2(abs(base)) * exp > MAX_INT_BITS:
            raise ValueError(f"{_brief(base)} ** {_brief(exp)} is too large (over {MAX_INT_BITS:,} bits)")
    try:
        return base**exp
    except OverflowError:
        # an int a float cannot hold (from 2 ** 1023 one may round up past it), not a float
        # power's result that overflowed (10 ** 400.0): that one goes on below
        if isinstance(base, int) and isinstance(exp, float) and base.bit_length() >= 1024:
            return _big_int_power(base, exp)
        # a float power whose exponent does not fit a float (2 ** -(10**3000)): the result
        # is huge or tiny by whether |base| > 1 and the exponent's sign agree
        if base == 0:
            raise ZeroDivisionError from None  # 0 ** -(10**3000)
        if abs(base) == 1:
            return float(base) ** (abs(exp) % 2)
        if (abs(base) > 1) == (exp > 0):
            raise
        # tiny: what a float power that underflows gives (2 ** -2000), its sign kept
        return -0.0 if base < 0 and isinstance(exp, int) and exp % 2 else 0.0


def _big_int_power(base: int, exp: float) -> float:
    """``base ** exp`` for an int past a float's range (which Python converts first, and
    overflows): ``|base|`` as ``m * 2 ** s`` with ``m`` a float, so the power is
    ``m ** exp * 2 ** (s * exp)``, ``s * exp`` split exactly into its whole and its fraction.
    Huge or tiny by its size, not by the exponent's sign alone (``** 0.0`` is 1)."""
    if exp == 0:
        return 1.0
    odd = exp.is_integer() and int(exp) % 2 == 1
    if base < 0 and not exp.is_integer():
        raise ValueError("the result is not a real number")
    shift = base.bit_length() - 64
    m = float(abs(base) >> shift)  # (its top 64 bits, rounded to a float's 53: a float's error)
    if math.log2(m) * exp + shift * exp > 1100:  # past 2 ** 1024: the message of a float's overflow
        raise OverflowError
    scaled = Fraction(shift) * Fraction(exp)  # exactly: s * exp may be thousands
    whole = math.floor(scaled)
    value = math.ldexp(m**exp * 2.0 ** float(scaled - whole), whole)  # OverflowError past 2 ** 1024
    return -value if base < 0 and odd else value


def _int_and_float(left: Any, right: Any) -> bool:
    return {type(left), type(right)} == {int, float}


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ValueError(f"only numbers are allowed, got {node.value!r}")
        if isinstance(node.value, float) and not math.isfinite(node.value):  # 1e999 parses as inf
            raise ValueError("a number is too large for a float (over about 1.8e308)")
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        operand = _eval(node.operand)
        value = _UNARY[type(node.op)](operand)
        return _Tiny(value) if isinstance(operand, _Tiny) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(left, _Tiny) or isinstance(right, _Tiny):
            return _with_tiny(node.op, left, right)
        op = _power if isinstance(node.op, ast.Pow) else _BINOPS[type(node.op)]
        try:
            value = _check_size(op(left, right))
        except OverflowError:
            if _int_and_float(left, right) and not isinstance(node.op, ast.Pow):
                # the int was converted to a float on its own and overflowed, the result may
                # well fit one (10 ** 400 * 1e-300 is 1e100): exactly in fractions, then to a
                # float, which overflows only when the result is too large for one
                value = _check_size(float(_BINOPS[type(node.op)](Fraction(left), Fraction(right))))
                return _Tiny(value) if _underflowed(node.op, left, right, value) else value
            if isinstance(node.op, ast.Div) and isinstance(left, int) and isinstance(right, int):
                # an int quotient over a float's range (10 ** 400 / 3): // gives it exactly
                raise ValueError(
                    f"{TOO_LARGE_FOR_A_FLOAT}: / gives a float; use // for a quotient in whole numbers"
                ) from None
            raise
        return _Tiny(value) if _underflowed(node.op, left, right, value) else value
    if isinstance(node, ast.Call) and not isinstance(node.func, ast.Name | ast.Attribute):
        # 2(3 + 4) is a call of 2 to Python: the policy meant a product
        raise ValueError("unsupported expression: put * before '(' to multiply: 2 * (3 + 4), not 2(3 + 4)")
    what = getattr(node, "op", node)
    hint = _HINTS.get(type(what), f"{type(what).__name__} is not allowed")
    raise ValueError(f"unsupported expression: {hint} (only numbers, + - * / // % ** and parentheses)")


def _format(value: int | float) -> str:
    """An int in full; a float to 15 significant digits, all a double holds reliably, so the
    noise of binary fractions is not shown (0.1 + 0.2 reads 0.3, not 0.30000000000000004)
    while every digit the value has is (12 digits showed 100000000001.5 as 100000000002)."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:  # every integer below 2**53 is exact
            return str(int(value))
        text = f"{value:.15g}"
        # a fraction past the 15th digit would round away and leave what looks like an
        # integer (123456789012345.6 as 123456789012346): show the shortest exact form then.
        # Below 1e14 an integer-looking text is the noise-free value (4.35 * 100 is 435,
        # not 434.99999999999994): a fraction there has a digit within the 15
        if "." in text or "e" in text or abs(value) < 1e14:
            return text
        return repr(value)
    return str(value)


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``ValueError`` saying what is wrong."""
    if not isinstance(expression, str):  # envpool's in-process bridge passes the policy's value as it is
        raise ValueError(
            f"expression must be a string, got {type(expression).__name__}: pass it as text, e.g. 2 + 3"
        )
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(text)} characters, over the {MAX_EXPRESSION_CHARS} limit")
    text = text.translate(_UNICODE)
    if holds_json_arguments(text, "expression"):
        raise ValueError(
            'expression holds the JSON arguments ({"expression": ...}): pass the expression itself '
            "as the string, e.g. (17 + 25) * 3"
        )
    if sup := next((c for c in text if c in _SUPERSCRIPTS), None):
        raise ValueError(f"superscript {sup!r} is not allowed: write a power with ** (3**2, not 3\u00b2)")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        hint = next((h for pattern, h in _SYNTAX_HINTS if pattern.search(text)), "")
        raise ValueError(f"not an arithmetic expression: {e.msg}{hint}") from None
    except (RecursionError, MemoryError):
        raise ValueError("expression is nested too deeply") from None
    try:
        value = _eval(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:  # a float power, an int too large to convert (10 ** 400 * 1.0)
        raise ValueError(TOO_LARGE_FOR_A_FLOAT) from None
    except RecursionError:
        raise ValueError("expression is nested too deeply") from None
    return float(value) if isinstance(value, _Tiny) else value


@fabric.tool(
    warm=1,
    timeout_s=5,
    examples=(
        {"expression": "2 + 3 * 4"},
        {"expression": "(17 + 25) ** 2 / 7 - -1"},
        {"expression": "7 // 2 % 3"},
    ),
)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses)."""
    return _format(evaluate(expression))
