r"""``format_reward``: does the completion have the structure the task asks for?

Rules are configured per call (``rules`` in the payload) and each enabled rule gives one
component, 1.0 or 0.0; the score is their mean. A rule set to ``null``/``false`` (or left
out) is off. Without ``rules`` the default is the reasoning format most RL recipes use::

    {"tags": ["think"], "answer_after_tag": "think", "boxed_once": true, "nothing_after_answer": true}

The "final answer" is the last ``\boxed{...}`` of the completion (with the boxes inside it, if
any: the outermost box is the answer as written).
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

import fabric
from fabric.protocol import RewardResult, Trajectory

_BOXED = re.compile(r"\\boxed[ \t]*\{")  # \boxed {42} too, as TeX and the answer rewards read it
# a brace, or an escape that is no brace (\{ and \} are characters; after \\, an escaped
# backslash, a brace is a brace): as the answer rewards match a box's braces
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)
_TAG_NAME = re.compile(r"^[A-Za-z][\w:-]*$")
_CLOSING_TAG = re.compile(r"</[A-Za-z][\w:-]*>")
# what may follow the final answer under nothing_after_answer: closing math/punctuation
_TRAILING_OK = set(" \t\r\n$.)]")


class FormatRules(BaseModel):
    """Which structural rules to check; every field is one rule (``None`` = off)."""

    model_config = ConfigDict(extra="forbid")

    tags: list[str] | None = None
    """Each ``<tag>...</tag>`` pair appears exactly once, unnested, in this order
    (``["think", "answer"]``: the thinking comes before the answer). At least one tag, each
    named once (an empty list would pass any text)."""
    answer_after_tag: str | None = None
    r"""The completion opens with ``<tag>`` and the final answer (last ``\boxed{}``) begins
    after its ``</tag>``: "think first, then answer"."""
    boxed_once: bool | None = None
    r"""``\boxed{...}`` appears exactly once, with balanced braces (``\{`` and ``\}`` are
    characters)."""
    max_chars: int | None = Field(None, gt=0)
    """The completion is at most this many characters long."""
    nothing_after_answer: bool | str | None = None
    r"""``true``: nothing but whitespace, ``$``, ``.``, brackets and closing tags after the final
    ``\boxed{}``; a string (such as ``"</answer>"``): nothing but whitespace after its last
    occurrence. The string may not be empty or blank (``""`` would be found at the end of any
    text)."""

    @model_validator(mode="before")
    @classmethod
    def _known_rules(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(
                    f"unknown format rule(s) {', '.join(map(repr, unknown))}; "
                    f"known rules: {', '.join(cls.model_fields)}"
                )
        return data

    @model_validator(mode="after")
    def _check(self) -> FormatRules:
        if not self.enabled():
            raise ValueError(
                f"no format rule is enabled; set at least one of: {', '.join(FormatRules.model_fields)}"
            )
        if self.tags == []:
            raise ValueError("tags is empty, so any text would pass; name at least one tag, or null for off")
        after = [] if self.answer_after_tag is None else [self.answer_after_tag]
        for tag in [*(self.tags or []), *after]:
            if not _TAG_NAME.match(tag):
                raise ValueError(f"{tag!r} is not a tag name (write 'think', not '<think>')")
        if self.tags and len(set(self.tags)) < len(self.tags):
            raise ValueError(f"tags {self.tags} repeats a tag; each pair must appear once, so none can pass")
        marker = self.nothing_after_answer
        if isinstance(marker, str) and not marker.strip():
            # rfind("") is the end of any text: the rule would pass everything
            raise ValueError(
                f"nothing_after_answer={marker!r} is blank; give the marker the answer ends with "
                "(such as '</answer>'), or true for the last \\boxed{}"
            )
        return self

    def enabled(self) -> dict[str, Any]:
        """The rules that are on, in field order, with their settings."""
        return {k: v for k, v in self if v is not None and v is not False}


DEFAULT_RULES = FormatRules(
    tags=["think"], answer_after_tag="think", boxed_once=True, nothing_after_answer=True
)


def boxed_spans(text: str) -> list[tuple[int, int] | None]:
    r"""``(start, end)`` of every ``\boxed{...}`` (end is past the closing brace), in order of
    start; ``None`` for one whose braces never balance (an escaped brace, ``\{`` or ``\}``, is a
    character, not a group: ``\boxed{f(x) = \left\{ x \right.}`` balances). One pass with a
    stack of open braces (linear, however many boxes are left open)."""
    opens = {m.end() - 1: m.start() for m in _BOXED.finditer(text)}  # brace index -> box start
    if not opens:
        return []
    found: dict[int, tuple[int, int] | None] = dict.fromkeys(opens.values())
    stack: list[int] = []  # box start, or -1 for a plain brace
    for b in _BRACE.finditer(text, min(opens)):
        if b[0] == "{":
            stack.append(opens.get(b.start(), -1))
        elif b[0] == "}" and stack:
            start = stack.pop()
            if start >= 0:
                found[start] = (start, b.end())
    return [found[start] for start in sorted(found)]


def _tags_ok(text: str, tags: list[str]) -> bool:
    pos = 0
    for tag in tags:
        open_, close = f"<{tag}>", f"</{tag}>"
        if text.count(open_) != 1 or text.count(close) != 1:
            return False
        start, end = text.find(open_), text.find(close)
        if start < pos or end < start:  # out of order, overlapping, or closed before opened
            return False
        pos = end + len(close)
    return True


def _final_answer(text: str) -> tuple[int, int] | None:
    """The last box, or the outermost closed box around it (``\\boxed{x = \\boxed{5}}`` is one
    answer, as the answer rewards read it); None when the last box never closes."""
    spans = boxed_spans(text)
    if not spans or (last := spans[-1]) is None:
        return None
    # boxes are nested or apart: the first (in order of start) that holds the last is outermost
    return next(s for s in spans if s is not None and s[0] <= last[0] and s[1] >= last[1])


def _answer_after_tag(text: str, tag: str) -> bool:
    answer = _final_answer(text)
    close = text.find(f"</{tag}>")
    return (
        answer is not None
        and text.lstrip().startswith(f"<{tag}>")
        and text.count(f"<{tag}>") == 1
        and 0 <= close < answer[0]
    )


def _nothing_after(text: str, marker: bool | str) -> bool:
    if isinstance(marker, str):
        at = text.rfind(marker)
        return at >= 0 and not text[at + len(marker) :].strip()
    answer = _final_answer(text)
    if answer is None:
        return False
    rest = _CLOSING_TAG.sub("", text[answer[1] :])
    return set(rest) <= _TRAILING_OK


def check_rule(text: str, rule: str, setting: Any) -> bool:
    """Whether ``text`` passes one rule (``rule`` is a ``FormatRules`` field name)."""
    if rule == "tags":
        return _tags_ok(text, setting)
    if rule == "answer_after_tag":
        return _answer_after_tag(text, setting)
    if rule == "boxed_once":
        return len(spans := boxed_spans(text)) == 1 and spans[0] is not None
    if rule == "max_chars":
        return len(text) <= setting
    if rule == "nothing_after_answer":
        return _nothing_after(text, setting)
    raise ValueError(f"unknown format rule {rule!r}; known rules: {', '.join(FormatRules.model_fields)}")


_EXAMPLE = "<think>6 * 7 is 42.</think>\nThe answer is \\boxed{42}."


@fabric.reward(
    warm=1,
    timeout_s=5,
    max_batch=64,
    examples=(
        {"traj": {"messages": [{"role": "assistant", "content": _EXAMPLE}]}},
        {"traj": "no tags, \\boxed{1} and \\boxed{2}", "rules": {"boxed_once": True, "max_chars": 100}},
    ),
)
def format_reward(traj: Trajectory | str, *, rules: FormatRules | None = None) -> RewardResult:
    """Structure of the final completion: one 1.0/0.0 component per rule, score = their mean."""
    text = traj if isinstance(traj, str) else traj.final_text()
    # in-process callers may pass a plain dict; the JSON path already validated it
    if rules is None:
        rules = DEFAULT_RULES
    elif not isinstance(rules, FormatRules):
        rules = FormatRules.model_validate(rules)
    components = {rule: float(check_rule(text, rule, setting)) for rule, setting in rules.enabled().items()}
    score = sum(components.values()) / len(components)
    return RewardResult(score=score, components=components, info={"chars": len(text)})
