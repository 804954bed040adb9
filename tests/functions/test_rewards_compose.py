"""Format, tool-use and composite rewards, and ``combine``."""

from __future__ import annotations

import json
import math
import re
import socket
import time
from typing import Any

import pytest
from pydantic import ValidationError

from fabric.errors import Unavailable, UnknownFunctionError
from fabric.protocol import Message, RewardResult, ToolCall, Trajectory, encode_payload
from fabric.registry import Registry
from fabric.runner import FunctionRunner
from fabric.testing import check_function
from functions.rewards.compose import CompositeSpec, combine, composite
from functions.rewards.format import DEFAULT_RULES, FormatRules, boxed_spans, check_rule, format_reward
from functions.rewards.tool_use import tool_use_reward

GOOD = "<think>6 * 7 = 42</think>\nSo the answer is \\boxed{42}."


def reply(text: str) -> Trajectory:
    return Trajectory(messages=[Message(role="user", content="q"), Message(role="assistant", content=text)])


def call(id_: str, name: str, arguments: Any = '{"x": 1}') -> ToolCall:
    return ToolCall(id=id_, function={"name": name, "arguments": arguments})


def tool_traj(calls: list[ToolCall], results: dict[str, str]) -> Trajectory:
    msgs = [Message(role="user", content="q"), Message(role="assistant", tool_calls=calls)]
    msgs += [Message(role="tool", tool_call_id=cid, content=c) for cid, c in results.items()]
    msgs.append(Message(role="assistant", content="done"))
    return Trajectory(messages=msgs)


def run(entry: str, payload: dict[str, Any]) -> tuple[bool, Any]:
    runner = FunctionRunner.from_entry(entry)
    runner.setup()
    ok, out = runner.run(encode_payload(payload))
    return ok, (json.loads(out) if ok else out)


# ----------------------------------------------------------------------------- format


def test_format_default_rules_well_formed() -> None:
    r = format_reward(reply(GOOD))
    assert r.score == 1.0
    assert r.components == {
        "tags": 1.0,
        "answer_after_tag": 1.0,
        "boxed_once": 1.0,
        "nothing_after_answer": 1.0,
    }
    assert format_reward(GOOD) == r  # a plain string is the completion itself
    assert r.info == {"chars": len(GOOD)}


@pytest.mark.parametrize(
    ("text", "failing"),
    [
        ("6 * 7 = 42, \\boxed{42}", {"tags", "answer_after_tag"}),
        ("<think>a</think><think>b</think> \\boxed{1}", {"tags", "answer_after_tag"}),
        ("<think>unclosed \\boxed{42}", {"tags", "answer_after_tag"}),
        ("\\boxed{42} <think>after</think>", {"answer_after_tag", "nothing_after_answer"}),
        ("<think>x</think> \\boxed{1} or \\boxed{2}", {"boxed_once"}),
        ("<think>x</think> \\boxed{42} and more words", {"nothing_after_answer"}),
        ("<think>x</think> no answer", {"boxed_once", "answer_after_tag", "nothing_after_answer"}),
        ("<think>x</think> \\boxed{4{2}", {"boxed_once", "answer_after_tag", "nothing_after_answer"}),
    ],
)
def test_format_default_rules_malformed(text: str, failing: set[str]) -> None:
    r = format_reward(text)
    assert {k for k, v in r.components.items() if v == 0.0} == failing
    assert r.score == pytest.approx(1 - len(failing) / 4)


def test_format_trailing_punctuation_and_closing_tags_allowed() -> None:
    assert check_rule("\\boxed{42}.  ", "nothing_after_answer", True)
    assert check_rule("$\\boxed{42}$", "nothing_after_answer", True)
    assert check_rule("<answer>\\boxed{42}</answer>\n", "nothing_after_answer", True)
    assert not check_rule("\\boxed{42} because", "nothing_after_answer", True)
    assert check_rule("<answer>42</answer>  \n", "nothing_after_answer", "</answer>")
    assert not check_rule("<answer>42</answer> P.S.", "nothing_after_answer", "</answer>")
    assert not check_rule("no marker", "nothing_after_answer", "</answer>")


