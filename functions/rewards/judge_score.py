"""``parse_score``: the score in a judge's reply (JSON, ``<score>`` tags, ``Score: N/M``, bold,
a last number), on the rubric's scale."""

from __future__ import annotations

import json
import re

from functions.openai_api import excerpt
from functions.rewards.judge_errors import JudgeResponseError

_NUM = r"[-+]?\d+(?:\.\d+)?"
_OF = rf"\s*(?:/|out\s+of)\s*({_NUM})"
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_JSON_OBJ = re.compile(r"\{[^{}]*\}")
_TAG = re.compile(rf"<score>\s*({_NUM})(?:{_OF})?\s*</score>", re.IGNORECASE)
_LABEL = re.compile(
    rf"\b(?:score|rating|grade)\b[\s*_:=]*(?:is|of)?[\s*:=]*({_NUM})(\s*%)?\**(?:{_OF})?", re.IGNORECASE
)
_BOLD = re.compile(rf"\*\*\s*({_NUM})(?:{_OF})?\s*\*\*")
_LAST = re.compile(rf"({_NUM})(\s*%)?(?:{_OF})?")
_SCORE_KEYS = ("score", "rating", "grade")


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


def _json_score(text: str, lo: float, hi: float) -> float | None:
    candidates = [_FENCE.sub("", text.strip()), *_JSON_OBJ.findall(text)[::-1]]
    for cand in candidates:
        try:
            obj = json.loads(cand)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        for key in _SCORE_KEYS:
            value = obj.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str):
                return parse_score(value, lo, hi)
    return None


def parse_score(text: str, lo: float = 0.0, hi: float = 10.0) -> float:
    """The score a judge gave, on the rubric's ``[lo, hi]`` scale. Looks for, in order: a JSON
    object with a ``score``, ``<score>N</score>``, a labelled ``Score: N`` (``/M``, ``out of M``,
    ``%``), a bold ``**N**``, and last the last number of the last line; the last match of a
    kind wins (a verdict follows its reasoning). ``JudgeResponseError`` when there is none or
    it is out of range."""
    body = _THINK.sub("", text)  # a reasoning model's scratch work is not its verdict
    raw = _json_score(body, lo, hi)
    lines = body.strip().splitlines()
    # an unlabelled number is trusted only on the last line: earlier ones are reasoning ("2 + 2")
    last_line = lines[-1] if lines else ""
    if raw is None:
        for pattern in (_TAG, _LABEL, _BOLD, _LAST):
            matches = pattern.findall(last_line if pattern is _LAST else body)
            if matches:
                m = matches[-1]
                if pattern is _TAG or pattern is _BOLD:
                    raw = _on_scale(m[0], None, m[1] or None, lo, hi)
                else:
                    raw = _on_scale(m[0], m[1].strip() or None, m[2] or None, lo, hi)
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
