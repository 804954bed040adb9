"""Reward composition: a weighted combination of named reward components.

Two ways to compose, with the same arithmetic (``combine``):

* ``combine(results, weights)``: for the core job, which calls each component function
  itself through the fabric client (each on its own workers, all in parallel) and then
  combines what came back. This is the path to use at scale.
* the ``composite`` reward: one function call that runs the components in-process, one after
  another, each through its own ``FunctionRunner`` (so its arguments are validated and its
  result encoded exactly as on a worker). Handy for small, cheap rewards (format, exact
  match, tool use); async components (an LLM judge) belong on the ``combine`` path.

A component that fails fails the composite: with ``Unavailable`` (retryable) when its own
failure was retryable (an ``llm_judge`` whose endpoint is down, an async component past its
``timeout_s``), with ``Misconfigured`` when its setup is wrong (its setup hook raised, or it
raised ``Misconfigured``: a judge's key refused), else with a final error naming the
component. Each component runs within its own ``timeout_s`` or what the composite's run has
left, whichever is sooner, so a judge whose endpoint hangs gives up with its ``Unavailable``
before the composite's limit cuts it off.

Score: with ``normalize`` (the default) the weighted mean ``sum(w * s) / sum(w)``, which
stays in the components' range; without it the plain weighted sum ``sum(w * s)``. Every
component's score is kept in ``RewardResult.components`` under its name and its own
components/info under ``RewardResult.info[name]``.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, model_validator

import fabric
from fabric.errors import RETRYABLE, ErrorCode, Misconfigured, Unavailable
from fabric.protocol import RewardResult, Trajectory, encode_payload
from fabric.registry import default_registry
from fabric.runner import FunctionRunner, time_left_s
from functions.rewards.tool_use import check_weights, weighted_mean

_BUILTINS = "functions"


class ComponentSpec(BaseModel):
    """One named term of a composite reward."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    """Key of this component in the result (two components may use one function)."""
    function: str = Field(min_length=1)
    """Registered reward function to run."""
    weight: float = Field(1.0, ge=0, allow_inf_nan=False)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Arguments for the function besides the trajectory."""


class CompositeSpec(BaseModel):
    """A weighted combination of reward functions."""

    model_config = ConfigDict(extra="forbid")

    components: list[ComponentSpec] = Field(min_length=1)
    normalize: bool = True
    """Divide the weighted sum by the sum of the weights (a weighted mean)."""

    @model_validator(mode="after")
    def _check(self) -> CompositeSpec:
        names = [c.name for c in self.components]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"component names must be unique; repeated: {', '.join(dupes)}")
        for c in self.components:
            if "traj" in c.kwargs:
                raise ValueError(f"component {c.name!r}: kwargs must not set 'traj' (it is shared)")
        check_weights({c.name: c.weight for c in self.components})
        return self


def combine(
    results: dict[str, RewardResult | float], weights: dict[str, float], normalize: bool = True
) -> RewardResult:
    """Combine component results by name. A component without a weight counts 1.0; a weight
    without a result is an error (a failed component must not silently drop out)."""
    if not results:
        raise ValueError("no component results to combine")
    missing = sorted(set(weights) - set(results))
    if missing:
        raise ValueError(f"weights name components with no result: {', '.join(missing)}")
    w = {name: float(weights.get(name, 1.0)) for name in results}
    check_weights(w)
    scores: dict[str, float] = {}
    info: dict[str, Any] = {}
    for name, r in results.items():
        if isinstance(r, RewardResult):
            scores[name] = r.score
            info[name] = {"components": dict(r.components), "info": dict(r.info)}
        elif isinstance(r, int | float) and not isinstance(r, bool):
            scores[name] = float(r)
            info[name] = {}
        else:
            raise ValueError(f"component {name!r}: expected a RewardResult or a number, got {r!r}")
        if not math.isfinite(scores[name]):
            raise ValueError(f"component {name!r} has a non-finite score {scores[name]}")
    if normalize:
        score = weighted_mean(scores, w)
    else:
        score = sum(w[n] * s for n, s in scores.items())
        if not math.isfinite(score):  # finite weights and scores whose products overflow
            raise ValueError(f"the weighted sum {score} is not finite; use smaller weights")
    return RewardResult(score=score, components=scores, info=info)


