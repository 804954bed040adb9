"""What the math reward's last-number fallback refuses to read (``math.extract_final``): a
number or math span the prose negates ("isn't 5", "cannot be 5"), a value it rejected named
again as a point of comparison ("not 5. It is close to 5"), what a question answered "No"
asks ("Is the answer 5? No."), and the bound of a condition after a value ("x = 4 since x >
0"). The rules, with their examples, are in ``functions/rewards/math.py``'s docstring; each
scan here is linear in the text (tests/functions/test_math_linear_time.py)."""

from __future__ import annotations

import bisect
import re

from functions.rewards.answer import REPLY, answer_key

__all__ = ["Refused", "Rejections", "without_premises"]

# a negation right before a number or math span ("not 5", "isn't 5", "cannot be 5", "not equal
# to $5$"): the value the text rejects, never the fallback's answer (the text states none;
# "x = 3, and not 5" still reads 3). Group 1: the math delimiter after it, if any
_NEGATION = re.compile(
    r"(?:\bnot|n['\u2019]t|\bnever|\bcannot)"
    r"(?:[ \t]+(?:be|equal(?:[ \t]+to)?|exactly|quite|just|simply))?[ \t]*[*_]*(\$|\\\()?[ \t]*",
    re.IGNORECASE,
)


# where a sentence ends: a rejection reaches no further ("The answer is not 5. Recomputing: 2 +
# 3 = 5." reads 5, as it would without the denial)
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")
# what states a value right before a mention of a rejected one: a correction ("not 2 hours but
# 2 days", "not 5 hours, it's 5 days") or an assertion ("f(2) doesn't equal 5, so f(3) = 5",
# "the first digit is not 0, the last is 0"); "not 5 but close to 5" states nothing
_STATING_WORDS = frozenset(
    "but rather instead is are was were equals it's that's it\u2019s that\u2019s".split()
)
_STATES_WINDOW = 30  # how far back the word before a mention is looked for


def _stated_at(text: str, pos: int) -> bool:
    """Whether ``text[pos]`` follows ``=`` or one of ``_STATING_WORDS`` (spaces, a comma,
    emphasis or a ``$`` between). A walk back of at most ``_STATES_WINDOW`` characters."""
    lo = max(0, pos - _STATES_WINDOW)
    j = pos
    while j > lo and text[j - 1] in " \t,*_$":
        j -= 1
    if j > lo and text[j - 1] == "=":
        return True
    k = j
    while k > lo and (text[k - 1].isalpha() or text[k - 1] in "'\u2019"):
        k -= 1
    return (k == 0 or not text[k - 1].isalnum()) and text[k:j].lower() in _STATING_WORDS


# a point of comparison, not a value: "close to 5", "near 5", "about 5", "more than 5", "~5".
# Read as the value elsewhere ("It takes about 7 hours"), but after a rejection of that value
# it agrees with the rejection rather than takes it back ("not 5. It is close to 5")
_COMPARED = re.compile(
    r"(?:(?<![A-Za-z])(?:close[ \t]+to|near(?:ly|[ \t]+to)?|next[ \t]+to|almost|about|around|"
    r"approx(?:imately|\.)?|roughly|than|at[ \t]+(?:least|most))|~|\u2248|\\(?:approx|sim)(?![A-Za-z]))"
    r"[ \t*_$]*\Z",
    re.IGNORECASE,
)


def _compared_at(text: str, pos: int) -> bool:
    """Whether ``text[pos]`` follows a word of comparison (``_COMPARED``); a bounded look back."""
    return _COMPARED.search(text, max(0, pos - _STATES_WINDOW), pos) is not None


class Rejections:
    """The values a text rejects ("not 5", "isn't 5", a denied candidate, a question answered
    "No"), each with where its rejection is. A later mention of one in the same sentence ("the
    answer is not 5 but it is close to 5") repeats what was rejected: the fallback does not
    read it, unless what comes right before it states it (see ``_stated_at``: "not 2 hours but
    2 days"). In a later sentence a mention is read as it would be without the rejection
    ("Recomputing: 2 + 3 = 5"), except one as a point of comparison ("It is close to 5", see
    ``_COMPARED``), which agrees with the rejection. Each look is a bisection or two and a
    bounded match (a megabyte of numbers after one "not 5" stays about a second)."""

    def __init__(self, text: str, at_start: frozenset[str]) -> None:
        self._text = text
        self._at: dict[str, list[int]] = {key: [0] for key in at_start}  # key -> sorted positions
        self._all = [0] if at_start else []  # every rejection's position, sorted
        self._sentences: list[int] = []  # where each sentence starts: found by sort(), if needed

    def add(self, value: str, pos: int) -> None:
        self._at.setdefault(_key(value), []).append(pos)
        self._all.append(pos)

    def sort(self) -> None:
        for positions in (self._all, *self._at.values()):
            positions.sort()
        if self._all:  # (the usual text rejects nothing: no scan of it for sentences)
            self._sentences = [m.end() for m in _SENTENCE_END.finditer(self._text)]

    def restates(self, value: str, pos: int) -> bool:
        """Whether ``value`` at ``text[pos]`` repeats a value rejected before it: in its
        sentence, unless stated; in any sentence, as a point of comparison."""
        if not self._all or self._all[0] >= pos:
            return False  # the usual text: it rejects nothing (before pos)
        at = self._at.get(_key(value))
        if not at or at[0] >= pos:
            return False
        if _compared_at(self._text, pos):
            return True
        k = bisect.bisect_right(self._sentences, pos)
        sentence = self._sentences[k - 1] if k else 0
        return _between(at, sentence, pos) and not _stated_at(self._text, pos)


