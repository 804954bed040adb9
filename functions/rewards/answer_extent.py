"""Where a stated answer ends: its first sentence, before an aside, without the markdown
emphasis around it ("**42**, because ..." states 42). Split from ``answer``, which re-exports
these names."""

from __future__ import annotations

import re

MAX_ANSWER_CHARS = 1000
"""An extracted final answer longer than this matches nothing: no real final answer is that
long, and the policy must not be able to make a reward call slow."""


# markdown emphasis around an answer: "**42**.", "*no*", "42**" when the marker took the opening
# "**" ("**Answer: 42**"); the sentence's closing punctuation stays. Inside it only bold
# between spaces goes ("**42** apples"): a lone * is a product (2*3*4), a lone _ a subscript
_EMPHASIS_OPEN = re.compile(r"^[*_]+(?=\S)")
_EMPHASIS_CLOSE = re.compile(r"(?<=[^\s^])[*_]+(?=[.!?,;:]*$)")
_BOLD = re.compile(r"(?<!\S)(\*\*|__)(?=\S)(.+?)(?<=\S)\1(?![\w*])")


def unemphasize(s: str) -> str:
    """``s`` without the markdown emphasis (``*``, ``_``) around it: ``**42**.`` is ``42.``.
    An answer over ``MAX_ANSWER_CHARS`` is left as it is (it matches nothing)."""
    if len(s) > MAX_ANSWER_CHARS:
        return s
    s = _BOLD.sub(r"\2", s)
    return _EMPHASIS_CLOSE.sub("", _EMPHASIS_OPEN.sub("", s))


# what the writer does, after "I"/"we": "5 and I am sure", "5, I think" (answer.py reads it too,
# for "I don't think the answer is X"). Named, not any word:
# "II and I only" names choices ("I" before "only"), "1 and i" two roots
WRITER_DOES = (
    r"(?:think|believe|guess|hope|suppose|assume|reckon|feel|expect|trust|bet|know|am|are|was|"
    r"were|have|had|will|would|should|could|can|may|might|must|need|want|did|do|double|just|"
    r"also|really|still|checked|verified|confirmed|found|got|computed|calculated|tested)\b"
)
# where a clause or an aside starts after the stated answer: "42, because ...", "42; this
# ...", "42 (six times seven)", "42 since ...". Not at a comma before anything else ("1, 2, 3",
# "Washington, D.C") and not at "or"/"and" ("42 (or 43)" is two answers)
_COMMA_ASIDE = re.compile(
    r",[ \t]*(?:because|since|which|who|whose|where|when|while|as|so|thus|hence|therefore|after|"
    r"before|the|an?|this|that|these|those|it|its|not|given|using|including|meaning|namely)[ \t]+\S"
    r"|,[ \t]*(?:i\.e|e\.g)\."
    # the writer's doubt or a next step: "42, but let me check", "42, though.", "42, I think"
    r"|,[ \t]*(?:but|though|although|however|unless|if|hopefully|maybe|perhaps|probably)\b"
    r"|,[ \t]*(?:i|we)(?:['\u2019](?:m|re|d|ve|ll)\b|[ \t]+" + WRITER_DOES + ")",
    re.IGNORECASE,
)
_SEMICOLON_ASIDE = re.compile(r";[ \t]*[A-Za-z]{2}")
# one space, not a run: tried at every space, [ \t]+ would rescan a long run from each of them
_SPACE_ASIDE = re.compile(
    r"[ \t](?:\((?!(?:or|and)\b)[A-Za-z]{2}|(?:because|since|which|where)[ \t]+\S"
    # the writer, not the answer: "5 but I'm not sure", "5 I think", "5 (I think)", "5 though."
    r"|\(?i[ \t]+(?:think|believe|guess|hope|suppose)\b"
    # ("I" only before what the writer does: "1 and i" are two roots, "II and I only" choices;
    # "it" before a word: "12 and it checks out"; "that" before what it does)
    r"|(?:but|and|so|if|unless)[ \t]+(?:i(?=[ \t]+" + WRITER_DOES + r")|i'm|we|we're|let|let's|"
    r"that's|this|it's|it(?=[ \t]+[a-z])|that(?=[ \t]+(?:is|was|matches|checks|works|agrees|fits|"
    r"holds|seems|looks|makes|gives|satisfies)\b))(?![\w'])"
    r"|though(?=[ \t]*(?:[.!,;]|$))"
    # another value it is not: "12 and not 13", "5 — not 6", "5 rather than 6" (before a number
    # or math only: "p and not q", "3 not counting zero", "water rather than ice")
    r"|(?:(?:and|[-\u2013\u2014])[ \t]+)?not[ \t]+(?=[-+]?\$?\d|\$|\\)"
    r"|(?:rather[ \t]+than|instead[ \t]+of)[ \t]+(?=[-+]?\$?\d|\$|\\))",
    re.IGNORECASE,
)

_ASIDE_AT = {",": _COMMA_ASIDE, ";": _SEMICOLON_ASIDE, " ": _SPACE_ASIDE, "\t": _SPACE_ASIDE}


