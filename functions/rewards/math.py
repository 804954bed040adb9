r"""``math_answer``: 1.0 when the final answer of a completion is mathematically equivalent
to the ground truth.

Extraction reads what follows the last ``</think>`` when the text has one (a reasoning model's
thinking is not its answer, "Maybe \boxed{41}?" in it included; nothing after it is no
answer), with its Unicode math (a minus sign, U+00D7, U+00BD...) read as the canonical form
below reads it. There, first that applies: the last ``\boxed{}``/``\fbox{}`` (its braces
balanced, an escaped ``\{`` or ``\}`` a character: ``\boxed{\left\{ x \right.}`` closes; the outermost
when boxes nest, boxes inside it unwrapped: ``\boxed{2 + \boxed{3}}`` is ``2 + 3``; or MATH's
brace-less ``\boxed 5``, up to ``$`` or the line's end) or the stated answer,
whichever comes later ("First guess \boxed{41}. ... the final answer is 42." states 42; "The
answer is \boxed{42}" boxes it); the stated answer follows the last "the answer is" ("the
correct answer is") / "final answer:" / a line starting "Answer:" / GSM8K's "#### 42" line
(the last one in the text, whichever its form), up to the end of its first sentence and to a
clause or an aside after the answer, outside math and brackets ("The final answer is
$\frac{1}{2}$. I hope it is correct." states ``\frac{1}{2}``; "42, because ...", "42, which
...", "42; this ...", "42 (six times seven)", "42 since ...", "42 dollars, after tax" state 42;
a list "1, 2, 3", a point "(1, 2)" and "42 (or 43)" stay whole; markdown emphasis around it,
``**42**``, goes; a display block, ``\[...\]`` or ``$$...$$``, right after the marker is read
whole, over its lines; a chain of arithmetic, "6 \times 7 = 42", states its last side); else
the last math span (``$...$``, ``\(...\)``, ``\[...\]``) that no number of the prose follows,
read as its last side (``$x = \frac{3}{4}$``: ``\frac{3}{4}``): an inequality is a condition,
and the span before it is read (``$f(n) = 3$ for all $n \ge 1$``: ``3``), and a span with no
number in it (a digit, ``\frac``, ``\sqrt``, ``\pi``...) is read only when it ends the text and
is more than a lone variable (in "42 ways, one for each value of $n$." the answer is 42); else
the last number (``\frac{3}{4}``, a power, ``2^{10}``, scientific notation, ``3 \times 10^8``
or, typed, ``1.5 x 10^3``, and a root of a number, ``3\sqrt{2}``, count as one; an exponent of a
unit or a variable, ``cm^2``, ``x^{-2}``, is none), with the numbers it is a product or quotient
of on its line: "The product is 2·3." reads ``2 \cdot 3`` (6), "12 ÷ 4" reads ``12 / 4``; a sum
is not read whole, and the number after the last ``=`` wins ("3 \times 4 = 12": 12); a percent
sign (or the word) after it, or after a factor, stays with it, so that the percentage rule
applies ("so it is 1,000%." reads ``1,000%``, "50% \times 2" the product, not 2).
A percent sign or a unit the prose states right after a box, the last math span or the last
number is read with it, so that the percentage and units rules below apply ("$\boxed{25}\%$"
reads ``25%``; "It takes 5 hours.", "$5$ hours" and "\boxed{5} hours" read ``5 hours``; "5
apples" names no unit and reads ``5``).

A condition states no value. A number beside an inequality (``<``, ``>``, ``<=``, ``>=``,
``!=``, ``\le``, ``\ge``, ``\lt``, ``\gt``, ``\ne``, ``\neq``, the Unicode signs) is a bound,
and its relation is a premise when a reason introduces it (since, because, as, given,
assuming, suppose; or a check of a value against it: satisfies, check, verify) or a
consequence follows it ("x > 0 so ...", "hence", ``\implies``, ``=>``), or when a domain word
introduces it (for, where, when, if, unless, provided, with, such that, ``\forall``); "that",
"all", "real"... may stand between. Neither fallback reads a reason's bound after a number
that is no premise's ("So x = 4 since x > 0", "x is 4, not -4, because x > 0", "x = 4, which
satisfies x > 0", "x = 4. Check: 4 > 0" and "He needs 4 more boxes since 4 * 3 > 10" read 4;
"Thus $x = \frac34$, since 4 > 3" reads ``\frac34``), nor a domain's after a value stated in
its sentence (a number after ``=`` or a stating word: "x = 9 if x > 3" reads 9). A domain in a
sentence of its own may be what the text concludes, and is read ("S = n(n+1)/2. This exceeds
100 for n \ge 14": 14); so is a premise with only premises before it, all the text offers
("Since 2 < x < 5", "The inequality holds when n \ge 6"), and the bound of a relation that
concludes ("Solve x - 3 > 0: x > 3": 3, "we need $x \ge 1$": 1): the fallback reads a number,
and an inequality answer is read whole only where it is stated or boxed ("the answer is $x >
3$", which is the interval ``(3, \infty)``). A bound after ``=`` is the relation's, not the
value's: in "0 < x = 4" the value is 4.

A negated statement of an answer states none. "the answer is not 5", "the answer isn't 5",
"the answer can't be 5" and a marker the writer disbelieves ("I don't think the answer is 5",
"It is not true that the answer is 5", "I doubt that the answer is 5") deny 5: a text with
nothing else has no answer (score 0), a correction after the candidate is the answer ("not 5
but 6", "I don't think the answer is 5, it is 6"), and an answer stated, or boxed, before a
denial that names it is withdrawn ("The answer is 5. Wait, the answer can't be 5"); a denial
of another value leaves it ("The answer is 5. I don't think the answer is 4."), and so does a
negation elsewhere ("If we don't round, the answer is 5", "I'm not sure, but the answer is 5";
a doubt, "I'm not sure the answer is 5", states 5). A question the text answers "No" ("Is the
answer 5? No.", "Could it be 5?\nNope.", "Is x = 5? Hmm, no.") refuses what it asks about,
from its clause's start to its "?", as "not 5" does: alone it states nothing, and "Is it 5?
No, it is 6." reads 6; answered "Yes" it reads as any text does ("Is the answer 5? Yes." reads
5). So does a stated answer that asks: "The answer is 5? No." denies 5, "The answer is 5?
Yes." states it. A box after a denial is explicit and stands ("I don't think the answer is 5.
\boxed{5}"). Neither fallback reads a value the prose negates ("isn't 5", "cannot be 5", "x is
not $5$"; "x = 3, and not 5" reads 3), nor the value the text rejected said again later in the
same sentence ("the answer is not 5 but it is close to 5", "It is not 5 but near 5": no
answer), unless what comes right before it states it ("not 2 hours but 2 days", "... so f(3) =
5", "the last digit is 0"); a later sentence is read as it would be without the denial ("The
answer is not 5. Recomputing: 2 + 3 = 5." reads 5), except where it names the rejected value
as a point of comparison, which agrees with the rejection rather than takes it back ("The
answer is not 5. It is close to 5", "near 5", "about 5", "more than 5", "~5": no answer; "It
takes about 7 hours", with nothing rejected, reads 7). ``info["extracted_by"]`` says which
rule read the answer: ``boxed``, ``answer_is``, ``last_math``, ``last_number``.

Equivalence, cheapest first:

1. **Fast path, in-process, no sympy.** Both answers are canonicalised (``$`` and the other currency
   signs, ``\[ \]``, ``\left``/``\right``, spacing commands (``\,``, ``\quad``,
   ``\hspace{1em}``, ``\phantom{0}``, ``\mathstrut``...), unit words and a ``\text{}`` that
   holds only unit words
   (any other ``\text{}`` says what it says: ``\text{not } 3`` is not 3, ``\text{ and }`` is
   a comma (and so is a bare "and" after a value: ``2 and 3``, ``1, 2, and 3``), and so is
   ``\text{ or }`` between values of one unknown: ``x = 2 \text{ or } x = 3`` is the set
   ``2, 3``; unit words go only after a number with no variable beside it, so
   ``\frac{1}{2} b h`` keeps its ``h``, and the one-letter units ``m``, ``s``, ``h``, ``g``,
   ``l`` only inside ``\text{}``/``\mathrm{}``: ``4 s`` is ``4s``, ``4 \text{ s}`` is 4),
   degrees (except in a trigonometric expression, where they are radians to sympy:
   ``\tan 45^\circ`` is 1), ``\dfrac`` and ``\cfrac``, ``\dbinom``, ``\tbinom`` and
   ``{n \choose k}`` (``\binom``), ``\lbrace``/``\rbrace`` (``\{``/``\}``), a leading ``x =``,
   ``x \approx`` or ``f(x) =``,
   a leading "approximately" / "about" / "around" / "roughly" / ``\approx`` / ``~`` before a
   number (not "at least" or "nearly", which change it), thousands
   separators (of a number alone, and in an argument of ``\frac``, ``\sqrt`` or ``\binom``,
   where a comma lists nothing: ``\frac{1,000}{2}`` is 500; a set's or a point's comma lists
   its elements, and one number in groups of three alone in brackets, ``(1,000)``,
   ``\{1,000\}``, matches only itself: not 1000, nor -1000 (an accountant's), nor the
   point ``(1, 0)``; a decimal point is one, ``1.000`` is 1 and ``1,5`` a list, and LaTeX's
   ``{,}`` separates thousands only before three digits (``3{,}5`` is a decimal comma, left
   as written); and of an
   operand of arithmetic, ``\times``, ``\cdot``, ``\div``, ``*``,
   ``/``, ``+``, ``-``, in an answer with no other comma and no bracket: ``2 \times 1,000`` is
   2000, ``2 \times 1,000, 3`` a list) and zero-width characters removed; the signs U+00D7,
   U+22C5, U+00B7 (the middle dot, as a product is typed: ``2·3`` is 6, and ``3·14`` 42, not
   3.14) and U+00F7 are
   ``\times``, ``\cdot``, ``\cdot`` and ``/``, and pi, infinity, the root sign, superscript digits and
   vulgar fractions (U+03C0, U+221E, U+221A, U+00B2, U+00BD...) their LaTeX (the parentheses
   after a root sign are its braces: ``√(x+1)`` is ``\sqrt{x+1}``); ``\varnothing``, ``\{\}`` and U+2205 are
   ``\emptyset``, ``\mathbb{R}`` (``\R``, U+211D) is ``(-\infty, \infty)``; an answer
   in words, whole, is the symbol it names: "all real numbers" (``\text{all reals}``...) is
   ``(-\infty, \infty)``, "no solution" ("no real solutions"...) ``\emptyset``, "infinity"
   ``\infty``, and "undefined", "does not exist" and "DNE" are one answer;
   ``a \pm b`` is the list ``a + b, a - b``, in a list element by element:
   ``\pm 2, \pm 3`` is ``2, -2, 3, -3`` and ``(\pm 1, 2)`` the two points). Equal strings are equal;
   two plain numbers (integers, decimals, ``a/b``, ``\frac{a}{b}``, a mixed number,
   ``3\frac{1}{2}`` or ``3 1/2``, ``1e3``,
   ``1 \times 10^3``, ``0.\overline{3}``) are compared exactly as fractions; two words are
   compared as normalised text. Intervals, tuples, sets and ``\cup`` unions are split into elements
   first, so a bracket or size mismatch is decided here too.
2. **sympy, in a forked child process** killed after ``sympy_timeout_s`` (default 2 s, at
   most ``MAX_TIMEOUT_S``, 5 s: half the reward's own ``timeout_s``; 0, a negative number or
   NaN is a ``ValueError``). The child converts the LaTeX (with ``\binom``, ``C(n, k)``, ``\log_b``, ``n!``,
   ``\lfloor x \rfloor``, ``\lceil x \rceil``, ``\gcd``, ``\operatorname{lcm}``, ``\max``
   and ``\min``) to a sympy expression and compares: ``a - b == 0`` exactly; for numbers, numerically at
   30 digits; with free symbols, at three fixed points and two drawn at random for each call
   (an identity test no answer can be fitted to: a polynomial vanishing at the public points
   is not ``0``), exact rationals, so that two exact expressions are compared exactly there
   (``x^2 + 10^{-12}`` is not ``x^2``); a point where one side is finite and the other is
   not is a difference, and fewer than two finite points leave it to ``simplify``. A timeout, a crash or an
   unparsable answer counts as *not equivalent*, and ``info`` says which. The limit works in
   any thread or worker process: it uses no signals, only ``os.fork``, a pipe and
   ``SIGKILL``, and the child is always reaped. Nor can the child outlive its parent or its
   budget when the parent itself is killed (a worker past its ``timeout_s``): the kernel
   kills it with its parent (``PR_SET_PDEATHSIG``, Linux), it keeps no file descriptor but
   its result pipe (so it cannot hold its worker's socket open), and ``RLIMIT_CPU`` stops it
   after ``ceil(limit) + 1`` seconds of CPU.

Rules worth knowing:

* **Tolerance.** Exact values compare exactly: two integers or fractions (``123456789013``
  is not ``123456789012``, ``10^{30}+1`` is not ``10^{30}``), and two exact irrational values
  agree to 20 of the 30 digits they are evaluated at; against an exact rational ground truth
  the difference must also be under 1e-20 absolutely (``10^{30} + \sqrt{2}`` is not
  ``10^{30} + 7``). Only a decimal is read as rounded: it
  equals a number when ``|a - b| <= 1e-9 * max(|a|, |b|)`` and, on the fast path, ``|a - b|``
  is at most one unit in its last place. A rounded decimal therefore does *not* match an
  exact value (``1.57`` is not ``\pi/2``, ``0.333`` is not ``1/3``); only a decimal good to
  about ten significant digits does. Against a ground truth that is an exact rational ``p/q``
  (an integer: ``q = 1``) a decimal must also single it out, its last place at most
  ``1/(2q)``: ``1.844674407 \times 10^{19}`` and the float ``1.8446744073709552e19`` are not
  ``2^{64}``, while ``0.3333333333`` is ``1/3``. A decimal inside an expression (decided by
  sympy: ``(123456789013.0)``, ``123456789100.0 \cdot 1``) is read as the exact number it
  spells and must equal such a ground truth exactly. The tolerance stays against a ground
  truth that is irrational (``\pi`` against 15 digits) or itself a decimal. A decimal cut
  short with an ellipsis (``0.999...``, ``3.14...``, also as the last number of a text) is not
  its digits, and matches only itself (``0.999...`` is not ``0.999``). An infinity
  (``\infty``, ``-\infty``) equals only itself; a division by zero (``1/0``, ``\frac{x}{0}``)
  or an indeterminate form (``0/0``, ``\infty - \infty``) is no number and equals no other
  answer (sympy's ``zoo`` equals itself: ``1/0`` was ``2/0``), only its own text; a huge
  finite number (``9^{999}``, ``e^{1000}``) is compared as any other number.
* **Percentages.** When exactly one side has a ``%`` (or ``\%``, "percent"), its number
  ``X`` is read as ``X/100`` if the other side is written as a fraction or decimal
  (``50% == 0.5 == 1/2``) and as ``X`` if the other side is an integer (``50% == 50``); against
  a fraction or decimal above 1 in magnitude, as either (``37.5% == 37.5``, ``150% == 1.5``;
  ``0.5%`` is not ``0.5``). A product (or quotient) with a percent sign at its end is a
  percentage of the product: ``2 \times 50%`` is ``100%``. Where the sign is an operand's (a
  sum, a percent sign inside, two of them) each ``X%`` is ``X/100`` and the value ``V`` is read
  as a percentage is (``100 V`` against an integer): ``1 + 50%`` is 1.5 (it was ``(1 +
  50)/100``, 0.51), ``100 - 20%`` is 99.8, not 80, ``50% \times 2`` is ``100%`` and ``50%
  \times 50%`` is ``25%``.
* **Dates.** A date (a four-digit year first, ``2024-03-04``, ``2024/3/4``, or last,
  ``3/4/2024``, ``04.03.2024``) is a day, not the quotient or difference it is spelt with
  (``3/4/2024`` is not ``3/8096``, ``2024-03-04`` not 2017): it equals a date written alike
  (``03/04/2024`` is ``3/4/2024``) or one that can only mean the same day (``25/3/2024`` is
  ``2024-03-25``), and nothing else (``3/4/2024``, March 4 or April 3, is not
  ``2024-03-04``). Extraction reads one whole ("on 2024-03-04." reads the date, not ``-04``).
* **Units.** Units are dropped, but two answers that both carry one must carry the same,
  in any spelling (``5 \text{ hours}`` is not ``5 \text{ minutes}``, ``5 km`` not ``5 miles``,
  ``5 \text{ m}^2`` not ``5 \text{ m}``; ``3 \text{ m/s}`` is ``3 \text{ meters per
  second}``, ``30^\circ`` is ``30 \text{ degrees}``); no scale is converted (``5 km`` is not
  ``5000 m``), and a count noun (apples, people) is no unit. A bare number against an answer
  with a unit is the number (``5`` is ``5 \text{ minutes}``).
* **Multiple choice.** Against a ground truth that is a letter A-E (``C``, ``(C)``), an
  answer that starts with a choice, as AMC solutions do (``\textbf{(C) }12``), is that
  choice, unless it names another one or says "or"; a label in parentheses in lowercase,
  ``(d)``, is its capital's, and so is a lowercase letter a-e alone in a box (``\boxed{d}``)
  in a text that names choices (a label "(b)", a line "B) ...", the words option or choice):
  elsewhere a lone letter keeps its case.
* **Collections.** ``(a, b)``, ``[a, b)`` etc. compare element-wise and brackets must match
  (an open interval is not a closed one); ``\{...\}`` sets and bare comma lists compare as
  sets (order and repeats ignored). A list of assignments names a point: ``x = 1, y = 2``
  (in any order) is ``(1, 2)`` and ``1, 2``, its values ordered by variable (``x_2`` before
  ``x_10``), and another assignment list must name the same variables; ``x = 1, x = 2`` (the
  solutions of one unknown) is the set ``1, 2``. An inequality in one variable with bounds
  free of letters is its interval: ``x \le 3`` is ``(-\infty, 3]``, ``1 < x \le 3`` is
  ``(1, 3]``, ``3 > x`` is ``(-\infty, 3)``, and inequalities in it joined by "or" are the
  union of theirs: ``x < -2 \text{ or } x > 3`` is ``(-\infty, -2) \cup (3, \infty)``. A
  union is the set it covers: intervals in it that overlap or touch are one (``[0, 1] \cup
  [1, 2]`` is ``[0, 2]``, ``(0, 1] \cup (1, 2)`` is ``(0, 2)``; ``(0, 1) \cup (1, 2)`` is
  not, 1 is left out), where their ends are plain numbers or infinities.
* **Equations.** Against a value (a ground truth with no ``=``), an answer written with
  ``=`` states its last side when every side before it is arithmetic or names a value: ``2+1=3``,
  ``x = 2 \cdot 3 = 6``, ``AB = 5``, ``f(2) = 5``, ``m\angle A = 30^\circ`` (and a ground
  truth so written, against an answer with no ``=``). One with an expression in a variable
  stays an equation, equal only to the same equation: ``2x = 10`` is not 10, ``x + y = 5``
  not 5.
* **Empty ground truth.** One that is empty once canonicalised (``""``, ``"$ $"``) is a
  ``ValueError`` (the call fails as a ``UserError``, not retried): it is a data or config
  error, which scoring every answer 0 would hide.
* **Length.** A predicted final answer over ``MAX_ANSWER_CHARS`` (1000) characters is not
  equivalent (``decided_by: too_long``); every in-process step is linear in the answer.
* **Symbols.** ``e`` is Euler's number, ``i`` the imaginary unit; a Greek letter
  (``\theta``, ``\varepsilon`` is ``\epsilon``) and a name with a subscript (``x_1``,
  ``a_n``, ``x_{12}``; ``x_12`` too) are symbols (``2\theta`` is ``\theta + \theta``,
  ``x_1x_2`` is ``x_1 \cdot x_2``); words that are not math
  functions are text, never multiplied-out symbols, and two answers made of letters only
  compare as text however short, their spaces word breaks (``on`` is not ``no``, ``ba`` is
  not ``ab``, ``north east`` is not ``northeast``; a lone letter keeps its case, a variable's
  or a point's: ``x`` is not ``X``): a product is
  written with an operator or a coefficient (``a \cdot b``, ``2ab``); a short word of prose
  beside math (``not 0``, ``0 or 1``, ``x is 0``) makes the answer unparsable, never a product
  of its letters. A numeral is read whole: ``03`` is 3 (``x + 03`` was ``x + 0 \cdot 3``),
  ``0x10`` is no hexadecimal, and ``1.000.000`` is unparsable. A function command
  applies to what follows it, braced or not (``\ln 2`` is ``\ln{2}``, ``3\ln 2`` is
  ``\ln 8``); trigonometric functions take radians, as sympy does (``\sin 30`` is not
  ``\frac{1}{2}``), and ``\sin^{-1} x`` is the inverse function, ``\arcsin x`` (not ``\csc
  x``: ``\tan^{-1} 1`` is ``\frac{\pi}{4}``), as are ``\arccos``, ``\arctan``... An odd root
  of a negative number is the real one (``\sqrt[3]{-8}`` is -2, not sympy's principal root
  ``1 + i\sqrt{3}``).
"""

