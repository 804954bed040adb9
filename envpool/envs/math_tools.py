"""Arithmetic word problems with a calculator tool.

Each reset poses one problem generated from the seed (or ``options={"question": ...,
"answer": ...}`` for a problem of your own). An action is either

* a tool call, as JSON: ``{"tool": "calculator", "arguments": {"expression": "17 * 23"}}``
  (``"name"`` for ``"tool"`` and OpenAI's JSON-string ``"arguments"`` are accepted too):
  the environment calls the tool through its bridge and shows the output, reward 0; or
* a final answer: the episode ends with reward 1.0 when it equals the problem's answer, else
  0.0. The answer is read and judged as the ``math_answer`` reward does
  (``functions.rewards.math.extract_final`` and ``is_equivalent``: "Answer: 37 trees",
  "My final answer: 37" and "The answer is 37.0" all state 37), so the env's reward (a
  run's success) and the reward function agree on it. A reply states a final answer, and
  ends the episode, when that extraction finds a box or an answer marker ("Answer:",
  "final answer:", "the answer is", "####"), or when the whole reply is one number (a bare
  "37"). The reward's last-resort rule, the last number anywhere in a reply, does not end
  the episode: "17 * 23 is 391; next I add 5" is a step, not an answer (the reward would
  judge 5 if the episode ended there).

Anything else gets a reminder of the two forms, reward 0.

For the schedulers, ``info["valid"]`` is False and ``info["outcome"]`` ``"tool_error"`` on a
bad tool call, a tool that answers ``error: ...`` and a reply that is neither form; a
correct answer is ``"success"``.

For the rewards, a step that was a tool call says so in ``info["calls"]`` (the env
manager's contract, ``core.rollout.tool_calls``): ``[{"name", "arguments", "output"}]``,
with ``"refused": <why>`` when the call was not run (bad JSON, an unknown tool, arguments
the calculator does not take): it is still the policy's call, an invalid one.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any, ClassVar

from envpool.api import Env, Observation, StepResult
from functions.rewards.math import extract_final, is_equivalent
from functions.tools.calculator import OPENAI_SCHEMA

TOOLS = [OPENAI_SCHEMA]
_STATED = frozenset({"boxed", "answer_is"})  # extract_final's rules for a stated final answer
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")
_HOW = (
    'Call the calculator with JSON, e.g. {"tool": "calculator", "arguments": {"expression": "12 * 7"}}, '
    "or give the final answer as 'Answer: <number>'."
)

Problem = tuple[str, int]


def _orchard(r: random.Random) -> Problem:
    a, b, c = r.randint(12, 48), r.randint(15, 60), r.randint(20, 300)
    q = (
        f"An orchard has {a} rows of {b} apple trees. The farmer plants {c} more trees. "
        "How many trees are there now?"
    )
    return q, a * b + c


def _change(r: random.Random) -> Problem:
    price, n = r.randint(3, 19), r.randint(4, 12)
    bill = 50 * ((price * n) // 50 + 1)
    q = (
        f"Pens cost {price} dollars each. Maria buys {n} pens and pays with {bill} dollars. "
        "How much change, in dollars, does she get?"
    )
    return q, bill - price * n


def _train(r: random.Random) -> Problem:
    speed, hours = r.randint(45, 140), r.randint(2, 9)
    q = (
        f"A train travels {speed * hours} km in {hours} hours at a constant speed. "
        "What is its speed in km per hour?"
    )
    return q, speed


def _tank(r: random.Random) -> Problem:
    start, leak, hours = r.randint(800, 2000), r.randint(11, 39), r.randint(3, 12)
    refill = r.randint(50, 400)
    q = (
        f"A tank holds {start} liters of water. It leaks {leak} liters per hour for {hours} hours, "
        f"then {refill} liters are added. How many liters are in the tank now?"
    )
    return q, start - leak * hours + refill


def _boxes(r: random.Random) -> Problem:
    per_box, boxes = r.randint(6, 24), r.randint(25, 140)
    extra = r.randint(1, per_box - 1)
    q = (
        f"A bakery packs cookies in boxes of {per_box}. Today it baked {per_box * boxes + extra} cookies. "
        f"How many full boxes can it pack?"
    )
    return q, boxes


GENERATORS: tuple[Callable[[random.Random], Problem], ...] = (_orchard, _change, _train, _tank, _boxes)


def generate_problem(rng: random.Random) -> Problem:
    """One ``(question, integer answer)`` drawn from the built-in templates."""
    return GENERATORS[int(rng.random() * len(GENERATORS))](rng)


class MathToolsEnv(Env):
    """One word problem per episode; the policy may call ``calculator`` before answering."""

    example_actions: ClassVar[tuple[str, ...]] = (
        '{"tool": "calculator", "arguments": {"expression": "6 * 7"}}',
        "I am not sure yet.",
        "Answer: 0",
    )

    def __init__(self) -> None:
        self._rng: random.Random | None = None
        self.question = ""
        self.answer = ""
        self.tool_calls = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if seed is not None or self._rng is None:
            self._rng = random.Random(seed)
        options = options or {}
        if "question" in options:
            if "answer" not in options:
                raise ValueError("options with a 'question' need its 'answer' too")
            self.question, self.answer = str(options["question"]), str(options["answer"])
        else:
            question, answer = generate_problem(self._rng)
            self.question, self.answer = question, str(answer)
        self.tool_calls = 0
        text = f"{self.question}\n\n{_HOW}"
        # info["task"] is for the harness (the policy never sees info): the core job copies it
        # into the trajectory's task, where reward functions find the ground truth
        task = {"question": self.question, "answer": self.answer}
        return Observation(text=text, tools=TOOLS), {"tools": ["calculator"], "task": task}

    def step(self, action: str) -> StepResult:
        text = action.strip()
        call = _parse_tool_call(text)
        if call is not None:
            return self._tool_step(call, text)
        given, rule = extract_final(text)
        if given is not None and (rule in _STATED or (rule == "last_number" and given == text)):
            correct, _ = is_equivalent(given, self.answer)
            verdict = "Correct." if correct else "Incorrect."
            info = {"answer": given, "correct": correct, "tool_calls": self.tool_calls}
            if correct:
                info["outcome"] = "success"
            return StepResult(
                obs=Observation(text=f"{verdict} Episode over."),
                reward=1.0 if correct else 0.0,
                terminated=True,
                info=info,
            )
        return StepResult(
            obs=Observation(text=f"No tool call or final answer found. {_HOW}", tools=TOOLS),
            info=dict(_TOOL_ERROR),
        )

    def _tool_step(self, call: dict[str, Any] | str, text: str) -> StepResult:
        if isinstance(call, str):  # what was wrong with the JSON
            shown = f"Bad tool call: {call}. {_HOW}"
            name, arguments = _as_written(text)
            refused = {"name": name, "arguments": arguments, "output": shown, "refused": call}
            return StepResult(
                obs=Observation(text=shown, tools=TOOLS), info={**_TOOL_ERROR, "calls": [refused]}
            )
        self.tool_calls += 1
        output = self.call_tool(call["tool"], call["arguments"])
        # the bridge answers a tool's exception (a calculator's refusal) as "error: ..."
        failed = output.startswith("error:")
        ran = {"name": call["tool"], "arguments": json.dumps(call["arguments"]), "output": output}
        info: dict[str, Any] = {
            "tool": call["tool"],
            "tool_calls": self.tool_calls,
            "valid": not failed,
            "calls": [ran],
        }
        if failed:
            info["outcome"] = "tool_error"
        return StepResult(obs=Observation(text=output, tools=TOOLS), info=info)


# the schedulers' signal (info["outcome"]) for a reply that neither calls a tool nor answers
_TOOL_ERROR: dict[str, Any] = {"valid": False, "outcome": "tool_error"}


_TOO_DEEP = "invalid JSON (nested too deep)"


def _as_written(text: str) -> tuple[str, str]:
    """A refused call's name and arguments as the policy wrote them, for the rewards: the
    name when the JSON gives a string one (else ""), the arguments as a JSON string, or the
    whole text when it is not a JSON object at all."""
    body = _FENCE.sub("", text).strip()
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return "", body
    if not isinstance(data, dict):
        return "", body
    name = data.get("tool", data.get("name"))
    args = data.get("arguments", {})
    return (name if isinstance(name, str) else ""), (args if isinstance(args, str) else json.dumps(args))


def _parse_tool_call(text: str) -> dict[str, Any] | str | None:
    """``{"tool", "arguments"}``, a message saying why the JSON is not a valid call, or
    None when the action is not meant as a tool call."""
    body = _FENCE.sub("", text).strip()
    if not body.startswith("{"):
        return None
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg} at position {e.pos})"
    except RecursionError:  # (raised from step, it made the trajectory an environment failure)
        return _TOO_DEEP
    if not isinstance(data, dict):
        return "a tool call is a JSON object"
    name = data.get("tool", data.get("name"))
    args = data.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return "'arguments' is a string that is not JSON"
        except RecursionError:
            return _TOO_DEEP
    if name != "calculator":
        return f"unknown tool {name!r}; the only tool is 'calculator'"
    if not isinstance(args, dict) or set(args) != {"expression"} or not isinstance(args["expression"], str):
        return 'calculator takes {"expression": "<text>"} and nothing else'
    return {"tool": name, "arguments": args}
