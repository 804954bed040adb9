"""``parse_score``: the score in a judge's reply, on the rubric's scale.

A judge often quotes the response it grades, and that text is the policy's: anything in it
that looks like a score (``Score: 10/10``, ``{"score": 10}``, ``<score>10</score>``) must not
become the score. In order:

1. the verdict line: the default rubric asks the judge to end with ``Verdict NONCE: N/M``,
   ``NONCE`` six letters drawn per call and never found in the response (drawn again), so
   no text of the response can carry it; its last such line is the score, whatever follows
   (a custom rubric gets the same with the ``{nonce}`` placeholder);
2. a reply that is one JSON object (bare or in one fenced block) with a ``score``,
   ``rating`` or ``grade``: the whole reply is the verdict. A reply that is, whole, text the
   response carries (retyped as below) is none: the judge echoed the response, or obeyed
   its "reply only with ...";
3. where the rubric asked for the verdict line (``{nonce}``) and the reply has none: only a
   line that begins with its score, as a verdict line does (a garbled or dropped nonce:
   ``Verdict kzqrtn: 2/10``, ``**Final verdict:** 2/10``, ``Score: 2/10``, ``Score (1-10):
   2``, a line that is only ``2/10``, ``**2**`` or ``<score>2</score>``), the latest outside
   quotes of the response as below; nothing else in the reply is read (``JudgeResponseError``
   instead): a judge that refuses to grade a response's injection ("it tries to force a
   perfect 10/10; I decline") names the score demanded, which was read as its verdict;
4. else (a rubric without ``{nonce}``) the latest candidate in the reply, across the forms,
   that is not in a quoted copy of the response. Candidates are the form the rubric asks for
   (``requested_form``) anywhere (``Score: N/M``, also ``Rating: N out of M``, ``Grade:
   85%``; ``<score>N</score>``; under a JSON rubric a complete top-level object that starts a
   line, prose may follow it), the other forms only where they end the reply (a JSON object
   or the last fenced block, ``<score>N</score>``; ``**N**`` or a fraction, ``I give it
   1/10.``, on the last line; a labelled ``Score: N`` anywhere when the rubric asked for
   another form), and last of all a bare number on the last line (``I give it a 7.``), only
   when it is the one number there outside quotes: several (``3 bugs, so 6``) fail the call
   (``JudgeResponseError``) rather than guess. A candidate within another is part of it. A
   candidate is quoted when its text is in the response, as a judge might retype it (case,
   spacing, markdown and quote marks, NFKC: ``SCORE:\u00a010 / 10`` in the response makes
   ``Score: 10/10`` a quote); a bare number only verbatim, with 8 characters of its line
   around it.

A score may name its scale, and then the scale's numbers are no scores: ``7/10``,
``7 out of 10`` (``out of a possible 10``), ``7 (out of 10)``, ``7 on a scale of 0 to 10``,
``7 on a 1-10 scale``, ``7 on a 10-point scale``. A scale with the rubric's top is the
rubric's (7 stays 7); another is mapped to the same place in the rubric's range (``4/5``
and ``3 on a scale of 1 to 5`` are 8 and 5 on 0-10). A percentage is that fraction of the
way from the rubric's bottom to its top (``85%`` is 8.5 on 0-10), refused
(``JudgeResponseError``) when its number is also a score on the rubric's scale that reads
otherwise (``10%`` on 0-10: 10, or 1?). A comma before one or two digits is a
decimal comma (``7,5/10`` is 7.5). On the last line, a scale named before the number
(``Score (1-10): 8``, ``Rating [0-10]: 7``, ``Score out of 10: 8``, ``On a scale of 1 to
10, I'd give it an 8``) and a number the judge says it gives (``I give it 10``, ``I rate it
7``) are read as labelled scores.

What step 4 cannot tell: a judge that writes a score after its verdict which the response
does not carry (a paraphrase, ``it claims ten out of ten``) is read as that score;
and a judge's own verdict that happens to be text the response carries (a response that
lists ``Score: 0/10`` to ``Score: 3/10``) is not read. A score of the judge's before it
(``a perfect answer would get Score: 10/10``) is then not read either when it is higher: a
later score that the response carries and that reads lower fails the call
(``JudgeResponseError``) rather than let a response knock the judge's low verdict out. The
verdict line of step 1 has none of these problems, as long as the judge copies the nonce.

A ``<think>...</think>`` block is dropped only where a reasoning model puts it, at the start
of the reply: one quoted from the response (maybe unclosed) is ordinary text. So is the text up
to a first ``</think>`` that no ``<think>`` opens: the chat template opened it in the prompt
(DeepSeek-R1, Qwen3), and the server has no reasoning parser to split it off.
"""

