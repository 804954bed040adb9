"""math-tools' tool calls, reviewed: a malformed call from the policy is an observation
saying what is wrong with it (reward 0, ``outcome: tool_error``), never an exception of the
environment. JSON nested past the decoder's depth raised ``RecursionError`` from ``step``:
the trajectory ended ``infra_failed`` (masked, so the policy never learnt from it), and a
policy that kept writing it stopped a job as a broken environment."""

from __future__ import annotations

import pytest

import envpool

DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    "action",
    [
        '{"tool": "calculator", "arguments": ' + DEEP + "}",
        '{"tool": "calculator", "arguments": "' + DEEP + '"}',
        "{" + '"a": {' * 3000 + "}" * 3001,
    ],
    ids=["deep-arguments", "deep-arguments-string", "deep-object"],
)
def test_a_tool_call_nested_too_deep_is_a_bad_call_not_an_env_error(action):
    env = envpool.make("math-tools-v1")
    env.reset(seed=1)
    r = env.step(action)
    assert r.obs.text.startswith("Bad tool call: ") and "nested too deep" in r.obs.text
    [call] = r.info.pop("calls")  # still the policy's call, refused (for the rewards)
    assert call["refused"] == "invalid JSON (nested too deep)"
    assert r.reward == 0.0 and not r.done and r.info == {"valid": False, "outcome": "tool_error"}