def test_format_the_final_answer_is_the_outermost_of_nested_boxes() -> None:
    # as the answer rewards read it: the inner box was the final answer, and the outer box's
    # closing brace was something after it
    assert check_rule("so \\boxed{x = \\boxed{5}}.", "nothing_after_answer", True)
    assert not check_rule("\\boxed{x = \\boxed{5}} because", "nothing_after_answer", True)
    assert check_rule("<think>\\boxed{1}</think> \\boxed{\\boxed{2}}", "answer_after_tag", "think")
    assert not check_rule("<think>\\boxed{1 \\boxed{2}}</think>", "answer_after_tag", "think")
    assert not check_rule("\\boxed{\\boxed{5}}", "boxed_once", True)  # two boxes all the same


def test_format_tag_order_and_max_chars() -> None:
    rules = {"tags": ["think", "answer"], "max_chars": 40}
    ok = format_reward("<think>hm</think><answer>42</answer>", rules=rules)
    assert ok.components == {"tags": 1.0, "max_chars": 1.0} and ok.score == 1.0
    swapped = format_reward("<answer>42</answer><think>hm</think>", rules=rules)
    assert swapped.components["tags"] == 0.0
    nested = format_reward("<think><answer>42</answer></think>", rules={"tags": ["think", "answer"]})
    assert nested.score == 0.0
    long = format_reward("<think>" + "x" * 40 + "</think><answer>1</answer>", rules=rules)
    assert long.components == {"tags": 1.0, "max_chars": 0.0} and long.score == 0.5


def test_format_rules_off_and_pydantic_rules() -> None:
    r = format_reward("\\boxed{1}", rules=FormatRules(boxed_once=True, tags=None, nothing_after_answer=False))
    assert r.components == {"boxed_once": 1.0}
    assert DEFAULT_RULES.enabled()["tags"] == ["think"]


def test_format_boxed_spans() -> None:
    assert boxed_spans("a \\boxed{x{y}} b") == [(2, 14)]
    assert boxed_spans("\\boxed{1}\\boxed{2") == [(0, 9), None]
    assert boxed_spans("none") == []
    assert boxed_spans("\\boxed{a \\boxed{b}} c") == [(0, 19), (9, 18)]
    assert boxed_spans("\\boxed{\\boxed{1}") == [None, (7, 16)]
    assert boxed_spans("{ \\boxed{x} }} \\boxed{") == [(2, 11), None]


def test_format_escaped_braces_do_not_count_in_a_box() -> None:
    # \\{ and \\} are characters, not a group: a piecewise answer's \\left\\{ left its box
    # unclosed (boxed_once and nothing_after_answer failed), a lone \\} closed it early
    piecewise = "<think>x</think> so \\boxed{f(x) = \\left\\{ x \\right.}."
    assert boxed_spans(piecewise) == [(20, len(piecewise) - 1)]
    assert format_reward(piecewise).score == 1.0
    assert boxed_spans("\\boxed{\\lbrace 1 \\}} x") == [(0, 20)]
    assert boxed_spans("\\boxed{\\{1,2\\}}") == [(0, 15)]
    # \\\\ is an escaped backslash (a row break): the brace after it is a brace
    assert boxed_spans("\\boxed{a \\\\{b}}") == [(0, 15)]
    assert boxed_spans("\\boxed{1 \\\\}") == [(0, 12)]
    assert boxed_spans("\\boxed{\\{1\\}") == [None]  # its own brace is still open


def test_format_a_box_with_a_space_before_its_brace_is_a_box() -> None:
    # TeX reads \boxed {42} as \boxed{42}, and so do the answer rewards (math_answer,
    # exact_match): the format reward saw no box at all
    r = format_reward("<think>6 * 7</think> so \\boxed {42}.")
    assert r.components == dict.fromkeys(
        ["tags", "answer_after_tag", "boxed_once", "nothing_after_answer"], 1.0
    )
    assert boxed_spans("\\boxed {1} \\boxed\t{2}") == [(0, 10), (11, 21)]