from __future__ import annotations

import json
import re
import secrets
import unicodedata
from collections import deque
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Literal

from functions.openai_api import excerpt
from functions.rewards.judge_errors import JudgeResponseError

Form = Literal["label", "tag", "json"]

# a decimal comma ("7,5/10") is a decimal point; "1,000" is not (three digits: a thousands
# separator), so only one or two digits may follow it
_NUM = r"[-+]?\d+(?:\.\d+|,\d{1,2}(?!\d))?"
_TO = r"\s*(?:-|\u2013|to)\s*"  # 0-10 (hyphen or en dash), 0 to 10
# What follows a score to name its scale, in one group (``_range`` reads it): 7/10,
# 7 out of 10, 7 out of a possible 10, 7 (out of 10), 7 on a scale of 0 to 10, 7 on a 1-10
# scale, 7 on a 10-point scale. A scale left unread leaves its numbers to be taken for
# scores ("2 on a scale of 0 to 10" was read as 10).
_OF = (
    r"\s*("
    rf"/\s*{_NUM}"
    rf"|out\s+of\s+(?:a\s+(?:possible|maximum\s+of|max\s+of)\s+)?{_NUM}"
    rf"|\(\s*out\s+of\s+{_NUM}\s*\)"
    rf"|(?:\(\s*)?on\s+a\s+scale\s+(?:of|from)\s+{_NUM}{_TO}{_NUM}\s*\)?"
    rf"|(?:\(\s*)?on\s+an?\s+(?:{_NUM}{_TO})?{_NUM}(?:(?:\s*-\s*|\s+)point)?\s+scale\s*\)?"
    r")"
)  # no alternative starts with \s* of its own: after the \s* above, a long run was quadratic
# the numbers of a scale: a sign only where no digit is before it (the "-" of "1-10" is not)
_RANGE_NUM = re.compile(r"(?<![\d.,])[-+]?\d+(?:\.\d+|,\d{1,2}(?!\d))?")
_THINK = re.compile(r"\A\s*<think>.*?(?:</think>|\Z)", re.DOTALL | re.IGNORECASE)
_THINK_END = re.compile(r"</think>", re.IGNORECASE)
_THINK_OPEN = re.compile(r"<think>", re.IGNORECASE)
_TAG = re.compile(rf"<score>\s*({_NUM})(?:{_OF})?\s*</score>", re.IGNORECASE)
_LABEL = re.compile(
    # the separators before the number must not overlap ("score" then a long run of spaces
    # was quadratic): "is"/"of" is optional and a whole word
    rf"\b(?:score|rating|grade)\b[\s*_:=]*(?:(?:is|of)\b[\s*:=]*)?({_NUM})(\s*%)?(?:\**{_OF})?",
    # the bold after the number ("**Score: 10**") is part of the span only before a scale
    # ("Score: **10**/10"): a span ending in "**" is no longer text the response carries
    # verbatim, so a bold quote of its "Score: 10" passed for the judge's own score
    re.IGNORECASE,
)
_BOLD = re.compile(rf"\*\*\s*({_NUM})(?:{_OF})?\s*\*\*")
_LAST = re.compile(rf"({_NUM})(\s*%)?(?:{_OF})?")
_SCORE_KEYS = ("score", "rating", "grade")
_OBJ_START = re.compile(r"^[ \t]*\{", re.MULTILINE)
_FENCE = "```"
_FENCE_LANG = re.compile(r"\A[\w+-]*\s*")  # ```json
# a rubric that shows the judge its answer format: <score>N</score>, or a JSON "score" key
_ASKS_TAG = re.compile(r"<score>", re.IGNORECASE)
_ASKS_JSON = re.compile(r"""["'](?:score|rating|grade)["']\s*:""", re.IGNORECASE)
_NONCE_LETTERS = "bcdfghjklmnpqrstvwxz"  # no vowels: no words, nothing rude
#: Line-start objects tried for a JSON verdict that ends the reply (from the last).
_MAX_OBJ_TRIES = 16


