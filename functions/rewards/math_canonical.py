"""The canonical form of a ``math_answer`` answer and its structure, in-process and without
sympy: presentation stripped (``canonical``: math delimiters, units, ``x =``, thousands
separators, ``\\pm``, inequalities as intervals), and the structure of the result (``shape``:
scalar, tuple or interval, set, union). The fast path and the sympy path compare what these
give (``functions.rewards.math_fast``); the rules are documented in
``functions.rewards.math``."""

from __future__ import annotations

import re

# the cache, Unicode math and units live in math_cache, math_unicode and math_units; their
# names, private ones included, stay importable from here
from functions.rewards.math_cache import _CACHE_KEY_MAX, _T, _small_cache  # noqa: F401
from functions.rewards.math_unicode import (  # noqa: F401
    _PAREN,
    _ROOT_PAREN,
    _SIGNS,
    _SUPERSCRIPT,
    _SUPERSCRIPTS,
    _VULGAR,
    _VULGAR_FRACTION,
    _root_parentheses,
    plain_unicode,
)
from functions.rewards.math_units import (  # noqa: F401
    _BEFORE_UNIT,
    _DEGREES,
    _LETTER,
    _LETTER_UNITS,
    _PROSE_WORD,
    _SPAN_POWER,
    _TEXT_UNIT_TOKEN,
    _UNIT_AFTER_WORDS,
    _UNIT_GROUP,
    _UNIT_NAMES,
    _UNIT_SCAN,
    _UNIT_TOKEN,
    _UNIT_WORD,
    _UNITS,
    _WORD_END,
    _key,
    _names,
    _unit_names,
    _unit_token,
    unit_after,
    unit_key,
)

__all__ = ["GREEK", "Shape", "canonical", "plain_unicode", "shape", "unit_after", "unit_key"]

# ----------------------------------------------------------------------------- canonical form