def _between(positions: list[int], lo: int, hi: int) -> bool:
    """Whether the sorted ``positions`` hold one in ``[lo, hi)``."""
    j = bisect.bisect_left(positions, lo)
    return j < len(positions) and positions[j] < hi


def _key(value: str) -> str:
    """``answer_key(value)``, without its work for a plain integer (most values here)."""
    if value.isascii() and value.isdigit():
        return value.lstrip("0") or "0"
    return answer_key(value)


def _negated_starts(text: str) -> set[int]:
    """Where a value that a negation rejects would start: right after each negation, and at
    the math delimiter after one (``not $5$``: at the ``$`` and at the ``5``). One pass."""
    starts: set[int] = set()
    for m in _NEGATION.finditer(text):
        starts.add(m.end())
        if m.start(1) >= 0:
            starts.add(m.start(1))
    return starts


# where a clause starts: what a question answered "No" covers ("We check: is 2 + 3 = 5? No")
_CLAUSE_END = re.compile(r"[.!?;:](?=\s)|\n")


def _questions_answered_no(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of each question that the text answers "No" ("Is the answer 5? No.",
    "Could it be 5?\\nNope.": see ``REPLY``), from its clause's start to its "?", in order: what
    it asks about is refused, as "not 5" is. Two linear scans, the second only when there is one."""
    marks = [m.start() for m in REPLY.finditer(text) if m["no"]]
    if not marks:
        return []
    ends = [m.end() for m in _CLAUSE_END.finditer(text)]
    questions = []
    for q in marks:
        k = bisect.bisect_right(ends, q) - 1
        questions.append((ends[k] if k >= 0 else 0, q))
    return questions


class Refused:
    """Where a value the text refuses starts: right after a negation (``_negated_starts``: "not
    5", "isn't $5$"), or anywhere in a question it answers "No" ("Is the answer 5? No.")."""

    def __init__(self, text: str) -> None:
        self._negated = _negated_starts(text)
        self._questions = _questions_answered_no(text)
        self._starts = [start for start, _ in self._questions]

    def __contains__(self, pos: int) -> bool:
        if pos in self._negated:
            return True
        k = bisect.bisect_right(self._starts, pos) - 1
        return k >= 0 and pos < self._questions[k][1]


# what a relation around a number is made of, and what it is said in: an inequality ("<"), "="
# ("="), an arrow or \implies that draws a consequence ("=>"), a word of two letters or more
# (itself, lower-cased; a LaTeX command is no word, and a lone letter is a variable), and
# punctuation that ends a clause (itself). Each alternative is anchored and bounded: linear
_RELATION_MARK = re.compile(
    r"(?P<then><=>|={1,2}>|-{1,2}>|[\u21d2\u2192\u2234]"
    r"|\\(?:implies|Rightarrow|Longrightarrow|therefore)(?![A-Za-z]))"
    r"|(?P<ineq><=|>=|!=|[<>\u2264\u2265\u2260\u2a7d\u2a7e]"
    r"|\\(?:leqslant|geqslant|leq|geq|neq|le|ge|lt|gt|ne)(?![A-Za-z]))"
    r"|(?P<eq>=|\\approx(?![A-Za-z]))"
    r"|(?P<word>(?<![A-Za-z\\])[A-Za-z]{2,}|\\forall(?![A-Za-z]))"
    r"|(?P<stop>[,;:.!?\n])"
)
_ANY_INEQUALITY = re.compile(r"[<>\u2264\u2265\u2260\u2a7d\u2a7e]|!=|\\(?:le|ge|lt|gt|ne)")
# a relation these introduce is a reason ("since x > 0", "given that a < 3", "assuming b \ne
# 0"), or a check of a value against it ("x = 4, which satisfies x > 0", "Check: 4 > 0"): a
# premise, never a value
_REASON_WORDS = frozenset(
    "since because as given assuming assume assumed suppose supposing satisfies satisfy "
    "satisfying satisfied check checking checked verify verifying verified".split()
)
# ... a domain ("for all $n \ge 1$", "where k \ge 2", "if x > 3", "when n \ge 6"): where a
# statement holds, which may itself be what a sentence concludes ("This exceeds 100 for n \ge
# 14": the answer may be 14)
_DOMAIN_WORDS = frozenset("for where when whenever if iff unless provided providing with such forall".split())
# words that may stand between either kind and its relation ("for all real x > 0")
_CONDITION_FILLERS = frozenset(
    "that all every each any some the an of we have know only real integer integers positive "
    "negative nonnegative natural whole number numbers value values".split()
)
# a relation these follow is a reason too ("x > 0 so it is valid", "x \ge 0 \implies ...")
_CONSEQUENCE_WORDS = frozenset("so hence thus therefore then implies gives means =>".split())
_PREMISE_REACH = 8  # how many marks a look from a bound to its condition word passes at most


class _Premises:
    """Which numbers are bounds of a premise: an operand of an inequality (<, >, \\le, \\ge,
    \\ne, !=, the Unicode signs) that a reason or a domain word introduces or a consequence
    follows. A bound after "=" is the relation's, not the value's ("x = 4 > 3": 4 is a value)."""

    def __init__(self, text: str) -> None:
        self._text = text
        self._starts: list[int] = []
        self._kinds: list[str] = []
        for m in _RELATION_MARK.finditer(text):
            kind = m.lastgroup
            self._starts.append(m.start())
            if kind == "word":
                self._kinds.append(m[0].lstrip("\\").lower())
            else:
                self._kinds.append({"then": "=>", "ineq": "<", "eq": "="}.get(kind or "", m[0]))
        self._sentences = [m.end() for m in _SENTENCE_END.finditer(text)]

    def sentence(self, pos: int) -> int:
        """Which sentence ``text[pos]`` is in (0 for the first)."""
        return bisect.bisect_right(self._sentences, pos)

    def stated(self, start: int) -> bool:
        """Whether the number at ``text[start]`` is a stated value: "=" is the last mark before
        it (``x = \\frac{3}{4}``, ``x = 2 + 3``), or a stating word is right before it
        (``_stated_at``: "x is 4")."""
        i = bisect.bisect_left(self._starts, start) - 1
        return (i >= 0 and self._kinds[i] == "=") or _stated_at(self._text, start)

    def premise(self, start: int, end: int) -> str | None:
        """``"reason"`` or ``"domain"`` when the number at ``text[start:end]`` is a bound of a
        premise of that kind, else None."""
        kinds = self._kinds
        i = bisect.bisect_left(self._starts, start) - 1  # the last mark before it
        j = bisect.bisect_left(self._starts, end)  # the first mark after it
        before = kinds[i] if i >= 0 else ""
        after = kinds[j] if j < len(kinds) else ""
        if before != "<" and (after != "<" or before == "="):
            return None  # no bound: no inequality beside it
        k = i  # back over the relation (and a few words) to a condition word
        for _ in range(_PREMISE_REACH):
            if k < 0:
                break
            if kinds[k] in _REASON_WORDS:
                return "reason"
            if kinds[k] in _DOMAIN_WORDS:
                return "domain"
            if kinds[k] not in ("<", "=", ":") and kinds[k] not in _CONDITION_FILLERS:
                break
            k -= 1
        k = j  # on over the relation (and a comma after it) to a consequence
        while k < len(kinds) and kinds[k] in ("<", "=") and k - j < _PREMISE_REACH:
            k += 1
        if k < len(kinds) and kinds[k] == ",":
            k += 1
        return "reason" if k < len(kinds) and kinds[k] in _CONSEQUENCE_WORDS else None


def without_premises(text: str, numbers: list[re.Match[str]]) -> list[re.Match[str]]:
    """``numbers`` without the bounds of a premise that a value comes before: a reason's after
    any number that is no premise's bound ("So x = 4 since x > 0", "x = 4. Check: 4 > 0", "He
    needs 4 more boxes since 4 * 3 > 10" read 4), a domain's after a value stated in its
    sentence (``_Premises.stated``: "x = 9 if x > 3" states 9; "S = n(n+1)/2. This exceeds 100
    for n \\ge 14." concludes the domain: 14). A premise with only premises before it is all
    the text offers, and is kept ("Since 2 < x < 5.", "The inequality holds when n \\ge 6")."""
    if not _ANY_INEQUALITY.search(text):
        return numbers  # the usual text: no relation at all
    premises = _Premises(text)
    kept = []
    valued = False  # whether a number that is no premise's bound came before
    stated = -1  # the sentence of the last stated value, -1 before the first
    for m in numbers:
        kind = premises.premise(m.start(), m.end())
        if (kind == "reason" and valued) or (kind == "domain" and premises.sentence(m.start()) == stated):
            continue
        kept.append(m)
        if kind is None:
            valued = True
            if premises.stated(m.start()):
                stated = premises.sentence(m.start())
    return kept