def test_format_reward_is_linear_in_unbalanced_boxes() -> None:
    # boxed_spans scanned to the end once per unbalanced \boxed{ (O(n * k)): 28,000 took 6.6 s,
    # these 200,000 would take minutes; one pass takes well under a second (the bound is loose)
    t0 = time.monotonic()
    r = format_reward("<think>x</think>" + "\\boxed{" * 200_000)
    assert time.monotonic() - t0 < 5.0
    assert r.components["boxed_once"] == 0.0


def test_format_unknown_and_empty_rules() -> None:
    with pytest.raises(
        ValueError, match=r"unknown format rule\(s\) 'boxd'; known rules: tags, answer_after_tag"
    ):
        format_reward(GOOD, rules={"boxd": True})
    with pytest.raises(ValueError, match="no format rule is enabled"):
        format_reward(GOOD, rules={"boxed_once": False})
    with pytest.raises(ValueError, match="not a tag name"):
        format_reward(GOOD, rules={"tags": ["<think>"]})
    with pytest.raises(ValueError, match="unknown format rule 'nope'"):
        check_rule(GOOD, "nope", True)


@pytest.mark.parametrize(
    ("rules", "match"),
    [
        # each of these passed any text at all (score 1.0 for "x"): a free reward
        ({"tags": []}, "tags is empty"),
        ({"nothing_after_answer": ""}, "is blank"),
        ({"nothing_after_answer": " \n"}, "is blank"),
        # these could pass no text
        ({"tags": ["think", "think"]}, "repeats a tag"),
        ({"answer_after_tag": ""}, "'' is not a tag name"),
    ],
)
def test_format_rules_that_decide_nothing_are_refused(rules: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        format_reward("x", rules=rules)
    ok, (code, message, _) = run("functions.rewards.format:format_reward", {"traj": "x", "rules": rules})
    assert not ok and code == "InvalidArguments" and re.search(match, message), message


def test_format_through_runner() -> None:
    entry = "functions.rewards.format:format_reward"
    ok, value = run(entry, {"traj": reply(GOOD), "rules": {"boxed_once": True, "max_chars": 10}})
    assert ok and value == {
        "score": 0.5,
        "components": {"boxed_once": 1.0, "max_chars": 0.0},
        "info": {"chars": len(GOOD)},
    }
    ok, (code, message, _) = run(entry, {"traj": GOOD, "rules": {"boxd": True}})
    assert not ok and code == "InvalidArguments"
    assert "unknown format rule(s) 'boxd'" in message and "known rules: tags" in message


# ----------------------------------------------------------------------------- tool use


def test_tool_use_perfect() -> None:
    t = tool_traj([call("a", "calculator"), call("b", "search")], {"a": "42", "b": "Paris"})
    r = tool_use_reward(t, allowed_tools=["calculator", "search"], max_calls=2)
    assert r.score == 1.0
    assert r.components == {"valid_calls": 1.0, "answered_calls": 1.0, "no_errors": 1.0, "within_budget": 1.0}
    assert r.info["calls"] == 2 and r.info["invalid"] == {} and r.info["unanswered"] == []


def test_tool_use_bad_json_unknown_tool_non_object() -> None:
    calls = [
        call("a", "calculator"),
        call("b", "calculator", "{not json"),
        call("c", "rm_rf"),
        call("d", "calculator", "[1, 2]"),
    ]
    r = tool_use_reward(tool_traj(calls, dict.fromkeys("abcd", "ok")), allowed_tools=["calculator"])
    assert r.components["valid_calls"] == 0.25
    assert r.info["invalid"] == {
        "b": "arguments are not valid JSON",
        "c": "unknown tool 'rm_rf'",
        "d": "arguments are not a JSON object",
    }
    # without an allow-list every named tool is allowed; already-parsed dict arguments are fine
    r = tool_use_reward(tool_traj([call("c", "rm_rf"), call("e", "calc", {"x": 1})], {"c": "1", "e": "2"}))
    assert r.components["valid_calls"] == 1.0


def test_tool_use_deeply_nested_arguments_are_invalid_not_a_crash() -> None:
    # the decoder gives up past its depth with RecursionError: the reward failed (masked, not
    # penalised) for any policy that wrote arguments nested 100,000 deep
    calls = [call("a", "calculator", "[" * 100_000), call("b", "calculator", '{"x": ' * 100_000)]
    r = tool_use_reward(tool_traj([*calls, call("c", "calculator")], dict.fromkeys("abc", "ok")))
    assert r.info["invalid"] == dict.fromkeys("ab", "arguments are not valid JSON")
    assert r.components["valid_calls"] == pytest.approx(1 / 3)


def test_tool_use_unanswered_and_errors() -> None:
    calls = [call("a", "calculator"), call("b", "calculator"), call("c", "calculator")]
    t = tool_traj(calls, {"a": "Error: division by zero", "b": "42", "zzz": "stray"})
    r = tool_use_reward(t)
    assert r.components["answered_calls"] == pytest.approx(2 / 3)
    assert r.info["unanswered"] == ["c"]
    assert r.components["no_errors"] == pytest.approx(2 / 3)  # 1 of 3 results is an error
    assert tool_use_reward(t, error_prefix="fail:").components["no_errors"] == 1.0
    # a result that comes before its call does not answer it
    early = Trajectory(
        messages=[
            Message(role="tool", tool_call_id="a", content="42"),
            Message(role="assistant", tool_calls=[call("a", "calculator")]),
        ]
    )
    assert tool_use_reward(early).components["answered_calls"] == 0.0


@pytest.mark.parametrize("prefix", ["", "  ", "\t"])
def test_tool_use_a_blank_error_prefix_is_refused(prefix: str) -> None:
    # every result starts with "": no_errors was 0 for every trajectory with a tool result
    # (and a blank one, compared after the result's leading space is stripped, matched none)
    t = tool_traj([call("a", "calculator")], {"a": "42"})
    with pytest.raises(ValueError, match=r"error_prefix .* is blank"):
        tool_use_reward(t, error_prefix=prefix)
    # leading space in a prefix is not required of the result either
    bad = tool_traj([call("a", "calculator")], {"a": "  Error: no"})
    assert tool_use_reward(bad, error_prefix=" error:").components["no_errors"] == 0.0


def test_tool_use_counts_every_call_even_with_repeated_ids() -> None:
    bad = {"id": "c1", "function": {"name": "calculator", "arguments": "{not json"}}
    traj = Trajectory.model_validate(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "tool_calls": [bad, bad, bad, bad]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ]
        }
    )
    # four calls, none valid, one answered: one result answers one call, not every call of its id
    r = tool_use_reward(traj)
    assert r.components["valid_calls"] == 0.0 and r.components["answered_calls"] == 0.25, r
    assert r.info["unanswered"] == ["c1", "c1", "c1"]


