"""What ``is_equivalent`` (``functions.rewards.math``) reads before it compares two answers: a
multiple-choice letter (``_choice``, ``_boxed_choice``) and the last side of a chain or a named
value (``_last_side``). The rules are documented in ``functions.rewards.math``."""

from __future__ import annotations

import re

from functions.rewards.math_extraction import _COMMAND, _INEQUALITY
from functions.rewards.math_fast import Verdict

# a multiple-choice ground truth (a letter A-E) and an answer that starts with its choice, as
# AMC solutions do: \textbf{(C) }12; a label in parentheses is a choice in either case ((d) is D)
_CHOICE_GT = re.compile(r"\(?([A-E])\)?")
_CHOICE_PRED = re.compile(r"\s*(?:\\text(?:bf|rm)?\s*\{\s*)?\(([A-Ea-e])\)")
_ANOTHER_CHOICE = re.compile(r"\([A-Ea-e]\)|\bor\b")
# a lowercase letter a-e alone in a box (\boxed{d}, \boxed{\text{d}}), and what shows that the
# text answers a multiple-choice question: a label, "(b)" or a line "B) ..." / "b. ...", or
# the words option(s), choice(s)
_LOWER_CHOICE = re.compile(r"\s*(?:\\(?:text(?:bf|rm)?|mathrm|mathbf)\s*\{\s*([a-e])\s*\}|([a-e]))\s*")
_CHOICES_NAMED = re.compile(
    r"\([A-Ea-e]\)|(?<![A-Za-z])(?:[Oo]ptions?|[Cc]hoices?)(?![A-Za-z])|^[ \t]*+[A-Ea-e][.)][ \t]",
    re.MULTILINE,
)


def _choice(pred: str, gt: str) -> Verdict | None:
    """The verdict on a choice letter, or None when ``gt`` is not one or ``pred`` does not start
    with exactly one."""
    g = _CHOICE_GT.fullmatch(gt.strip().strip("$").strip())
    p = pred.replace("$", "")
    m = _CHOICE_PRED.match(p)
    if g is None or m is None or _ANOTHER_CHOICE.search(p, m.end()):
        return None
    return m[1].upper() == g[1], "choice"


def _boxed_choice(answer: str, gt: str, text: str) -> str:
    """``answer``, a box's, as the capital it names when it is a lowercase letter a-e, the
    ground truth a choice letter and the text one that names choices (``\\boxed{d}`` after
    "(A) 1, (B) 2..." is D): a lone letter keeps its case elsewhere (a variable's, a point's),
    so a choice boxed in lowercase missed its capital."""
    if _CHOICE_GT.fullmatch(gt.strip().strip("$").strip()) is None:
        return answer
    m = _LOWER_CHOICE.fullmatch(answer)
    if m is None or _CHOICES_NAMED.search(text) is None:
        return answer
    return (m[1] or m[2]).upper()


# what a side that names a value is made of besides its letters: subscripts (S_{10}),
# arguments (f(2), P(A)), commands (m\angle A), braces, spaces and primes
_NAME_PARTS = re.compile(r"_(?:\{[^{}]*\}|\w)|\([^()]*\)|\\[A-Za-z]+|[{}\s']")


# a side that starts by negating ("not x = 5", "never x = 5") denies the value: no name of one
_DENIED_NAME = re.compile(r"\s*(?:not|never)\b", re.IGNORECASE)


def _last_side(s: str) -> str:
    """The value a canonical answer states with ``=``: the last side of a chain of arithmetic
    (``2+1=3``, ``5! = 120``) or of names and arithmetic (``AB = 5``, ``x = 2 \\cdot 3 = 6``,
    ``f(2) = 5``, ``m\\angle A = 30``); ``s`` itself when a side before it is an expression in
    a variable (``2x = 10`` says x is 5, ``x + y = 5`` is an equation), when it is a list
    (``x = 1, y = 2``) or a relation (``x \\le 3``, ``==``), or a denial (``not x = 5``)."""
    if "=" not in s or "," in s or "==" in s or "!=" in s or _INEQUALITY.search(s):
        return s
    *before, value = s.split("=")
    if not value.strip() or _DENIED_NAME.match(before[0]):
        return s
    for side in before:
        if not side.strip():
            return s
        has_variable = any(c.isalpha() for c in _COMMAND.sub("", side))
        if has_variable and not _NAME_PARTS.sub("", side).isalpha():
            return s
    return value.strip()