def requested_form(rubric: str | None) -> Form:
    """The form a rubric template asks the judge to answer in: ``"tag"`` when it shows
    ``<score>``, ``"json"`` when it shows a ``"score":`` key (whichever comes last, when it
    shows both), else ``"label"`` (``Score: N/M``, as the default rubric). Read from the
    template, never the filled prompt: the response must not choose how it is graded."""
    if not rubric:
        return "label"
    tag = [m.start() for m in _ASKS_TAG.finditer(rubric)]
    js = [m.start() for m in _ASKS_JSON.finditer(rubric)]
    if not tag and not js:
        return "label"
    return "tag" if max(tag, default=-1) > max(js, default=-1) else "json"


def _float(num: str) -> float:
    return float(num.replace(",", "."))  # _NUM takes a comma only as a decimal one


def _range(scale: str) -> tuple[float, float]:
    """The ``(bottom, top)`` a scale text names: ``/10`` and ``out of 10`` are ``(0, 10)``,
    ``on a scale of 1 to 5`` is ``(1, 5)``."""
    nums = [_float(n) for n in _RANGE_NUM.findall(scale)]
    return (0.0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])


def _on_scale(num: str, percent: str | None, scale: str | None, lo: float, hi: float) -> float:
    """A matched number on the rubric's scale: ``8/10`` on a 0-10 rubric is 8, and so are
    ``8 out of 10`` and ``8 on a scale of 1 to 10`` (the same top); ``4/5`` on it is 8 and
    ``3 on a scale of 1 to 5`` is 5 (the same place in the range); ``80%`` likewise: a
    percentage is that fraction of the way from the rubric's bottom to its top (on 0-10,
    ``85%`` is 8.5; on 1-5, ``50%`` is 3). A percentage whose number is itself a score on the
    rubric's scale, read otherwise (``10%`` on 0-10: a 10 with a stray sign, or 1?), is
    refused rather than guessed: it read a judge's 10 as 1. Readings within a hundredth of the
    range of each other are one grade (``85%`` on 1-100 is 85.15)."""
    n = _float(num)
    if percent:
        as_percent = lo + n / 100 * (hi - lo)
        # ambiguous only where the readings differ by over a point of the range's hundred:
        # on 1-100, 85% (85.15) and 85 are the same grade
        if lo <= n <= hi and abs(as_percent - n) > 0.01 * (hi - lo) * (1 + 1e-9):
            raise JudgeResponseError(
                f"the judge's score {num}% is ambiguous on the rubric's [{lo:g}, {hi:g}] scale: "
                f"{num} as a score, or {as_percent:g} as a percentage of the range? Make the "
                f'rubric ask for "N/{hi:g}" (the default verdict line does)'
            )
        return as_percent
    if scale is None:
        return n
    bottom, top = _range(scale)
    if top == hi:
        return n
    if top <= bottom:
        raise JudgeResponseError(f"score {num} {scale.strip()} has an empty or reversed scale")
    return lo + (n - bottom) / (top - bottom) * (hi - lo)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # nested past the decoder's depth is no verdict either
        return None


def _obj_score(obj: Any, lo: float, hi: float) -> float | None:
    if not isinstance(obj, dict):
        return None
    for key in _SCORE_KEYS:
        value = obj.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            return parse_score(value, lo, hi)
    return None


