"""Arithmetic word problems with a calculator tool.

Each reset poses one problem generated from the seed (or ``options={"question": ...,
"answer": ...}`` for a problem of your own). An action is either

* one or more tool calls, ``{"name": "calculator", "arguments": {"expression": "17 * 23"}}``
  (``"tool"`` for ``"name"``, Llama 3.1's ``"parameters"`` for ``"arguments"``; the
  arguments an object or OpenAI's JSON string of one), written as real policies write them
  (``envpool.envs.reply_calls``): the whole reply, Hermes/Qwen ``<tool_call>...</tool_call>``
  blocks after any text or thinking, a line of its own after the text (the OpenAI engine's
  form), or a fenced JSON block. Each call is run in order
  through the bridge (at most 8 a turn; one more is refused as one too many) and the
  observation is their outputs, one a line in the calls' order (a refused call's line says
  why), reward 0. A reply that makes a call is a step, even if it states an answer too: the
  policy has not seen the outputs yet; or
* a final answer: the episode ends with reward 1.0 when it equals the problem's answer, else
  0.0. The answer is read and judged as the ``math_answer`` reward does
  (``functions.rewards.math.extract_final`` and ``is_equivalent``: "Answer: 37 trees",
  "My final answer: 37" and "The answer is 37.0" all state 37), so the env's reward (a
  run's success) and the reward function agree on it. A reply states a final answer, and
  ends the episode, when that extraction finds a box or an answer marker ("Answer:",
  "final answer:", "the answer is", "####"), or when the whole reply is one number (a bare
  "37", after any ``<think>...</think>``). The reward's last-resort rule, the last number
  anywhere in a reply, does not end the episode: "17 * 23 is 391; next I add 5" is a step,
  not an answer (the reward would judge 5 if the episode ended there).

Anything else gets a reminder of the two forms, reward 0.

For the schedulers, ``info["valid"]`` is False and ``info["outcome"]`` ``"tool_error"`` on a
bad tool call, a tool that answers ``error: ...`` and a reply that is neither form; a
correct answer is ``"success"``.

For the rewards, a step that was a tool call says so in ``info["calls"]`` (the env
manager's contract, ``core.rollout.tool_calls``): ``[{"name", "arguments", "output"}]``,
one entry per call in order, with ``"refused": <why>`` when the call was not run (bad JSON,
no name or an unknown tool, arguments that are not an object or that the calculator does
not take, one call too many): it is still the policy's call, an invalid one. ``info["valid"]``
is True only when every call of the turn ran and none answered ``error: ...``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any, ClassVar

from envpool.api import Env, Observation, StepResult
from envpool.envs.reply_calls import ToolCallText, find_tool_calls
from functions.rewards.answer import after_thinking
from functions.rewards.math import extract_final, is_equivalent
from functions.tools.calculator import OPENAI_SCHEMA

TOOLS = [OPENAI_SCHEMA]
TOOL_NAMES = ("calculator",)
_STATED = frozenset({"boxed", "answer_is"})  # extract_final's rules for a stated final answer
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
        'Hm.\n<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>',
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
        calls = find_tool_calls(text, TOOL_NAMES)
        if calls:
            return self._tool_step(calls)
        given, rule = extract_final(text)
        # a bare number is one only when it is all the reply says after its thinking, as the
        # reward reads it ("<think>...</think>\n42" was a reply that neither called nor answered)
        bare = after_thinking(text).strip()
        if given is not None and (rule in _STATED or (rule == "last_number" and given == bare)):
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

    def _tool_step(self, calls: list[ToolCallText]) -> StepResult:
        """Run each call in order (a refused one answered by why), and show their outputs one
        a line, in order: the observation is the outputs joined by newlines, as the rewards'
        view of the turn expects (``core.rollout.tool_calls``)."""
        records: list[dict[str, Any]] = []
        ran = failed = 0
        for call in calls:
            why = call.refused or _calculator_refuses(call.parsed)
            if why is not None:
                shown = f"Bad tool call: {why}. {_HOW}"
                records.append(
                    {"name": call.name, "arguments": call.arguments, "output": shown, "refused": why}
                )
                continue
            assert call.parsed is not None  # (a call not refused has its arguments parsed)
            self.tool_calls += 1
            ran += 1
            output = self.call_tool(call.name, call.parsed)
            # the bridge answers a tool's exception (a calculator's refusal) as "error: ..."
            failed += output.startswith("error:")
            records.append({"name": call.name, "arguments": json.dumps(call.parsed), "output": output})
        obs = Observation(text="\n".join(r["output"] for r in records), tools=TOOLS)
        if not ran:
            return StepResult(obs=obs, info={**_TOOL_ERROR, "calls": records})
        valid = not failed and ran == len(records)
        info: dict[str, Any] = {
            "tool": "calculator",
            "tool_calls": self.tool_calls,
            "valid": valid,
            "calls": records,
        }
        if not valid:
            info["outcome"] = "tool_error"
        return StepResult(obs=obs, info=info)


def _calculator_refuses(arguments: dict[str, Any] | None) -> str | None:
    if arguments is None or set(arguments) != {"expression"} or not isinstance(arguments["expression"], str):
        return 'calculator takes {"expression": "<text>"} and nothing else'
    return None


# the schedulers' signal (info["outcome"]) for a reply that neither calls a tool nor answers
_TOOL_ERROR: dict[str, Any] = {"valid": False, "outcome": "tool_error"}
