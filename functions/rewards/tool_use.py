"""``tool_use_reward``: how well a trajectory used its tools.

Components, each in [0, 1]:

* ``valid_calls``: share of the assistant's tool calls (each one counted, ids repeated or
  not) whose ``arguments`` are a JSON object and whose name is in ``allowed_tools`` (any
  name when ``allowed_tools`` is not given), and that the environment did not refuse (a
  call carrying ``refused: <why>``, below);
* ``answered_calls``: share of calls followed by a ``role: "tool"`` message with the same
  ``tool_call_id`` (each result answers one call: the oldest unanswered one with its id);
* ``no_errors``: share of tool results whose content does not start with ``error_prefix``
  (``"error:"``, case-insensitive, leading spaces of either ignored; a blank one is an error);
* ``within_budget``: 1.0 when ``min_calls <= calls <= max_calls`` (both counts >= 0,
  ``min_calls`` not above ``max_calls``: a budget no trajectory can meet is an error).

In the core job, an agentic environment's episode reaches the rewards in this shape (see
``core.rollout.tool_calls``): the calls the environment parsed from the policy's replies are
the assistant turns' ``tool_calls``, their outputs the ``role: "tool"`` results (a
calculator's ``error: ...`` is an error), and a call the environment refused (bad JSON, an
unknown tool, arguments the tool does not take) is a call carrying ``refused: <why>``,
answered by the refusal the policy was shown: counted under ``valid_calls`` only, whatever
the refusal's text begins with. The observation that was only the calls' outputs is not
repeated as a user message.

A share over no calls (or no results) is 1.0: nothing was done wrong; ask for ``min_calls``
when the task needs tools. The score is the weighted mean of the components, every weight
1.0 by default; ``weights`` overrides some or all (0 drops a component).
"""

from __future__ import annotations

import json
from typing import Any

import fabric
from fabric.protocol import RewardResult, ToolCall, Trajectory

COMPONENTS = ("valid_calls", "answered_calls", "no_errors", "within_budget")
DEFAULT_WEIGHTS: dict[str, float] = dict.fromkeys(COMPONENTS, 1.0)


def check_weights(weights: dict[str, float], known: tuple[str, ...] | None = None) -> None:
    """``ValueError`` for unknown names, negative or non-finite weights, or all zero."""
    if known is not None:
        unknown = sorted(set(weights) - set(known))
        if unknown:
            raise ValueError(
                f"unknown component(s) {', '.join(map(repr, unknown))} in weights; known: {', '.join(known)}"
            )
    bad = {k: w for k, w in weights.items() if not (0.0 <= w < float("inf"))}
    if bad:
        raise ValueError(f"weights must be finite and >= 0, got {bad}")
    if not any(weights.values()):
        raise ValueError("all weights are zero; at least one component must count")


def weighted_mean(scores: dict[str, float], weights: dict[str, float]) -> float:
    """``sum(w * s) / sum(w)`` over ``scores`` (weights checked by ``check_weights``), with the
    weights scaled to the largest first: finite weights can sum past the largest float
    (``1e308`` twice), and ``x / inf`` made the mean 0, or ``inf / inf`` NaN."""
    top = max(weights[k] for k in scores)
    return sum(weights[k] / top * s for k, s in scores.items()) / sum(weights[k] / top for k in scores)


def check_budget(min_calls: int, max_calls: int | None) -> None:
    """``ValueError`` for a call budget no trajectory can meet (a negative count, or
    ``min_calls`` above ``max_calls``): ``within_budget`` would be 0 for every one."""
    for name, value in (("min_calls", min_calls), ("max_calls", max_calls)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if max_calls is not None and min_calls > max_calls:
        raise ValueError(
            f"min_calls ({min_calls}) is above max_calls ({max_calls}): no trajectory is within budget"
        )


def _call_problem(call: ToolCall, allowed: set[str] | None) -> str | None:
    refused = (call.model_extra or {}).get("refused")
    if refused:  # the environment's own verdict: it knows its tools' arguments, we may not
        return str(refused)
    name = call.function.get("name")
    if not isinstance(name, str) or not name:
        return "no tool name"
    if allowed is not None and name not in allowed:
        return f"unknown tool {name!r}"
    args = call.function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):  # nested past the decoder's depth: not usable JSON
            return "arguments are not valid JSON"
    if not isinstance(args, dict):
        return "arguments are not a JSON object"
    return None


_EXAMPLE_TRAJ = {
    "messages": [
        {"role": "user", "content": "What is 6 * 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}},
                {"id": "c2", "function": {"name": "search", "arguments": "{bad json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
}


@fabric.reward(
    warm=1,
    timeout_s=5,
    max_batch=64,
    examples=(
        {"traj": _EXAMPLE_TRAJ, "allowed_tools": ["calculator"], "max_calls": 4},
        {"traj": _EXAMPLE_TRAJ, "weights": {"within_budget": 0.0, "no_errors": 2.0}},
    ),
)
def tool_use_reward(
    traj: Trajectory,
    *,
    allowed_tools: list[str] | None = None,
    max_calls: int | None = None,
    min_calls: int = 0,
    error_prefix: str = "error:",
    weights: dict[str, float] | None = None,
) -> RewardResult:
    """Valid, answered, error-free tool calls within budget: a weighted mean of four shares."""
    w = {**DEFAULT_WEIGHTS, **(weights or {})}
    check_weights(w, COMPONENTS)
    check_budget(min_calls, max_calls)
    allowed = set(allowed_tools) if allowed_tools is not None else None
    prefix = error_prefix.lstrip().lower()  # compared with the result's content, lstripped too
    if not prefix:
        raise ValueError(
            f"error_prefix {error_prefix!r} is blank: every tool result would start with it, or "
            "none could; give the text an error result starts with (such as 'error:'), or weight "
            "no_errors 0 to ignore errors"
        )

    # counted per call, not per id: a policy may repeat an id, and one result answers one call
    calls: list[ToolCall] = []
    waiting: dict[str, list[int]] = {}  # tool_call_id -> its unanswered calls, oldest first
    errors = n_results = 0
    for m in traj.messages:
        if m.role == "assistant" and m.tool_calls:
            for c in m.tool_calls:
                waiting.setdefault(c.id, []).append(len(calls))
                calls.append(c)
        elif m.role == "tool":
            n_results += 1
            ids = waiting.get(m.tool_call_id or "")
            answers = calls[ids.pop(0)] if ids else None
            if answers is not None and (answers.model_extra or {}).get("refused"):
                continue  # the refusal is counted under valid_calls, not once more as an error
            errors += (m.content or "").lstrip().lower().startswith(prefix)

    problems = [(c.id, p) for c in calls if (p := _call_problem(c, allowed)) is not None]
    invalid = dict(problems)
    unanswered = [calls[k].id for k in sorted(k for ks in waiting.values() for k in ks)]
    n = len(calls)
    components = {
        "valid_calls": 1.0 - len(problems) / n if n else 1.0,
        "answered_calls": 1.0 - len(unanswered) / n if n else 1.0,
        "no_errors": 1.0 - errors / n_results if n_results else 1.0,
        "within_budget": float(min_calls <= n and (max_calls is None or n <= max_calls)),
    }
    score = weighted_mean(components, w)
    info: dict[str, Any] = {
        "calls": n,
        "results": n_results,
        "errors": errors,
        "invalid": invalid,
        "unanswered": unanswered,
    }
    return RewardResult(score=score, components=components, info=info)
