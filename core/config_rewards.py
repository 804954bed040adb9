"""The job config's ``rewards`` checked against the fabric registry, each problem under its
key: every ``function`` is a registered reward, its ``args`` and ``task_args`` fit the
function's parameters, and the fixed ``args`` values are of the parameters' types.

The values are validated as the reward's worker validates a call (``fabric.runner``: the
payload as JSON, against the function's type hints with their constraints), so a value the
worker would refuse is refused here. Found by the calls instead, a ``ground_truth: 5`` for a
``str`` failed every trajectory with ``InvalidArguments`` and the job stopped with a
``RolloutError`` after Ray started, the policy was built and 8 groups were re-run 3 times.

A built-in reward named while ``fabric.discover`` leaves the ``functions`` package out is
told so, with the list that adds it: "unknown reward 'env_return'" read as if it did not
exist.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

from pydantic import PydanticUserError, ValidationError

from core.config_messages import hint, listing
from core.config_sections import BUILTIN_FUNCTIONS, RewardConfig
from fabric.config_messages import describe
from fabric.errors import PayloadError, RegistryError
from fabric.protocol import encode_payload
from fabric.registry import Registry
from fabric.runner import args_adapter
from fabric.spec import CTX_PARAM, FunctionSpec

Problems = list[tuple[str, str]]


def reward_problems(
    rewards: Mapping[str, Sequence[RewardConfig]], registry: Registry, discover: Sequence[str]
) -> Problems:
    """Every problem of ``rewards`` against ``registry`` (found by ``discover``, the config's
    ``fabric.discover``, unless the caller passed its own)."""
    known = sorted(s.name for s in registry.specs() if s.kind == "reward")
    problems: Problems = []
    for tag, specs in rewards.items():
        for j, spec in enumerate(specs):
            key = f"rewards.{tag}[{j}]"
            if spec.function not in registry:
                problems.append((f"{key}.function", _unknown(spec.function, known, discover)))
                continue
            fn = registry.get(spec.function)
            if fn.kind != "reward":
                problems.append(
                    (
                        f"{key}.function",
                        f"{spec.function!r} is a {fn.kind}, not a reward; rewards: {listing(known)}",
                    )
                )
                continue
            # the stream calls fn(traj=..., **args, **task_args): check that shape now, not per call
            shape = dict.fromkeys(["traj", *spec.args, *spec.task_args])
            problem = fn.check_args(shape)
            if problem is not None:
                problems.append((f"{key}.args", problem))
            code = registry.callable(spec.function)
            problems += _ctx_problems(key, spec, fn, code)
            problems += _value_problems(key, spec.args, fn, code)
    return problems


def _unknown(name: str, known: list[str], discover: Sequence[str]) -> str:
    entry = builtin_rewards().get(name)
    if entry is not None and not any(_covers(target, entry) for target in discover):
        module = entry.partition(":")[0]
        wanted = ", ".join([BUILTIN_FUNCTIONS, *discover])
        return (
            f"unknown reward {name!r}: {name!r} is a built-in reward ({module}), and fabric.discover "
            f"leaves the built-ins out; add {BUILTIN_FUNCTIONS} to fabric.discover: [{wanted}] "
            f"(registered now: {listing(known)})"
        )
    return f"unknown reward {name!r}{hint(name, known)}; registered: {listing(known)}"


def _covers(target: str, entry: str) -> bool:
    """Whether discovering ``target`` (a package, a module, ``module:attr``) registers the
    function at ``entry``: then the registry at hand is not the one discovery built (a
    test's, a job's own), and adding the built-ins to the list would change nothing."""
    if ":" in target:
        return target == entry
    module = entry.partition(":")[0]
    return module == target or module.startswith(target + ".")


@cache
def builtin_rewards() -> dict[str, str]:
    """Built-in reward -> its entry point (what discovering ``functions`` registers); read
    only when a reward is unknown. Empty if the package does not import: no hint then."""
    try:
        specs = Registry().discover(BUILTIN_FUNCTIONS)
    except RegistryError:
        return {}
    return {s.name: s.entry for s in specs if s.kind == "reward"}


def _ctx_problems(key: str, spec: RewardConfig, fn: FunctionSpec, code: Callable[..., Any]) -> Problems:
    """A function taking ``ctx`` and ``**kwargs``: ``check_args`` lets a ``ctx`` argument
    through, and the worker replaced its value with the setup hook's, silently."""
    if not fn.accepts_extra or CTX_PARAM not in inspect.signature(code).parameters:
        return []
    why = (
        f"{fn.name} gets {CTX_PARAM} from its setup hook (what the hook returned, in each worker), "
        "never from the config: pass the value under another name"
    )
    return [
        (f"{key}.{field}.{CTX_PARAM}", why)
        for field in ("args", "task_args")
        if CTX_PARAM in getattr(spec, field)
    ]


def _value_problems(key: str, args: dict[str, Any], fn: FunctionSpec, code: Callable[..., Any]) -> Problems:
    """The fixed ``args`` validated as the worker validates them: encoded as the client
    encodes the payload, then checked by the function's own argument validator."""
    if not args:
        return []
    try:
        raw = encode_payload(args, what="its args")
    except PayloadError as e:  # NaN, Infinity: refused by the client at every call
        return [(f"{key}.args", str(e))]
    try:
        adapter = args_adapter(code, fn)
    except PydanticUserError:
        return []  # a hint pydantic cannot validate: the workers cannot start, which warm-up reports
    try:
        adapter.validate_json(raw)
    except ValidationError as e:
        errors = e.errors(include_url=False)
    else:
        return []
    annotations = {p.name: p.annotation for p in fn.params}
    problems: Problems = []
    for err in errors:
        loc = tuple(err["loc"])
        if err["type"] in ("missing", "extra_forbidden") and len(loc) == 1:
            continue  # the trajectory and the task_args are not here; an unknown key is check_args's
        sub, msg = describe(err, RewardConfig)  # RewardConfig: only an unknown key's wording reads it
        param = str(loc[0])
        msg = f"{fn.name} takes {param}: {annotations.get(param, 'Any')}; {msg}"
        if len(loc) == 1 and annotations.get(param) == "str" and isinstance(err["input"], int | float | bool):
            msg += ": quote it in the YAML"  # read as a number (or a bool) where text is wanted
        problems.append((f"{key}.args.{sub}", msg))
    return problems