_PERCENT_WORD = re.compile(r"(?<!\s)\s*\bpercent\b", re.IGNORECASE)  # starts once per space run
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_TEXT_UNIT = re.compile(_TEXT_CMD.pattern + r"(?:\s*\^\s*\{?[23]\}?)?")
# not the second backslash of a row break: "1 \\\\ 2" (pmatrix) is not "1 \\ 2"
# ... and the named spaces, struts and phantoms, which print nothing (\hspace{1em}5 was
# unparsable, not 5)
_SPACING = re.compile(
    r"(?<!\\)\\[,;:! ]|~"
    r"|\\(?:quad|qquad|displaystyle|textstyle|scriptstyle|enspace|thinspace|medspace|thickspace"
    r"|negthinspace|negmedspace|negthickspace|mathstrut|strut)(?![A-Za-z])"
    r"|\\(?:[hv]space\*?|hphantom|vphantom|phantom|mkern|kern)\s*\{[^{}]*\}"
)
_DISPLAY = re.compile(r"^\\\[|\\\]$")  # display math around the answer: \[ 42 \]
_LEFT_RIGHT = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)\b\.?")
_TRIG_CMD = re.compile(r"\\(?:sin|cos|tan|cot|sec|csc)(?![A-Za-z])")
# ``x =``, ``x_1 =``, ``f(x) =``, ``(x, y) =``, ``x \in``
_LHS = re.compile(
    r"^(?:[a-zA-Z](?:_(?:\{\w+(?:\s*,\s*\w+)+\}|\{?\w+\}?))?(?:\(\s*[a-zA-Z]\s*\))?|\(\s*[a-zA-Z](?:\s*,\s*[a-zA-Z])*\s*\))"
    r"\s*(?:=|\\in\b|\\approx\b|≈)\s*(?=\S)"
)
# "approximately 3.14", "about 7 hours", "\approx 0.33": the number is the answer; only words
# that say "about this value" go ("at least 7", "nearly 7" say something else and stay)
_HEDGE = re.compile(
    r"^(?:approximately|approx\.?|about|around|roughly|\\approx|≈|~)\s*(?=[-+]?(?:\d|\.\d|\\[dtc]?frac|\\sqrt|\\pi))",
    re.IGNORECASE,
)
# one part of an answer such as ``x = 1, y = 2``: a variable (``x``, ``x_1``, ``x_{12}``) and
# its value (anything with no further ``=``)
_ASSIGN = re.compile(r"^([a-zA-Z](?:_\{?\w+\}?)?)\s*=\s*(\S[^=]*)$")  # linear: \S ends the \s*
_THIN_THOUSANDS = re.compile(r"(?<=\d)\\[,!: ](?=\d{3}\b)")
# a percentage is a number too: "1,000%" is 1000%, not the list 1, 000%
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?$")
# an argument of \frac (either), \sqrt or \binom, where a comma lists nothing: a number in
# groups of three there is one number (\frac{1,000}{2} is 500); a set's or a point's comma
# lists its elements (\{1,000\} is not {1000}; compare reads it as neither: _GROUPED_ALONE)
_ARGUMENT = re.compile(
    r"(?:\\(?:frac|sqrt|binom)(?![A-Za-z])\s*(?:\[[^\[\]{}]*\]\s*)?|(?<=[^\\]\}))\{[^{}]*\}"
)
_GROUPED = re.compile(r"(?<![\d.,])\d{1,3}(?:,\d{3})+(?![\d,])")
# ... and an operand of arithmetic (2 \times 1,000 is 2000, 1,000 + 500 is 1500), where the
# comma could list only a number that starts with three digits and an operator ("1" and "000 +
# 500"): read as thousands, unless another comma or a bracket could make it a list or a point
# (2 \times 1,000, 3 and (2, 1,000 + 5) stay as written)
_ARITHMETIC_OP = r"(?:\\(?:times|cdot|div)(?![A-Za-z])|[-+*/])"
_GROUPED_OPERAND = re.compile(rf"{_ARITHMETIC_OP}\s*{_GROUPED.pattern}|{_GROUPED.pattern}\s*{_ARITHMETIC_OP}")
_LISTS = re.compile(r"[,()\[\]]|\\[{}]|\\[lr]angle(?![A-Za-z])")
_SPACED_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?: \d{3})+(?:\.\d+)?%?$")
GREEK = {
    name: name
    for name in (
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi rho sigma tau "
        "upsilon phi chi psi omega Gamma Delta Theta Lambda Xi Sigma Upsilon Phi Psi Omega"
    ).split()
} | {"varepsilon": "epsilon", "vartheta": "theta", "varphi": "phi", "varrho": "rho", "varsigma": "sigma"}
"""Greek letters (``\\pi`` aside, a number) by command name, variants as their letter."""
# a one-token argument of \frac, \binom or \sqrt, as TeX reads it (\frac12, \frac\pi2, \frac a
# b, \sqrt\pi; \binom 5 2 was unparsable): a braced group with no braces inside, a symbol
# command, a letter or a digit
_SYMBOL = r"\\(?:pi|infty|" + "|".join(sorted(GREEK, key=len, reverse=True)) + r")(?![A-Za-z])"
_ARG = rf"\{{[^{{}}]*\}}|{_SYMBOL}|[0-9A-Za-z]"
_FRAC_SHORT = re.compile(rf"\\(frac|binom)(?![A-Za-z])\s*({_ARG})\s*({_ARG})")
_SQRT_SHORT = re.compile(rf"\\sqrt(?![A-Za-z])\s*(\d+|[a-zA-Z]|{_SYMBOL})")


def _braced_args(m: re.Match[str]) -> str:
    num, den = (a[1:-1] if a.startswith("{") else a for a in (m[2], m[3]))
    return f"\\{m[1]}{{{num}}}{{{den}}}"


def _strip_units(s: str, unit: re.Pattern[str] = _UNIT_TOKEN) -> str:
    """``s`` without its trailing whitespace-separated unit words, in one right-to-left pass."""
    end = len(s)
    while True:
        j = end
        while j > 0 and s[j - 1].isspace():
            j -= 1
        i = j
        while i > 0 and not s[i - 1].isspace():
            i -= 1
        if i == 0 or i == j or not unit.fullmatch(s, i, j):
            return s[:end]  # the first token is the number itself, never a unit
        end = i


def _is_units(text: str) -> bool:
    """Whether ``text`` (inside ``\\text{}``) is only unit words (``cm``, ``square meters``,
    ``m/s``, ``s``)."""
    words = text.split()
    return bool(words) and all(_TEXT_UNIT_TOKEN.fullmatch(w) for w in words)