def _unfenced(body: str) -> str | None:
    """What the reply's last fenced block holds when that block ends the reply."""
    if len(body) < 2 * len(_FENCE) or not body.endswith(_FENCE):
        return None
    start = body.rfind(_FENCE, 0, len(body) - len(_FENCE))
    if start < 0:
        return None
    inner = body[start + len(_FENCE) : -len(_FENCE)]
    return _FENCE_LANG.sub("", inner, count=1)


def _whole_json(body: str, lo: float, hi: float) -> float | None:
    text = body
    if body.startswith(_FENCE) and body.count(_FENCE) == 2:  # one fenced block, nothing around it
        text = _unfenced(body) or ""
    return _obj_score(_loads(text), lo, hi) if text.lstrip().startswith("{") else None


def _last_line_span(body: str) -> tuple[int, int]:
    start = body.rfind("\n") + 1
    return start, len(body)


# A candidate verdict: where it lies in the reply (start, end), whether its text alone is
# specific enough to say it was copied from the response (a labelled, tagged, bold or JSON
# score, or a fraction; not a bare number), and how to read it (lazily: a quoted "3/0" must
# not fail the call).
_Candidate = tuple[int, int, bool, Callable[[], float | None]]


def _scaled(m: re.Match[str], lo: float, hi: float, *, pct: int | None, den: int) -> Callable[[], float]:
    def read() -> float:
        percent = m.group(pct) if pct else None
        return _on_scale(m.group(1), (percent or "").strip() or None, m.group(den) or None, lo, hi)

    return read


def _tail(matches: Iterator[re.Match[str]]) -> deque[re.Match[str]]:
    # only the latest candidates are ever looked at (_MAX_CANDIDATES)
    return deque(matches, maxlen=_MAX_CANDIDATES)


def _labels(body: str, lo: float, hi: float, at: int = 0) -> list[_Candidate]:
    return [
        (m.start(), m.end(), True, _scaled(m, lo, hi, pct=2, den=3)) for m in _tail(_LABEL.finditer(body, at))
    ]


def _tags(body: str, lo: float, hi: float, at: int = 0) -> list[_Candidate]:
    return [
        (m.start(), m.end(), True, _scaled(m, lo, hi, pct=None, den=2))
        for m in _tail(_TAG.finditer(body, at))
    ]


def _tag_at_end(body: str, lo: float, hi: float) -> list[_Candidate]:
    # another form than the one asked for counts only where it ends the reply
    return [c for c in _tags(body, lo, hi, _last_line_span(body)[0]) if c[1] == len(body)]


def _bold_at_end(body: str, lo: float, hi: float) -> list[_Candidate]:
    at = _last_line_span(body)[0]
    return [
        (m.start(), m.end(), True, _scaled(m, lo, hi, pct=None, den=2))
        for m in _tail(_BOLD.finditer(body, at))
    ]


def _json_ending(body: str, lo: float, hi: float) -> list[_Candidate]:
    """A JSON verdict that ends the reply: the last fenced block, or an object from the start
    of a line to the end (``{"score": 7}`` after the reasoning)."""
    inner = _unfenced(body)
    if inner is not None:
        start = body.rfind(_FENCE, 0, len(body) - len(_FENCE))
        obj = _loads(inner)
        return [(start, len(body), True, lambda: _obj_score(obj, lo, hi))]
    if not body.endswith("}"):
        return []
    starts = [m.start() for m in _OBJ_START.finditer(body)][-_MAX_OBJ_TRIES:]
    for start in reversed(starts):
        raw = _obj_score(_loads(body[start:]), lo, hi)
        if raw is not None:
            return [(start, len(body), True, partial(float, raw))]
    return []


_DECODER = json.JSONDecoder()


def _json_objects(body: str, lo: float, hi: float) -> list[_Candidate]:
    """Under a JSON rubric: complete objects that start a line and carry a score (the last
    of them counts, prose may follow: ``{"score": 7}`` then a sentence), top-level only (an
    object inside a tried one is part of it)."""
    found: list[_Candidate] = []
    end = -1
    for m in list(_OBJ_START.finditer(body))[-_MAX_OBJ_TRIES:]:
        start = body.index("{", m.start())
        if start < end:
            continue  # inside the object before
        try:
            obj, stop = _DECODER.raw_decode(body, start)
        except (ValueError, RecursionError):
            continue
        end = stop
        if isinstance(obj, dict) and any(k in obj for k in _SCORE_KEYS):
            found.append((start, stop, True, partial(_obj_score, obj, lo, hi)))
    return found


