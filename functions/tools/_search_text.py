"""The terms ``functions.tools.search`` indexes and looks up: ``tokenize`` (NFKC-normalised,
case-folded words with their combining marks, English stopwords dropped, plurals stemmed;
CJK runs as overlapping character pairs). See ``functions.tools.search`` for the rules.

A module of its own to keep ``search`` small. Imported by the tool's module, not defining
the tool, it is not in the tool's version (``fabric.registry.capture_code``) nor in the text
a local pool keeps: a worker started after an edit here imports the edited file under the
old version, so do not edit it under a running job (or run the job from a checkout of its
own, as ``docs/fabric.md`` says of helper modules).
"""

from __future__ import annotations

import itertools
import re
import unicodedata
from collections.abc import Iterator

STOPWORDS = frozenset(
    """
    a about above after again against all also am an and any are as at be because been before
    being below between both but by can could d did do does doing down during each few for from
    further had has have having he her here hers herself him himself his how i if in into is it
    its itself just ll m me more most my myself no nor not now of off on once only or other our
    ours ourselves out over own re s same she should so some such t than that the their theirs
    them themselves then there these they this those through to too under until up ve very was
    we were what when where which while who whom why will with would you your yours yourself
    aren couldn didn doesn don hadn hasn haven isn shouldn wasn weren wouldn
    """.split()
)


def _marks() -> str:
    """A regex class body of every combining mark (Unicode categories Mn, Mc, Me)."""
    ranges: list[tuple[int, int]] = []
    # marks lie in planes 0-1 and in the variation selectors of plane 14; Python's re has no \p{M}
    for cp in itertools.chain(range(0x20000), range(0xE0000, 0xE1000)):
        if unicodedata.category(chr(cp))[0] == "M":
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1] = (ranges[-1][0], cp)
            else:
                ranges.append((cp, cp))
    return "".join(f"{chr(a)}-{chr(b)}" if a < b else chr(a) for a, b in ranges)


# \w leaves out combining marks, the vowel signs of Devanagari and other scripts (भाषा fell
# apart into भ and ष), and the accents of decomposed (NFD) text: a word goes on over them
_WORD = re.compile(rf"\w[\w{_marks()}]*")
# Han (with the iteration mark and ideographic zero), Hiragana, Katakana (with ー), Hangul:
# written without spaces between words, so a run of them is indexed as its overlapping
# character pairs (a single character alone), on documents and queries alike: 東京 is found
# in 東京は日本の首都です
_CJK = re.compile(
    "([\u1100-\u11ff\u3005\u3007\u3041-\u30ff\u3130-\u318f\u31f0-\u31ff\u3400-\u4dbf"
    "\u4e00-\u9fff\ua960-\ua97f\uac00-\ud7ff\uf900-\ufaff\U00020000-\U0003ffff]+)"
)


def stem(word: str) -> str:
    """Strip an English plural ending from a lowercase word (a deliberately light stemmer:
    ``planets -> planet``, ``countries -> country``, ``boxes -> box``; ``glass``, ``virus``,
    ``analysis`` stay). A plural's ``-ies`` and ``-es`` can be a singular's ``-ie`` or
    ``-e`` (``cookies``, ``prizes``, ``caches``): such a singular ends the way its plural is
    stripped (``cookie -> cooky``, ``prize -> priz``, ``cache -> cach``), so both meet."""
    if len(word) > 3 and word.endswith("s"):
        word = _singular(word)
    # only the endings whose plurals lose "es" or "ies" above: "plane" must not become "plan"
    if len(word) > 2 and word.endswith("ie"):
        return word[:-2] + "y"
    if word.endswith(("sse", "xe", "ze", "che", "she")):
        return word[:-1]
    return word


def _singular(word: str) -> str:
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "zes", "ches", "shes")):
        return word[:-2]
    if word.endswith(("ss", "us", "is")):
        return word
    return word[:-1]


def _cjk_terms(word: str, characters: bool) -> Iterator[str]:
    """The terms of a normalised word that holds CJK: its CJK runs as character pairs (a
    single character alone; with ``characters``, each character too), the rest as words."""
    for i, piece in enumerate(_CJK.split(word)):
        if i % 2:  # a CJK run (split's captured separators are the odd items)
            if len(piece) == 1:
                yield piece
                continue
            yield from (piece[j : j + 2] for j in range(len(piece) - 1))
            if characters:
                yield from piece
        elif piece and piece not in STOPWORDS:
            yield stem(piece)


def tokenize(text: str, *, document: bool = False) -> list[str]:
    """The index terms of ``text``, in order (stopwords dropped, plurals stemmed). The text is
    NFKC-normalised and case-folded first, so the composed and decomposed forms of a word
    (``café`` typed, ``cafe`` + U+0301 from a macOS file), full-width and ordinary letters,
    ``Straße`` and ``STRASSE`` meet. A ``document``'s CJK runs give their single characters
    too, so that a query of one character (猫) finds 小猫; a query's runs of two or more
    give pairs only, and score as before."""
    text = unicodedata.normalize("NFKC", text).casefold()
    cjk = _CJK.search(text) is not None  # most texts have none: no need to look in each word
    terms: list[str] = []
    for word in _WORD.findall(text):
        if cjk and _CJK.search(word):
            terms.extend(_cjk_terms(word, document))
        elif word not in STOPWORDS:
            terms.append(stem(word))
    return terms
