"""math-tools reads the replies real policies write, reviewed. It took a reply only when the
whole of it was one JSON object, so a Hermes/Qwen ``<tool_call>`` block, a call after some
thinking, the OpenAI engine's own text (the content, then each call on a line of its own),
two calls in one turn and a bare number after ``</think>`` all got "No tool call or final
answer found" (or "Bad tool call: invalid JSON (Extra data ...)"): the policy's calls were
lost. Its fence regex also backtracked quadratically on a long run of whitespace (a policy
stuck emitting newlines up to its token budget)."""

from __future__ import annotations

import json
import threading
from typing import Any

import envpool
from core.rollout.engines.base import GenerateRequest
from core.rollout.engines.openai_ import OpenAIEngine
from envpool.envs.math_tools import MathToolsEnv
from fabric.protocol import Message
from functions.fakes import FakeOpenAI, Scripted
from functions.rewards.math import math_answer

CALL = {"name": "calculator", "arguments": {"expression": "6 * 7"}}


def env() -> Any:
    e = envpool.make("math-tools-v1")
    e.reset(options={"question": "What is 6 * 7 + 1?", "answer": "43"})
    return e


def test_a_hermes_tool_call_after_thinking_runs():
    reply = (
        "<think>I should use the calculator.</think>\nLet me compute it.\n"
        f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
    )
    res = env().step(reply)
    assert (res.obs.text, res.reward, res.terminated) == ("42", 0.0, False)
    assert res.info["calls"] == [
        {"name": "calculator", "arguments": '{"expression": "6 * 7"}', "output": "42"}
    ]
    assert res.info["valid"] is True


def test_a_call_cut_off_before_its_closing_tag_runs():
    # "</tool_call>" is a common stop string: the reply ends at the call's end
    assert env().step(f"<tool_call>{json.dumps(CALL)}").obs.text == "42"


def test_a_call_drafted_in_thinking_is_not_run():
    reply = f"<think><tool_call>{json.dumps(CALL)}</tool_call> no, just answer</think>Answer: 43"
    res = env().step(reply)
    assert (res.reward, res.terminated) == (1.0, True)


async def test_what_the_openai_engine_writes_runs_every_call_in_order():
    calls = [
        {
            "id": "c0",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
        },
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "42+1"}'},
        },
    ]
    message = {"role": "assistant", "content": "Let me compute both.", "tool_calls": calls}
    choice = {"index": 0, "message": message, "finish_reason": "tool_calls"}
    body = json.dumps({"id": "x", "object": "chat.completion", "choices": [choice]}).encode()
    with FakeOpenAI(reply="unused", model="p") as srv:
        srv.enqueue(Scripted(body=body))
        async with OpenAIEngine(model=srv.model, base_url=srv.base_url, api_key=srv.api_key) as engine:
            c = await engine.generate(GenerateRequest(messages=[Message(role="user", content="?")]))
    e = env()
    res = e.step(c.text)
    # one output per call, in the calls' order, one a line (the contract's plain observation)
    assert res.obs.text == "42\n43"
    assert [(k["arguments"], k["output"]) for k in res.info["calls"]] == [
        ('{"expression": "6*7"}', "42"),
        ('{"expression": "42+1"}', "43"),
    ]
    assert res.info["tool_calls"] == 2 and res.info["valid"] is True


def test_several_tool_call_blocks_each_get_an_answer_a_bad_one_its_reason():
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
    reply = f"<tool_call>{json.dumps(CALL)}</tool_call>\n{bad}\n<tool_call>{json.dumps(CALL)}</tool_call>"
    res = env().step(reply)
    first, second, third = res.obs.text.split("\n")
    assert first == third == "42" and second.startswith("Bad tool call: invalid JSON")
    assert [("refused" in k) for k in res.info["calls"]] == [False, True, False]
    assert res.info["valid"] is False and res.info["outcome"] == "tool_error" and res.info["tool_calls"] == 2


def test_too_many_calls_in_one_turn_are_cut_off():
    reply = "\n".join(json.dumps(CALL) for _ in range(50))
    res = env().step(reply)
    ran = [k for k in res.info["calls"] if "refused" not in k]
    [extra] = [k for k in res.info["calls"] if "refused" in k]
    assert len(ran) == 8 and "more than 8 tool calls" in extra["refused"]


def test_arguments_as_a_json_string_in_a_tag():
    call = {"name": "calculator", "arguments": json.dumps({"expression": "2 ** 10"})}
    assert env().step(f"OK.<tool_call>{json.dumps(call)}</tool_call>").obs.text == "1024"


def test_what_is_still_refused_says_why():
    cases = {
        "<tool_call>not json</tool_call>": "invalid JSON",
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>': "unknown tool 'search'",
        '<tool_call>{"arguments": {"expression": "1"}}</tool_call>': "no tool name",
        '<tool_call>{"name": "calculator", "arguments": "\\"6*7\\""}</tool_call>': "not a JSON object",
        'I will call it.\n{"name": "calculator", "arguments": null}': "not a JSON object",
    }
    for reply, says in cases.items():
        res = env().step(reply)
        [call] = res.info.pop("calls")
        assert says in call["refused"] and res.obs.text.startswith("Bad tool call: "), reply
        assert res.info == {"valid": False, "outcome": "tool_error"} and not res.terminated


def test_a_pretty_printed_call_in_a_fence_after_text_runs():
    pretty = json.dumps(CALL, indent=2)
    reply = f"I'll use the calculator:\n```json\n{pretty}\n```"
    assert env().step(reply).obs.text == "42"


def test_a_bare_number_after_thinking_is_the_final_answer():
    reply = "<think>6 * 7 = 42, plus 1.</think>\n43"
    res = env().step(reply)
    assert (res.reward, res.terminated) == (1.0, True)
    assert math_answer(reply, ground_truth="43").score == 1.0  # the reward agrees


def test_a_final_answer_with_text_around_it_ends_the_episode():
    res = env().step("6 * 7 = 42 and 42 + 1 = 43.\n\n**Answer:** 43\n\nLet me know if you need more.")
    assert (res.reward, res.terminated) == (1.0, True)


def _finishes(action: str, limit_s: float = 60.0) -> bool:
    """Whether a step on ``action`` returns within ``limit_s``: a hang guard, not a speed test
    (quadratic work on these replies takes many minutes; linear work milliseconds). The env
    itself: ``make``'s wrapper refuses an action over 64 KiB, where the old regex still spent
    seconds a step."""
    e = MathToolsEnv()
    e.reset(seed=1)
    t = threading.Thread(target=e.step, args=(action,), daemon=True)
    t.start()
    t.join(limit_s)
    return not t.is_alive()


def test_long_and_adversarial_replies_are_read_in_linear_time():
    n = 400_000
    assert _finishes("{" + " " * n + "x")  # the fence regex backtracked over the spaces
    assert _finishes("a" + "\n" * n + "x")
    assert _finishes("<tool_call>" * (n // 11))
    assert _finishes('{"' * n)
    assert _finishes("```\n" * (n // 4))
