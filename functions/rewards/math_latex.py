"""LaTeX answers as Python expressions for sympy's parser (``latex_to_python``): commands,
fractions, roots, functions and their arguments, implicit products. Pure string work, without
sympy: ``functions.rewards.math_sympy`` parses what it gives."""

from __future__ import annotations

import re

from functions.rewards.math_fast import GREEK

_FUNCS = {
    *("sqrt", "pi", "oo", "log", "sin", "cos", "tan", "cot", "sec", "csc", "exp", "E", "I", "Abs"),
    *("asin", "acos", "atan", "acot", "asec", "acsc"),
    "realroot",  # sympy's real_root, for an odd \sqrt[n]{} (see latex_to_python)
    "binomial",
    # floor, ceiling, gcd, lcm, max and min (\lfloor x \rfloor, \gcd(12, 18), \operatorname{lcm}(4,
    # 6), \max(3, 5) were unparsable, so a right answer in that form missed)
    *("floor", "ceiling", "gcd", "lcm", "Max", "Min", "max", "min"),
}
_LATEX_CMDS = {
    "\\pi": " pi ",
    "\\infty": " oo ",
    "\\cdot": "*",
    "\\times": "*",
    "\\div": "/",
    # a function name ends with a space: the parser skips the one after the command, and
    # "\\ln 2" written "log2" was a product of the symbols l, o, g and 2
    "\\ln": " log ",
    "\\log": " log ",
    "\\exp": " exp ",
    "\\sin": " sin ",
    "\\cos": " cos ",
    "\\tan": " tan ",
    "\\cot": " cot ",
    "\\sec": " sec ",
    "\\csc": " csc ",
    "\\arcsin": " asin ",
    "\\arccos": " acos ",
    "\\arctan": " atan ",
    "\\arccot": " acot ",
    "\\arcsec": " asec ",
    "\\arccsc": " acsc ",
    "\\lfloor": " floor(",
    "\\rfloor": ")",
    "\\lceil": " ceiling(",
    "\\rceil": ")",
    "\\gcd": " gcd",
    "\\lcm": " lcm",
    "\\max": " Max",
    "\\min": " Min",
}
# the functions whose arguments a comma separates: anywhere else a comma lists nothing to sympy
# (3(1, 2) is no number; compare has split the lists and tuples of an answer already)
_MULTI_ARGUMENT = frozenset(["gcd", "lcm", "Max", "Min", "max", "min", "binomial", "realroot"])
# a name starts only where a word does, and its spaces are few: linear in a long run of either
_CALL_OPEN = re.compile(r"(?<![A-Za-z])([A-Za-z]+)[ \t]{0,3}\(|[(),]")
# C(5, 2) is the binomial coefficient (it was the product of a symbol C and the point (5, 2)):
# integer arguments or one letter each (C(n, 2)); \mathrm{C} is C once canonical
_CHOOSE_CALL = re.compile(r"(?<![A-Za-z\\_])C[ \t]*\([ \t]*(\d+|[A-Za-z])[ \t]*,[ \t]*(\d+|[A-Za-z])[ \t]*\)")
_CMD = re.compile(r"\\[A-Za-z]+")
_GLUED_NUMBERS = re.compile(r"[\d.]\s+[\d.]")


# a subscript: one letter, a run of digits (x_10, as answers mean it), or letters and digits in braces
_SUBSCRIPT = re.compile(r"_\s*(?:\{\s*([A-Za-z0-9]+)\s*\}|(\d+|[A-Za-z]))")


def _subscript(m: re.Match[str] | None) -> str:
    return "" if m is None else "_" + (m[1] or m[2])


_TRIG = re.compile(r"\\(?:sin|cos|tan|cot|sec|csc)(?![A-Za-z])")
# \sin^{-1} x is the inverse function (arcsin), as textbooks and MATH write it, not the power
# -1 of \sin: read so, \sin^{-1} x was \csc x and \tan^{-1} 1 was \cot 1, not \frac{\pi}{4}
_INVERSE_TRIG = re.compile(
    r"\\(sin|cos|tan|cot|sec|csc)[ \t]*\^[ \t]*(?:\{[ \t]*-[ \t]*1[ \t]*\}|-[ \t]*1(?![\d.]))"
)
_DEGREES = re.compile(r"(\d+(?:\.\d+)?)\s*\^\s*(?:\{\s*\\circ\s*\}|\\circ)")