_ASSIGNED = re.compile(r"([A-Za-z](?:_\{?\w+\}?)?)\s*=")


def _strip_text(s: str) -> str:
    r"""``\text{cm}`` after a number is a unit (dropped), and so are the units of a number
    inside one (``\text{4 s}`` is 4; ``s``, ``m``, ``h``, ``g`` and ``l`` are units only in
    there); any other ``\text{}`` says what it says: ``\text{Paris}`` is Paris, ``\text{not }
    3`` is "not 3" and ``3 \text{ (or 5)}`` is "3 (or 5)" (both used to be 3), ``\text{ and }``
    is a comma (``x=1 \text{ and } y=2``), and so is ``\text{ or }`` between the values of
    one unknown (``x = 2 \text{ or } x = 3`` is the set 2, 3; ``x=1 \text{ or } y=2`` is not
    the point (1, 2))."""
    one_unknown = len(set(_ASSIGNED.findall(s))) <= 1

    def unit_or_text(m: re.Match[str]) -> str:
        if _is_units(m[1]):
            return ""
        inner = m[1].strip()
        number = _strip_units(inner, _TEXT_UNIT_TOKEN)
        if number != inner and not _VARIABLE.search(_COMMAND.sub("", number)):
            return number
        rest = m.group()[m.end(1) - m.start() + 1 :]  # an exponent that followed the braces
        word = m[1].strip()
        if word == "and" or (word == "or" and one_unknown):
            return ", "
        return m[1] + rest

    without = _TEXT_UNIT.sub(unit_or_text, s).strip()
    if without and any(c.isdigit() for c in without):
        return without
    return _TEXT_CMD.sub(r"\1", s)  # no number left: \text{cm} alone is the word cm


_COMMAND = re.compile(r"\\[A-Za-z]+")
_VARIABLE = re.compile(r"[A-Za-z]")
# \dbinom and \tbinom are \binom; {n \choose k} (plain TeX) too; \lbrace \rbrace are \{ \}
_BINOM_STYLE = re.compile(r"\\[dt]binom(?![A-Za-z])")
_CHOOSE = re.compile(r"\{([^{}]*?)\\choose(?![A-Za-z])([^{}]*)\}")
_SET_BRACE = re.compile(r"\\([lr])brace(?![A-Za-z])\s*")
_BRACED_THOUSANDS = re.compile(r"(?<=\d)\{,\}(?=\d{3}(?!\d))")
_TRUNCATED = re.compile(r"\d\.\d+\.{3,}$")
_REALS = re.compile(r"\\mathbb\s*\{?\s*R\s*\}?|\\R|\u211d")
_LIST_AND = re.compile(r"(?<=[\d}])(?:[ \t]*+,)?[ \t]++and[ \t]++(?=\S)")
_EMPTY_ELEMENT = re.compile(r",(?:[ \t]*+,)++")
_EMPTY_SET = re.compile(r"\\varnothing\b|^\\\{\s*\\\}$")
# an answer in words is the symbol it names (whole, case folded): "all real numbers" is the real
# line, "no solution" the empty set, "infinity" \infty, and "undefined", "does not exist" and
# "DNE" one answer; as text none of them matched its symbol, nor each other
_WORD_ANSWERS = (
    dict.fromkeys(
        (
            "all real numbers",
            "all reals",
            "all real values",
            "all real x",
            "any real number",
            "every real number",
            "the set of all real numbers",
            "the set of real numbers",
        ),
        "(-\\infty, \\infty)",
    )
    | dict.fromkeys(
        (
            "no solution",
            "no solutions",
            "no real solution",
            "no real solutions",
            "no real roots",
            "no roots",
            "the empty set",
            "empty set",
        ),
        "\\emptyset",
    )
    | dict.fromkeys(("infinity", "+infinity", "positive infinity"), "\\infty")
    | dict.fromkeys(("-infinity", "negative infinity", "minus infinity"), "-\\infty")
    | dict.fromkeys(
        ("undefined", "not defined", "does not exist", "doesn't exist", "doesn\u2019t exist", "dne", "d.n.e"),
        "undefined",
    )
)
_WORD_ANSWER_CHARS = max(map(len, _WORD_ANSWERS))