def without_aside(s: str) -> str:
    """``s`` up to where a clause or an aside starts after the answer, outside math (``$...$``)
    and brackets: a ``,`` before a word that starts one (because, since, which, as, so, where,
    the, this, after...), a ``;`` before a word, `` (`` before a word ("42 (six times seven)"),
    or one of the connectives because, since, which, where (not a bare "as" or "so", which
    text answers hold: "as good as new", "so-called"), or a value it is not ("12 and not 13",
    "5 — not 6", "5 rather than 6": before a number or math): "42, because 6 times 7 is
    42" states 42, "Paris, the capital" Paris. Number lists (``1, 2, 3``), points (``(1, 2)``)
    and "42 (or 43)" stay whole. Only the first ``MAX_ANSWER_CHARS`` characters are looked at:
    a cut later would leave an answer too long to match anything."""
    in_math = False
    depth = 0
    i = 0
    n = min(len(s), MAX_ANSWER_CHARS + 1)
    while i < n:
        c = s[i]
        if c == "\\":  # an escaped character (\$, \{, \() or a command: skip its first letter
            i += 2
            continue
        if c == "$":
            in_math = not in_math
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif (aside := _ASIDE_AT.get(c)) and i and not in_math and not depth and aside.match(s, i):
            # a comma before a clause that starts at a space ("18, and that's ...") is the clause's
            return s[:i].rstrip(" \t,") or s
        i += 1
    return s


def first_sentence(s: str) -> str:
    """``s`` up to the end of its first sentence: a period or ``!`` followed by a space, outside
    math (``$...$``) and braces, and not after an abbreviation (``Mr.``) nor, for ``!``, before
    an operator (``5! = 120``: a factorial). A decimal point is followed by a digit; "17." stays
    whole."""
    in_math = False
    depth = 0
    i = 0
    n = len(s)
    while i < n:
        c = s[i]
        if c == "\\":  # an escaped character (\$, \{, \.) or a command: skip its first letter
            i += 2
            continue
        if c == "$":
            in_math = not in_math
        elif c == "{":
            depth += 1
        elif c == "}":
            depth = max(0, depth - 1)
        elif c in ".!" and not in_math and not depth:
            k = i + 1  # closing emphasis may sit between the period and the space ("**42.** So")
            while k < n and s[k] in "*_":
                k += 1
            if c == "!" and k == n:  # "The answer is 5!": excitement; a factorial is 5! = 120 or $5!$
                return s[:i].rstrip()
            if k < n and s[k].isspace() and not (c == "!" and _FACTORIAL_NEXT.match(s, k)):
                j = i  # the word before the period; the scan stops at the space after the last one
                while j > 0 and not s[j - 1].isspace():
                    j -= 1
                b = j  # the character before that word (a slice of s here was quadratic)
                while b > 0 and s[b - 1].isspace():
                    b -= 1
                after_number = b > 0 and s[b - 1].isdigit()
                if c == "!" or not _abbreviation(s[j:i].lstrip("*_"), s, k + 1, after_number):
                    return s[:i].rstrip()
        i += 1
    return s


# "5! = 120", "3! + 1": a "!" followed by an operator is a factorial, not an exclamation
_FACTORIAL_NEXT = re.compile(r"\s+(?:[=+*/<>^-]|\\(?:times|cdot|div|neq?|le|ge)(?![A-Za-z]))")

# a period after these does not end a sentence ("the answer is Mr. Smith"); "no." only before a
# number ("No. 5"): "The answer is no. It cannot be done." states "no"; a mountain and ranks
# too ("Mt. Everest" read "Mt"), but no unit ("5 ft. It is tall" ends at "5 ft")
_ABBREVIATIONS = frozenset("mr mrs ms dr st jr sr prof vs etc e.g i.e approx".split())
# a title comes before a name, never after a number: there the same letters are a unit
# ("120 rev. That is 2 per second." ends at "120 rev", as "5 mt." and "2 lt." do)
_TITLES = frozenset("mt gen gov sen rev capt lt col sgt".split())
_NUMBER_SIGN = frozenset(["no"])
# an initialism (U.S, D.C) ends a sentence only before a word that starts one: "U.S. Grant" and
# "U.S. dollars" go on, "Washington, D.C. It is the capital." ends at "D.C."
_INITIALISM = re.compile(r"(?:[A-Za-z]\.)+[A-Za-z]")
_STARTERS = frozenset(
    "a an the it its this that these those he she they we i you there here so thus hence "
    "therefore because since but and or which what note let if then".split()
)
_NEXT_WORD = re.compile(r"[\s*_]*([\w$\\]*)")


def _abbreviation(word: str, s: str, after: int, after_number: bool = False) -> bool:
    """Whether the period after ``word`` is an abbreviation's; ``s[after:]`` follows the space,
    ``after_number``: a number comes just before ``word``."""
    low = word.lower()
    if low in _ABBREVIATIONS or (low in _TITLES and not after_number):
        return True
    nxt = _NEXT_WORD.match(s, after)
    following = nxt[1] if nxt else ""
    if low in _NUMBER_SIGN:
        return following[:1].isdigit()
    if _INITIALISM.fullmatch(word):
        return bool(following) and following.lower() not in _STARTERS
    return False
