"""The fast path of ``math_answer``'s equivalence, in-process and without sympy: exact plain
numbers, and ``compare``, the structure-first comparison the sympy path reuses with its own
scalar test, over the canonical forms and structures of ``functions.rewards.math_canonical``.
The rules are documented in ``functions.rewards.math``."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction

from functions.rewards.answer import normalize
from functions.rewards.math_canonical import GREEK, Shape, _named, _small_cache, canonical, shape

# the canonical form and the structure live in math_canonical; their public names stay
# importable from here
__all__ = [
    "GREEK",
    "Shape",
    "Verdict",
    "as_fraction",
    "canonical",
    "compare",
    "fast_equivalent",
    "shape",
]

_TOL = Fraction(1, 10**9)


# ----------------------------------------------------------------------------- numbers

# linear: ``\d+\.?\d*`` backtracks quadratically on a long run of digits; the exponent is
# bounded so that ``Fraction("1e999999999")`` is never built
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,4})?"
_PLAIN = re.compile(rf"^{_NUM}$")
_SLASH = re.compile(rf"^({_NUM})\s*/\s*({_NUM})$")
_FRAC = re.compile(rf"^([-+]?)\\frac\{{\s*({_NUM})\s*\}}\{{\s*({_NUM})\s*\}}$")
_SCI = re.compile(
    rf"^({_NUM})\s*(?:\\times|\\cdot|\*|x)\s*10\s*(?:\^|\*\*)\s*\{{?\s*([-+]?\d{{1,3}})\s*\}}?$"
)
_MIXED = re.compile(r"^([-+]?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}$")
# ... and typed: 1 1/2 is 1.5 (two numbers side by side were unparsable), its fraction proper
_MIXED_SLASH = re.compile(r"^([-+]?)(\d+) +(\d+)/(\d+)$")
_POW10 = re.compile(r"^10\s*\^\s*\{?\s*([-+]?\d{1,3})\s*\}?$")
# a repeating decimal: 0.\overline{3} is 1/3, 1.2\overline{45} is 1.2454545...
_REPEATING = re.compile(r"^([-+]?)(\d*)\.(\d{0,50})\\overline\s*\{(\d{1,50})\}$")


@_small_cache
def as_fraction(s: str) -> Fraction | None:
    """The exact value of a plain number written as ``s``, or None."""
    try:
        if _PLAIN.match(s):
            return Fraction(s)
        if m := _SLASH.match(s):
            den = Fraction(m[2])
            return Fraction(m[1]) / den if den else None
        if m := _FRAC.match(s):
            den = Fraction(m[3])
            if not den:
                return None
            v = Fraction(m[2]) / den
            return -v if m[1] == "-" else v
        if m := _SCI.match(s):
            return Fraction(m[1]) * Fraction(10) ** int(m[2])
        if ((m := _MIXED.match(s)) or (m := _MIXED_SLASH.match(s))) and 0 < int(m[3]) < int(m[4]):
            # 3\frac{1}{3} is 3 + 1/3, as is 3 1/3
            v = int(m[2]) + Fraction(int(m[3]), int(m[4]))
            return -v if m[1] == "-" else v
        if m := _POW10.match(s):
            return Fraction(10) ** int(m[1])
        if m := _REPEATING.match(s):
            head, fixed, cycle = int(m[2] or 0), m[3], m[4]
            tail = Fraction(int(fixed or 0)) + Fraction(int(cycle), 10 ** len(cycle) - 1)
            v = head + tail / 10 ** len(fixed)
            return -v if m[1] == "-" else v
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


_DECIMAL = re.compile(r"^[-+]?(\d*)\.(\d*)(?:[eE]([-+]?\d+))?$")


def _ulp(s: str) -> Fraction | None:
    """The unit in the last place of ``s`` when it is written as a decimal (``1.57``: 1/100,
    ``1.5 \\times 10^3``: 100; an odd form such as ``1.5/2``: 1), None when ``s`` is exact
    (integers, ``a/b``, ``\\frac``, integer mantissas)."""
    if "." not in s or _REPEATING.match(s):  # a repeating decimal is exact
        return None
    if m := _DECIMAL.match(s):
        return Fraction(10) ** (int(m[3] or 0) - len(m[2]))
    if (m := _SCI.match(s)) and (d := _DECIMAL.match(m[1])):
        return Fraction(10) ** (int(m[2]) + int(d[3] or 0) - len(d[2]))
    return Fraction(1)


def _close(a: Fraction, b: Fraction, ulp_a: Fraction | None = None, ulp_b: Fraction | None = None) -> bool:
    """Whether prediction ``a`` equals ground truth ``b``. Exact values compare exactly; a
    rounded decimal matches within the relative tolerance and within one unit of its last place
    (so ``123456789013.0`` is not ``123456789012``). Against an exact ground truth ``p/q`` (an
    integer: ``q = 1``) a decimal must also single it out among the numbers of its denominator:
    its last place at most ``1/(2q)``, so ``1.844674407 \\times 10^{19}`` and the float
    ``1.8446744073709552e19`` (last places 10^10 and 1000) are not ``2^{64}``, while
    ``0.3333333333`` is ``1/3``."""
    if a == b:
        return True
    if ulp_a is None and ulp_b is None:
        return False
    if ulp_b is None and ulp_a is not None and ulp_a * 2 * b.denominator > 1:
        return False
    ulp = max(u for u in (ulp_a, ulp_b) if u is not None)
    return abs(a - b) <= min(_TOL * max(abs(a), abs(b)), ulp)


def _is_integer_form(s: str) -> bool:
    return bool(re.fullmatch(r"[-+]?\d+", s))


_WORD = re.compile(r"^[A-Za-z][A-Za-z ]*$")
_WORD_BREAK = re.compile(r"[A-Za-z]{2} +[A-Za-z]|[A-Za-z] +[A-Za-z]{2}")

# a date: a four-digit year first (2024-03-04, 2024/3/4) or last (3/4/2024, 04.03.2024), one
# separator throughout
_DATE = re.compile(r"^(?:(\d{4})([-/.])(\d{1,2})\2(\d{1,2})|(\d{1,2})([-/.])(\d{1,2})\6(\d{4}))$")


@_small_cache
def _date(s: str) -> tuple[tuple[object, ...], frozenset[tuple[int, int, int]]] | None:
    """``(as written, readings)`` of a date ``s``, None when ``s`` is none: its fields as
    numbers in their order (with the separator of a year last, where / and . may be different
    conventions) and its ``(year, month, day)`` readings. A year first is year-month-day; a
    year last is month/day or day/month, both where both are dates (3/4/2024), the one that is
    where the other is not (25/3/2024)."""
    if not (m := _DATE.match(s)):
        return None
    if m[1] is not None:
        year, readings = int(m[1]), [(int(m[3]), int(m[4]))]
        written: tuple[object, ...] = ("ymd", year, *readings[0])
    else:
        a, b = int(m[5]), int(m[7])
        year, readings = int(m[8]), [(a, b), (b, a)]
        written = (m[6], a, b, year)
    found = frozenset((year, mo, d) for mo, d in readings if 1 <= mo <= 12 and 1 <= d <= 31)
    return (written, found) if found else None


def _same_date(p: str, g: str) -> bool | None:
    """Whether dates ``p`` and ``g`` are the same day: written alike (03/04/2024 is 3/4/2024), or
    each with one reading, the same (25/3/2024 is 2024-03-25); 3/4/2024 (March 4 or April 3) is
    not 2024-03-04 nor 4/3/2024. None when neither is a date; False when one is not."""
    pd, gd = _date(p), _date(g)
    if pd is None and gd is None:
        return None
    if pd is None or gd is None:
        return False
    return pd[0] == gd[0] or (len(pd[1]) == 1 and pd[1] == gd[1])


# ----------------------------------------------------------------------------- comparison

Verdict = tuple[bool | None, str]
"""``(equivalent, rule)``; ``None`` means the fast path cannot tell."""


def _percent(pred: str, gt: str) -> list[tuple[str, str]]:
    """Apply the percentage rule: drop the ``%`` signs, scaling by 1/100 where it applies. The
    readings to compare, either of which may match: ``X%`` against an integer is ``X``, against
    a fraction or decimal ``X/100``, and also ``X`` when that number is above 1 in magnitude
    (``37.5%`` is ``37.5`` as ``50%`` is ``50``; ``0.5`` against ``50%`` is still ``0.5``)."""
    pp, gp = pred.endswith("%"), gt.endswith("%")
    if ("%" in pred and not _lone_percent(pred)) or ("%" in gt and not _lone_percent(gt)):
        if (operands := _operand_percents(pred, gt)) is not None:
            return operands
    if pp == gp:
        return [(pred.rstrip("%").strip(), gt.rstrip("%").strip())]

    def readings(x: str, other: str) -> list[str]:
        x = x.rstrip("%").strip()
        if _is_integer_form(other):
            return [x]
        v = as_fraction(x)
        try:
            hundredths = str(v / 100) if v is not None else f"({x})/100"
        except ValueError:  # over Python's 4300-digit int-to-str limit (1e9999%): the quotient
            hundredths = f"{x}/100"  # as_fraction reads, never written out
        o = as_fraction(other)
        return [hundredths, x] if o is not None and abs(o) > 1 else [hundredths]

    if pp:
        return [(p, gt) for p in readings(pred, gt)]
    return [(pred, g) for g in readings(gt, pred)]


# what makes a percent sign an operand's, not the whole answer's: another one, or a sum or
# difference (a sign after the first character, not an exponent's); a list or a union is
# compared element by element, each with its own sign. A quotient is left whole: 1/2% is half
# a percent
_NOT_A_FACTOR = re.compile(r"(?<![eE{^])[-+]|%")
_PERCENT_OPERAND = re.compile(r"((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,4})?)\s*%")


def _lone_percent(s: str) -> bool:
    """Whether the percent sign of ``s`` is the whole answer's: ``X%`` with ``X`` a number or
    a product (``2 \\times 50%`` is ``(2 \\times 50)%``), or ``s`` is a list (its elements
    are read one by one)."""
    return "," in s or "\\cup" in s or (s.endswith("%") and not _NOT_A_FACTOR.search(s, 1, len(s) - 1))


def _operand_percents(pred: str, gt: str) -> list[tuple[str, str]] | None:
    """The percentage rule where a percent sign is an operand's (``1 + 50%``, ``50% \\times
    2``, ``50% \\times 50%``, ``\\frac{50%}{2}``): each ``X%`` is ``(X/100)`` in the value
    ``V`` it gives (1.5, 1, 1/4, 1/4; ``1 + 50%`` was ``(1 + 50)/100``, 0.51), and that value is
    read as a percentage is: ``100 V`` against an integer, ``V`` against a fraction or decimal,
    and either against one above 1 in magnitude. Both sides with a percent sign compare their
    values. None when a percent sign follows no number (``10^{-3}%``)."""

    def value(s: str) -> str | None:
        v = _PERCENT_OPERAND.sub(r"(\1/100)", s)
        return None if "%" in v else v

    if "%" in pred and "%" in gt:
        pv, gv = value(pred), value(gt)
        return None if pv is None or gv is None else [(pv, gv)]
    x, other = (pred, gt) if "%" in pred else (gt, pred)
    v = value(x)
    if v is None:
        return None
    percent = f"({v}) \\cdot 100"
    if _is_integer_form(other):
        readings = [percent]
    else:
        o = as_fraction(other)
        readings = [v, percent] if o is not None and abs(o) > 1 else [v]
    return [(r, gt) for r in readings] if x is pred else [(pred, r) for r in readings]


_DROPPABLE_SPACE = re.compile(r" (?!\d)|(?<!\d) ")


def _squash(s: str) -> str:
    """``s`` without the spaces that do not change it: a space between two digits separates two
    numbers (``1 2`` is not ``12``, ``2^3 4`` is not ``2^34``); ``canonical`` has already
    joined a number written in groups of three (``1 000 000``)."""
    return _DROPPABLE_SPACE.sub("", s)


def _fast_scalar(p: str, g: str) -> Verdict:
    if p == g:
        return True, "string"
    # a space beside a word of two letters or more is a word break, not a product's (north
    # east is not northeast; x y is xy): two such answers in words are the text rule's below
    if _squash(p) == _squash(g) and not (
        _WORD.match(p) and _WORD.match(g) and (_WORD_BREAK.search(p) or _WORD_BREAK.search(g))
    ):
        return True, "string"
    a, b = as_fraction(p), as_fraction(g)
    if a is None or b is None:
        # a date is not the quotient or difference it is spelt with (3/4/2024 is not 3/8096,
        # 2024-03-04 not 2017): equal to a date that can only mean the same day, and to
        # nothing else
        if (same := _same_date(p, g)) is not None:
            return same, "date"
    if a is not None and b is not None:
        return _close(a, b, _ulp(p), _ulp(g)), "number"
    # e alone is Euler's number (sympy's E), not the word "e"; a capital E alone is a choice
    pw, gw = p != "e" and bool(_WORD.match(p)), g != "e" and bool(_WORD.match(g))
    if pw and gw:  # two words are text, however short: sympy read "on" as o*n, which is "no"
        if len(p) == 1 or len(g) == 1:  # a lone letter is a variable or a point: x is not X
            return p == g, "text"
        return normalize(p) == normalize(g), "text"
    if (pw and b is not None) or (gw and a is not None):
        return False, "text"
    return None, "undecided"


def compare(pred: str, gt: str, scalar: Callable[[str, str], Verdict]) -> Verdict:
    """Compare canonical answers structure-first, scalars with ``scalar``; with a percentage on
    one side, equal when either of its readings is (``_percent``)."""
    undecided: Verdict | None = None
    for p, g in _percent(pred, gt):
        verdict = _compare_read(p, g, scalar)
        if verdict[0]:
            return verdict
        if verdict[0] is None:
            undecided = verdict
    return undecided or verdict


# one number in groups of three alone in brackets: (1,000) is the point (1, 0), the number
# 1000 in parentheses, or an accountant's -1000; \{1,000\} the set {1, 0} or {1000}
# (a pair of brackets: [1,500) is an interval; and no leading 0: (0,100) is one too)
_GROUPED = r"[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?"
_GROUPED_ALONE = re.compile(rf"\({_GROUPED}\)|\[{_GROUPED}\]|\\\{{{_GROUPED}\\\}}")


_INFINITIES = {"\\infty": math.inf, "+\\infty": math.inf, "-\\infty": -math.inf}


def _endpoint(s: str) -> Fraction | float | None:
    """An interval's endpoint as a number: a plain number exactly, an infinity as ``inf``;
    None for anything else (a root, a letter), which only sympy could place."""
    return _INFINITIES[s] if s in _INFINITIES else as_fraction(s)


def _merged_union(s: str) -> str:
    """A union of intervals with the ones that overlap or touch joined: ``[0, 1] \\cup [1, 2]``
    is ``[0, 2]`` (compared part by part, it missed it), ``(0, 1] \\cup (1, 2)`` is ``(0, 2)``;
    ``(0, 1) \\cup (1, 2)`` keeps its gap at 1. ``s`` itself when nothing joins, or a part is
    not an interval with plain-number (or infinite) endpoints."""
    kind, _, parts = shape(s)
    if kind != "union":
        return s
    spans: list[tuple[Fraction | float, bool, Fraction | float, bool, str, str]] = []
    for part in parts:
        k, brackets, ends = shape(part)
        if k != "seq" or len(ends) != 2 or brackets not in ("()", "[]", "(]", "[)"):
            return s
        lo, hi = _endpoint(ends[0]), _endpoint(ends[1])
        if lo is None or hi is None or lo > hi:
            return s
        spans.append((lo, brackets[0] == "[", hi, brackets[1] == "]", ends[0], ends[1]))
    spans.sort(key=lambda sp: (sp[0], not sp[1]))  # by the low end, a closed one first
    merged = [spans[0]]
    for sp in spans[1:]:
        lo, lo_closed, hi, hi_closed, lo_text, _ = merged[-1]
        if sp[0] < hi or (sp[0] == hi and (hi_closed or sp[1])):  # overlaps or touches
            if sp[2] > hi or (sp[2] == hi and sp[3]):
                merged[-1] = (lo, lo_closed, sp[2], sp[3], lo_text, sp[5])
        else:
            merged.append(sp)
    if len(merged) == len(spans):
        return s
    return " \\cup ".join(
        f"{'[' if lc else '('}{lt}, {ht}{']' if hc else ')'}" for _, lc, _, hc, lt, ht in merged
    )


def _compare_read(pred: str, gt: str, scalar: Callable[[str, str], Verdict]) -> Verdict:
    """``compare`` once the percentage rule has been applied."""
    # a union is the set it covers, however it is cut: intervals that overlap or touch are one
    pred = _merged_union(pred) if "\\cup" in pred else pred
    gt = _merged_union(gt) if "\\cup" in gt else gt
    if "," in pred or "," in gt:
        # an answer that could be a list or a number in groups of three is neither: it matches
        # only itself ((1,000) matched the point (1, 0), which nobody writes so; it was never
        # 1000 nor -1000)
        if _GROUPED_ALONE.fullmatch(pred) or _GROUPED_ALONE.fullmatch(gt):
            return _squash(pred) == _squash(gt), "ambiguous"
    pn, gn = _named(pred), _named(gt)
    if pn or gn:
        return _compare_named(pred, gt, pn, gn, scalar)
    ps, gs = shape(pred), shape(gt)
    if ps[0] == "scalar" and gs[0] == "scalar":
        return scalar(pred, gt)
    # a bare list against a braced set differs only in its brackets: compared as sets below
    if (ps[0] != gs[0] or ps[1] != gs[1]) and not ps[0] == gs[0] == "set":
        return False, "structure"
    pe, ge = ps[2], gs[2]
    # a set's elements and a union's parts are unordered ((3,4)\cup(1,2) is (1,2)\cup(3,4))
    unordered = ps[0] in ("set", "union")
    if unordered:
        pe, ge = tuple(dict.fromkeys(pe)), tuple(dict.fromkeys(ge))
    if len(pe) != len(ge):
        return False, "structure"
    rule = "structure"
    if not unordered:
        undecided = False
        for a, b in zip(pe, ge, strict=True):
            v, r = compare(a, b, scalar)
            if v is False:
                return False, r
            if v is None:
                undecided = True
            elif r == "sympy":
                rule = r
        return (None, "undecided") if undecided else (True, rule)
    # sets: every ground-truth element matched by a distinct predicted element
    unused = list(pe)
    undecided = False
    for b in ge:
        hit = None
        for a in unused:
            v, r = compare(a, b, scalar)
            if v:
                hit = a
                rule = "sympy" if r == "sympy" else rule
                break
            if v is None:
                undecided = True
        if hit is None:
            return (None, "undecided") if undecided else (False, "structure")
        unused.remove(hit)
    return True, rule


def _compare_named(
    pred: str,
    gt: str,
    pn: tuple[tuple[str, ...], tuple[str, ...]] | None,
    gn: tuple[tuple[str, ...], tuple[str, ...]] | None,
    scalar: Callable[[str, str], Verdict],
) -> Verdict:
    """``x=1, y=2`` is the point ``(1, 2)``: against another assignment list the variables must
    be the same; against a tuple or a bare list (``(1, 2)``, ``1, 2``) its values, ordered by
    variable, compare element-wise (a bare list is read in its written order here, not as a set:
    ``y=1, x=2`` is not ``1, 2``)."""
    if pn and gn and pn[0] != gn[0]:
        return False, "structure"

    def values(s: str, named: tuple[tuple[str, ...], tuple[str, ...]] | None) -> tuple[str, ...] | None:
        if named:
            return named[1]
        kind, brackets, elements = shape(s)
        return elements if (kind, brackets) in (("seq", "()"), ("set", "")) else None

    pv, gv = values(pred, pn), values(gt, gn)
    if pv is None or gv is None or len(pv) != len(gv):
        return False, "structure"
    return compare(f"({', '.join(pv)})", f"({', '.join(gv)})", scalar)


def fast_equivalent(pred: str, gt: str) -> Verdict:
    """In-process verdict on canonical answers, or ``None`` when sympy is needed."""
    return compare(pred, gt, _fast_scalar)
