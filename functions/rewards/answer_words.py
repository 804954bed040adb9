"""The words that make a stated answer something other than an answer: hedges and verdicts
after "the answer is", denials ("not 5", "isn't Paris") and what corrects them ("but 6"),
disbelief before the marker, references back to an earlier answer. ``answer.py`` reads a
completion with these; they live apart so that the reader's logic stays short. Every pattern
is bounded or possessive: a completion is model output, and a reward must stay linear in it.
"""

from __future__ import annotations

import re

from functions.rewards.answer_extent import WRITER_DOES

# after "the answer is" (a marker ending in "is"), words that hedge or qualify what follows:
# "probably wrong" is a verdict, "probably 5" states 5. Not "about"/"nearly"/"at least", which
# change a number (the math reward reads those), nor "still"/"now"/"just", which text answers
# start with ("still water")
_HEDGE_WORDS = (
    r"(?:(?:very|most|quite|almost|highly|pretty)[ \t]+)?"
    r"(?:probably|likely|possibly|perhaps|maybe|surely|certainly|clearly|obviously|definitely|"
    r"indeed|actually|therefore|thus|hence|also|simply|then|undoubtedly|presumably)"
)
# ... except where the hedge word is the first word of a term: "simply connected" (a space)
_TERM_AFTER_HEDGE = r"(?!simply[ \t]+(?:connected|supported|typed|laced|ordered)\b)"
_HEDGE = re.compile(_TERM_AFTER_HEDGE + _HEDGE_WORDS + r"[ \t]*,?[ \t]+(?=\S)", re.IGNORECASE)
# words that judge the answer, not state it: up to two hedges ("indeed", "very likely",
# "still"), "not", the verdict, then nothing but the sentence's end or a word that cannot
# start a noun phrase ("wrong though", "correct in this case", "right, I think"): "right
# triangle" and "valid argument" are answers. "off by one" judges whatever follows it
_VERDICT = re.compile(
    r"(?:(?:" + _HEDGE_WORDS + r"|still|now|just|not)[ \t]+){0,3}"
    r"(?:(?:correct|right|wrong|incorrect|reasonable|plausible|consistent|valid|sound|accurate|"
    r"confirmed|verified|checked|ok|okay|fine|mistaken"
    # how hard it is to see, not what it is: "not obvious" ("the answer is clear" may answer,
    # and "not simple" may: a group's, so only "not so simple" judges)
    r"|not[ \t]+(?:(?:immediately|entirely|completely|quite|so|that|very)[ \t]+)?"
    r"(?:obvious|clear|apparent|evident|straightforward|easy|trivial)|not[ \t]+(?:so|that|quite)[ \t]+simple)"
    r"(?=[ \t]*(?:[.,;:!?)]|\r?\n|\Z)|[ \t]+(?:because|since|as|and|so|but|for|if|when|given|here|"
    r"though|although|too|either|then|anyway|again|after|actually|i|we|in|to|there|now|"
    r"overall|at|by|with|according|based|on|upon|indeed|this|that)\b)"
    r"|off[ \t]+by\b)",
    re.IGNORECASE,
)
# what a denial's candidate starts with: a number, math, or a lone choice letter
_CANDIDATE_START = r"(?=[-+]?\$?[\d.]|\$|\\|\(|(?-i:[A-Z])(?![\w'-]))"
_NUMBER_START = re.compile(_CANDIDATE_START)
# ... or a word ("not Paris", "not the Eiffel Tower"), one that names rather than modifies
# what follows ("not only", "not just", "not necessarily", "not exactly" deny nothing)
_WORD_START = (
    r"(?=[\"'\u201c]?[A-Za-z])(?![\"'\u201c]?(?:only|just|necessarily|exactly|quite|merely|simply|"
    r"always|even|really|actually|yet|so|too|very|all|every|sure|certain)(?![\w']))"
)
# where a correction's answer starts: any of those (a word's correction may be a number)
_ANY_START = r"(?:" + _CANDIDATE_START + r"|(?=[\"'\u201c]?[A-Za-z]))"
# "the answer is not 5" (or "not $x = 3$", "not (B)", "definitely not B"): a candidate the
# text rejects, not the answer. Ends where the candidate starts
_DENIAL = re.compile(r"(?:" + _HEDGE_WORDS + r"[ \t]+){0,2}not[ \t]+[*_]*" + _CANDIDATE_START, re.IGNORECASE)
# "the answer is not Paris": the same before a word. A text answer may itself be a negation
# ("not possible", "not applicable", "not guilty"), which no reader tells from a denial by its
# words: with a correction after it, it is a denial ("not Paris, it is London"); with none and
# no answer before it, it reads as what it says (see Found.said), which matches its candidate
# never. A title's "Not" ("Not Guilty") and a shout of one ("NOT GUILTY") are answers
_TEXT_DENIAL = re.compile(
    r"(?:" + _HEDGE_WORDS + r"[ \t]+){0,2}"
    r"(?-i:not|NOT(?![ \t]+[A-Z]{2,}(?![\w'])))[ \t]++[*_]{0,3}" + _WORD_START,
    re.IGNORECASE,
)