@_small_cache
def canonical(answer: str) -> str:
    """The answer with presentation stripped (see ``functions.rewards.math``'s docstring)."""
    # the Unicode minus sign (and its small and full-width forms) is a minus; dashes are not
    # (an en dash, U+2013, between two numbers is a range, which must not become 3 - 5)
    s = plain_unicode(answer.strip())
    s = s.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "")
    s = _DISPLAY.sub("", s.strip())
    s = _LEFT_RIGHT.sub("", s)
    s = _THIN_THOUSANDS.sub("", s)
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\cfrac", "\\frac")
    s = _BINOM_STYLE.sub(r"\\binom", s)
    s = _CHOOSE.sub(r"\\binom{\1}{\2}", s)
    s = _SET_BRACE.sub(lambda m: "\\{" if m[1] == "l" else "\\}", s)
    # {,} is a thousands separator before a group of three (1{,}000), else a decimal comma
    # (3{,}5, German LaTeX's 3.5), which is left: it was dropped, and 3{,}5 matched 35
    s = _BRACED_THOUSANDS.sub("", s) if "{,}" in s else s
    s = _ARGUMENT.sub(lambda m: _GROUPED.sub(lambda g: g[0].replace(",", ""), m[0]), s)
    if "," in s and _GROUPED_OPERAND.search(s) and not _LISTS.search(_GROUPED.sub("", s)):
        s = _GROUPED.sub(lambda g: g[0].replace(",", ""), s)
    # a degree sign is dropped (45^\circ is 45), except in a trigonometric expression, where
    # sympy reads it as pi/180 (\tan 45^\circ is 1, not tan(45))
    s = _DEGREES.sub(r"^\\circ" if _TRIG_CMD.search(s) else "", s)
    s = s.replace("\\%", "%").replace("\\percent", "%")
    s = _PERCENT_WORD.sub("%", s)
    s = _or_union(s) if "or" in s else s
    s = _strip_text(s)
    # "and" between values lists them ("2 and 3" was unparsable), and the Oxford comma before
    # it is the same comma ("1, 2, \text{ and } 3" was "1, 2, , 3", with an empty element)
    s = _EMPTY_ELEMENT.sub(",", _LIST_AND.sub(", ", s)) if "," in s or "and" in s else s
    s = s.strip()
    # a sentence's period goes, not a decimal's ellipsis: 0.999... is not 0.999 (it is 1), and
    # 3.14... is not 3.14; it is left to match only itself (42... is 42, a pause)
    s = s if _TRUNCATED.search(s) else s.rstrip(".").strip()
    s = _HEDGE.sub("", s)
    if any(c.isdigit() for c in s):
        stripped = _strip_units(s).strip()
        # a unit follows a number: what is left must be one (``x =`` aside), not an expression
        # with a variable in it (``\frac{1}{2} b hours``)
        if not _VARIABLE.search(_COMMAND.sub("", _LHS.sub("", stripped))):
            s = stripped
    listed = _assignments(s)
    # a single leading ``x =`` goes; an assignment list keeps its variables (``_named``)
    s = _LHS.sub("", s) if listed is None else listed
    s = _FRAC_SHORT.sub(_braced_args, s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = " ".join(s.split())
    if _THOUSANDS.match(s) or _SPACED_THOUSANDS.match(s):
        s = s.replace(",", "").replace(" ", "")
    if len(s) <= _WORD_ANSWER_CHARS and (named := _WORD_ANSWERS.get(s.lower())) is not None:
        return named
    s = _EMPTY_SET.sub(r"\\emptyset", s)
    if _REALS.fullmatch(s):  # the real line is the interval it is (\mathbb{R} did not match it)
        return "(-\\infty, \\infty)"
    return _plus_minus(_as_interval(s))


# a relation of an inequality: "less" (<, \le...) or "greater", and whether it is strict
_RELATION = re.compile(r"(<|>|≤|≥|\\(?:lt|le|leq|leqslant|gt|ge|geq|geqslant)(?![A-Za-z]))")
_LESS = frozenset(["<", "≤", "\\lt", "\\le", "\\leq", "\\leqslant"])
_STRICT = frozenset(["<", ">", "\\lt", "\\gt"])


def _as_interval(s: str) -> str:
    """An inequality in one variable as the interval it describes: ``x \\le 3`` is
    ``(-\\infty, 3]``, ``1 < x \\le 3`` is ``(1, 3]``, ``3 > x`` is ``(-\\infty, 3)``; ``s``
    itself for anything else (a bound with a letter in it, two relations that do not bound one
    interval, a comparison without a lone variable)."""
    found = _interval(s)
    return s if found is None else found[0]


# "or" between inequalities, as a word or in \text{}: no \s around it, which a failed match
# retried at every space of a long run would rescan (the parts are stripped instead)
_OR = re.compile(r"\\text\s*\{\s*or\s*\}|(?<![A-Za-z\\])or(?![A-Za-z])")


def _or_union(s: str) -> str:
    """Inequalities in one variable joined by "or" as the union of their intervals: ``x < -2
    \\text{ or } x > 3`` is ``(-\\infty, -2) \\cup (3, \\infty)`` (a list of inequalities
    matched no union); ``s`` itself for anything else ("and" is an intersection, and two
    variables bound no union)."""
    parts = _OR.split(s)
    if len(parts) < 2:
        return s
    found = [_interval(p.strip()) for p in parts]
    if any(f is None for f in found) or len({f[1] for f in found if f}) != 1:
        return s
    return " \\cup ".join(f[0] for f in found if f)


def _interval(s: str) -> tuple[str, str] | None:
    """``(interval, variable)`` of an inequality in one variable (see ``_as_interval``), else
    None."""
    parts = [p.strip() for p in _RELATION.split(s)]
    if len(parts) not in (3, 5):
        return None
    sides, ops = parts[::2], parts[1::2]
    lone = [i for i, side in enumerate(sides) if len(side) == 1 and side.isalpha()]
    if len(lone) != 1 or any(
        not side or _VARIABLE.search(_COMMAND.sub("", side)) for i, side in enumerate(sides) if i != lone[0]
    ):
        return None
    less = [op in _LESS for op in ops]
    if len(sides) == 3 and lone == [1] and less[0] == less[1]:  # a < x < b, b > x > a
        lo, hi, lo_op, hi_op = (
            (sides[0], sides[2], ops[0], ops[1]) if less[0] else (sides[2], sides[0], ops[1], ops[0])
        )
    elif len(sides) == 2 and lone == [0]:  # x < b, x > a
        lo, hi, lo_op, hi_op = (
            ("-\\infty", sides[1], "<", ops[0]) if less[0] else (sides[1], "\\infty", ops[0], "<")
        )
    elif len(sides) == 2 and lone == [1]:  # a < x, b > x
        lo, hi, lo_op, hi_op = (
            (sides[0], "\\infty", ops[0], "<") if less[0] else ("-\\infty", sides[0], "<", ops[0])
        )
    else:
        return None
    interval = f"{'(' if lo_op in _STRICT else '['}{lo}, {hi}{')' if hi_op in _STRICT else ']'}"
    return interval, sides[lone[0]]


def _plus_minus(s: str) -> str:
    """``a \\pm b`` is the list ``a + b, a - b``: ``\\pm 2`` is ``+2, -2``, ``\\frac{1 \\pm
    \\sqrt{5}}{2}`` both roots. In a list each element with one ``\\pm`` (or ``\\mp``) is
    expanded on its own (``\\pm 2, \\pm 3`` is ``+2, -2, +3, -3``; the tuple ``(\\pm 1, 2)`` is
    the two points ``(+1, 2), (-1, 2)``; in a set ``\\{\\pm 1, 2\\}`` the elements), and an
    answer with an element of two is left as written; so is an assignment list with a comma
    (``x = \\pm 1, y = 2``)."""
    if "\\pm" not in s and "\\mp" not in s:
        return s
    if "," not in s:
        return _expand_pm(s)
    if "=" in s:
        return s
    out = []
    for part in _split_top(s, ","):
        part = part.strip()
        if part.startswith("\\{") and part.endswith("\\}") and "," in part:
            inner = _plus_minus(part[2:-2])
            if inner == part[2:-2] and _PLUS_MINUS.search(inner):
                return s
            out.append(f"\\{{{inner}\\}}")
            continue
        expanded = _expand_pm(part)
        if expanded == part and _PLUS_MINUS.search(part):
            return s
        out.append(expanded)
    return ", ".join(out)


def _expand_pm(s: str) -> str:
    """``s`` with its one ``\\pm``/``\\mp`` as the pair of its two signs; ``s`` when it has none
    or more than one."""
    signs = _PLUS_MINUS.findall(s)
    if len(signs) != 1:
        return s
    first, second = ("+", "-") if signs[0].startswith("\\pm") else ("-", "+")
    return f"{_PLUS_MINUS.sub(first, s)}, {_PLUS_MINUS.sub(second, s)}"


# a control word ends at the first non-letter: \pm5 is \pm 5 (\b saw no end between m and 5)
_PLUS_MINUS = re.compile(r"\\(?:pm|mp)(?![A-Za-z])\s*")


def _name_order(name: str) -> tuple[str, int]:
    """``x_2`` before ``x_10``; ``x`` before ``y``."""
    base, _, sub = name.partition("_")
    digits = sub.strip("{}")
    return base, int(digits) if digits.isdigit() else -1


def _pairs(s: str) -> list[tuple[str, str]] | None:
    """The ``(variable, value)`` parts of a comma list of two or more assignments, else None."""
    parts = _split_top(s, ",")
    if len(parts) < 2:
        return None
    found = [_ASSIGN.match(p) for p in parts]
    if not all(found):
        return None
    return [(m[1], m[2].strip()) for m in found if m]


def _assignments(s: str) -> str | None:
    """A list of assignments in one form: ``x = 1, x = 2`` (the solutions of one unknown) is the
    list ``1, 2``; ``y = 2, x = 1`` (a solution of a system) is ``x=1, y=2``, ordered by
    variable, which ``compare`` reads as the tuple ``(1, 2)``."""
    pairs = _pairs(s)
    if pairs is None:
        return None
    pairs = [(n.replace("{", "").replace("}", ""), v) for n, v in pairs]
    names = {n for n, _ in pairs}
    if len(names) == 1:
        return ", ".join(v for _, v in pairs)
    if len(names) < len(pairs):  # x = 1, y = 2, x = 3: not one point; left as written
        return s
    return ", ".join(f"{n}={v}" for n, v in sorted(pairs, key=lambda nv: _name_order(nv[0])))


def _named(s: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """``(names, values)`` of a canonical ``x=1, y=2`` (see ``_assignments``), else None."""
    pairs = _pairs(s)
    if pairs is None or len({n for n, _ in pairs}) < len(pairs):  # not one point
        return None
    return tuple(n for n, _ in pairs), tuple(v for _, v in pairs)


# ----------------------------------------------------------------------------- structure


def _split_top(s: str, sep: str) -> list[str]:
    """Split at ``sep`` outside any bracket (``(``/``[``/``{`` open, ``)``/``]``/``}`` close,
    so half-open intervals balance)."""
    parts: list[str] = []
    depth = 0
    start = 0
    i = 0
    n = len(sep)
    while i < len(s):
        c = s[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and s.startswith(sep, i):
            parts.append(s[start:i].strip())
            start = i + n
            i += n
            continue
        i += 1
    parts.append(s[start:].strip())
    return parts


def _balanced(inner: str) -> bool:
    depth = 0
    for c in inner:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth < 0:
                return False
    return depth == 0


Shape = tuple[str, str, tuple[str, ...]]
"""``(kind, brackets, elements)``: kind is scalar, seq (tuple/interval), set or union."""


@_small_cache
def shape(s: str) -> Shape:
    if "\\cup" in s:
        parts = _split_top(s, "\\cup")
        if len(parts) > 1:
            return ("union", "", tuple(parts))
    if s.startswith("\\{") and s.endswith("\\}") and _balanced(s[2:-2]):
        return ("set", "{}", tuple(p for p in _split_top(s[2:-2], ",") if p))
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}" and _balanced(s[1:-1]):
        parts = _split_top(s[1:-1], ",")
        if len(parts) > 1:
            if s[0] == "{":
                return ("set", "{}", tuple(parts))
            return ("seq", s[0] + s[-1], tuple(parts))
    parts = _split_top(s, ",")
    if len(parts) > 1 and all(parts):
        return ("set", "", tuple(parts))
    return ("scalar", "", (s,))