from __future__ import annotations

from typing import Any

import fabric
from fabric.protocol import RewardResult, Trajectory
from functions.rewards.answer import MAX_ANSWER_CHARS, after_thinking, boxed_or_stated  # noqa: F401
from functions.rewards.math_canonical import plain_unicode, unit_after, unit_key  # noqa: F401
from functions.rewards.math_equivalence import (  # noqa: F401
    _ANOTHER_CHOICE,
    _CHOICE_GT,
    _CHOICE_PRED,
    _CHOICES_NAMED,
    _DENIED_NAME,
    _LOWER_CHOICE,
    _NAME_PARTS,
    _boxed_choice,
    _choice,
    _last_side,
)
from functions.rewards.math_extraction import (  # noqa: F401
    _A_NUMBER,
    _COMMAND,
    _DOLLAR,
    _INEQUALITY,
    _LAST_NUMBER,
    _LONE_VARIABLE,
    _NOT_AN_EXPONENT,
    _NUMERIC,
    _PERCENT,
    _PERCENT_AFTER,
    _TIMES,
    _TRAILING,
    _chain_end,
    _last_math,
    _math_spans,
    _value_of,
    _with_unit,
    extract_final,
)
from functions.rewards.math_fast import (
    Shape,
    Verdict,
    as_fraction,
    canonical,
    compare,
    fast_equivalent,
    shape,
)
from functions.rewards.math_refusals import Refused, Rejections, without_premises  # noqa: F401
from functions.rewards.math_sympy import (
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    check_timeout,
    latex_to_python,
    sympy_equivalent,
    sympy_scalar,
)