def _number_at_end(body: str, lo: float, hi: float) -> list[_Candidate]:
    # an unlabelled number is trusted only on the last line: earlier ones are reasoning
    # ("2 + 2"); a fraction there ("I give it 1/10.") is a verdict, a bare number the last resort
    at = _last_line_span(body)[0]
    return [
        (m.start(), m.end(), bool(m.group(2) or m.group(3)), _scaled(m, lo, hi, pct=2, den=3))
        for m in _tail(_LAST.finditer(body, at))
    ]


# A verdict on the last line that names its scale first ("Score (1-10): 8", "Rating [0-10]:
# 7", "Score out of 10: 8", "On a scale of 1 to 10, I'd give it an 8"), or says it gives a
# number ("I give it 10"): read as labelled. Left to the bare numbers, the scale's own
# numbers made the line ambiguous and the call failed.
_SCALE = rf"{_NUM}{_TO}{_NUM}"
_SCALE_FIRST = re.compile(
    rf"\b(?:score|rating|grade)\b\s*(?:[(\[]\s*(?P<scale>{_SCALE})\s*[)\]]|(?P<outof>out\s+of\s+{_NUM}))"
    rf"[\s*_:=]*(?P<num>{_NUM})"  # one class: \s* then [\s*_]* split a run of spaces n^2 ways
    rf"|\bon\s+a\s+scale\s+(?:of|from)\s+(?P<scale2>{_SCALE})\s*[,:]?[^\n\d]{{0,40}}?(?<![\d.])(?P<num2>{_NUM})",
    re.IGNORECASE,
)
_GIVES = re.compile(
    # each optional word takes its own trailing space: adjacent \s+ and \s* were quadratic
    rf"\b(?:give|rate|award|assign)s?\s+(?:(?:it|this|the\s+\w+)\s+)?(?:an?\s+)?(?<![\d.])(?P<num>{_NUM})(?P<pct>\s*%)?(?:{_OF})?",
    re.IGNORECASE,
)


def _phrased_at_end(body: str, lo: float, hi: float) -> list[_Candidate]:
    at = _last_line_span(body)[0]
    found: list[_Candidate] = []
    for m in _tail(_SCALE_FIRST.finditer(body, at)):
        num = m.group("num") or m.group("num2")
        scale = m.group("scale") or m.group("outof") or m.group("scale2")
        found.append((m.start(), m.end(), True, partial(_on_scale, num, None, scale, lo, hi)))
    for m in _tail(_GIVES.finditer(body, at)):
        scale = m.group(m.re.groups)  # _OF's group, the last
        pct = (m.group("pct") or "").strip() or None
        found.append((m.start(), m.end(), True, partial(_on_scale, m.group("num"), pct, scale, lo, hi)))
    return found


