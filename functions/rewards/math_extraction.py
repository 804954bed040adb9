"""The final answer of a math completion (``extract_final``): after the thinking, the last
``\\boxed{}`` or stated answer, else the last number outside the refusals of
``functions.rewards.math_refusals``; with the unit the prose states after it. The rules are
documented in ``functions.rewards.math``."""

from __future__ import annotations

import bisect
import re

from functions.rewards.answer import after_thinking, boxed_or_stated
from functions.rewards.math_canonical import plain_unicode, unit_after, unit_key
from functions.rewards.math_refusals import Refused, Rejections, without_premises

_A_NUMBER = (
    # a date is one value (2024-03-04: not 2024 and -03 and -04, the last of which was read)
    r"(?<![\d.])(?:\d{4}-\d{1,2}-\d{1,2}|\d{4}/\d{1,2}/\d{1,2}|\d{1,2}-\d{1,2}-\d{4}|\d{1,2}\.\d{1,2}\.\d{4})"
    r"(?!\d|\.\d)|"
    # a mixed number is one number (1 1/2 cups: not 1 and 1/2, which was read)
    r"(?<![\d.,/])[-+]?\d+[ \t]\d{1,2}/\d{1,2}(?![\d/]|\.\d)|"
    # a root of a number is one number, its coefficient with it (3\sqrt{2}: not 3 and 2)
    r"[-+]?(?:\d+(?:\.\d+)?[ \t]*)?\\sqrt(?:\[\d+\])?[ \t]*(?:\{[ \t]*\d+[ \t]*\}|\d+)|"
    # \frac{3}{4} is one number, not 3 and 4 (\frac{1,000}{2} too)
    r"[-+]?\\[dt]?frac\s*\{\s*(?:\d{1,3}(?:,\d{3})+|\d+)\s*\}\s*\{\s*(?:\d{1,3}(?:,\d{3})+|\d+)\s*\}"
    r"|[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
    # a power is one number (2^{10}, 10^3: not 10 and 3), as are 1e3, 3 \times 10^8 and 3/4
    r"(?:\^(?:\{[-+]?\d+\}|\d+)"
    # ("1.5 x 10^3" as typed too: its 10^3 alone was read, which matched 1000)
    r"|\s*(?:\\times|\\cdot|\u00d7|\u22c5|\*|x)\s*10\^(?:\{[-+]?\d+\}|[-+]?\d+)"
    r"|(?:[eE][-+]?\d+)?(?:/\d+(?:\.\d+)?)?)|[-+]?\.\d+"
)
# a product or quotient of numbers is one expression ("The product is 2 \cdot 3." states 6, not
# 3): numbers joined by \times, \cdot, \div, * or / on one line, signs that between numbers
# are arithmetic. Not a sum: in prose "-" is also a dash ("pages 10 - 12") and "+" a bound
# ("18+"). Nor across "=": "3 \times 4 = 12" still reads 12, the number after the last "="
_TIMES = r"[ \t]*+(?:\\(?:times|cdot|div)(?![A-Za-z])|[*/])[ \t]*+"
# ... with its percent sign (or word): "so it is 50%." states 50%, which the percentage rule
# reads as 1/2 against a fraction; read as 50 it matched only 50. A factor's too: "50% \times
# 2" is one product (its 2 alone was read)
_PERCENT = r"(?:[ \t]*+(?:\\?%|[Pp]ercent(?![A-Za-z])))?"
# ... and no exponent of something else: a unit's (cm^2, cm\u00b2, which reads cm^{2}) or a
# variable's (x^{-2}) is not a value ("12 cm\u00b2." read 2); a number's is part of it (2^{10})
_NOT_AN_EXPONENT = r"(?<!\^)(?<!\^\{)(?<!\^[-+])(?<!\^\{[-+])"
_LAST_NUMBER = re.compile(
    rf"{_NOT_AN_EXPONENT}(?:{_A_NUMBER}){_PERCENT}(?:{_TIMES}(?:{_A_NUMBER}){_PERCENT})*"
)
# one math span: $...$, $$...$$ (an escaped \$ is a dollar sign), \(...\), \[...\]
_DOLLAR = re.compile(r"(?<!\\)\$\$?")
_INEQUALITY = re.compile(r"[<>]|\\(?:le|ge|lt|gt|leq|geq|neq|ne)(?![A-Za-z])")  # \ge1 too
# a value that is a number, or is built from numbers: a digit or a LaTeX number form
_NUMERIC = re.compile(r"\d|\\(?:[dtc]?frac|sqrt|pi|infty|emptyset|varnothing|binom)(?![A-Za-z])")
# a lone variable (n, X, \alpha, c_{\text{total}}, x'): what the prose talks about, not an answer
_LONE_VARIABLE = re.compile(r"\\?[A-Za-z]+(?:_(?:\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\}|\w))?'*")
# what may follow a final math span: closing punctuation, emphasis, space
_TRAILING = re.compile(r"[\s.,;:!?)\]*_]*")


