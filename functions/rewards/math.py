r"""``math_answer``: 1.0 when the final answer of a completion is mathematically equivalent
to the ground truth.

Extraction (first that applies): the last ``\boxed{}``/``\fbox{}``, else "the answer is ..."
/ "Answer: ...", else the last number in the text.

Equivalence, cheapest first:

1. **Fast path, in-process, no sympy.** Both answers are canonicalised (``$``, ``\left``/
   ``\right``, spacing commands, ``\text{}`` units, unit words, degrees, ``\dfrac``, a
   leading ``x =``, thousands separators removed). Equal strings are equal; two plain
   numbers (integers, decimals, ``a/b``, ``\frac{a}{b}``, ``1e3``, ``1 \times 10^3``) are
   compared exactly as fractions; two words are compared as normalised text. Intervals,
   tuples, sets and ``\cup`` unions are split into elements first, so a bracket or size
   mismatch is decided here too.
2. **sympy, in a forked child process** killed after ``timeout_s`` (default 2 s). The child
   converts the LaTeX to a sympy expression and compares: ``a - b == 0`` exactly; for numbers,
   numerically at 30 digits; with free symbols, at three fixed points (a deterministic
   identity test). A timeout, a crash or an unparsable answer counts as *not equivalent*,
   and ``info`` says which. The limit works in any thread or worker process: it uses no
   signals, only ``os.fork``, a pipe and ``SIGKILL``, and the child is always reaped.

Rules worth knowing:

* **Tolerance.** Numbers are equal when ``|a - b| <= 1e-9 * max(|a|, |b|)``. A rounded
  decimal therefore does *not* match an exact value (``1.57`` is not ``\pi/2``, ``0.333`` is
  not ``1/3``); only a decimal good to about ten significant digits does.
* **Percentages.** When exactly one side has a ``%`` (or ``\%``, "percent"), its number
  ``X`` is read as ``X/100`` if the other side is written as a fraction or decimal
  (``50% == 0.5 == 1/2``) and as ``X`` if the other side is an integer (``50% == 50``).
* **Collections.** ``(a, b)``, ``[a, b)`` etc. compare element-wise and brackets must match
  (an open interval is not a closed one); ``\{...\}`` sets and bare comma lists compare as
  sets (order and repeats ignored).
* **Symbols.** ``e`` is Euler's number, ``i`` the imaginary unit; words that are not math
  functions are text, never multiplied-out symbols.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import time
from collections.abc import Callable
from fractions import Fraction
from functools import lru_cache
from typing import Any

import fabric
from fabric.protocol import RewardResult, Trajectory
from functions.rewards.answer import _ANSWER_COLON, _ANSWER_IS, last_boxed, normalize

DEFAULT_TIMEOUT_S = 2.0
"""Wall-clock limit of the sympy child, in seconds."""
_MAX_CHILD_MEMORY = 1 << 30
"""Address space the child may add to the parent's, so a huge power fails fast."""
_TOL = Fraction(1, 10**9)

# ----------------------------------------------------------------------------- extraction

_LAST_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+(?:\.\d+)?)?|[-+]?\.\d+"
)