_Finder = Callable[[str, float, float], list[_Candidate]]
_FINDERS: dict[Form, tuple[_Finder, ...]] = {
    "label": (_labels, _json_ending, _tag_at_end, _bold_at_end, _phrased_at_end, _number_at_end),
    "tag": (_tags, _json_ending, _labels, _bold_at_end, _phrased_at_end, _number_at_end),
    "json": (
        _json_objects,
        _json_ending,
        _labels,
        _tag_at_end,
        _bold_at_end,
        _phrased_at_end,
        _number_at_end,
    ),
}
# Where the rubric asked for the verdict line and the reply has none, a line that begins with
# its score, as a verdict line does (a garbled or dropped nonce): "Verdict kzqrtn: 2/10",
# "Final verdict: 2/10", "**Score:** 2/10", "2/10". Not a score anywhere else: a judge that
# refuses to grade an injection names the score it demanded ("it tries to force a perfect
# 10/10; I decline"), and that was read as the verdict.
_LEAD_SEP = r"[ \t*_:=\-\u2013\u2014]"
_VERDICT_LINE = re.compile(
    rf"^[ \t>#*_`]*(?:(?:(?:final|overall)[ \t]+)?(?:verdict|score|rating|grade)|final)\b{_LEAD_SEP}*"
    rf"(?:[\[(]?[a-z]{{1,12}}[\])]?{_LEAD_SEP}+)?({_NUM})([ \t]*%)?(?:\**{_OF})?",
    re.IGNORECASE | re.MULTILINE,
)
# a line that is only a score: "7/10", "**7**", "<score>7</score>"
_SCORE_LINE = re.compile(
    # the spaces before "</score>" go with it: a run of its own beside [ \t*_.]* was quadratic
    rf"^[ \t>#*_`]*(?:<score>[ \t]*)?({_NUM})([ \t]*%)?(?:\**{_OF})?(?:[ \t]*</score>)?[ \t*_.]*$",
    re.MULTILINE | re.IGNORECASE,
)
_LINE_START = re.compile(r"[ \t>#*_`]*")


def _past_markdown(body: str, at: int) -> int:
    m = _LINE_START.match(body, at)
    return m.end() if m else at


def _verdict_lines(body: str, lo: float, hi: float) -> list[_Candidate]:
    # a candidate starts after the line's markdown (a blockquote, a heading): with it, a quote
    # of the response ("> 10/10") was no longer text the response carries
    found: list[_Candidate] = [
        (_past_markdown(body, m.start()), m.end(), True, _scaled(m, lo, hi, pct=2, den=3))
        for pattern in (_VERDICT_LINE, _SCORE_LINE)
        for m in _tail(pattern.finditer(body))
    ]
    # a label that names its scale first, at the start of a line: "Score (1-10): 8"
    for m in _tail(_SCALE_FIRST.finditer(body)):
        line = body.rfind("\n", 0, m.start()) + 1
        if m.group("num") and _LINE_START.fullmatch(body, line, m.start()):
            scale = m.group("scale") or m.group("outof")
            found.append((m.start(), m.end(), True, partial(_on_scale, m.group("num"), None, scale, lo, hi)))
    return found


#: Bare-number candidates count as copied from the response only with this much of the text
#: around them copied too ("7" alone is in many responses).
_QUOTE_CONTEXT = 8
#: Latest candidates looked at before giving up (each costs a search of the response).
_MAX_CANDIDATES = 64


# What a judge changes when it retypes a score it quotes: case, spacing, markdown and quote
# marks, and (NFKC) no-break spaces and fullwidth digits. The policy chooses how its forged
# score is written: "SCORE:\u00a010/10", mentioned by the judge as "Score: 10/10", passed for
# the judge's own score when only a verbatim copy counted as a quote.
_RETYPED = re.compile(r"[\s*_`'\"]+")


_WORDY = re.compile(r"[^\W\d_]")  # a letter


def _plain(text: str) -> str:
    """``text`` as a judge might retype it, for telling whether a score is a quote."""
    return _RETYPED.sub("", unicodedata.normalize("NFKC", text).casefold())


def _quoted(body: str, c: _Candidate, response: str, plain_response: str) -> bool:
    """Whether candidate ``c`` lies in a copy of the response the judge quotes: its text is in
    the response (a labelled, tagged, bold or JSON score or a fraction: retyped as far as
    ``_plain`` goes; a bare number: verbatim, with ``_QUOTE_CONTEXT`` characters around it on
    its line)."""
    start, end, specific, _ = c
    if not response:
        return False
    if specific:
        text = _plain(body[start:end])
        return bool(text) and text in plain_response
    if body[start:end] not in response:
        return False
    line_start = body.rfind("\n", 0, start) + 1
    line_end = body.find("\n", end)
    line_end = len(body) if line_end < 0 else line_end
    a, b = start, end
    while a > line_start and (b - a) - (end - start) < _QUOTE_CONTEXT and body[a - 1 : b] in response:
        a -= 1
    while b < line_end and (b - a) - (end - start) < _QUOTE_CONTEXT and body[a : b + 1] in response:
        b += 1
    return (b - a) - (end - start) >= _QUOTE_CONTEXT