def _math_spans(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, content)`` of every math span of ``text``, in order of their ends.
    Linear: each delimiter is looked for once from where the last search stopped."""
    found: list[tuple[int, int, str]] = []
    opening = None  # the $ delimiters pair in order: 1st with 2nd, 3rd with 4th... (a lone
    for m in _DOLLAR.finditer(text):  # last $ is a dollar sign)
        if opening is None:
            opening = m
        else:
            found.append((opening.start(), m.end(), text[opening.end() : m.start()]))
            opening = None
    for left, right in (("\\(", "\\)"), ("\\[", "\\]")):
        pos = 0
        while (i := text.find(left, pos)) >= 0:
            if i > 0 and text[i - 1] == "\\":  # \\[2pt] is a line break, not math
                pos = i + len(left)
                continue
            j = text.find(right, i + len(left))
            if j < 0:
                break
            found.append((i, j + len(right), text[i + len(left) : j]))
            pos = j + len(right)
    return sorted(found, key=lambda s: s[1])


def _value_of(span: str) -> str | None:
    """What a math span says the answer is: its last side (``x = \\frac{3}{4}``:
    ``\\frac{3}{4}``, ``2 + 3 = 5``: ``5``), or all of it for a list of assignments (``x = 1,
    y = 2``); None for an inequality or an empty span."""
    if _INEQUALITY.search(span):
        return None
    span = span.replace("\\approx", "=")
    value = span if "," in span else span.rpartition("=")[2]
    return value.strip() or None


def _last_math(
    text: str,
    spans: list[tuple[int, int, str]],
    numbers: list[re.Match[str]],
    negated: Refused,
    rejections: Rejections,
) -> tuple[str, int] | None:
    """``(value, end)`` of the last math span that states an answer (see ``extract_final``),
    ``end`` just past the span; None when no span states one."""
    # the end of the last number of the prose (outside every span): a span before it is not
    # the answer ("$5$ apples, 12 left")
    merged: list[list[int]] = []  # the spans as disjoint intervals (a $ span can sit in \[ \])
    for start, end, _ in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [s for s, _ in merged]
    prose_end = -1
    for number in reversed(numbers):
        k = bisect.bisect_right(starts, number.start()) - 1
        if k < 0 or merged[k][1] < number.end():
            prose_end = number.end()
            break
    for start, end, content in reversed(spans):
        if end < prose_end:
            return None
        if start in negated:  # "x is not $5$": a value the text rejects, look further back
            continue
        if content.lstrip().startswith("^"):  # cm$^2$: the exponent of what precedes it
            continue
        value = _value_of(content)
        if value is None:  # an inequality ("for all $n \ge 1$") is a condition: look further back
            continue
        if rejections.restates(value, start):  # "not $5$ but close to $5$"
            continue
        if _NUMERIC.search(value):
            return value, end
        if not _LONE_VARIABLE.fullmatch(value) and _TRAILING.fullmatch(text, end):
            return value, end  # an expression that ends the text ("so it is $a + b$.")
    return None


_COMMAND = re.compile(r"\\[a-zA-Z]+")


def _chain_end(stated: str) -> str:
    """The last side of a stated chain of arithmetic ("6 \\times 7 = 42": ``42``); an equation
    with a variable (``x + y = 5``) or a list (``x = 1, y = 2``) stays whole."""
    if "=" not in stated or "," in stated or _INEQUALITY.search(stated):
        return stated
    lhs, _, value = stated.rpartition("=")
    if any(c.isalpha() for c in _COMMAND.sub("", lhs.replace("\\text", ""))) or not value.strip():
        return stated
    return value.strip()


def extract_final(text: str) -> tuple[str | None, str]:
    """``(answer, rule)``: rule is ``boxed``, ``answer_is``, ``last_math``, ``last_number`` or
    ``none`` (also when nothing follows the last ``</think>``)."""
    # the answer's own canonical form reads Unicode math (a minus sign, \u00d7, \u00bd): so must
    # extraction, or "x = \u22123" reads 3 and "1.5\u00d710\u00b3" reads 10
    text = plain_unicode(after_thinking(text))
    found = boxed_or_stated(text)
    rejected: frozenset[str] = frozenset()
    if found is not None:
        if found.rule == "boxed":
            return _with_unit(found.answer, text, found.end), "boxed"
        if found.rule != "denied":
            return _chain_end(found.answer), found.rule
        # what follows a rejected candidate ("not 5, it is 6"): never the candidate, nor the
        # rest of its sentence saying it again ("not 5 but it is close to 5")
        text, rejected = found.answer, found.rejected
    negated = Refused(text)
    rejections = Rejections(text, rejected)
    numbers = []
    for m in _LAST_NUMBER.finditer(text):
        if m.start() in negated:
            rejections.add(m.group(), m.start())
        else:
            numbers.append(m)
    spans = _math_spans(text)
    for start, _, content in spans:
        if start in negated and (rejected_value := _value_of(content)) is not None:
            rejections.add(rejected_value, start)
    rejections.sort()
    numbers = [m for m in numbers if not rejections.restates(m.group(), m.start())]
    numbers = without_premises(text, numbers)
    last = _last_math(text, spans, numbers, negated, rejections)
    if last is not None:
        value, end = last
        return _with_unit(value, text, end), "last_math"
    number = numbers[-1] if numbers else None
    if number is not None:
        if "." in number.group() and text.startswith("...", number.end()):
            # a decimal cut short ("It is 3.14...") is not its digits: canonical keeps it so
            return number.group() + "...", "last_number"
        return _with_unit(number.group(), text, number.end()), "last_number"
    return None, "none"


# a percent sign (or the word) right after a box or a math span ("$\boxed{25}\%$", "$25$%")
_PERCENT_AFTER = re.compile(r"[ \t]*+(?:\$[ \t]*+)?(?:\\?%|[Pp]ercent(?![A-Za-z]))")


def _with_unit(answer: str, text: str, end: int) -> str:
    """``answer``, read from ``text`` up to ``end``, with the percent sign or the unit the
    prose states after it ("It takes 5 hours." reads ``5 hours``, "$\\boxed{25}\\%$" ``25%``):
    two answers that both carry a unit must carry the same, and a unit outside the value read
    (a box's, a math span's or the last number's) was dropped, so 5 hours matched 5 minutes.
    None after it, or a count noun ("5 apples"), leaves ``answer`` as it is; so does an answer
    with a variable (``2x``) for a unit, which canonical keeps whole with a unit word after it
    (``\\frac{1}{2} b h``)."""
    if end < 0 or unit_key(answer) or not any(c.isdigit() for c in answer):
        return answer
    if "%" not in answer and _PERCENT_AFTER.match(text, end):
        return answer + "%"  # 25%, which the percentage rule reads as 1/4 against a fraction
    if any(c.isalpha() for c in _COMMAND.sub("", answer)):
        return answer
    return answer + unit_after(text, end)
