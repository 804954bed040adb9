"""Final-answer extraction and normalisation shared by the answer-matching rewards."""

from __future__ import annotations

import decimal
import re
from collections import deque
from typing import NamedTuple

# where a stated answer ends (split off; MAX_ANSWER_CHARS is imported from here too)
from functions.rewards.answer_extent import (
    MAX_ANSWER_CHARS as MAX_ANSWER_CHARS,
)
from functions.rewards.answer_extent import (
    first_sentence,
    unemphasize,
    without_aside,
)
from functions.rewards.answer_words import (
    _BACK_REFERENCE,
    _CANDIDATE_START,
    _CORRECTION,
    _CORRECTION_WORDS_MAX,
    _DENIAL,
    _DISBELIEF,
    _DISBELIEF_WINDOW,
    _HEDGE,
    _NEGATED_MARK,
    _NOT_A_CORRECTION,
    _NUMBER_START,
    _REPLY_CORRECTION,
    _TEXT_CORRECTION,
    _TEXT_DENIAL,
    _VERDICT,
    _WORD_START,
)

# where a stated answer starts: "the answer is" ("the correct answer is"), "final answer:", a
# line that starts with "Answer:" (markdown emphasis around the words allowed: "**Answer:**
# 42"), or GSM8K's "#### 42". Linear: no \s* that could run across lines sits where a failed
# match is retried from every position (``^\s*answer`` with MULTILINE rescanned a run of n
# newlines from each of its n line starts; ``is\s*:?\s*(.+)`` split one run between two \s* in
# n^2 ways), and markers do not overlap
_ANSWER_MARK = re.compile(
    r"(?:final|the|(?:the )?(?:correct|right)) answer[*_]*[ \t]*(?:is\b(?:[ \t]*:)?|:)[*_]*"
    r"|^[ \t]*[*_]*answer[*_]*[ \t]*:[*_]*"
    r"|^[ \t]*####[ \t]*(?=[-+]?\$?[\d.,]+[ \t]*$)",  # GSM8K's "#### 42" (a number: not a heading)
    re.IGNORECASE | re.MULTILINE,
)
# an article as the first word, before a word: not before a lone letter or punctuation ("A C",
# "A, C" and "the A" name choices)
_ARTICLE = re.compile(r"(?:a|an|the)\s+(?=\w\w)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_NUMBER = re.compile(r"^[-+]?(\d+(?:\.\d*)?|\.\d+)(e[-+]?\d+)?$")  # \d+\.?\d* backtracks: O(n^2)
# sentence punctuation only: math symbols (/ ^ + - * = ( ) [ ] < > %) change the meaning.
# Quotes are dropped; the rest becomes a space, so that it still separates: "1,2" (a pair),
# "1:2" (a ratio) and "10_2" (a base) are not "12" and "102".
_QUOTES = str.maketrans("", "", "\"'`")
# zero-width characters are not there; the Unicode minus sign (and its small and full-width
# forms) is a minus, as math_answer reads it ("\u22125" is -5); a dash is not one
_ZERO_WIDTH_AND_MINUS = str.maketrans(
    {"\u2212": "-", "\ufe63": "-", "\uff0d": "-"} | dict.fromkeys("\u200b\u200c\u200d\u2060\ufeff")
)
_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|emph|operatorname)\s*\{")
_COMMAND_OR_ESCAPE = re.compile(r"\\(?:[A-Za-z]+|.)", re.DOTALL)
_DISPLAY = re.compile(r"^\\[\[(]|\\[\])]$")  # \[ 42 \] and \( 42 \) around the answer
_CHOICE = re.compile(r"\(?([a-z])\)")
_PUNCT = str.maketrans(dict.fromkeys("!?;:,_~@#&|", " "))


THINK_END = "</think>"
"""Where a reasoning model's thinking ends: the answer is what follows the last one."""


def after_thinking(text: str) -> str:
    """What follows the last ``</think>`` in ``text`` (all of it when there is none): an answer
    the model weighed while thinking ("Maybe \\boxed{41}?") is not the one it gives. A text that
    ends its thinking and says nothing after it has no answer (``""``)."""
    end = text.rfind(THINK_END)
    return text if end < 0 else text[end + len(THINK_END) :]


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced (an escaped
    brace, ``\{`` or ``\}``, is a character: ``\boxed{f(x) = \left\{ x \right.}`` closes), the
    outermost when boxes nest (``\boxed{x = \boxed{5}}`` is ``x = 5``); also the brace-less
    ``\boxed 5`` (MATH's convention: up to ``$``, a line's end or ``\]``)."""
    found = _last_boxed(text)
    return None if found is None else found[0]


_BOX_BRACED = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
_BOX_BARE = re.compile(r"\\boxed[ \t]+(?=[^\s{])")
_BARE_END = re.compile(r"\$|\n|\\\]|\\\)")
_BARE_ANSWER = re.compile(r"[-+(.\\\d]|[A-Za-z]{1,3}$")


def _last(pattern: re.Pattern[str], text: str) -> re.Match[str] | None:
    found = deque(pattern.finditer(text), maxlen=1)  # the last match, holding no others
    return found[0] if found else None


def _last_boxed(text: str) -> tuple[str, int] | None:
    """``(content, end)`` of the last box, ``end`` just past its closing brace (or its
    content, for a brace-less box)."""
    braced, bare = _last(_BOX_BRACED, text), _last(_BOX_BARE, text)
    if bare is not None and (braced is None or bare.start() > braced.start()):
        stop = _BARE_END.search(text, bare.end())
        end = len(text) if stop is None else stop.start()
        content = text[bare.end() : end].rstrip().rstrip(".,;").rstrip()
        # an answer (5, -3, \frac12, (1, 2), x), not prose that names the command ("written
        # in \boxed form as asked" after the real box read "form as asked)")
        if _BARE_ANSWER.match(content):
            return content, end
        if braced is None:
            return None
    if braced is None:
        return None
    return _outermost_box(text, braced)


# a brace, or an escape that is no brace: \{ and \} are characters (a set's braces, a piecewise
# answer's \left\{ ... \right.), and \\ (an escaped backslash, a row break) leaves the brace
# after it a brace. Consumed token by token from a box's brace on, so no escape is split
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)


def _outermost_box(text: str, last: re.Match[str]) -> tuple[str, int] | None:
    """``(content, end)`` of the box ``last`` (the last braced box), or of the outermost closed
    box around it, without the commands and braces of the boxes inside it: the writer of
    ``\\boxed{2 + \\boxed{3}}`` boxed 2 + 3, not 3. None when ``last`` never closes (no reliable
    answer); a box around it that never closes is no box (``\\boxed{\\boxed{1}`` is 1). One pass
    with a stack of open braces from the first box on (linear, however deep the boxes)."""
    if _BOX_BRACED.search(text, 0, last.start()) is None:
        # a lone box (nearly every reply): nothing can hold it, and the last box holds no
        # other; its own braces, to its close. The general pass below scans to the text's end
        # and builds its tables: a third more per call of a cheap reward, which the fabric's
        # hedging benchmark reads as queueing (its hedged p99 went from ~8 to 10-30 ms)
        return _closed(text, last.end())
    boxes = {m.end() - 1: m for m in _BOX_BRACED.finditer(text, 0, last.end())}  # brace -> box
    closing: dict[int, int] = {}  # a box's opening brace -> its closing brace
    stack: list[int] = []
    for b in _BRACE.finditer(text, min(boxes)):
        if len(b[0]) > 1:
            continue  # an escape: \{ is no group
        if b[0] == "{":
            stack.append(b.start())
        elif stack:
            opened = stack.pop()
            if opened in boxes:
                closing[opened] = b.start()
    at = last.end() - 1
    if at not in closing:
        return None  # unbalanced: no reliable answer
    # the boxes are nested or apart (one stack closed them): the first to hold the last is the
    # outermost
    outer = next(i for i in sorted(closing) if i <= at and closing[i] >= closing[at])
    end = closing[outer]
    cut = sorted(
        span
        for i, j in closing.items()
        if outer < i < end
        for span in ((boxes[i].start(), i + 1), (j, j + 1))  # \\boxed{ and its }
    )
    parts, pos = [], outer + 1
    for i, j in cut:
        parts.append(text[pos:i])
        pos = j
    parts.append(text[pos:end])
    return "".join(parts), end + 1


def _closed(text: str, start: int) -> tuple[str, int] | None:
    """``(content, end)`` of the group whose content starts at ``start`` (just past its
    opening brace): to its balancing brace, escapes no braces; None when it never closes."""
    depth = 1
    for b in _BRACE.finditer(text, start):
        c = b[0]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start : b.start()], b.end()
    return None


class Found(NamedTuple):
    """What ``boxed_or_stated`` found: the answer and the rule that found it."""

    answer: str
    rule: str
    """``boxed``, ``answer_is`` or ``denied`` (``answer`` is then the text after the rejected
    candidate, where a fallback may look)."""
    rejected: frozenset[str] = frozenset()
    """For ``denied``: the candidate the text rejects, as ``answer_key``s (its first token and
    all of it, each also as the last side of an ``=``), which the denial's sentence must not
    be read as stating by a fallback ("the answer is not 5 but it is close to 5")."""
    said: str | None = None
    """For ``denied``, when the candidate is a word after "not", "isn't" or "can't be" ("the
    answer is not applicable", "the answer cannot be determined"): the denial as the text
    says it (``not applicable``). A text answer may itself be a negation, which no reader
    tells from a denial by its words; read as what it says, it matches a ground truth that is
    that negation and never the candidate it negates. ``extract_answer`` reads it; a reward
    that reads values (``math_answer``) reads the fallback after the candidate instead."""
    end: int = -1
    """For ``boxed``: where the box ends in the text (past its closing brace), so that a reader
    can look at what follows it (``math_answer`` reads a unit there: "\\boxed{5} hours");
    -1 otherwise."""


def boxed_or_stated(text: str) -> Found | None:
    """The answer from the last box (rule ``boxed``) or the last stated answer (rule
    ``answer_is``, see ``stated_answer``), whichever comes later: "First guess \\boxed{41}.
    Wait, recomputing, the final answer is 42." states 42, "The answer is \\boxed{42}." boxes it
    (a marker inside the box, or before it, leaves the box the answer). None when there is
    neither. Rule ``denied``: the text states no answer after the box (if any) but rejects a
    candidate ("the answer is not 5", "the answer can't be 5", "I don't think the answer is
    5", "the answer is not Paris", or not the box's content); the answer is then the text
    after that candidate, where a fallback may still find one ("not 5, it is 6"), never the
    rejected one in the denial's sentence (``Found.rejected``). A denial of a word after "not",
    "isn't" or "can't be" also carries what it says (``Found.said``: "not applicable")."""
    boxed = _last_boxed(text)
    # only a marker after the box can beat it: the scan starts there (the usual "... so the
    # answer is \boxed{42}." scans nothing)
    stated = _stated_answer(text, 0 if boxed is None else boxed[1])
    if stated is None:
        return None if boxed is None else Found(boxed[0], "boxed", end=boxed[1])
    answer, _, denied = stated
    if denied is None:
        return Found(answer, "answer_is")
    candidate, after, token, literal = denied
    # a denial after the box withdraws it if it names it ("\boxed{5} ... the answer is not
    # 5"); a note that the answer is not 3 leaves \boxed{7} standing
    if boxed is not None and answer_key(candidate) != normalize(boxed[0]):
        return Found(boxed[0], "boxed", end=boxed[1])
    return Found(text[after:], "denied", _rejected_keys(candidate, token), answer if literal else None)


def _rejected_keys(*candidates: str) -> frozenset[str]:
    """The ``answer_key``s a rejected candidate is known by: each spelling whole and, when it is
    an assignment ("not $x = 5$"), its last side."""
    keys = set()
    for c in candidates:
        keys.add(answer_key(c))
        if "=" in c:
            keys.add(answer_key(c.rpartition("=")[2].strip(" $")))
    keys.discard("")
    return frozenset(keys)


def stated_answer(text: str) -> str | None:
    """The answer after the last "the answer is" / "final answer:" / "Answer:" / "####" in ``text``
    (the last one in the text wins, whichever its kind): the rest of its line (the next
    non-blank line when the marker ends its own), up to the end of its first sentence, so that
    "The final answer is $\\frac{1}{2}$. I hope it is correct." states ``$\\frac{1}{2}$``, and
    up to a clause or an aside after it ("42, because ...", "42 (six times seven)", see
    ``without_aside``); markdown emphasis around it goes (``**42**``, see ``unemphasize``).
    "the answer is correct" (or reasonable, right, wrong, not obvious...) judges an answer rather than
    states one: the marker before it counts ("The answer is 42. Let me check that the answer
    is correct." states 42), and so does it before one that denies a candidate ("the answer is
    not 5"), unless it states that candidate ("The answer is 5. Wait, the answer is not 5":
    withdrawn; a question, "What if the answer is not 5?", denies nothing); with no marker
    before it the denial is what the text states (``not 5``, which matches nothing), unless a
    correction follows the candidate ("not 5 but 6", "not 5. It is 6": the correction is the
    answer). "the answer isn't 5" (or "can't be", "cannot be", "won't be"...) and a marker the
    writer disbelieves ("I don't think the answer is 5", "It is not true that the answer is
    5") are denials the same way (stating ``can't be 5``, ``I don't think the answer is 5``),
    and so is a stated answer that asks and is answered "No" ("the answer is 5? No.": stating
    ``5? No``; answered "Yes" it states ``5``, see ``REPLY``). Text answers follow the same
    rule: "the answer is not Paris, it is London", "... not Paris. It is London.", "... not
    Paris but (rather) London", "I don't think the answer is Paris, it's London" and "the
    answer is Paris? No, it is London" state ``London``; a correction of a word is a few words
    that name an answer, not a remark ("it is important to note ...", "but I am not sure",
    "but it is close to Paris", a verdict: see ``_names_an_answer``). A denial of a word
    leaves an answer before it that it does not name ("The answer is London. Note that the
    answer is not Paris." states ``London``) and withdraws one it names, whole ("the Eiffel
    Tower"). A text answer may itself be a negation ("not applicable", "not guilty", "cannot
    be determined"; "Not Guilty" and "NOT GUILTY" are never denials), which no reader can tell
    from a denial by its words: with no correction and no answer before it, "the answer is not
    Paris" states ``not Paris``, as it says, which matches a ground truth that is that
    negation and never ``Paris``. An answer that refers back ("the answer is the same as
    before", "as above") states nothing either: the marker before it counts."""
    found = _stated_answer(text)
    return None if found is None else found[0]


def _stated_answer(text: str, pos: int = 0) -> tuple[str, int, tuple[str, int, str, bool] | None] | None:
    """``(answer, start, denied)`` of the stated answer, ``start`` where its marker starts;
    markers before ``pos`` are not looked at. ``denied`` is None, or, when the text states no
    answer but denies one ("the answer is not 5", "the answer can't be 5", "I don't think the
    answer is 5"), ``(candidate, end, token, said)``: the candidate it denies (``5``), where
    it ends in ``text``, its first token (``5`` of "5 apples") and whether the denial reads as
    what it says (a word after "not", "isn't" or "can't be": see ``Found.said``), with the
    denial (``not 5``, ``can't be 5``, ``I don't think the answer is 5``) as the answer. A
    denial is not an answer, but neither may the candidate it rejects be read as one by a
    fallback (the last number, or a box before it)."""
    n = len(text)
    # the last marker that denies a candidate: (said, candidate, start, whether it reads as said)
    denial: tuple[int, int, int, bool] | None = None
    # what the denials after the marker at hand reject, read once a marker states an answer
    # (only then compared: a text of denials alone reads none of them)
    pending: list[tuple[int, bool]] = []  # (where a candidate starts, whether it is a word)
    denied: set[str] = set()
    # a marker that judges or denies an answer ("the answer is probably wrong", "the answer is
    # not 5") leaves the one before it the answer: walked from the last. Only ends are kept,
    # and each rejection is an anchored match at the marker's end (or a bounded look before
    # its start), so the walk is linear
    # (start, end, kind, where a negated marker's negation starts): kind "is" for a marker
    # that ends in "is" (a verdict or a denial may follow it), ":" for one that ends in ":" or
    # "####", "not" for a negated marker ("the answer can't be"), which ends at its candidate
    markers = [
        (m.start(), m.end(), "is" if m[0][-1:].isalpha() else ":", -1)
        for m in _ANSWER_MARK.finditer(text, pos)
    ]
    negated = [(m.start(), m.end(), "not", m.start("negation")) for m in _NEGATED_MARK.finditer(text, pos)]
    if negated:  # rare: merged in order of their starts (the two kinds never overlap)
        markers = sorted(markers + negated)
    for start, i, kind, negation in reversed(markers):
        while i < n and text[i].isspace():
            i += 1
        if i == n:
            continue  # a marker with nothing after it
        said = i  # where the denial the text states starts, if it is one
        candidate = None  # where the candidate a denial rejects starts
        answered_no = -1  # where a stated answer starts that asks and is answered "No"
        agreed = ""  # a stated answer that asks and is answered "Yes", without its "?"
        negates = False  # "not"/"isn't"/"can't be" before it: with a word, an answer may say so
        if kind == "not":
            said, candidate, negates = negation, i, True
        elif (kind == "is" and _VERDICT.match(text, i)) or _BACK_REFERENCE.match(text, i):
            continue
        elif denying := _DENIAL.match(text, i) or _TEXT_DENIAL.match(text, i):  # "Answer: not 5" too
            candidate, negates = denying.end(), True
        elif kind == "is" and (disbelief := _disbelief_before(text, start)) is not None:
            said = disbelief
            hedge = _HEDGE.match(text, i)  # "I don't think the answer is really 5"
            candidate = hedge.end() if hedge and text[i].islower() else i
        elif (asked := _QUESTION.match(text, i)) and (reply := REPLY.match(text, asked.end() - 1)):
            # a stated answer that asks and is answered: "the answer is 5? No." denies 5, as
            # "the answer is not 5" does; "the answer is 5? Yes." states 5
            if reply["no"]:
                candidate = answered_no = i
            else:
                agreed = _answer_at(text[i : asked.end() - 1], 0)[0]
        if candidate is not None:
            if candidate != answered_no and _QUESTION.match(text, candidate):
                continue  # "What if the answer is not 5?" asks; it denies nothing, nor states
            worded = _NUMBER_START.match(text, candidate) is None  # "not Paris"
            if (corrected := _correction(text, candidate, worded)) is not None:
                return _answer_at(text, corrected)[0], start, None
            if denial is None:
                denial = (said, candidate, start, worded and negates)
            pending.append((candidate, worded))
            continue
        # each candidate read once, by bounded matches: linear however many denials. Its first
        # token ("not 5 apples" denies 5), and a word's whole name ("not the Eiffel Tower")
        for j, worded in pending:
            if token := _CANDIDATE.match(text, j):
                denied.add(answer_key(token[0]))
            if worded:
                denied.update(_name_keys(text, j))
        pending.clear()
        if denied and answer_key(agreed or _answer_at(text[i : i + _BOUNDED], 0)[0]) in denied:
            # a later denial names it ("The answer is 5. Wait, the answer is not 5"): withdrawn,
            # as a box is; one of another value leaves it ("... the answer is not 6"). Read
            # from a bounded slice (a candidate is short): a line of withdrawn answers stays linear
            continue
        return agreed or _answer_at(text, i)[0], start, None
    if denial is None:
        return None
    said, candidate, start, literal = denial
    token = _CANDIDATE.match(text, candidate)
    rejection = (*_answer_at(text, candidate), token[0] if token else "", literal)
    return _answer_at(text, said)[0], start, rejection


def _disbelief_before(text: str, start: int) -> int | None:
    """Where a disbelief that governs the marker at ``text[start]`` starts ("I don't think |the
    answer is 5"), or None; looked for in a bounded window before it."""
    m = _DISBELIEF.search(text, max(0, start - _DISBELIEF_WINDOW), start)
    return None if m is None else m.start()


# the candidate a denial rejects, as a stated answer before it is compared with: math, or a
# short run without a space ("5", "(B)", "\frac{1}{2}"); bounded, as _CORRECTION's
_CANDIDATE = re.compile(r"\$[^$\n]{1,300}\$|\\\(.{0,300}?\\\)|[^\s,;]{1,100}")
_BOUNDED = 400  # how much of a stated answer is read to compare it with the candidates
# where a denied name ends at the latest: its clause's end ("not the Eiffel Tower. Wait")
_NAME_END = re.compile(r"[.,;:!?](?=\s|\Z)|\n")
_NAME_WORDS = 6  # a denied name is read up to this many words (as a correction is)


def _name_keys(text: str, j: int) -> list[str]:
    """The ``answer_key``s of the name a denial of a word rejects at ``text[j]``: each run of
    its first words up to its clause's end ("not New York but it is close" names "new york",
    as it does "new" and "new york but"), as a first token names a number ("not 5 apples").
    One bounded look (100 characters) and one normalisation: a line of denials stays linear."""
    cut = _NAME_END.search(text, j, j + 100)
    words = answer_key(text[j : cut.start() if cut else j + 100]).split()[:_NAME_WORDS]
    return [" ".join(words[:k]) for k in range(1, len(words) + 1)]


# a candidate that ends a question ("What if the answer is not 5?"): bounded as _CANDIDATE
# (a name of a few words too, in one sentence: "the answer is New York? No.")
_QUESTION = re.compile(
    r"(?:\$[^$\n]{1,300}\$|\\\(.{0,300}?\\\)|[^\s,;?]{1,100})"
    r"(?:(?<![.!:])[ \t]++[^\s,;?.!:]{1,30}){0,3}[*_]{0,3}[ \t]*+\?"
)
REPLY = re.compile(
    r"\?[ \t]*(?:\r?\n[ \t]*)?[*_]{0,3}(?:(?:hm+|wait|well|actually|oh|ah)(?:,[ \t]*|[ \t]+))?"
    r"(?:(?P<no>no|nope)|(?P<yes>yes|yep|yeah))[*_]{0,3}(?=[ \t]*(?:[.,!;:\u2013\u2014-]|\r?\n|\Z))",
    re.IGNORECASE,
)
"""The reply a text gives right after a question's ``?`` (matched there): group ``no`` ("No.",
"No, ...", "Nope", "Hmm, no.", "No" on the next line) or ``yes``. "No one", "No idea" and "No
doubt" are no reply. Anchored and bounded: linear."""


def answer_key(answer: str) -> str:
    """What a stated answer and a denied candidate are compared by (``**$5$**.`` is ``5``)."""
    return normalize(unemphasize(answer.rstrip(" .,;:!?")).rstrip(" .,;:!?"))


def _correction(text: str, candidate: int, worded: bool = False) -> int | None:
    """Where the answer that corrects the candidate denied at ``text[candidate]`` starts ("not 5
    but 6", "not 5, but rather 6", "not 5. It is 6"); None when no number, math or choice
    letter follows a correction right after the candidate. After a ``worded`` candidate ("not
    Paris, it is London"), a word may follow too, if it names an answer (``_names_an_answer``)."""
    m = (_TEXT_CORRECTION if worded else _CORRECTION).match(text, candidate)
    return None if m is None or not _names_an_answer(text, m.end()) else m.end()


def _names_an_answer(text: str, i: int) -> bool:
    """Whether what starts at ``text[i]`` after a correction's words names an answer: a number,
    math or a choice letter, or a few words ("London", "the Louvre") that are not a remark
    about the answer ("it is important to note ...", "it is clear from ...", "but I am not
    sure", "but it is close to Paris", a verdict). Bounded: a look of ``_BOUNDED`` characters."""
    if _NOT_A_CORRECTION.match(text, i):  # (first: "but I am not sure" names no choice I)
        return False
    if _NUMBER_START.match(text, i):
        return True
    if _VERDICT.match(text, i) or _BACK_REFERENCE.match(text, i):
        return False
    return len(_answer_at(text[i : i + _BOUNDED], 0)[0].split()) <= _CORRECTION_WORDS_MAX


def _answer_at(text: str, i: int) -> tuple[str, int]:
    """The answer that starts at ``text[i]`` (not a space), and where it ends in ``text``: a
    display math block, or the rest of the line up to its first sentence's end or an aside,
    without a hedge before it."""
    if (close := _DISPLAY_OPEN.get(text[i : i + 2])) is not None:
        j = text.find(close, i + 2)  # display math: the whole block, over its lines
        if j >= 0:
            return " ".join(text[i : j + 2].split()), j + 2
    end = text.find("\n", i)
    line = text[i : len(text) if end < 0 else end].rstrip()
    # "probably 5", "therefore 42": the answer is 5, 42. A capitalised hedge before a word
    # (no comma) starts a name: "Simply Red", "Also sprach Zarathustra"
    hedge = _HEDGE.match(line)
    skip = 0
    if hedge and (line[0].islower() or "," in hedge[0] or not line[hedge.end()].isalpha()):
        skip = hedge.end()
    answer = without_aside(first_sentence(line[skip:]))  # a prefix of the rest of the line
    return unemphasize(answer), i + skip + len(answer)


_DISPLAY_OPEN = {"\\[": "\\]", "$$": "$$"}


def extract_answer(text: str) -> str:
    r"""The final answer of a completion, read after its thinking (``after_thinking``): the
    last ``\boxed{}`` or stated answer, whichever comes later (``boxed_or_stated``), else the
    last non-empty line (after a rejected candidate, if the text rejects one: "the answer is
    not 5"; a denial of a word, "the answer is not applicable", as it says: ``Found.said``);
    ``""`` when there is none. A last line that rejects and corrects states the correction
    ("Paris? No, it is London.", "It isn't Paris, it is London.", "Is it 5?\nNo, it is 6.":
    see ``_corrected_on``)."""
    text = after_thinking(text)
    found = boxed_or_stated(text)
    if found is not None:
        if found.rule != "denied":
            return found.answer
        if found.said is not None:
            return found.said
        text = found.answer
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    asked = len(lines) > 1 and lines[-2].rstrip().endswith("?")  # "Is it Paris?\nNo, it is London."
    return _corrected_on(lines[-1], asked) or lines[-1]


# a rejection on a line with no marker: a negation before a candidate ("It isn't Paris", "It's
# not 5", "Not Paris"), ends where the candidate starts. Possessive: one look per run
_LINE_DENIAL = re.compile(
    r"(?<![\w'\u2019])(?:not|never|cannot(?:[ \t]++be)?|can[ \t]++not[ \t]++be|"
    r"(?:is|are|was|were|ca|does|do|did|could|would|should|must|wo)n['\u2019]t(?:[ \t]++be)?)"
    r"[ \t]++[*_]{0,3}(?:" + _CANDIDATE_START + "|" + _WORD_START + ")",
    re.IGNORECASE,
)


def _corrected_on(line: str, asked: bool) -> str | None:
    """The answer a correction states on the last ``line`` of a text with no marker, after its
    last rejection: a negation ("It isn't Paris, it is London", "Not 5 but 6") or a question
    answered "No" ("Paris? No, it is London"; ``asked``: the line before ends with the "?", and
    this one replies). None when the last rejection has no correction (the line is read
    whole, as before). Two linear scans and one bounded match."""
    if asked:
        line = "?" + line
    denial = _last(_LINE_DENIAL, line)
    reply = _last(REPLY, line)
    end = None
    if reply is not None and reply["no"] and (denial is None or reply.start() > denial.start()):
        m = _REPLY_CORRECTION.match(line, reply.end())
        end = m.end() if m is not None and _names_an_answer(line, m.end()) else None
    elif denial is not None and (reply is None or denial.start() > reply.start()):
        end = _correction(line, denial.end(), _NUMBER_START.match(line, denial.end()) is None)
    return None if end is None else _answer_at(line, end)[0]


def _canonical_number(s: str) -> str:
    """One spelling per exact value ('42.0', '42.', '4.2e1' -> '42'): decimal arithmetic with
    enough precision for every digit, never float (which merged 2**53 + 1 with 2**53)."""
    if s.isascii() and s.isdigit():  # the usual answer, a plain integer: no Decimal needed
        return s.lstrip("0") or "0"
    ctx = decimal.Context(prec=len(s) + 2, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
    try:
        d = decimal.Decimal(s).normalize(ctx)
    except decimal.DecimalException:
        return s
    if d.is_zero():
        return "0"
    return format(d, "f") if -30 <= d.adjusted() <= 30 else str(d)


def normalize(answer: str) -> str:
    """Lower-case, strip math delimiters (``$``, ``\\[ \\]``, ``\\( \\)``), text commands
    (``\\textbf{}``...), escapes (``\\$``, ``\\%``), zero-width characters, punctuation, a
    leading article before a word ("the Eiffel Tower"; "A C", "A, C" and "the A" keep theirs)
    and thousands separators; other braces stay unless they hold one character (see
    ``_unbrace``: ``\\frac{12}{3}`` is not ``\\frac{1}{23}``); a parenthesised choice letter is
    the letter (``(A)``, ``A)``); the Unicode minus sign is a minus; canonical numbers
    ('42.0' == '42'), compared exactly."""
    s = _DISPLAY.sub("", answer.translate(_ZERO_WIDTH_AND_MINUS).strip()).strip().strip("$").strip()
    s = s.replace("\\$", "").replace("\\%", "%")
    s = _unbrace(s).lower().rstrip(".").strip()
    if m := _CHOICE.fullmatch(s):
        return m[1]
    s = _THOUSANDS.sub("", s)
    if _NUMBER.match(s):
        return _canonical_number(s)
    s = s.translate(_QUOTES)
    if article := _ARTICLE.match(s):
        s = s[article.end() :]
    return " ".join(s.translate(_PUNCT).split())


def _unbrace(s: str) -> str:
    """``s`` with its text commands unwrapped (``\\text{Paris}`` is Paris) and a group of one
    character written as that character, as TeX reads it (``\\frac{1}{2}`` is ``\\frac12``,
    ``x^{2}`` is ``x^2``, ``\\sqrt{a}`` is ``\\sqrt a``); any other braces stay, so
    ``\\frac{12}{3}`` is not ``\\frac{1}{23}`` and ``\\sqrt{2}3`` is not ``\\sqrt{23}``.
    One pass with a stack of where each open group started."""
    if "{" not in s and "}" not in s:
        return s
    out: list[str] = []
    opened: list[int | None] = []  # per open brace: its index in out, None for a text command's
    after_command = -1  # the index in out right after the last control word
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":
            if m := _TEXT_CMD.match(s, i):
                opened.append(None)
                i = m.end()
                continue
            m = _COMMAND_OR_ESCAPE.match(s, i)  # \frac, or \{ (a brace that is a character)
            token = m.group() if m else c
            out.append(token)
            if token[1:].isalpha():
                after_command = len(out)
            i += len(token)
            continue
        if c == "{":
            opened.append(len(out))
            out.append(c)
        elif c == "}" and opened:
            start = opened.pop()
            if start is None:  # the end of a text command's argument
                pass  # dropped, as its \text{ was: the argument stays as plain text
            elif len(out) == start + 2 and len(out[-1]) == 1:  # one character: {2} is 2
                inner = out.pop()
                out[start] = " " if start == after_command and inner.isalpha() else ""
                out.append(inner)
            else:
                out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)