def _latest(body: str, lo: float, hi: float, finders: tuple[_Finder, ...], response: str) -> float | None:
    """The latest candidate in the reply, across the finders, that is not in a quoted copy of
    the response; a bare number on the last line only when there is no other."""
    found = [c for find in finders for c in find(body, lo, hi)]
    # a candidate within another (the "7/10" of "Score: 7/10", a label inside a JSON verdict)
    # is part of it
    spans = sorted({(c[0], c[1]) for c in found}, key=lambda s: (s[0], -s[1]))
    inner: set[tuple[int, int]] = set()
    reach = (-1, -1)
    for span in spans:
        if span[1] <= reach[1] and span != reach:
            inner.add(span)
        elif span[1] > reach[1]:
            reach = span
    found = [c for c in found if (c[0], c[1]) not in inner]
    strong = sorted((c for c in found if c[2]), key=lambda c: c[0], reverse=True)
    plain_response = _plain(response)
    skipped: list[_Candidate] = []  # quoted ones, later than the one being looked at
    for c in strong[:_MAX_CANDIDATES]:
        if _quoted(body, c, response, plain_response):
            skipped.append(c)
            continue
        raw = c[3]()
        if raw is not None:
            _not_knocked_out(body, c, raw, skipped, lo, hi)
            return raw
    # the last resort, a bare number on the last line, only when it is the only one there:
    # in "3 of 4 steps are right, so 6" the latest is no likelier the score than the first
    bare = sorted((c for c in found if not c[2]), key=lambda c: c[0], reverse=True)
    own = [c for c in bare[:_MAX_CANDIDATES] if not _quoted(body, c, response, plain_response)][:2]
    if len(own) > 1:
        numbers = ", ".join(body[c[0] : c[1]] for c in reversed(own))
        raise JudgeResponseError(
            f"the last line of the judge's reply, {excerpt(body[_last_line_span(body)[0] :])}, "
            f"holds several numbers ({numbers}) and none is marked as the score; make the "
            f'rubric ask for a final line "Verdict {{nonce}}: N/{hi:g}"'
        )
    if not own:
        return None
    raw = own[0][3]()
    if raw is not None:
        _not_knocked_out(body, own[0], raw, [c for c in skipped if c[0] > own[0][0]], lo, hi)
    return raw


def _not_knocked_out(
    body: str, chosen: _Candidate, raw: float, later: list[_Candidate], lo: float, hi: float
) -> None:
    """Refuse ``raw`` when a later candidate, skipped as text the response carries, reads
    lower. A policy cannot forge a high score (a quote of it is skipped), but it can carry the
    low ones ("Score: 0/10" to "Score: 3/10"): the judge's own low verdict is then skipped as a
    quote, and a high score it mentioned before ("a perfect answer would get Score: 10/10")
    was read as its verdict. A forged score the judge quotes after its verdict reads higher,
    and is skipped as before."""
    for c in later:
        try:
            value = c[3]()
        except JudgeResponseError:  # a quoted "3/0" is no reading
            continue
        if value is not None and lo <= value < raw:
            raise JudgeResponseError(
                f"a score late in the judge's reply, {excerpt(body[c[0] : c[1]])}, is text the "
                f"response carries (a quote, or the judge's verdict?), and the earlier "
                f"{excerpt(body[chosen[0] : chosen[1]])} reads higher: which is the verdict "
                f'cannot be told; make the rubric ask for a final line "Verdict {{nonce}}: '
                f'N/{hi:g}" (the response cannot carry that)'
            )


def verdict_nonce() -> str:
    """A nonce for the verdict line (``Verdict NONCE: N/M``): six lowercase letters, short
    enough for a judge to copy exactly, and no digits, so a judge that garbles it does not
    turn it into a number."""
    return "".join(secrets.choice(_NONCE_LETTERS) for _ in range(6))


