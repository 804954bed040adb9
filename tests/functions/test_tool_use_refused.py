"""``tool_use`` and a call the environment refused (``refused: <why>`` on the call, as the
core job records it): invalid whatever its name and arguments look like, and its answer (the
refusal the policy was shown) is not counted again as an error."""

from __future__ import annotations

import pytest

from fabric.protocol import Trajectory
from functions.rewards.tool_use import tool_use_reward


def _traj(refused: str | None, answer: str) -> Trajectory:
    call = {"id": "c1", "function": {"name": "search", "arguments": '{"query": "x"}'}}
    if refused is not None:
        call["refused"] = refused
    return Trajectory.model_validate(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "...", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": answer},
            ]
        }
    )


def test_a_refused_call_is_invalid_for_the_environments_reason():
    r = tool_use_reward(_traj("unknown tool 'search'", "Bad tool call: unknown tool 'search'"))
    assert r.info["invalid"] == {"c1": "unknown tool 'search'"}
    assert r.components["valid_calls"] == 0.0 and r.components["answered_calls"] == 1.0
    # without the mark the same call looks valid: any name goes when allowed_tools is not given
    assert tool_use_reward(_traj(None, "results")).components["valid_calls"] == 1.0


@pytest.mark.parametrize("answer", ["error: unknown tool 'search'", "Bad tool call"])
def test_a_refusal_is_not_counted_again_as_an_error(answer):
    r = tool_use_reward(_traj("unknown tool 'search'", answer))
    assert r.info["errors"] == 0 and r.components["no_errors"] == 1.0 and r.info["results"] == 1
    # the same answer to a call that ran is an error when it says so
    ran = tool_use_reward(_traj(None, answer))
    assert ran.info["errors"] == int(answer.startswith("error:"))