# "the answer isn't 5", "the answer can't be 5", "the final answer cannot possibly be $5$": a
# marker that denies its candidate, as "the answer is not 5" does (_DENIAL); before a word,
# as "the answer is not Paris" does (_TEXT_DENIAL): "the answer cannot be determined", with
# nothing that corrects it and no answer before it, states what it says. Group "negation":
# where the denial starts
_NEGATED_MARK = re.compile(
    r"(?:final|the|(?:the )?(?:correct|right)) answer[*_]*[ \t]+(?P<negation>"
    r"isn['\u2019]t|(?:can(?:not|['\u2019]t)|could[ \t]+not|couldn['\u2019]t|"
    r"must[ \t]+not|mustn['\u2019]t|should[ \t]+not|shouldn['\u2019]t|will[ \t]+not|won['\u2019]t|"
    r"would[ \t]+not|wouldn['\u2019]t)(?:[ \t]+possibly)?[ \t]+be)"
    r"(?:[ \t]++(?:actually|really|exactly|just|simply|quite))?[ \t]++[*_]{0,3}"
    r"(?:" + _CANDIDATE_START + "|" + _WORD_START + ")",
    re.IGNORECASE,
)
# before "the answer is": the writer disbelieves what follows ("I don't think the answer is 5",
# "It is not true that the final answer is 5"): a denial of it. Named, not any negation before
# the marker: "If we don't round, the answer is 5", "It is not hard to see that the answer is
# 5", "I'm not sure, but the answer is 5" state 5, and so (a doubt, not a denial) does "I'm
# not sure the answer is 5"; "can't say" and "didn't think" are left out too (not yet known,
# or an opinion since revised: "I didn't think the answer was 5 at first, but it is")
_DISBELIEF = re.compile(
    r"(?<![\w'\u2019])(?:"
    r"(?:i|we)[ \t]+(?:do[ \t]+not|don['\u2019]t|no[ \t]+longer|would[ \t]+not|wouldn['\u2019]t)"
    r"(?:[ \t]+(?:really|actually|honestly))?[ \t]+"
    r"(?:think|believe|agree|accept|buy|suppose|expect|reckon|say)(?:[ \t]+that)?"
    r"|i[ \t]+doubt(?:[ \t]+that)?"
    r"|it(?:['\u2019]s|[ \t]+is)[ \t]+not[ \t]+(?:true|the[ \t]+case)(?:[ \t]+that)?"
    r"|it(?:['\u2019]s|[ \t]+is)[ \t]+not[ \t]+that"
    r"|there(?:['\u2019]s|[ \t]+is)[ \t]+no[ \t]+way(?:[ \t]+that)?"
    r")[ \t]+(?:the[ \t]+)?\Z",  # the marker starts at "the", or at "final" after it
    re.IGNORECASE,
)
_DISBELIEF_WINDOW = 80  # longer than any _DISBELIEF match: the look before a marker is bounded