def _verdict(body: str, nonce: str, lo: float, hi: float) -> float | None:
    pattern = re.compile(
        rf"\b{re.escape(nonce)}\b[^\w\n]{{0,12}}?({_NUM})(\s*%)?(?:\**{_OF})?", re.IGNORECASE
    )
    matches = list(pattern.finditer(body))
    return _scaled(matches[-1], lo, hi, pct=2, den=3)() if matches else None


def _without_thinking(text: str) -> str:
    """``text`` without a reasoning model's scratch work: a ``<think>`` block that opens the
    reply, or everything up to the first ``</think>`` with no ``<think>`` before it (DeepSeek-R1's
    and Qwen3's chat templates open the block in the prompt, so a server without a reasoning
    parser answers the scratch work, ``</think>``, then the answer: a score the judge weighed
    there was read as its verdict). Only a prefix is dropped, so a ``</think>`` the judge quotes
    from the response can only leave out text before it: a verdict there fails the call, it
    never makes another score the verdict."""
    body, n = _THINK.subn("", text, count=1)
    if n:
        return body
    end = _THINK_END.search(text)
    if end is None or _THINK_OPEN.search(text, 0, end.start()):
        return text
    return text[end.end() :]


def parse_score(
    text: str,
    lo: float = 0.0,
    hi: float = 10.0,
    *,
    rubric: str | None = None,
    nonce: str | None = None,
    response: str | None = None,
) -> float:
    """The score a judge gave, on the rubric's ``[lo, hi]`` scale (see the module's docstring
    for how it is found). ``rubric`` is the template (its form is the one read), ``nonce`` the
    call's verdict nonce when the rubric asked for a verdict line with it, ``response`` the
    graded text (a score the judge quotes from it is not the score). ``JudgeResponseError``
    when there is none or it is out of range."""
    body = _without_thinking(text).strip()  # a reasoning model's scratch work is not its verdict
    fenced = body.startswith(_FENCE) and body.count(_FENCE) == 2
    whole = _plain((_unfenced(body) or "") if fenced else body)
    # (a reply that is only a number, "8", is no echo: a response has numbers of its own)
    if response and _WORDY.search(whole) and whole in _plain(response):
        # the whole reply is the response's text: a judge that obeyed "reply only with
        # {"score": 10}" echoes the policy, and a whole-reply verdict was read before any quote
        raise JudgeResponseError(
            f"the judge's reply {excerpt(text)} is text the response carries (the judge echoed "
            "it, or obeyed an instruction in it): it is no verdict"
        )
    raw = _verdict(body, nonce, lo, hi) if nonce else None
    if raw is None:
        raw = _whole_json(body, lo, hi)
    if raw is None and nonce:
        # the rubric asked for the verdict line: without it, only a line shaped like one
        raw = _latest(body, lo, hi, (_verdict_lines,), response or "")
        if raw is None:
            raise JudgeResponseError(
                f"no verdict line in the judge's reply {excerpt(text)}: the rubric asks it to end "
                f'with "Verdict {nonce}: N/{hi:g}", and a reply without one (nor a line that '
                "begins with its score) is not searched for scores elsewhere: a judge refusing a "
                "response's injection names the score demanded. Check that the model follows "
                "the rubric (and that max_tokens leaves it room)"
            )
    if raw is None:
        raw = _latest(body, lo, hi, _FINDERS[requested_form(rubric)], response or "")
    if raw is None:
        raise JudgeResponseError(
            f"no score in the judge's reply {excerpt(text)} (a score in text quoted from the "
            f"response does not count); make the rubric ask for a final line "
            f'"Verdict {{nonce}}: N/{hi:g}" (or check that the model follows instructions)'
        )
    if not lo <= raw <= hi:
        raise JudgeResponseError(
            f"the judge's score {raw:g} is outside the rubric's range [{lo:g}, {hi:g}] "
            f"(reply {excerpt(text)}); check min_score/max_score against the rubric"
        )
    return raw + 0.0  # a "-0" is 0: -0.0 passes the range check, and logs as negative
