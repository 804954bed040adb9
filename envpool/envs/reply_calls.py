"""The tool calls in a policy's reply, in the forms real policies write them.

``find_tool_calls(reply, tools)`` reads, in the order they are written:

* Hermes/Qwen blocks, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, anywhere
  in the reply; one cut off before its closing tag (a reply stopped at ``</tool_call>``, or
  out of tokens) runs to the reply's end;
* a reply that is one JSON object (pretty-printed or not, in a Markdown fence or not);
* outside the tags, each line that is one JSON object (``{"`` starts it): what the OpenAI
  engine writes, the content and then each call the server parsed on a line of its own
  (``core.rollout.engines.openai_``), and several calls written one a line;
* a JSON object in a fenced block (````json`` or a bare fence) after some text.

A call is ``{"name": <tool>, "arguments": <object>}`` (``"tool"`` for ``"name"``;
``"parameters"`` for ``"arguments"``, Llama 3.1's form, read when there is no
``"arguments"``; the arguments as an object or, OpenAI's wire form, a string holding one;
none is ``{}``). What precedes the last ``</think>`` is thinking, as the answer rewards
read it (``functions.rewards.answer.after_thinking``), and so is a ``<think>`` never
closed: a call drafted there is not made. Each attempt the reply makes comes back, with why it is refused
when it is not a call (malformed JSON, not an object, no name, an unknown tool, arguments
that are not an object). At most ``limit`` are read: one more is refused as one too many,
and the rest of the reply is not read.

Every scan is a ``str.find`` or a split moving forward, and each piece of JSON is decoded
once, so a long or adversarial reply costs time linear in its length (no regex that can
backtrack).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from functions.rewards.answer import after_thinking

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 8
TOO_DEEP = "invalid JSON (nested too deep)"


@dataclass(frozen=True)
class ToolCallText:
    """One call the reply attempts: ``name`` (``""`` when not a string), ``arguments`` as
    written (their JSON text, or the attempt's whole text when it is not a JSON object),
    ``parsed`` (the arguments object; ``None`` when refused) and ``refused`` (why not)."""

    name: str
    arguments: str
    parsed: dict[str, Any] | None = None
    refused: str | None = None


def calls_region(reply: str) -> str:
    """The part of ``reply`` that can make calls: after the last ``</think>``, up to a
    ``<think>`` never closed."""
    region = after_thinking(reply)
    opened = region.find("<think>")
    return region if opened < 0 else region[:opened]


def find_tool_calls(reply: str, tools: Collection[str], limit: int = MAX_CALLS) -> list[ToolCallText]:
    """The calls ``reply`` attempts, in order (``[]``: it attempts none); see the module."""
    found = _Found(tools, limit)
    region = calls_region(reply)
    pos = 0
    while pos <= len(region) and not found.full:
        t = region.find(OPEN, pos)
        found.loose(region[pos : t if t >= 0 else len(region)])
        if t < 0:
            break
        start = t + len(OPEN)
        end = region.find(CLOSE, start)
        found.tagged(region[start : end if end >= 0 else len(region)])
        pos = end + len(CLOSE) if end >= 0 else len(region) + 1
    return found.calls


class _Found:
    def __init__(self, tools: Collection[str], limit: int) -> None:
        self.tools, self.limit = tools, limit
        self.calls: list[ToolCallText] = []

    @property
    def full(self) -> bool:
        return len(self.calls) > self.limit

    def add(self, call: ToolCallText) -> None:
        if self.full:
            return
        if len(self.calls) == self.limit:
            why = (
                f"more than {self.limit} tool calls in one reply: the first {self.limit} are "
                "answered, this one and any after it are not"
            )
            call = ToolCallText(call.name, call.arguments, refused=why)
        self.calls.append(call)

    def tagged(self, body: str) -> None:
        text = _unfence(body.strip())
        if text:
            self.block(text)
        else:
            self.add(ToolCallText("", body, refused=f"an empty {OPEN}: put the call's JSON in it"))

    def loose(self, text: str) -> None:
        """Text outside the tags: one JSON object, else its fenced blocks and one-line objects."""
        whole = _unfence(text.strip())
        if whole.startswith("{"):
            self.block(whole)
            return
        fence: list[str] | None = None  # the lines of the open fenced block
        json_fence = False
        for line in text.split("\n"):
            s = line.strip()
            if fence is not None and s.startswith("```"):
                self.fenced(fence, json_fence)
                fence = None
            elif fence is not None:
                fence.append(line)
            elif s.startswith("```"):
                fence, json_fence = [], s[3:].strip().lower() in ("", "json")
            elif _one_line_object(s):
                self.add(self.decode(s))
            if self.full:
                return
        if fence is not None:
            self.fenced(fence, json_fence)  # a fence the reply never closed

    def fenced(self, lines: list[str], json_fence: bool) -> None:
        body = "\n".join(lines).strip()
        if json_fence and body.startswith("{"):
            self.block(body)

    def block(self, text: str) -> None:
        """``text`` meant as a call: one JSON object, else (JSON that does not parse, over
        several lines) each line that is one (several calls, one a line), else refused."""
        call = self.decode(text)
        if call.refused is None or "\n" not in text or not call.refused.startswith("invalid JSON"):
            self.add(call)
            return
        before = len(self.calls)
        for line in text.split("\n"):
            s = line.strip()
            if _one_line_object(s):
                self.add(self.decode(s))
            if self.full:
                return
        if len(self.calls) == before:
            self.add(call)

    def decode(self, text: str) -> ToolCallText:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            return ToolCallText("", text, refused=f"invalid JSON ({e.msg} at position {e.pos})")
        except RecursionError:
            return ToolCallText("", text, refused=TOO_DEEP)
        if not isinstance(data, dict):
            return ToolCallText("", text, refused="a tool call is a JSON object")
        name = data.get("tool", data.get("name"))
        # Llama 3.1's JSON tool calling writes the arguments under "parameters"
        key = "arguments" if "arguments" in data or "parameters" not in data else "parameters"
        args = data.get(key, {})
        try:
            written = args if isinstance(args, str) else json.dumps(args)
        except RecursionError:
            written = text
        shown = name if isinstance(name, str) else ""
        if name is None:
            why = 'no tool name: a call is {"name": "<tool>", "arguments": {...}}'
            return ToolCallText("", written, refused=why)
        if name not in self.tools:
            names = sorted(self.tools)
            known = f"the only tool is {names[0]!r}" if len(names) == 1 else f"the tools are {names}"
            return ToolCallText(shown, written, refused=f"unknown tool {name!r}; {known}")
        if isinstance(args, str):  # OpenAI's wire form: the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCallText(shown, written, refused=f"'{key}' is a string that is not JSON")
            except RecursionError:
                return ToolCallText(shown, written, refused=TOO_DEEP)
        if not isinstance(args, dict):
            got = type(args).__name__
            why = f"'{key}' is not a JSON object (got {got}): give {{\"<name>\": <value>, ...}}"
            return ToolCallText(shown, written, refused=why)
        return ToolCallText(shown, written, parsed=args)


def _one_line_object(s: str) -> bool:
    """A line meant as a JSON object: ``{`` then a key's quote (``{"`` or ``{ "``; ``'`` too,
    which is refused as bad JSON with json's message); a brace in prose (``{42}``) is not."""
    return s.startswith("{") and s[1:].lstrip()[:1] in ('"', "'")


def _unfence(s: str) -> str:
    """``s`` without a Markdown fence around it (````json`` ... `````), by prefix and suffix:
    the regex this replaced backtracked quadratically on a long run of whitespace."""
    if s.startswith("```"):
        s = s[3:]
        if s.startswith("json"):
            s = s[4:]
        s = s.lstrip()
    if s.endswith("```"):
        s = s[:-3].rstrip()
    return s