# what corrects a denied candidate, before the answer that does: "but 6", ", but rather 6",
# ". It is 6", "; it's 6". After a number, math or a choice letter only one of those is read
# ("not 5 but it is close" corrects nothing); after a word, a word too (_TEXT_CORRECTION).
# Runs of spaces are possessive (*+, ++): a long run after a candidate was split between two
# [ \t]* in n^2 ways, and is now taken once
_CORRECTION_WORDS = (
    # the candidate: math, or a short run without a space (bounded: a long line of denials is
    # looked at once per denial, so each look is short)
    r"(?:\$[^$\n]{1,300}\$|\\\(.{0,300}?\\\)|[^\s,;$]{1,100}?)[*_]{0,3}"
    # its unit, or a few words that name what it counts ("not 6 apples but 7"), none that
    # starts a clause of its own ("not 5 since that is 3 more" corrects nothing)
    r"(?:[ \t]++(?!(?:but|rather|instead|it|that|because|since|as|so|if|when|while|which|and|or)\b)"
    r"[A-Za-z]{1,30}){0,3}"
)
# the words that correct, from the end of what they correct (a reply's "No", see REPLY)
_CORRECTING = (
    r"[ \t]*+[,;.:\u2013\u2014-]?[ \t]*+"
    r"(?<![\w'])(?:but|rather|instead|it(?:'s|[ \t]++is)|that(?:'s|[ \t]++is))"
    r"(?:[ \t]++(?:rather|instead|actually|it(?:'s|[ \t]++is)))*(?:[ \t]*+,)?[ \t]++[*_]{0,3}"
)
_CORRECTION = re.compile(_CORRECTION_WORDS + _CORRECTING + _CANDIDATE_START, re.IGNORECASE)
_TEXT_CORRECTION = re.compile(_CORRECTION_WORDS + _CORRECTING + _ANY_START, re.IGNORECASE)
_REPLY_CORRECTION = re.compile(_CORRECTING + _ANY_START, re.IGNORECASE)
# what a word after a correction starts rather than an answer: the writer, a pronoun, a
# clause, a remark about the answer ("It is important to note", "It is clear from", "It is
# because"); with a verdict (_VERDICT) or a reference back (_BACK_REFERENCE), no correction
_NOT_A_CORRECTION = re.compile(
    r"(?:i(?=[ \t]+" + WRITER_DOES + r")|i['\u2019](?:m|d|ve|ll)|"
    r"we|you|he|she|they|it|its|it's|this|that|these|those|there|here|not|also|"
    r"because|since|as|so|if|when|while|although|though|let|let's|what|which|who|why|how|"
    r"important|worth|necessary|interesting|clear|obvious|evident|apparent|likely|unlikely|"
    r"close|near|nearly|about|around|almost|roughly|approximately)(?![\w'])",
    re.IGNORECASE,
)
_CORRECTION_WORDS_MAX = 6  # a correction names an answer; a longer clause explains one

# an answer that refers back to an earlier one states nothing itself ("So the answer is the
# same as before."): the marker before it counts, or, with none, the fallback (the last
# number, the last line). "the same as the radius" names something, and "unchanged" answers
# whether something changed: answers
_BACK_REFERENCE = re.compile(
    r"(?:(?:still|again|just|then|therefore|thus|so)[ \t]+)?"
    r"(?:(?:the[ \t]+)?same[ \t]+(?:as[ \t]+)?(?:before|above|earlier|previously|"
    r"(?:the[ \t]+)?(?:previous|last|first|earlier|above)(?:[ \t]+(?:one|answer|result|value))?)"
    r"|as[ \t]+(?:before|above)|(?:the[ \t]+)?one[ \t]+(?:above|before))"
    r"(?=[ \t]*(?:[.,;:!?)]|\r?\n|\Z))",
    re.IGNORECASE,
)
