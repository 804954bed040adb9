"""Final-answer extraction and normalisation shared by the answer-matching rewards."""

from __future__ import annotations

import decimal
import re

MAX_ANSWER_CHARS = 1000
"""An extracted final answer longer than this matches nothing: no real final answer is that
long, and the policy must not be able to make a reward call slow."""

# linear: no \s* that can run across lines sits where a failed match is retried from every
# position (``^\s*answer`` with MULTILINE rescanned a run of n newlines from each of its n line
# starts; ``is\s*:?\s*`` split one run between two \s* in n^2 ways); the \s* after the colon
# is reached once per marker, and markers do not overlap
_ANSWER_IS = re.compile(r"(?:final answer|the answer)[ \t]*(?:is(?:[ \t]*:)?|:)\s*(.+)", re.IGNORECASE)
_ANSWER_COLON = re.compile(r"^[ \t]*answer[ \t]*:\s*(.+)$", re.IGNORECASE | re.MULTILINE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")
_NUMBER = re.compile(r"^[-+]?(\d+(?:\.\d*)?|\.\d+)(e[-+]?\d+)?$")  # \d+\.?\d* backtracks: O(n^2)
# sentence punctuation only: math symbols (/ ^ + - * = ( ) [ ] < > %) change the meaning.
# Quotes are dropped; the rest becomes a space, so that it still separates: "1,2" (a pair),
# "1:2" (a ratio) and "10_2" (a base) are not "12" and "102".
_QUOTES = str.maketrans("", "", "\"'`")
_PUNCT = str.maketrans(dict.fromkeys("!?;:,_~@#&|", " "))


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: no reliable answer


def extract_answer(text: str) -> str:
    r"""The final answer of a completion: ``\boxed{}``, else "the answer is ...", else
    "Answer: ...", else the last non-empty line."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    matches = _ANSWER_IS.findall(text) or _ANSWER_COLON.findall(text)
    if matches:
        return matches[-1].strip().split("\n")[0]
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _canonical_number(s: str) -> str:
    """One spelling per exact value ('42.0', '42.', '4.2e1' -> '42'): decimal arithmetic with
    enough precision for every digit, never float (which merged 2**53 + 1 with 2**53)."""
    ctx = decimal.Context(prec=len(s) + 2, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
    try:
        d = decimal.Decimal(s).normalize(ctx)
    except decimal.DecimalException:
        return s
    if d.is_zero():
        return "0"
    return format(d, "f") if -30 <= d.adjusted() <= 30 else str(d)


def normalize(answer: str) -> str:
    """Lower-case, strip math delimiters, punctuation, articles and thousands separators;
    canonical numbers ('42.0' == '42'), compared exactly."""
    s = answer.strip().strip("$").strip()
    s = s.replace("\\text{", "").replace("\\mathrm{", "").replace("}", "").replace("{", "")
    s = s.lower().rstrip(".").strip()
    s = _THOUSANDS.sub("", s)
    if _NUMBER.match(s):
        return _canonical_number(s)
    s = s.translate(_QUOTES).translate(_PUNCT)
    if " " in s:  # a lone "a" is a multiple-choice answer, not an article
        s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())