def latex_to_python(s: str) -> str | None:
    r"""A sympy-parsable string for LaTeX-ish ``s``, or None. Iterative (an explicit brace
    stack), so deep nesting costs no recursion. Degrees in a trigonometric expression are
    radians (``\tan 45^\circ`` is 1); elsewhere a degree sign is the fast path's to drop."""
    s = _INVERSE_TRIG.sub(r"\\arc\1 ", s)
    s = _CHOOSE_CALL.sub(r"\\binom{\1}{\2}", s)
    if _TRIG.search(s):
        s = _DEGREES.sub(r"{\1 \\cdot \\frac{\\pi}{180}}", s)
    out: list[str] = []
    stack: list[str] = []
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            m = _CMD.match(s, i)
            if m is None:
                if s.startswith("\\}", i) and stack and stack[-1] == "set_call":
                    stack.pop()
                    out.append(")")
                    i += 2
                    continue
                return None
            cmd = m.group()
            i = m.end()
            while i < n and s[i] == " ":
                i += 1
            if cmd in ("\\frac", "\\binom"):
                if i >= n or s[i] != "{":
                    return None
                stack.append("frac1" if cmd == "\\frac" else "binom1")
                out.append("((" if cmd == "\\frac" else " binomial((")
                i += 1
            elif cmd == "\\log" and i < n and s[i] == "_":  # \log_2 8, \log_{b} x: log(x)/log(b)
                i += 1
                if i < n and s[i] == "{":
                    j = s.find("}", i)
                    base, i = (s[i + 1 : j], j + 1) if j > 0 else ("", n)
                else:
                    base, i = s[i : i + 1], i + 1
                base_code = latex_to_python(base) if base.strip() else None
                if base_code is None:
                    return None
                out.append(f" (1/log({base_code}))*log")
            elif cmd == "\\sqrt":
                if i < n and s[i] == "[":
                    j = s.find("]", i)
                    if j < 0 or j + 1 >= n or s[j + 1] != "{":
                        return None
                    idx = latex_to_python(s[i + 1 : j])
                    if idx is None:
                        return None
                    if idx.strip().isdigit() and int(idx) % 2:
                        # an odd root of a negative number is the real one, as answers mean
                        # it (\sqrt[3]{-8} is -2; sympy's principal root is 1 + i\sqrt{3})
                        stack.append("realroot:" + idx.strip())
                        out.append(" realroot((")
                    else:
                        stack.append("root:" + idx)
                        out.append("((")
                    i = j + 2
                elif i < n and s[i] == "{":
                    stack.append("sqrt")
                    out.append(" sqrt(")
                    i += 1
                else:
                    return None
            elif cmd in ("\\max", "\\min") and s.startswith("\\{", i):  # \max\{3, 5\}
                stack.append("set_call")
                out.append(_LATEX_CMDS[cmd] + "(")
                i += 2
            elif cmd in _LATEX_CMDS:
                out.append(_LATEX_CMDS[cmd])
            elif (letter := GREEK.get(cmd[1:])) is not None:
                # a symbol named _theta: no input spells a name with "_" in front, sympy does
                # not split it into letters, and it is not the word "eta" or "nu"
                sub = _SUBSCRIPT.match(s, i)
                if sub is not None:
                    i = sub.end()
                out.append(f" _{letter}{_subscript(sub)} ")
            else:
                return None
            continue
        if c == "_":  # x_1, a_n, x_{12}: the symbol named so, after a letter only
            sub = _SUBSCRIPT.match(s, i)
            if sub is None or not out or not out[-1][-1:].isalpha() or not out[-1].isascii():
                return None
            out.append(_subscript(sub) + " ")  # x_1x_2 is x_1 * x_2
            i = sub.end()
            continue
        if c == "{":
            stack.append("group")
            out.append("(")
        elif c == "}":
            if not stack:
                return None
            kind = stack.pop()
            if kind in ("frac1", "binom1"):
                out.append(")/" if kind == "frac1" else "),")
                while i + 1 < n and s[i + 1] == " ":
                    i += 1
                if i + 1 >= n or s[i + 1] != "{":
                    return None
                stack.append("frac2")
                out.append("(")
                i += 1
            elif kind == "frac2":
                out.append("))")
            elif kind.startswith("root:"):
                out.append(f")**(1/({kind[5:]})))")
            elif kind.startswith("realroot:"):
                out.append(f"), {kind[9:]})")
            else:
                out.append(")")
        elif c == "^":
            out.append("**")
        elif c == "|":  # |x|: the absolute value (no nesting of bars inside bars)
            if stack and stack[-1] == "abs":
                stack.pop()
                out.append(")")
            else:
                stack.append("abs")
                out.append(" Abs(")
        elif c in "[]":
            out.append("(" if c == "[" else ")")
        elif c == "!":  # a factorial (sympy's factorial_notation); "!=" is a relation, not a value
            if s.startswith("!=", i):
                return None
            out.append(c)
        elif c.isalnum() or c in " .+-*/(),":
            out.append(c)
        else:
            return None
        i += 1
    if stack:
        return None
    text = "".join(out)
    if "," in text and not _commas_in_calls(text):
        return None
    if _GLUED_NUMBERS.search(text):  # "5 6" is two numbers (5 \text{ or } 6), not 30
        return None
    # a numeral with two points (1.000.000, 3.0.0) is no number: Python's tokenizer read it as
    # the product 1.000 * .000, so it was 0
    if _TWO_POINTS.search(text):
        return None
    # a leading zero (2024-03-04, x + 03) is no digit of its own: Python's tokenizer read 03
    # as 0 and 3, a product that is 0 (2024-03-04 was 2024, x + 03 was x); 0x10 is not hex 16
    text = _LEADING_ZEROS.sub("", _RADIX_PREFIX.sub("0 ", text))
    # words: known functions stay, short letter runs are products of symbols, others are text
    # (a name's subscript, x_ab, and a Greek letter's name, _theta, are not words); a short
    # word of prose is prose, not a product of its letters ("not 0", "0 or 1" and "x is 0"
    # were 0)
    for word in set(re.findall(r"(?<![A-Za-z_])[A-Za-z]+", text)):
        if (word not in _FUNCS and len(word) > 3) or word.lower() in _PROSE:
            return None
    text = re.sub(r"(?<![A-Za-z_])([a-z]{2,3})(?![A-Za-z(])", _split_word, text)
    return _BARE_ARGUMENT.sub(_call, text)


