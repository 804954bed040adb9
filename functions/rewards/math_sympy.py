"""The sympy path of ``math_answer``'s equivalence: LaTeX to a sympy expression, the scalar
test (exact, numeric, at fixed points), and ``sympy_equivalent``, which runs it in a forked
child killed after a wall-clock limit."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import math
import os
import random
import re
import select
import signal
import time
from fractions import Fraction
from typing import Any

from fabric.errors import Misconfigured
from functions.rewards.math_fast import GREEK, Verdict, _close, _fast_scalar, _ulp, as_fraction, compare

DEFAULT_TIMEOUT_S = 2.0
"""Wall-clock limit of the sympy child, in seconds."""
MAX_TIMEOUT_S = 5.0
"""The longest limit a caller may ask for: half of ``math_answer``'s own ``timeout_s`` (10 s),
so that extraction, the fork and the sympy child all end before the worker running the call is
killed for running too long."""
_MAX_CHILD_MEMORY = 1 << 30
"""Address space the child may add to the parent's, so a huge power fails fast."""

# ----------------------------------------------------------------------------- sympy (child only)

_sympy: Any = None


def _load_sympy() -> Any:
    global _sympy
    if _sympy is None:
        try:
            import sympy
            from sympy.parsing import sympy_parser
        except ImportError as e:
            # the worker's install, not the answer: only symbolic answers get here, and a
            # failure_score would score just those (Misconfigured is never scored)
            raise Misconfigured(
                "the math_answer reward needs sympy for symbolic answers: pip install 'rl-fabric[rewards]'"
            ) from e
        _sympy = (sympy, sympy_parser)
        # sympy imports modules lazily on first use (evalf, the parser, polys); do it once
        # here so each forked child does not pay ~100 ms for it again
        for pred, gt in _WARM_UP:
            compare(pred, gt, sympy_scalar)
    return _sympy


_WARM_UP = (
    ("x^2+2x+1", "(x+1)^2"),
    ("\\pi/2", "1.57"),
    ("2\\sqrt{2}", "\\sqrt[3]{8}"),
    ("e^{i\\pi}", "\\frac{\\sin(x)}{\\log(3)}"),
)


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


def _parse(s: str) -> Any:
    sympy, sp = _load_sympy()
    code = latex_to_python(s)
    if code is None or not code.strip():
        return None
    # a decimal is read as the exact number it spells (123456789013.0 is 123456789013, not a
    # 15-digit Float); whether a side had one is tracked by _has_decimal, for _num_close
    trans = (
        *sp.standard_transformations,
        sp.implicit_multiplication_application,
        sp.convert_xor,
        sp.rationalize,
    )
    local = {"e": sympy.E, "i": sympy.I, "E": sympy.E, "I": sympy.I, "pi": sympy.pi, "oo": sympy.oo}
    local["realroot"] = sympy.real_root
    local |= {"max": sympy.Max, "min": sympy.Min}
    try:
        return sp.parse_expr(code, local_dict=local, transformations=trans)
    except Exception:  # sympy raises anything from SyntaxError to TypeError on junk
        return None


_REL_TOL = 1e-9
"""Relative tolerance of numeric comparisons (see ``functions.rewards.math``)."""
_EXACT_REL_TOL = 1e-20
"""Relative tolerance between two exact (Float-free) values evaluated at 30 digits."""
_POINTS = ((0.5381, 1.2713), (1.9127, -0.7349), (-1.3163, 2.4471))
_SECRET_POINTS = 2
_random = random.SystemRandom()


def _identity_points(syms: list[Any]) -> list[dict[Any, Any]]:
    """Where the identity test evaluates both sides: three fixed points (both signs, so that
    ``|x|`` is not ``x``) and two drawn at random for each call from the OS's generator. The
    fixed points are public (this file): ``x^2 + (x-0.5381)(x-1.9127)(x+1.3163)`` vanishes at
    them and matched ``x^2``; no answer can vanish at points it cannot know. An honest identity
    holds everywhere, so the random points never change its verdict.

    The points are exact rationals (six decimals), not Floats: an exact expression evaluated
    there stays exact, so it is compared at the exact tolerance, and ``x^2 + 10^{-12}`` is not
    ``x^2`` (at Float points both sides were rounded values, within 1e-9 of each other)."""
    sympy, _ = _load_sympy()

    def exact(v: float) -> Any:
        return sympy.Rational(f"{v:.6f}")

    points = [
        {s: exact(x0 + j * dx / (k + 2)) for j, s in enumerate(syms)} for k, (x0, dx) in enumerate(_POINTS)
    ]
    points += [{s: exact(_random.uniform(-2.5, 2.5)) for s in syms} for _ in range(_SECRET_POINTS)]
    return points


