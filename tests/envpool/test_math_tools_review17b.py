"""math-tools reads Llama 3.1's tool-call form, reviewed: Llama 3.1 (its JSON tool calling)
writes ``{"name": ..., "parameters": {...}}``, the arguments under ``"parameters"``. They
were read as absent (``{}``), so every call of a Llama policy was run with no expression and
answered an error."""

from __future__ import annotations

import json
from typing import Any

import envpool
from envpool.envs.reply_calls import find_tool_calls
from functions.rewards.math import extract_final

LLAMA = {"name": "calculator", "parameters": {"expression": "6 * 7"}}


def env() -> Any:
    e = envpool.make("math-tools-v1")
    e.reset(options={"question": "What is 6 * 7 + 1?", "answer": "43"})
    return e


def test_a_llama_call_with_parameters_runs():
    res = env().step(json.dumps(LLAMA))
    assert (res.obs.text, res.reward, res.terminated) == ("42", 0.0, False)
    assert res.info["calls"] == [
        {"name": "calculator", "arguments": '{"expression": "6 * 7"}', "output": "42"}
    ]
    assert res.info["valid"] is True


def test_a_llama_call_after_text_and_in_a_tool_call_block_runs():
    assert env().step(f"Let me compute it.\n{json.dumps(LLAMA)}").obs.text == "42"
    assert env().step(f"<tool_call>{json.dumps(LLAMA)}</tool_call>").obs.text == "42"


def test_arguments_win_over_parameters_and_bad_parameters_are_refused():
    both = {"name": "calculator", "arguments": {"expression": "1 + 1"}, "parameters": {"expression": "9"}}
    [call] = find_tool_calls(json.dumps(both), ["calculator"])
    assert call.parsed == {"expression": "1 + 1"}
    [bad] = find_tool_calls(json.dumps({"name": "calculator", "parameters": [1]}), ["calculator"])
    assert bad.parsed is None and bad.refused is not None and "not a JSON object" in bad.refused


def test_the_math_reward_does_not_read_answer_tags_so_the_env_does_not_end_on_them():
    # the brief's second half: <answer>42</answer> would end the episode only if the
    # math_answer reward read the tag too. It does not: it reads the last number anywhere, so
    # text after the tag wins, and an episode ended on the tag would be judged on another
    # number than the env judged. The env leaves the tag to the reward (a reminder, no end).
    assert extract_final("<answer>43</answer> I used 2 steps") == ("2", "last_number")
    res = env().step("<answer>43</answer> I used 2 steps")
    assert (res.reward, res.terminated) == (0.0, False)