# ----------------------------------------------------------------------------- in-process

_runners: dict[tuple[str, str], FunctionRunner] = {}
_discovered = False


def _runner(function: str) -> FunctionRunner:
    """The runner of a registered reward, its setup hook run once per process."""
    global _discovered
    if function not in default_registry and not _discovered:
        default_registry.discover(_BUILTINS)
        _discovered = True
    spec = default_registry.get(function)  # UnknownFunctionError lists the known names
    if spec.kind != "reward":
        raise ValueError(f"{function!r} is a {spec.kind}, not a reward; only rewards can be components")
    key = (spec.entry, spec.version)
    runner = _runners.get(key)
    if runner is None:
        runner = FunctionRunner(default_registry.callable(function), spec)
        try:
            runner.setup()
        except Exception as e:
            # on a worker this is the component's SetupFailed; here it is the composite's call's
            # error, and the setup's fault (a judge with no model), not the response's: no
            # failure_score may score it
            raise Misconfigured(f"the setup hook of {function!r} failed: {type(e).__name__}: {e}") from e
        _runners[key] = runner
    return runner


def _run(runner: FunctionRunner, payload: dict[str, Any]) -> Any:
    raw = encode_payload(payload)
    # a component runs within what the composite's own run has left, not its own timeout_s:
    # an llm_judge bounds its retries by its run's limit, and on its 300 s a dead endpoint
    # outlived the composite's 30 s, ending in the composite's FunctionTimeout (which a
    # failure_score scores as the response's fault) instead of the judge's Unavailable
    left = time_left_s()
    limit = runner.spec.timeout_s if left is None else min(runner.spec.timeout_s, max(0.0, left))
    if runner.is_async:
        ok, out = asyncio.run(runner.run_async(raw, limit))
    else:
        ok, out = runner.run(raw, time.monotonic() + limit)
    if not ok:
        code, message, _ = out
        text = f"{runner.spec.name} failed: {code}: {message}"
        # a component's transient failure (its endpoint down, its timeout) is the composite's:
        # retryable, not a final UserError, which the fabric neither retries nor lets a later
        # call under the same idempotency key run again
        if code in RETRYABLE:
            raise Unavailable(text)
        # a component's setup fault (a judge's key refused) is the composite's, not a UserError
        raise Misconfigured(text) if code == ErrorCode.MISCONFIGURED else RuntimeError(text)
    value = pydantic_core.from_json(out)
    return RewardResult.model_validate(value) if isinstance(value, dict) else value


_EXAMPLE_TRAJ = {
    "messages": [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<think>6 * 7 = 42</think> \\boxed{42}"},
    ]
}
_EXAMPLE_SPEC = {
    "components": [
        {"name": "correct", "function": "exact_match", "weight": 0.8, "kwargs": {"ground_truth": "42"}},
        {"name": "format", "function": "format_reward", "weight": 0.2},
    ]
}


@fabric.reward(
    warm=1,
    timeout_s=30,
    max_batch=16,
    examples=(
        {"traj": _EXAMPLE_TRAJ, "spec": _EXAMPLE_SPEC},
        {"traj": _EXAMPLE_TRAJ, "spec": {**_EXAMPLE_SPEC, "normalize": False}},
    ),
)
def composite(traj: Trajectory, *, spec: CompositeSpec) -> RewardResult:
    """Weighted combination of reward functions run in-process on one trajectory."""
    if not isinstance(spec, CompositeSpec):  # in-process callers may pass a plain dict
        spec = CompositeSpec.model_validate(spec)
    runners = {c.name: _runner(c.function) for c in spec.components}  # all known before any runs
    results: dict[str, RewardResult | float] = {}
    for c in spec.components:
        try:
            results[c.name] = _run(runners[c.name], {"traj": traj, **c.kwargs})
        except (RuntimeError, Unavailable, Misconfigured) as e:
            raise type(e)(f"component {c.name!r}: {e}") from None
    return combine(results, {c.name: c.weight for c in spec.components}, normalize=spec.normalize)