_DECIMAL_POINT = re.compile(r"\d\.|\.\d")


def _has_decimal(s: str) -> bool:
    """Whether ``s`` writes a decimal (``1.5``, ``.5``, ``3.``): a rounded number, maybe."""
    return bool(_DECIMAL_POINT.search(s))


def _num_close(a: Any, b: Any, rounded_a: bool = False, rounded_b: bool = False) -> bool:
    """Whether prediction ``a`` equals ground truth ``b`` (numeric sympy values) within the
    documented tolerance; ``rounded_*``: that side was written with a decimal.

    Everything stays in sympy Floats (mpmath: arbitrary exponent), so ``9^{999}`` or
    ``e^{1000}`` is a huge finite number rather than a Python ``inf`` that compares "close" to
    anything (``inf <= 1e-9 * inf``). A value that is not finite (``oo``, ``-oo``) equals only
    a structurally identical one (an undefined one, ``zoo`` or ``nan``, is never compared:
    ``_undefined``). Against an exact rational ground truth,
    an exact rational or an expression with a decimal in it (read as the exact number it spells)
    must be equal: the tolerance for a rounded decimal applies to a plain one (the fast path,
    where its last place is known) and, here, to a ground truth that is irrational or itself
    written as a decimal; ``(123456789013.0)``, ``123456789100.0 \\cdot 1`` are not
    ``123456789012``. An exact irrational prediction against an exact rational ground truth
    must be within ``_EXACT_REL_TOL`` of it absolutely, not only relatively."""
    sympy, _ = _load_sympy()
    if not (a.is_finite and b.is_finite):
        return bool(a == b)
    if b.is_Rational and not rounded_b and (a.is_Rational or rounded_a):
        return bool(a == b)
    # the 1e-9 tolerance is for rounded decimals (written, or the Float points of the identity
    # test); two exact values (sqrt, pi, ...) evaluated to 30 digits must agree to 20
    rounded = rounded_a or rounded_b or a.has(sympy.Float) or b.has(sympy.Float)
    tol = _REL_TOL if rounded else _EXACT_REL_TOL
    d = abs(sympy.N(a - b, 30))
    scale = max(abs(sympy.N(a, 30)), abs(sympy.N(b, 30)))
    if not (d.is_number and scale.is_number and d.is_finite and scale.is_finite):
        return False
    if b.is_Rational and not rounded:
        # two exact values, the ground truth rational: the difference must be small in
        # absolute terms too, or 10^{30} + \sqrt{2} would be 10^{30} + 7 (20 digits of 31 agree);
        # evalf finds a true zero far below it (0.e-146)
        return bool(d <= tol * min(scale, 1))
    return bool(d <= tol * scale)


def _undefined(x: Any) -> bool:
    """Whether sympy value ``x`` holds a division by zero or an indeterminate form."""
    sympy, _ = _load_sympy()
    return bool(x.has(sympy.zoo, sympy.nan))


def sympy_scalar(p: str, g: str) -> Verdict:
    fast = _fast_scalar(p, g)
    if fast[0] is not None:
        return fast
    sympy, _ = _load_sympy()
    a, b = _parse(p), _parse(g)
    if a is None or b is None:
        return False, "unparsable"
    try:
        # a division by zero (zoo, complex infinity) or an indeterminate form (nan: 0/0,
        # \infty - \infty) is no number: sympy holds zoo == zoo, so 1/0 matched 2/0. It
        # matches nothing here; the fast path's string rule has already matched its own text
        if _undefined(a) or _undefined(b):
            return False, "undefined"
        if a == b:
            return True, "sympy"
        diff = a - b
        if diff == 0:
            return True, "sympy"
        syms = sorted(diff.free_symbols | a.free_symbols | b.free_symbols, key=str)
        rounded = _has_decimal(p), _has_decimal(g)
        if not syms:
            if b.is_Rational and not rounded[1] and (x := as_fraction(p)) is not None:
                # a plain number against an exact rational written otherwise (2^{64}): the fast
                # path's rule, which knows the last place of a decimal
                return _close(x, Fraction(int(b.p), int(b.q)), _ulp(p)), "sympy"
            return _num_close(a, b, *rounded), "sympy"
        checked = 0
        for sub in _identity_points(syms):
            av, bv = a.subs(sub), b.subs(sub)
            fa, fb = av.is_finite, bv.is_finite
            if fa is not fb and None not in (fa, fb):  # x^{\infty} is 0 at 0.5, not at 1.9
                return False, "sympy"
            if not (fa and fb):
                continue
            if not _num_close(av, bv, *rounded):
                return False, "sympy"
            checked += 1
        if checked >= 2:
            return True, "sympy"
        return bool(sympy.simplify(diff) == 0), "sympy"
    except Exception:  # comparisons of odd objects (sets, relations) raise TypeError etc.
        return False, "sympy_error"


