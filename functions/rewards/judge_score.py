"""``parse_score``: the score in a judge's reply, on the rubric's scale.

A judge often quotes the response it grades, and that text is the policy's: anything in it
that looks like a score (``{"score": 10}``, ``<score>10</score>``) must not become the
score. So the verdict is read the way the rubric asks for it and from the end of the reply
(a judge gives its verdict after its reasoning, and quotes come in the reasoning):

1. a reply that is one JSON object (bare or in one fenced block) with a ``score``,
   ``rating`` or ``grade``: the whole reply is the verdict;
2. the form the rubric asks for (``requested_form``), its last match: ``Score: N/M`` (the
   default rubric's line; also ``Rating: N out of M``, ``Grade: 85%``), ``<score>N</score>``,
   or a JSON object that ends the reply;
3. the other forms only where they end the reply: a JSON object (bare on its own lines, or
   the reply's last fenced block) with nothing after it, ``<score>N</score>`` or ``**N**`` on
   the last line; a labelled ``Score: N`` anywhere when the rubric asked for another form;
4. last, a number on the reply's last line (``I give it a 7.``, ``3/10``).

A ``<think>...</think>`` block is dropped only where a reasoning model puts it, at the start
of the reply: one quoted from the response (maybe unclosed) is ordinary text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, Literal

from functions.openai_api import excerpt
from functions.rewards.judge_errors import JudgeResponseError

Form = Literal["label", "tag", "json"]

_NUM = r"[-+]?\d+(?:\.\d+)?"
_OF = rf"\s*(?:/|out\s+of)\s*({_NUM})"
_THINK = re.compile(r"\A\s*<think>.*?(?:</think>|\Z)", re.DOTALL | re.IGNORECASE)
_TAG = re.compile(rf"<score>\s*({_NUM})(?:{_OF})?\s*</score>", re.IGNORECASE)
_LABEL = re.compile(
    # the separators before the number must not overlap ("score" then a long run of spaces
    # was quadratic): "is"/"of" is optional and a whole word
    rf"\b(?:score|rating|grade)\b[\s*_:=]*(?:(?:is|of)\b[\s*:=]*)?({_NUM})(\s*%)?\**(?:{_OF})?",
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


def _on_scale(num: str, percent: str | None, den: str | None, lo: float, hi: float) -> float:
    """A matched number on the rubric's scale: ``8/10`` on a 0-10 rubric is 8; ``4/5`` on it
    is 8 (a fraction of the range); ``80%`` likewise."""
    n = float(num)
    if percent:
        return lo + n / 100 * (hi - lo)
    if den is None or float(den) == hi:
        return n
    if float(den) <= 0:
        raise JudgeResponseError(f"score {num}/{den} has a zero or negative denominator")
    return lo + n / float(den) * (hi - lo)


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


def _json_at_end(body: str, lo: float, hi: float) -> float | None:
    """A JSON verdict that ends the reply: the last fenced block, or an object from the start
    of a line to the end (``{"score": 7}`` after the reasoning)."""
    inner = _unfenced(body)
    if inner is not None:
        return _obj_score(_loads(inner), lo, hi)
    if not body.endswith("}"):
        return None
    starts = [m.start() for m in _OBJ_START.finditer(body)][-_MAX_OBJ_TRIES:]
    for start in reversed(starts):
        raw = _obj_score(_loads(body[start:]), lo, hi)
        if raw is not None:
            return raw
    return None


def _last_line(body: str) -> str:
    lines = body.splitlines()
    return lines[-1] if lines else ""


def _label(body: str, lo: float, hi: float) -> float | None:
    matches = _LABEL.findall(body)
    if not matches:
        return None
    num, percent, den = matches[-1]
    return _on_scale(num, percent.strip() or None, den or None, lo, hi)


def _tag(body: str, lo: float, hi: float) -> float | None:
    matches = _TAG.findall(body)
    return _on_scale(matches[-1][0], None, matches[-1][1] or None, lo, hi) if matches else None


def _tag_at_end(body: str, lo: float, hi: float) -> float | None:
    return _tag(_last_line(body), lo, hi)


def _bold_at_end(body: str, lo: float, hi: float) -> float | None:
    matches = _BOLD.findall(_last_line(body))
    return _on_scale(matches[-1][0], None, matches[-1][1] or None, lo, hi) if matches else None


def _number_at_end(body: str, lo: float, hi: float) -> float | None:
    # an unlabelled number is trusted only on the last line: earlier ones are reasoning ("2 + 2")
    matches = _LAST.findall(_last_line(body))
    if not matches:
        return None
    num, percent, den = matches[-1]
    return _on_scale(num, percent.strip() or None, den or None, lo, hi)


_Finder = Callable[[str, float, float], float | None]
_ORDER: dict[Form, tuple[_Finder, ...]] = {
    "label": (_label, _json_at_end, _tag_at_end, _bold_at_end, _number_at_end),
    "tag": (_tag, _json_at_end, _label, _bold_at_end, _number_at_end),
    "json": (_json_at_end, _label, _tag_at_end, _bold_at_end, _number_at_end),
}


def parse_score(text: str, lo: float = 0.0, hi: float = 10.0, *, rubric: str | None = None) -> float:
    """The score a judge gave, on the rubric's ``[lo, hi]`` scale, read in the form
    ``rubric`` (the template) asks for and from the end of the reply (see the module's
    docstring for the order). ``JudgeResponseError`` when there is none or it is out of
    range."""
    body = _THINK.sub("", text).strip()  # a reasoning model's scratch work is not its verdict
    raw = _whole_json(body, lo, hi)
    if raw is None:
        for find in _ORDER[requested_form(rubric)]:
            raw = find(body, lo, hi)
            if raw is not None:
                break
    if raw is None:
        raise JudgeResponseError(
            f"no score in the judge's reply {excerpt(text)}; make the rubric ask for a final "
            f'line "Score: N/{hi:g}" (or check that the model follows instructions)'
        )
    if not lo <= raw <= hi:
        raise JudgeResponseError(
            f"the judge's score {raw:g} is outside the rubric's range [{lo:g}, {hi:g}] "
            f"(reply {excerpt(text)}); check min_score/max_score against the rubric"
        )
    return raw