_TWO_POINTS = re.compile(r"\.\d*\.")
_LEADING_ZEROS = re.compile(r"(?<![\w.])0+(?=\d)")
_RADIX_PREFIX = re.compile(r"(?<![\w.])0(?=[xXbBoO])")
_PROSE = frozenset("or and not nor but no yes is are was the any all if of for".split())
"""Short words of prose: never a product of their letters in an answer."""


# a function written without parentheses, whose argument is followed by another function:
# "\sin x \cos x" is sin(x)*cos(x), where sympy's implicit application read sin(x*cos(x))
_APPLIED = r"(?:a?(?:sin|cos|tan|cot|sec|csc)|log|exp)"
_BARE_ARGUMENT = re.compile(
    rf"\b({_APPLIED})(\s*\*\*\s*\d+)?\s+((?:[A-Za-z0-9._]|\*\*)+)(?=\s*\*?\s*(?:{_APPLIED}|sqrt|Abs)\b)"
)


def _commas_in_calls(text: str) -> bool:
    """Whether every comma of ``text`` separates the arguments of a function that takes
    several (``gcd(12, 18)``, ``binomial((5),(2))``). One pass with a stack of parentheses."""
    calls: list[bool] = []
    for m in _CALL_OPEN.finditer(text):
        if m[0] == ",":
            if not calls or not calls[-1]:
                return False
        elif m[0] == ")":
            if calls:
                calls.pop()
        else:
            calls.append(m[1] is not None and m[1] in _MULTI_ARGUMENT)
    return True


def _call(m: re.Match[str]) -> str:
    name, power, arg = m.group(1), m.group(2) or "", m.group(3)
    return f"{name}({arg}){power.strip()} "


def _split_word(m: re.Match[str]) -> str:
    w = m.group(1)
    return w if w in _FUNCS else "*".join(w)