# extraction and what is_equivalent reads before comparing live in math_extraction and
# math_equivalence (their names, private ones included, stay importable from here); the
# canonical form, the fast path and the sympy path in math_canonical, math_fast and math_sympy
# (their public names stay importable from here); what the last-number fallback refuses to
# read (negations, rejections, questions answered No, conditions' bounds) in math_refusals
__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "MAX_TIMEOUT_S",
    "Shape",
    "Verdict",
    "as_fraction",
    "canonical",
    "compare",
    "extract_final",
    "fast_equivalent",
    "is_equivalent",
    "latex_to_python",
    "math_answer",
    "shape",
    "sympy_equivalent",
    "sympy_scalar",
]

# ----------------------------------------------------------------------------- equivalence


# is_equivalent stays here, not in math_equivalence: it calls sympy_equivalent by this
# module's name, which is what a test patches (``math.sympy_equivalent``) to keep the child out
def is_equivalent(pred: str, gt: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Verdict:
    """``(equivalent, rule)`` for two raw answers (not whole completions)."""
    if len(pred) > MAX_ANSWER_CHARS:  # see answer.MAX_ANSWER_CHARS
        return False, "too_long"
    if (choice := _choice(pred, gt)) is not None:
        return choice
    p, g = canonical(pred), canonical(gt)
    if not p or not g:
        return False, "empty"
    # canonical drops units: two answers that both carry one must carry the same (5 hours is
    # not 5 minutes); a bare number against a unit is still the number
    if (gu := unit_key(gt)) and (pu := unit_key(pred)) and pu != gu:  # a ground truth seldom has one
        return False, "units"
    if "=" not in g:  # a value against a chain or a named value: its last side
        p = _last_side(p)
    elif "=" not in p:
        g = _last_side(g)
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
    traj: Trajectory | str,
    *,
    ground_truth: str,
    sympy_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> RewardResult:
    """1.0 when the final answer (boxed, "the answer is", last number) equals the ground
    truth mathematically (fractions, radicals, percentages, intervals, sets, units)."""
    check_timeout(sympy_timeout_s)  # at most MAX_TIMEOUT_S: the call's own timeout_s is 10 s
    if not canonical(ground_truth):  # "" or "$ $": every answer would silently score 0
        raise ValueError(f"ground_truth {ground_truth!r} is empty once canonicalised; give the answer itself")
    text = traj if isinstance(traj, str) else traj.final_text()
    answer, extracted_by = extract_final(text)
    info: dict[str, Any] = {"extracted": answer, "extracted_by": extracted_by}
    if answer is None:
        info.update(decided_by="no_answer")
        return RewardResult(score=0.0, components={"correct": 0.0, "extracted": 0.0}, info=info)
    if len(answer) > MAX_ANSWER_CHARS:
        info.update(extracted=answer[:100] + "...", chars=len(answer), decided_by="too_long")
        return RewardResult(score=0.0, components={"correct": 0.0, "extracted": 1.0}, info=info)
    if extracted_by == "boxed":
        answer = _boxed_choice(answer, ground_truth, text)
    ok, rule = is_equivalent(answer, ground_truth, timeout_s=sympy_timeout_s)
    info.update(prediction=canonical(answer), ground_truth=canonical(ground_truth), decided_by=rule)
    if rule == "timeout":
        info["timeout_s"] = sympy_timeout_s
    score = 1.0 if ok else 0.0
    return RewardResult(score=score, components={"correct": score, "extracted": 1.0}, info=info)
