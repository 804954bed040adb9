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
from functions.rewards.math_fast import GREEK, Verdict, _close, _fast_scalar, _ulp, as_fraction, compare  # noqa: F401

# the LaTeX-to-Python translation lives in math_latex; its names, private ones included, stay
# importable from here
from functions.rewards.math_latex import (  # noqa: F401
    _APPLIED,
    _BARE_ARGUMENT,
    _CALL_OPEN,
    _CHOOSE_CALL,
    _CMD,
    _DEGREES,
    _FUNCS,
    _GLUED_NUMBERS,
    _INVERSE_TRIG,
    _LATEX_CMDS,
    _LEADING_ZEROS,
    _MULTI_ARGUMENT,
    _PROSE,
    _RADIX_PREFIX,
    _SUBSCRIPT,
    _TRIG,
    _TWO_POINTS,
    _call,
    _commas_in_calls,
    _split_word,
    _subscript,
    latex_to_python,
)

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