def test_tool_use_budget_and_weights() -> None:
    t = tool_traj([call("a", "calculator"), call("b", "nope", "{")], {"a": "1", "b": "2"})
    r = tool_use_reward(t, allowed_tools=["calculator"], max_calls=1)
    assert r.components["within_budget"] == 0.0 and r.components["valid_calls"] == 0.5
    assert r.score == pytest.approx((0.5 + 1 + 1 + 0) / 4)
    r = tool_use_reward(
        t, allowed_tools=["calculator"], max_calls=1, weights={"within_budget": 0, "valid_calls": 3}
    )
    assert r.score == pytest.approx((3 * 0.5 + 1 + 1) / 5)
    none = tool_traj([], {})
    assert tool_use_reward(none).score == 1.0  # nothing done wrong
    assert tool_use_reward(none, min_calls=1).components["within_budget"] == 0.0


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ({"validity": 1.0}, "unknown component.*'validity'.*known: valid_calls"),
        ({"no_errors": -1.0}, "finite and >= 0"),
        ({"no_errors": math.nan}, "finite and >= 0"),
        (
            dict.fromkeys(["valid_calls", "answered_calls", "no_errors", "within_budget"], 0.0),
            "all weights are zero",
        ),
    ],
)
def test_tool_use_bad_weights(weights: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tool_use_reward(tool_traj([], {}), weights=weights)


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        # within_budget was 0 for every trajectory, silently: a component that decides nothing
        ({"min_calls": 5, "max_calls": 2}, r"min_calls \(5\) is above max_calls \(2\)"),
        ({"max_calls": -1}, "max_calls must be >= 0, got -1"),
        ({"min_calls": -1}, "min_calls must be >= 0, got -1"),
    ],
)
def test_tool_use_impossible_budgets_are_refused(budget: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tool_use_reward(tool_traj([], {}), **budget)
    ok, (code, message, _) = run(
        "functions.rewards.tool_use:tool_use_reward", {"traj": tool_traj([], {}), **budget}
    )
    assert not ok and code == "UserError" and re.search(match, message), message
    # the edges themselves are budgets: exactly n calls, or none at all
    assert tool_use_reward(tool_traj([], {}), min_calls=0, max_calls=0).score == 1.0


def test_tool_use_through_runner() -> None:
    entry = "functions.rewards.tool_use:tool_use_reward"
    t = tool_traj([call("a", "calculator"), call("b", "calculator", "{")], {"a": "error: boom"})
    ok, value = run(entry, {"traj": t, "allowed_tools": ["calculator"], "max_calls": 5})
    assert ok
    assert value["components"] == {
        "valid_calls": 0.5,
        "answered_calls": 0.5,
        "no_errors": 0.0,
        "within_budget": 1.0,
    }
    assert value["score"] == 0.5
    ok, (code, message, _) = run(entry, {"traj": t, "weights": {"x": 1.0}})
    assert not ok and code == "UserError" and "unknown component(s) 'x'" in message


# ----------------------------------------------------------------------------- combine


def test_combine_normalised_and_plain() -> None:
    fmt = RewardResult(score=0.5, components={"tags": 1.0, "boxed_once": 0.0}, info={"chars": 3})
    r = combine({"correct": 1.0, "format": fmt}, {"correct": 3.0, "format": 1.0})
    assert r.score == pytest.approx((3 * 1.0 + 0.5) / 4)
    assert r.components == {"correct": 1.0, "format": 0.5}
    assert r.info == {
        "correct": {},
        "format": {"components": {"tags": 1.0, "boxed_once": 0.0}, "info": {"chars": 3}},
    }
    plain = combine({"correct": 1.0, "format": fmt}, {"correct": 3.0, "format": 1.0}, normalize=False)
    assert plain.score == pytest.approx(3.5)
    # a missing weight counts 1.0; a zero weight keeps the component visible but not counted
    assert combine({"a": 1.0, "b": 0.0}, {}).score == 0.5
    assert combine({"a": 1.0, "b": 0.0}, {"b": 0.0}).score == 1.0
    assert combine({"a": 1.0, "b": 0.0}, {"b": 0.0}).components == {"a": 1.0, "b": 0.0}


def test_combine_with_huge_finite_weights_is_still_the_weighted_mean() -> None:
    # every weight is finite, but their sum overflowed: inf / inf made the score NaN
    r = combine({"a": 1.0, "b": 0.5}, {"a": 1e308, "b": 1e308})
    assert r.score == pytest.approx(0.75)
    with pytest.raises(ValueError, match="not finite"):
        combine({"a": 1.0, "b": 1.0}, {"a": 1e308, "b": 1e308}, normalize=False)


def test_tool_use_with_huge_finite_weights_is_still_the_weighted_mean() -> None:
    r = tool_use_reward(
        Trajectory.model_validate({"messages": [{"role": "assistant", "content": "no calls"}]}),
        weights={"valid_calls": 1e308, "answered_calls": 1e308, "no_errors": 1e308, "within_budget": 1e308},
    )
    assert r.score == 1.0


@pytest.mark.parametrize(
    ("results", "weights", "match"),
    [
        ({}, {}, "no component results"),
        ({"a": 1.0}, {"a": 1.0, "b": 1.0}, "no result: b"),
        ({"a": 1.0}, {"a": -0.5}, "finite and >= 0"),
        ({"a": 1.0, "b": 1.0}, {"a": 0.0, "b": 0.0}, "all weights are zero"),
        ({"a": math.inf}, {}, "non-finite score"),
        ({"a": "1.0"}, {}, "expected a RewardResult or a number"),
        ({"a": True}, {}, "expected a RewardResult or a number"),
    ],
)
def test_combine_errors(results: dict[str, Any], weights: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        combine(results, weights)


# ----------------------------------------------------------------------------- composite


SPEC = {
    "components": [
        {"name": "correct", "function": "exact_match", "weight": 3.0, "kwargs": {"ground_truth": "42"}},
        {
            "name": "format",
            "function": "format_reward",
            "weight": 1.0,
            "kwargs": {"rules": {"tags": ["think"]}},
        },
    ]
}


def test_composite_runs_components() -> None:
    right_no_think = reply("so \\boxed{42}")
    r = composite(right_no_think, spec=CompositeSpec.model_validate(SPEC))
    assert r.components == {"correct": 1.0, "format": 0.0}
    assert r.score == pytest.approx(0.75)
    assert r.info["format"] == {"components": {"tags": 0.0}, "info": {"chars": 13}}
    wrong_with_think = reply("<think>hm</think> \\boxed{41}")
    r = composite(wrong_with_think, spec=SPEC)  # type: ignore[arg-type]  # a dict is accepted in-process
    assert r.components == {"correct": 0.0, "format": 1.0} and r.score == pytest.approx(0.25)
    r = composite(wrong_with_think, spec=CompositeSpec.model_validate({**SPEC, "normalize": False}))
    assert r.score == pytest.approx(1.0)


def test_composite_same_function_twice_and_tool_use() -> None:
    spec = CompositeSpec.model_validate(
        {
            "components": [
                {"name": "is42", "function": "exact_match", "kwargs": {"ground_truth": "42"}},
                {"name": "is7", "function": "exact_match", "kwargs": {"ground_truth": "7"}},
                {"name": "tools", "function": "tool_use_reward", "weight": 2.0, "kwargs": {"max_calls": 0}},
            ]
        }
    )
    t = tool_traj([call("a", "calculator")], {"a": "42"})
    t.messages[-1] = Message(role="assistant", content="\\boxed{42}")
    r = composite(t, spec=spec)
    assert r.components == {"is42": 1.0, "is7": 0.0, "tools": 0.75}
    assert r.score == pytest.approx((1.0 + 0.0 + 2 * 0.75) / 4)
    assert r.info["tools"]["components"]["within_budget"] == 0.0


def test_composite_errors() -> None:
    t = reply(GOOD)
    with pytest.raises(
        UnknownFunctionError, match=r"unknown function 'no_such_reward'; known functions: .*exact_match"
    ):
        composite(t, spec=CompositeSpec(components=[{"name": "x", "function": "no_such_reward"}]))  # type: ignore[list-item]
    with pytest.raises(ValueError, match="is a tool, not a reward"):
        composite(
            t, spec=CompositeSpec.model_validate({"components": [{"name": "c", "function": "calculator"}]})
        )
    bad_kwargs = {
        "components": [{"name": "c", "function": "exact_match", "kwargs": {"ground_truth": "1", "x": 1}}]
    }
    with pytest.raises(
        RuntimeError, match=r"component 'c': exact_match failed: InvalidArguments: .*unexpected 'x'"
    ):
        composite(t, spec=CompositeSpec.model_validate(bad_kwargs))


def test_a_transient_component_failure_stays_retryable(monkeypatch: pytest.MonkeyPatch) -> None:
    # an llm_judge component whose endpoint is down raises Unavailable (retryable); the
    # composite turned it into a RuntimeError, a final UserError, which the fabric does not
    # retry and caches under the call's idempotency key
    from functions.rewards import compose

    monkeypatch.setattr(compose, "_runners", {})  # the judge below reads this environment
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RL_FABRIC_JUDGE_MODEL", "m")
    monkeypatch.setenv("RL_FABRIC_JUDGE_BASE_URL", f"http://127.0.0.1:{port}/v1")
    monkeypatch.setenv("RL_FABRIC_JUDGE_MAX_RETRIES", "0")
    spec = {
        "components": [
            {"name": "correct", "function": "exact_match", "kwargs": {"ground_truth": "42"}},
            {"name": "judge", "function": "llm_judge", "kwargs": {"question": "q"}},
        ]
    }
    with pytest.raises(Unavailable, match=r"component 'judge': llm_judge failed: Unavailable: "):
        composite(reply(GOOD), spec=CompositeSpec.model_validate(spec))
    ok, (code, message, _) = run("functions.rewards.compose:composite", {"traj": reply(GOOD), "spec": spec})
    assert not ok and code == "Unavailable" and "component 'judge'" in message


def test_a_judge_component_stops_within_the_composites_own_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    # the judge retries and waits within what its run has left; run inside the composite, that
    # run was the judge's own timeout_s (300 s), not what the composite had left (its 30 s), so a
    # hung endpoint outlived the composite: cut off as a FunctionTimeout, which a reward's
    # failure_score scores as the response's fault, where the judge's Unavailable (an outage,
    # masked) was due
    from functions.fakes import FakeOpenAI, Scripted
    from functions.rewards import compose

    monkeypatch.setattr(compose, "_runners", {})  # the judge below reads this environment
    with FakeOpenAI() as srv:
        srv.enqueue(Scripted(hang_s=30))
        monkeypatch.setenv("RL_FABRIC_JUDGE_MODEL", srv.model)
        monkeypatch.setenv("RL_FABRIC_JUDGE_BASE_URL", srv.base_url)
        monkeypatch.setenv("RL_FABRIC_JUDGE_API_KEY", srv.api_key)
        monkeypatch.setenv("RL_FABRIC_JUDGE_MAX_RETRIES", "0")
        monkeypatch.setenv("RL_FABRIC_JUDGE_TIMEOUT_S", "5")
        spec = {"components": [{"name": "judge", "function": "llm_judge", "kwargs": {"question": "q"}}]}
        runner = FunctionRunner.from_entry("functions.rewards.compose:composite")
        raw = encode_payload({"traj": reply(GOOD), "spec": spec})
        ok, (code, message, _) = runner.run(raw, ends_at=time.monotonic() + 1.0)
    assert not ok and code == "Unavailable"
    # the attempt was bounded by the composite's second, not by the judge's timeout_s
    assert "what the call's time limit left" in message and "timeout_s=5" not in message


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"components": []}, "at least 1 item"),
        (
            {"components": [{"name": "a", "function": "exact_match", "weight": -1}]},
            "greater than or equal to 0",
        ),
        (
            {
                "components": [
                    {"name": "a", "function": "f", "weight": 0},
                    {"name": "b", "function": "f", "weight": 0},
                ]
            },
            "all weights are zero",
        ),
        ({"components": [{"name": "a", "function": "f"}, {"name": "a", "function": "g"}]}, "repeated: a"),
        ({"components": [{"name": "a", "function": "f", "kwargs": {"traj": "x"}}]}, "must not set 'traj'"),
        ({"components": [{"name": "a", "function": "f"}], "normalise": True}, "Extra inputs"),
    ],
)
def test_composite_spec_validation(spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        CompositeSpec.model_validate(spec)


def test_composite_through_runner() -> None:
    entry = "functions.rewards.compose:composite"
    ok, value = run(entry, {"traj": reply("<think>x</think> \\boxed{42}"), "spec": SPEC})
    assert ok and value["score"] == 1.0 and value["components"] == {"correct": 1.0, "format": 1.0}
    ok, (code, message, _) = run(
        entry, {"traj": reply("x"), "spec": {"components": [{"name": "a", "function": "f", "weight": -1}]}}
    )
    assert not ok and code == "InvalidArguments" and "weight" in message
    ok, (code, message, _) = run(
        entry, {"traj": reply("x"), "spec": {"components": [{"name": "a", "function": "nope"}]}}
    )
    assert not ok and code == "UserError" and "unknown function 'nope'" in message


# ----------------------------------------------------------------------------- conformance


@pytest.mark.parametrize("name", ["format_reward", "tool_use_reward", "composite"])
def test_conformance(name: str) -> None:
    reg = Registry()
    reg.discover("functions")
    check_function(name, reg)
    assert reg.get(name).kind == "reward" and len(reg.get(name).examples) == 2