def extract_final(text: str) -> tuple[str | None, str]:
    """``(answer, rule)``: rule is ``boxed``, ``answer_is``, ``last_number`` or ``none``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed"
    matches = _ANSWER_IS.findall(text) or _ANSWER_COLON.findall(text)
    if matches:
        return matches[-1].strip().split("\n")[0], "answer_is"
    numbers = _LAST_NUMBER.findall(text)
    if numbers:
        return numbers[-1], "last_number"
    return None, "none"


# ----------------------------------------------------------------------------- canonical form

_UNITS = (
    "mm cm m km meter meters metre metres centimeter centimeters millimeter millimeters kilometer "
    "kilometers in inch inches ft foot feet yd yard yards mi mile miles mph kph kmh "
    "g kg mg gram grams kilogram kilograms lb lbs pound pounds oz ounce ounces ton tons "
    "l ml liter liters litre litres gallon gallons cup cups quart quarts "
    "s sec second seconds min minute minutes h hr hrs hour hours day days week weeks month months "
    "year years dollar dollars cent cents euro euros "
    "deg degree degrees radian radians unit units sq square cubic "
    "people persons students apples cookies marbles pages points ways times"
).split()
_UNIT_WORDS = re.compile(
    r"(?:\s*(?:\b(?:"
    + "|".join(sorted(_UNITS, key=len, reverse=True))
    + r")\b\.?(?:\^\{?[23]\}?|²|³)?))+\s*$",
    re.IGNORECASE,
)
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_TEXT_UNIT = re.compile(_TEXT_CMD.pattern + r"(?:\s*\^\s*\{?[23]\}?)?")
_SPACING = re.compile(r"\\[,;:! ]|\\(?:quad|qquad|displaystyle|textstyle)\b|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)\b\.?")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?|°|\\degree\b")
_LHS = re.compile(
    r"^(?:[a-zA-Z](?:_\{?\w+\}?)?|\(\s*[a-zA-Z](?:\s*,\s*[a-zA-Z])*\s*\))\s*(?:=|\\in\b)\s*(?=\S)"
)
_THIN_THOUSANDS = re.compile(r"(?<=\d)\\[,!: ](?=\d{3}\b)")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_FRAC_SHORT2 = re.compile(r"\\frac\s*\{([^{}]*)\}\s*(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\d+|[a-zA-Z])")


def _strip_text(s: str) -> str:
    r"""``\text{cm}`` after a number is a unit (dropped); ``\text{Paris}`` alone is the answer."""
    without = _TEXT_UNIT.sub("", s).strip()
    if without and any(c.isdigit() for c in without):
        return without
    return _TEXT_CMD.sub(r"\1", s)


@lru_cache(maxsize=65536)
def canonical(answer: str) -> str:
    """The answer with presentation stripped (see the module docstring)."""
    s = answer.strip()
    s = s.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "")
    s = _LEFT_RIGHT.sub("", s)
    s = _THIN_THOUSANDS.sub("", s)
    s = _SPACING.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", "")
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "%").replace("\\percent", "%")
    s = re.sub(r"\s*\bpercent\b", "%", s, flags=re.IGNORECASE)
    s = _strip_text(s)
    s = s.strip().rstrip(".").strip()
    if any(c.isdigit() for c in s):
        s = _UNIT_WORDS.sub("", s).strip()
    s = _LHS.sub("", s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_SHORT2.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = " ".join(s.split())
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    return s


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


@lru_cache(maxsize=65536)
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


# ----------------------------------------------------------------------------- numbers

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_PLAIN = re.compile(rf"^{_NUM}$")
_SLASH = re.compile(rf"^({_NUM})\s*/\s*({_NUM})$")
_FRAC = re.compile(rf"^([-+]?)\\frac\{{\s*({_NUM})\s*\}}\{{\s*({_NUM})\s*\}}$")
_SCI = re.compile(
    rf"^({_NUM})\s*(?:\\times|\\cdot|\*|x)\s*10\s*(?:\^|\*\*)\s*\{{?\s*([-+]?\d{{1,3}})\s*\}}?$"
)
_MIXED = re.compile(r"^([-+]?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}$")
_POW10 = re.compile(r"^10\s*\^\s*\{?\s*([-+]?\d{1,3})\s*\}?$")


@lru_cache(maxsize=65536)
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
        if (m := _MIXED.match(s)) and 0 < int(m[3]) < int(m[4]):  # 3\frac{1}{3} is 3 + 1/3
            v = int(m[2]) + Fraction(int(m[3]), int(m[4]))
            return -v if m[1] == "-" else v
        if m := _POW10.match(s):
            return Fraction(10) ** int(m[1])
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def _close(a: Fraction, b: Fraction) -> bool:
    return a == b or abs(a - b) <= _TOL * max(abs(a), abs(b))


def _is_integer_form(s: str) -> bool:
    return bool(re.fullmatch(r"[-+]?\d+", s))


_WORD = re.compile(r"^[A-Za-z][A-Za-z ]*$")


# ----------------------------------------------------------------------------- comparison

Verdict = tuple[bool | None, str]
"""``(equivalent, rule)``; ``None`` means the fast path cannot tell."""


def _percent(pred: str, gt: str) -> tuple[str, str]:
    """Apply the percentage rule: drop the ``%`` signs, scaling by 1/100 where it applies."""
    pp, gp = pred.endswith("%"), gt.endswith("%")
    if pp == gp:
        return pred.rstrip("%").strip(), gt.rstrip("%").strip()

    def scaled(x: str, other: str) -> str:
        x = x.rstrip("%").strip()
        if _is_integer_form(other):
            return x
        v = as_fraction(x)
        return str(v / 100) if v is not None else f"({x})/100"

    if pp:
        return scaled(pred, gt), gt
    return pred, scaled(gt, pred)


def _fast_scalar(p: str, g: str) -> Verdict:
    if p == g or p.replace(" ", "") == g.replace(" ", ""):
        return True, "string"
    a, b = as_fraction(p), as_fraction(g)
    if a is not None and b is not None:
        return _close(a, b), "number"
    pw, gw = bool(_WORD.match(p)), bool(_WORD.match(g))
    if pw and gw:
        if normalize(p) == normalize(g):
            return True, "text"
        if max(len(w) for w in (p + " " + g).split()) > 3:  # words, not products like "ab"
            return False, "text"
        return None, "undecided"
    if (pw and b is not None) or (gw and a is not None):
        return False, "text"
    return None, "undecided"


def compare(pred: str, gt: str, scalar: Callable[[str, str], Verdict]) -> Verdict:
    """Compare canonical answers structure-first, scalars with ``scalar``."""
    pred, gt = _percent(pred, gt)
    ps, gs = shape(pred), shape(gt)
    if ps[0] == "scalar" and gs[0] == "scalar":
        return scalar(pred, gt)
    if ps[0] != gs[0] or ps[1] != gs[1]:
        if {ps[0], gs[0]} == {"set"}:  # a bare list against a braced set
            pass
        else:
            return False, "structure"
    pe, ge = ps[2], gs[2]
    if ps[0] == "set":
        pe, ge = tuple(dict.fromkeys(pe)), tuple(dict.fromkeys(ge))
    if len(pe) != len(ge):
        return False, "structure"
    rule = "structure"
    if ps[0] != "set":
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


def fast_equivalent(pred: str, gt: str) -> Verdict:
    """In-process verdict on canonical answers, or ``None`` when sympy is needed."""
    return compare(pred, gt, _fast_scalar)


# ----------------------------------------------------------------------------- sympy (child only)

_sympy: Any = None


def _load_sympy() -> Any:
    global _sympy
    if _sympy is None:
        try:
            import sympy
            from sympy.parsing import sympy_parser
        except ImportError as e:
            raise ImportError(
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


_FUNCS = {"sqrt", "pi", "oo", "log", "sin", "cos", "tan", "cot", "sec", "csc", "exp", "E", "I", "Abs"}
_LATEX_CMDS = {
    "\\pi": " pi ",
    "\\infty": " oo ",
    "\\cdot": "*",
    "\\times": "*",
    "\\div": "/",
    "\\ln": " log",
    "\\log": " log",
    "\\exp": " exp",
    "\\sin": " sin",
    "\\cos": " cos",
    "\\tan": " tan",
    "\\cot": " cot",
    "\\sec": " sec",
    "\\csc": " csc",
}
_CMD = re.compile(r"\\[A-Za-z]+")


def latex_to_python(s: str) -> str | None:
    r"""A sympy-parsable string for LaTeX-ish ``s``, or None. Iterative (an explicit brace
    stack), so deep nesting costs no recursion."""
    out: list[str] = []
    stack: list[str] = []
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            m = _CMD.match(s, i)
            if m is None:
                return None
            cmd = m.group()
            i = m.end()
            while i < n and s[i] == " ":
                i += 1
            if cmd == "\\frac":
                if i >= n or s[i] != "{":
                    return None
                stack.append("frac1")
                out.append("((")
                i += 1
            elif cmd == "\\sqrt":
                if i < n and s[i] == "[":
                    j = s.find("]", i)
                    if j < 0 or j + 1 >= n or s[j + 1] != "{":
                        return None
                    idx = latex_to_python(s[i + 1 : j])
                    if idx is None:
                        return None
                    stack.append("root:" + idx)
                    out.append("((")
                    i = j + 2
                elif i < n and s[i] == "{":
                    stack.append("sqrt")
                    out.append(" sqrt(")
                    i += 1
                else:
                    return None
            elif cmd in _LATEX_CMDS:
                out.append(_LATEX_CMDS[cmd])
            else:
                return None
            continue
        if c == "{":
            stack.append("group")
            out.append("(")
        elif c == "}":
            if not stack:
                return None
            kind = stack.pop()
            if kind == "frac1":
                out.append(")/")
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
        elif c.isalnum() or c in " .+-*/()":
            out.append(c)
        else:
            return None
        i += 1
    if stack:
        return None
    text = "".join(out)
    # words: known functions stay, short letter runs are products of symbols, others are text
    for word in set(re.findall(r"[A-Za-z]+", text)):
        if word not in _FUNCS and len(word) > 3:
            return None
    text = re.sub(r"(?<![A-Za-z])([a-z]{2,3})(?![A-Za-z(])", _split_word, text)
    return text


def _split_word(m: re.Match[str]) -> str:
    w = m.group(1)
    return w if w in _FUNCS else "*".join(w)


def _parse(s: str) -> Any:
    sympy, sp = _load_sympy()
    code = latex_to_python(s)
    if code is None or not code.strip():
        return None
    trans = (*sp.standard_transformations, sp.implicit_multiplication_application, sp.convert_xor)
    local = {"e": sympy.E, "i": sympy.I, "E": sympy.E, "I": sympy.I, "pi": sympy.pi, "oo": sympy.oo}
    try:
        return sp.parse_expr(code, local_dict=local, transformations=trans)
    except Exception:  # sympy raises anything from SyntaxError to TypeError on junk
        return None


_POINTS = ((0.5381, 1.2713), (1.9127, -0.7349), (-1.3163, 2.4471))


def _num_close(a: Any, b: Any) -> bool:
    sympy, _ = _load_sympy()
    d = abs(complex(sympy.N(a - b, 30)))
    scale = max(abs(complex(sympy.N(a, 30))), abs(complex(sympy.N(b, 30))))
    return d <= 1e-9 * scale


def sympy_scalar(p: str, g: str) -> Verdict:
    fast = _fast_scalar(p, g)
    if fast[0] is not None:
        return fast
    sympy, _ = _load_sympy()
    a, b = _parse(p), _parse(g)
    if a is None or b is None:
        return False, "unparsable"
    try:
        if a == b:
            return True, "sympy"
        diff = a - b
        if diff == 0:
            return True, "sympy"
        syms = sorted(diff.free_symbols | a.free_symbols | b.free_symbols, key=str)
        if not syms:
            return _num_close(a, b), "sympy"
        checked = 0
        for k, (x0, dx) in enumerate(_POINTS):
            sub = {s: x0 + j * dx / (k + 2) for j, s in enumerate(syms)}
            av, bv = a.subs(sub), b.subs(sub)
            if not (av.is_finite and bv.is_finite):
                continue
            if not _num_close(av, bv):
                return False, "sympy"
            checked += 1
        if checked:
            return True, "sympy"
        return bool(sympy.simplify(diff) == 0), "sympy"
    except Exception:  # comparisons of odd objects (sets, relations) raise TypeError etc.
        return False, "sympy_error"


# ----------------------------------------------------------------------------- the child


def _child_memory_limit() -> None:
    try:
        import resource

        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (vm + _MAX_CHILD_MEMORY, vm + _MAX_CHILD_MEMORY))
    except (OSError, ValueError, ImportError):
        pass  # no /proc or no rlimits: the wall-clock kill still applies


def sympy_equivalent(pred: str, gt: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """Decide with sympy in a forked child killed after ``timeout_s``; a timeout is
    ``(False, "timeout")``."""
    _load_sympy()  # imported here, before the fork, so the child does not pay for it
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
            os.close(r)
            _child_memory_limit()
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
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False, "timeout"
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                return False, "timeout"
            chunk = os.read(r, 4096)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    try:
        verdict, rule = json.loads(data)
        return bool(verdict), str(rule)
    except (ValueError, TypeError):
        return False, "child_failed"


def is_equivalent(pred: str, gt: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """``(equivalent, rule)`` for two raw answers (not whole completions)."""
    p, g = canonical(pred), canonical(gt)
    if not p or not g:
        return False, "empty"
    verdict, rule = fast_equivalent(p, g)
    if verdict is not None:
        return verdict, rule
    return sympy_equivalent(p, g, timeout_s)


# ----------------------------------------------------------------------------- the reward

_EXAMPLE_TRAJ = {
    "messages": [
        {"role": "user", "content": "What is 1/4 + 1/4?"},
        {"role": "assistant", "content": "1/4 + 1/4 = 2/4, so \\boxed{\\dfrac{1}{2}}.", "policy_version": 0},
    ]
}


@fabric.reward(
    name="math_answer",
    warm=1,
    timeout_s=10,
    examples=(
        {"traj": _EXAMPLE_TRAJ, "ground_truth": "0.5"},
        {"traj": "So the answer is $2\\sqrt{2}$.", "ground_truth": "\\sqrt{8}"},
        {"traj": "We get x = 3 apples, then 12 more: 15", "ground_truth": "16"},
    ),
)
def math_answer(
    traj: Trajectory | str, *, ground_truth: str, sympy_timeout_s: float = DEFAULT_TIMEOUT_S
) -> RewardResult:
    """1.0 when the final answer (boxed, "the answer is", last number) equals the ground
    truth mathematically (fractions, radicals, percentages, intervals, sets, units)."""
    text = traj if isinstance(traj, str) else traj.final_text()
    answer, extracted_by = extract_final(text)
    info: dict[str, Any] = {"extracted": answer, "extracted_by": extracted_by}
    if answer is None:
        info.update(decided_by="no_answer")
        return RewardResult(score=0.0, components={"correct": 0.0, "extracted": 0.0}, info=info)
    ok, rule = is_equivalent(answer, ground_truth, timeout_s=sympy_timeout_s)
    info.update(prediction=canonical(answer), ground_truth=canonical(ground_truth), decided_by=rule)
    if rule == "timeout":
        info["timeout_s"] = sympy_timeout_s
    score = 1.0 if ok else 0.0
    return RewardResult(score=score, components={"correct": score, "extracted": 1.0}, info=info)
