"""``calculator``: safe arithmetic for tool-using policies.

The expression is parsed with ``ast`` and only numbers, ``+ - * / // % **``, unary signs
and parentheses are evaluated: no names, calls, attributes or subscripts, so nothing the
policy writes can reach Python. Sizes are bounded before the work is done (``9**9**9`` is
refused at once instead of computing a number with 370 million digits). The signs a model
types for them (the minus sign, times, divide, full-width forms, no-break spaces) read as the
ASCII operators; a superscript, or the tool's JSON arguments passed as the expression, is
refused saying what to write instead.

The result is printed as text: an integer in full, a float to 15 significant digits
(``0.1 + 0.2`` is ``0.3``, ``0.5 + 123456789012`` is ``123456789012.5``), a whole float below
2**53 as an integer (``6 / 3`` is ``2``).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
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
_HINTS: dict[type[ast.AST], str] = {
    ast.BitXor: "'^' is not a power; use '**'",
    ast.Name: "names are not allowed",
    ast.Call: "function calls are not allowed",
    ast.Attribute: "attributes are not allowed",
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


def _check_size(value: Any) -> Any:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large")
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
        if math.log2(abs(base)) * exp > MAX_INT_BITS:
            raise ValueError(f"{_brief(base)} ** {_brief(exp)} is too large (over {MAX_INT_BITS:,} bits)")
    try:
        return base**exp
    except OverflowError:
        # a float power whose exponent does not fit a float (2 ** -(10**3000)): the result
        # is huge or tiny by whether |base| > 1 and the exponent's sign agree
        if base == 0:
            raise ZeroDivisionError from None  # 0 ** -(10**3000)
        if abs(base) == 1:
            return float(base) ** (abs(exp) % 2)
        if (abs(base) > 1) == (exp > 0):
            raise
        return 0.0  # tiny: what a float power that underflows gives (2 ** -2000)


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
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        op = _power if isinstance(node.op, ast.Pow) else _BINOPS[type(node.op)]
        return _check_size(op(left, right))
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
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise ValueError("expression is nested too deeply") from None
    try:
        return _eval(tree)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None
    except RecursionError:
        raise ValueError("expression is nested too deeply") from None


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
