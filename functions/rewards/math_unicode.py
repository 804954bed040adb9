"""Unicode math in ASCII and LaTeX (``plain_unicode``): minus signs, operators, pi, infinity,
the root sign, superscript digits and vulgar fractions, as the canonical form and the unit
reader of ``functions.rewards.math_canonical`` take them."""

from __future__ import annotations

import re

_SIGNS = str.maketrans(
    {"\u2212": "-", "\ufe63": "-", "\uff0d": "-"}
    # the multiplication and division signs are their operators (sympy cannot read them:
    # 1\u00d710^3 was unparsable, not 1000); so is the middle dot U+00B7, as a product is
    # usually typed (2\u00b73 was unparsable, not 6), though it was once also a decimal point
    # (3\u00b714 is 42 here, not 3.14: no reading of it could be both)
    | {"\u00d7": " \\times ", "\u22c5": " \\cdot ", "\u00b7": " \\cdot ", "\u00f7": "/"}
    # pi, infinity, the square root sign and the empty set are their commands (2\u03c0 was not
    # 2\\pi, \u2205 not \\emptyset)
    | {"\u03c0": "\\pi ", "\u221e": "\\infty ", "\u221a": "\\sqrt ", "\u2205": "\\emptyset "}
    # ... and so are the floor and ceiling brackets (\u230a3.7\u230b was unparsable, not 3)
    | {"\u230a": " \\lfloor ", "\u230b": " \\rfloor ", "\u2308": " \\lceil ", "\u2309": " \\rceil "}
    # zero-width characters are not there (3\u200b is 3), nor a currency sign, as a dollar
    # sign is not (the euro, pound, yen and rupee signs: \u20ac5 is 5)
    | dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff\u20ac\u00a3\u00a5\u20b9", "")
)
# a run of superscript digits is one exponent (10\u2076\u2074 is 10^{64}); a vulgar fraction is
# its \frac (3\u00bd is 3\frac{1}{2}, which is 3.5, not 31/2)
_SUPERSCRIPTS = str.maketrans(
    "\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079\u207a\u207b", "0123456789+-"
)
_SUPERSCRIPT = re.compile("[\u207a\u207b]?[\u2070\u00b9\u00b2\u00b3\u2074-\u2079]+")
_VULGAR = {
    "\u00bd": (1, 2),
    "\u2153": (1, 3),
    "\u2154": (2, 3),
    "\u00bc": (1, 4),
    "\u00be": (3, 4),
    "\u2155": (1, 5),
    "\u2156": (2, 5),
    "\u2157": (3, 5),
    "\u2158": (4, 5),
    "\u2159": (1, 6),
    "\u215a": (5, 6),
    "\u2150": (1, 7),
    "\u215b": (1, 8),
    "\u215c": (3, 8),
    "\u215d": (5, 8),
    "\u215e": (7, 8),
    "\u2151": (1, 9),
    "\u2152": (1, 10),
}
_VULGAR_FRACTION = re.compile("[" + "".join(_VULGAR) + "]")


_ROOT_PAREN = re.compile("\u221a[ \t]*\\(")
_PAREN = re.compile(r"[()]")


def _root_parentheses(s: str) -> str:
    """``s`` with the parentheses of a root sign as its braces: \u221a(x+1) is ``\\sqrt{x+1}``
    (it was ``\\sqrt (x+1)``, a root of nothing, unparsable); a pair that never closes is left.
    One pass with a stack of open parentheses (linear, however deep)."""
    roots = {m.end() - 1: m.start() for m in _ROOT_PAREN.finditer(s)}  # its ( -> the sign
    if not roots:
        return s
    out = list(s)
    stack: list[int] = []
    for m in _PAREN.finditer(s):
        if m[0] == "(":
            stack.append(m.start())
        elif stack and (opened := stack.pop()) in roots:
            out[roots[opened] : opened + 1] = [""] * (opened - roots[opened]) + ["\\sqrt{"]
            out[m.start()] = "}"
    return "".join(out)


def plain_unicode(s: str) -> str:
    """``s`` with its Unicode math in ASCII and LaTeX: minus signs, operators, pi, infinity,
    the root sign (its parentheses its braces), superscript digits and vulgar fractions;
    zero-width characters dropped."""
    s = _root_parentheses(s)
    s = s.translate(_SIGNS)
    s = _SUPERSCRIPT.sub(lambda m: "^{" + m[0].translate(_SUPERSCRIPTS) + "}", s)
    return _VULGAR_FRACTION.sub(lambda m: "\\frac{{{}}}{{{}}}".format(*_VULGAR[m[0]]), s)