# ----------------------------------------------------------------------------- the child

_PR_SET_PDEATHSIG = 1
_libc: Any = None  # loaded in the parent: the child should do as little as it can


def _load_libc() -> Any:
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
    return _libc


def check_timeout(timeout_s: float) -> float:
    """``timeout_s`` when it is a usable limit for the sympy child, else ``ValueError``: 0 or a
    negative limit made every sympy answer a silent timeout, NaN an opaque error."""
    if not (isinstance(timeout_s, int | float) and 0 < timeout_s <= MAX_TIMEOUT_S):  # NaN fails too
        raise ValueError(
            f"sympy_timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S}], got {timeout_s!r}"
        )
    return float(timeout_s)


def _confine_child(parent_pid: int, keep_fd: int, timeout_s: float) -> int:
    """Make the child unable to outlive its parent or its budget, whatever it computes.

    The parent kills it at its deadline, but the parent itself may be killed first (a worker
    past its function's ``timeout_s`` is SIGKILLed): the kernel then kills the child too
    (``PR_SET_PDEATHSIG``; the ``getppid`` check covers a parent that died before ``prctl``).
    It keeps no file descriptor but its result pipe, so an orphan could not hold its parent's
    socket open (the pool waits for EOF on it to replace the worker), and ``RLIMIT_CPU`` kills
    it on its own if nobody else does (a parent stopped, not dead). Returns the result pipe's
    descriptor (moved above 2 if it was one of them)."""
    libc = _libc
    if libc:
        with contextlib.suppress(Exception):  # no prctl: not Linux; the other limits still apply
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    if keep_fd <= 2:  # the parent had no stdin or stdout: the pipe got its number
        keep_fd = fcntl.fcntl(keep_fd, fcntl.F_DUPFD, 3)
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    os.closerange(3, keep_fd)
    os.closerange(keep_fd + 1, max(keep_fd + 1, os.sysconf("SC_OPEN_MAX")))
    try:
        import resource

        cpu = math.ceil(timeout_s) + 1
        # soft == hard: the kernel sends SIGKILL at once (SIGXCPU would dump core)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + _MAX_CHILD_MEMORY, vm + _MAX_CHILD_MEMORY))
    except (OSError, ValueError, ImportError):
        pass  # no /proc or no rlimits: the wall-clock kill still applies
    return keep_fd


def sympy_equivalent(pred: str, gt: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Decide with sympy in a forked child killed after ``timeout_s`` (at most
    ``MAX_TIMEOUT_S``); a timeout is ``(False, "timeout")``."""
    timeout_s = check_timeout(timeout_s)
    _load_sympy()  # imported here, before the fork, so the child does not pay for it
    _load_libc()
    parent_pid = os.getpid()
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # the child: compute, write one line, exit without cleanup handlers
        code = 1
        try:
            w = _confine_child(parent_pid, w, timeout_s)
            try:
                verdict, rule = compare(pred, gt, sympy_scalar)
            except MemoryError:
                verdict, rule = False, "memory"
            except RecursionError:
                verdict, rule = False, "too_deep"
            os.write(w, json.dumps([bool(verdict), rule]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout_s
    data = b""
    # poll, not select: select() refuses a descriptor numbered 1024 or more, which a busy
    # process (a server holding many connections) hands out
    poller = select.poll()
    poller.register(r, select.POLLIN)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False, "timeout"
            if not poller.poll(max(1, math.ceil(left * 1000))):
                return False, "timeout"
            chunk = os.read(r, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        with contextlib.suppress(ProcessLookupError):  # it may have exited already
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    try:
        verdict, rule = json.loads(data)
        return bool(verdict), str(rule)
    except (ValueError, TypeError):
        return False, "child_failed"
