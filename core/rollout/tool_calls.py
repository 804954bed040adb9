"""The tool calls of an agentic environment's episode, as the rewards see them.

An environment parses its tool calls out of the policy's text and shows their outputs as
its next observation, so the trajectory the policy plays and is trained on is a plain chat:
assistant text, user observations. A reward that scores tool use (``tool_use``) reads the
OpenAI shape instead: assistant messages with ``tool_calls``, ``role: "tool"`` results with
their ``tool_call_id``. Recorded as a plain chat, it saw no calls at all.

The contract: a step that was a tool call reports it in ``info["calls"]``, one entry per
call the environment parsed from the action::

    {"name": "calculator", "arguments": "{\\"expression\\": \\"6 * 7\\"}", "output": "42"}
    {"name": "", "arguments": "{oops", "output": "Bad tool call: ...", "refused": "invalid JSON ..."}

``refused`` marks a call the environment did not run (bad JSON, an unknown tool, arguments
the tool does not take): still the policy's call, an invalid one. The env manager keeps
them per assistant turn in ``traj.info["turn_tool_calls"]`` (``record_calls``); the reward stream
hands the rewards ``reward_trajectory(traj)``, a copy in the OpenAI shape. The trajectory
itself (what the proxy renders into the prompt, what the trainer takes token ids and
logprobs from) is never changed.
"""

from __future__ import annotations

import json
from typing import Any

from fabric.protocol import Message, ToolCall, Trajectory

TURN_CALLS_KEY = "turn_tool_calls"
"""``traj.info`` key: per assistant turn, the calls its step reported (``[]`` for none)."""


def record_calls(info: dict[str, Any]) -> list[dict[str, str]]:
    """The calls a step's ``info`` reports, each with string ``name``, ``arguments`` and
    ``output`` (and ``refused`` when given); anything else an environment put there is made
    a string rather than dropped: a call the policy made still counts."""
    given = info.get("calls")
    if not isinstance(given, list):
        return []
    out = []
    for c in given:
        c = c if isinstance(c, dict) else {"arguments": c}
        call = {k: _text(c.get(k)) for k in ("name", "arguments", "output")}
        # a reason, or True; an empty reason is still a refusal, but False is a flag saying
        # the call ran (made "false", a truthy string, tool_use counted it as invalid)
        if c.get("refused") not in (None, False):
            call["refused"] = _text(c["refused"]) or "refused by the environment"
        out.append(call)
    return out


def _text(v: Any) -> str:
    if v is None:
        return ""
    return v if isinstance(v, str) else json.dumps(v, default=str)


def reward_trajectory(traj: Trajectory) -> Trajectory:
    """``traj`` as the rewards get it: each assistant turn that made calls carries them as
    ``tool_calls`` (ids ``call_<turn>_<k>``; a refused one with ``refused: <why>``, which
    ``tool_use`` counts as invalid), followed by one ``role: "tool"`` message per call with
    its output. The turn's observation follows as a user message only when it is more than
    the outputs (it is not the outputs joined by newlines): math-tools' observation is the
    tool's output, and kept as both it would be read twice. The reply's text stays the
    assistant message's content (``final_text``, judges read it). ``traj`` itself when it
    has no calls recorded; never changed."""
    turns: list[list[dict[str, str]]] = traj.info.get(TURN_CALLS_KEY) or []
    if not any(turns):
        return traj
    messages: list[Message] = []
    turn = -1
    pending: list[Message] = []  # the tool results of the last turn, before its observation
    for m in traj.messages:
        if m.role == "assistant":
            messages.extend(pending)
            pending = []
            turn += 1
            calls = turns[turn] if turn < len(turns) else []
            if calls:
                ids = [f"call_{turn}_{k}" for k in range(len(calls))]
                messages.append(
                    m.model_copy(
                        update={"tool_calls": [_tool_call(i, c) for i, c in zip(ids, calls, strict=True)]}
                    )
                )
                pending = [
                    Message(role="tool", tool_call_id=i, content=c["output"])
                    for i, c in zip(ids, calls, strict=True)
                ]
                continue
        elif pending and m.role == "user":
            outputs = "\n".join(t.content or "" for t in pending)
            messages.extend(pending)
            pending = []
            if m.content == outputs:
                continue
        messages.append(m)
    messages.extend(pending)
    return traj.model_copy(update={"messages": messages})


def _tool_call(call_id: str, call: dict[str, str]) -> ToolCall:
    extra = {"refused": call["refused"]} if "refused" in call else {}
    return ToolCall(id=call_id, function={"name": call["name"], "arguments": call["arguments"]}, **extra)
