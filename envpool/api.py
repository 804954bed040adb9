"""The environment contract: gymnasium's shape, with text actions and chat-ready
observations, plus the registry (``register``/``make``).

    class MyEnv(envpool.Env):
        def reset(self, *, seed=None, options=None):
            return envpool.Observation(text="..."), {}
        def step(self, action: str) -> envpool.StepResult: ...

``make(id)`` wraps every environment so the rules hold whoever wrote it: no step before
reset or after the episode ended, actions are UTF-8 text under the size limit, episodes
are truncated at ``max_episode_steps``.
"""

from __future__ import annotations

import importlib
import json
import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envpool.errors import (
    ActionError,
    EnvOrderError,
    EnvRegistryError,
    ToolMisconfigured,
    ToolUnavailable,
    UnknownEnvError,
)

if TYPE_CHECKING:  # (as the bridge imports fabric: where a tool runs, not on every import of envpool)
    from fabric.spec import FunctionSpec

#: Actions over this many UTF-8 bytes are refused (an env may lower it).
MAX_ACTION_BYTES = 64 * 1024


class Observation(BaseModel):
    """What the policy sees: text for a chat message, and the tools it may call."""

    model_config = ConfigDict(extra="forbid")
    text: str
    tools: list[dict[str, Any]] | None = None
    """OpenAI-style tool schemas available on this turn."""

    def as_message(self) -> dict[str, Any]:
        return {"role": "user", "content": self.text}


class StepResult(BaseModel):
    model_config = ConfigDict(extra="forbid")
    obs: Observation
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = Field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


#: ``(tool name, arguments) -> text`` shown to the policy. The host provides it: in a
#: container the session brokers the call to the fabric (the container has no network).
ToolCaller = Callable[[str, dict[str, Any]], str]


class Env(ABC):
    """Subclass this. ``reset`` may return a plain string as the observation."""

    #: Actions that are valid in the initial state; the conformance checker plays them.
    example_actions: ClassVar[tuple[str, ...]] = ()
    _tool_caller: ToolCaller | None = None

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Call a stateless fabric tool (e.g. ``calculator``) from inside ``step``."""
        if self._tool_caller is None:
            raise RuntimeError(
                "this environment was created without a tool bridge; use envpool.make() or a pool"
            )
        return self._tool_caller(name, arguments)

    @abstractmethod
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Start an episode; return ``(observation, info)``."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one text action."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the environment holds (files, subprocesses)."""


def as_observation(obs: Any) -> Observation:
    if isinstance(obs, Observation):  # validated again: its fields may have been set after it was built
        return Observation.model_validate(obs.model_dump(warnings=False))
    if isinstance(obs, str):
        return Observation(text=obs)
    if isinstance(obs, dict):
        return Observation.model_validate(obs)
    raise TypeError(f"an observation is an Observation, a str or a dict, got {type(obs).__name__}")


def check_action(action: Any, limit: int = MAX_ACTION_BYTES) -> str:
    """The action as text, or ``ActionError`` saying what is wrong with it."""
    if isinstance(action, bytes | bytearray):
        try:
            action = bytes(action).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ActionError(f"action is not valid UTF-8: {e}") from None
    if not isinstance(action, str):
        raise ActionError(f"an action is text, got {type(action).__name__}")
    try:
        size = len(action.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates
        raise ActionError(f"action is not valid UTF-8: {e}") from None
    if size > limit:
        raise ActionError(f"action is {size:,} bytes, over the {limit:,}-byte limit")
    return action


class EnvSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(pattern=r"^[A-Za-z][A-Za-z0-9_.\-]*-v\d+$")
    """``name-vN``; a new version for any change that alters behaviour."""
    entry_point: str
    """``module:Class`` of an ``Env`` subclass."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    max_episode_steps: int | None = Field(None, ge=1)
    deterministic: bool = True
    """Same seed and actions give the same episode: a session lost to a dead container can
    then be rebuilt by replaying its actions on a fresh one."""
    max_action_bytes: int = Field(MAX_ACTION_BYTES, ge=1)
    description: str = ""


class EnvRegistry:
    def __init__(self, *, builtins: str | None = None) -> None:
        """``builtins``: a module that registers environments here when imported, imported
        the first time an id is looked up (the default registry's: ``envpool.envs``)."""
        self._specs: dict[str, EnvSpec] = {}
        self._builtins = builtins

    def register(self, id: str, entry_point: str, **options: Any) -> EnvSpec:
        try:
            spec = EnvSpec(id=id, entry_point=entry_point, **options)
        except ValidationError as e:
            raise EnvRegistryError(f"bad registration of {id!r}:\n{e}") from None
        old = self._specs.get(id)
        if old is not None and old != spec:
            raise EnvRegistryError(f"environment id {id!r} is already registered to {old.entry_point}")
        self._specs[id] = spec
        return spec

    def spec(self, id: str) -> EnvSpec:
        if id not in self._specs:
            self._load_builtins()
        try:
            return self._specs[id]
        except KeyError:
            raise UnknownEnvError(id, list(self._specs)) from None

    def ids(self) -> list[str]:
        self._load_builtins()
        return sorted(self._specs)

    def _load_builtins(self) -> None:
        # so that envpool.make("frozenlake-v1") works without `import envpool.envs` first
        module, self._builtins = self._builtins, None
        if module is not None:
            importlib.import_module(module)

    def __contains__(self, id: object) -> bool:
        return id in self._specs

    def make(self, id: str, *, tool_caller: ToolCaller | None = None, **kwargs: Any) -> GuardedEnv:
        """An in-process instance. Tool calls run the fabric function in this process
        unless ``tool_caller`` says otherwise."""
        spec = self.spec(id)
        cls = load_class(spec.entry_point)
        env = cls(**{**spec.kwargs, **kwargs})
        env._tool_caller = tool_caller or inprocess_tool_caller
        return GuardedEnv(env, spec)


def load_class(entry_point: str) -> type[Env]:
    mod, _, attr = entry_point.partition(":")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise EnvRegistryError(f"cannot load {entry_point!r}: {e}") from e
    if not (isinstance(obj, type) and issubclass(obj, Env)):
        raise EnvRegistryError(f"{entry_point!r} is not an envpool.Env subclass")
    return obj


def not_a_tool(name: str, spec: Any, tools: list[str]) -> str | None:
    """The error a tool bridge answers for ``name`` (its ``FunctionSpec`` or None) when it
    is no tool: a bridge runs ``@fabric.tool`` functions only. An environment passes the
    policy's tool name on as it came; a reward or a verifier named so ran with the policy's
    arguments (an LLM judge's cost, a verifier's sandbox) and its score became the answer."""
    if spec is not None and spec.kind == "tool":
        return None
    what = "" if spec is None else f" ({name!r} is a {spec.kind}, not a tool)"
    return f"error: unknown tool {name!r}{what}; tools: {', '.join(tools) or '(none)'}"


def tool_text(value: Any) -> str:
    """A tool's result as the environment shows it: a string as it is, anything else that is
    JSON-safe as compact JSON (``{"a":1}``, not Python's ``{'a': 1}``, which a policy trained
    on JSON tool results misreads), and the rest as ``str`` does."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # not JSON: a set, an object, a NaN
        return str(value)


def misconfigured(name: str, message: str) -> str:
    """``ToolMisconfigured``'s message: the tool, what it said to fix, and why not retried."""
    return (
        f"tool {name!r} is misconfigured: {message} (fix its setup; not retried, as every "
        "container runs it alike)"
    )


class _SetupFailed(ToolUnavailable):
    """A tool's setup hook raised in this process: told apart from a ``ToolUnavailable`` its
    own code raises, which is the tool's error (text), as a worker's ``UserError``."""


class _Tool:
    """A registered tool as this process runs it: a worker's ``FunctionRunner`` of it (its
    validator, and its setup hook's result as ``ctx``), the hook run at the first call, once.
    Calls come on many threads (a pool's tool threads, ``asyncio.to_thread``): the first
    calls at once wait for one run of the hook, and those that waited on a run that raised
    fail with it. A later call runs it again, as the in-process backend does (and the local
    pool, after its cooldown): a hook that failed for a moment (a download) recovers."""

    def __init__(self, fn: Callable[..., Any], spec: FunctionSpec):
        from fabric.runner import FunctionRunner

        self.runner = FunctionRunner(fn, spec)
        self._lock = threading.Lock()
        self._ready = False
        self._ended = 0  # runs of the hook ended
        self._failed: Exception | None = None  # the last run's raise

    def set_up(self) -> None:
        """Run the setup hook unless a run of it succeeded; ``ToolUnavailable`` saying
        ``SetupFailed`` and its raise (as ``fabric_tools`` says it) if it raised."""
        if self._ready:
            return
        seen = self._ended
        with self._lock:
            # a run that ended while this call waited: its outcome is this call's too
            failed = self._failed if self._ended != seen else None
            if failed is None and not self._ready:
                try:
                    self.runner.setup()
                except Exception as e:
                    failed = self._failed = e
                    self._ended += 1
                else:
                    self._ready, self._failed = True, None
                    self._ended += 1
        if failed is not None and not self._ready:
            raise _SetupFailed(
                f"tool {self.runner.spec.name!r} failed (SetupFailed): {type(failed).__name__}: {failed}"
            ) from failed


# each tool's, by name, as the in-process backend keeps its runners (a weak key would not
# do: the runner holds the function): made again for another function or spec under the
# name (registered again: its new code is set up anew), the old one's ctx let go
_TOOLS: dict[str, _Tool] = {}
_TOOLS_LOCK = threading.Lock()


def _tool(fn: Callable[..., Any], spec: FunctionSpec) -> _Tool:
    with _TOOLS_LOCK:  # one per function: two of them would run its hook twice
        tool = _TOOLS.get(spec.name)
        if tool is None or tool.runner.fn is not fn or tool.runner.spec is not spec:
            tool = _TOOLS[spec.name] = _Tool(fn, spec)
        return tool


def tool_arguments(fn: Callable[..., Any], spec: FunctionSpec, arguments: Any) -> dict[str, Any] | str:
    """The keyword arguments ``fn`` runs on, read as a fabric call reads the policy's
    ``arguments`` (the client's checks, then the worker's: its setup hook run once, its
    validator, the hook's result as ``ctx``), or the ``InvalidArguments``/
    ``PayloadNotSerializable`` text the job's bridge shows for them; ``ToolUnavailable`` if
    the setup hook raised. Called with them as they came, an extra field was a raw
    ``TypeError``, a wrong type reached the tool, and a ``ctx`` replaced the tool's setup object."""
    from fabric.errors import PayloadError
    from fabric.protocol import encode_payload
    from fabric.runner import format_validation_error

    tool = _tool(fn, spec)
    if not isinstance(arguments, dict):
        return f"{spec.name}: payload must be a dict of keyword arguments, got {type(arguments).__name__}"
    # names first, as the client checks them: the setup parameter is none of a spec's
    problem = spec.check_args(arguments)
    if problem is not None:
        return problem
    try:
        raw = encode_payload(arguments, what=f"payload of {spec.name}")
    except PayloadError as e:
        return str(e)
    # where a worker runs it: before it reads any call (so a call with a broken setup is
    # SetupFailed, whatever its arguments)
    tool.set_up()
    try:
        # the worker's own reading: its validator, then its setup's object as ctx (over a
        # **extra tool's ctx argument too)
        return tool.runner._kwargs(raw)
    except ValidationError as e:
        return format_validation_error(spec, e)


def inprocess_tool_caller(name: str, arguments: dict[str, Any]) -> str:
    """Run a registered fabric tool right here (built-ins are discovered on first use), on
    its arguments as a fabric worker reads them (``tool_arguments``: its setup hook's result
    as ``ctx``, the hook run at its first call in this process)."""
    import fabric

    reg = fabric.default_registry
    if name not in reg:
        reg.discover("functions")
    spec = reg.find(name)
    refused = not_a_tool(name, spec, [s.name for s in reg.specs() if s.kind == "tool"])
    if refused is not None:
        return refused
    assert spec is not None  # (not_a_tool refuses a name with none)
    fn = reg.callable(name)
    try:
        # (an argument's own validator may raise anything: the tool's error, as a worker's)
        kwargs = tool_arguments(fn, spec, arguments)
        if isinstance(kwargs, str):
            return f"error: {kwargs}"
        value = fn(**kwargs)
    except _SetupFailed:
        # its setup hook raised (tool_arguments): the job's bridge's infrastructure failure
        # too (SetupFailed), never text for the policy
        raise
    except fabric.Unavailable as e:
        # the tool says its own dependency failed, not its input: as the job's bridge
        # (``fabric_tools``) takes it, an infrastructure failure, never text for the policy
        raise ToolUnavailable(f"tool {name!r} failed (Unavailable): {e}") from e
    except fabric.Misconfigured as e:
        # its own setup is wrong (a key not set, a binary not installed): not the policy's
        # call either, and the fabric bridge fails the step on it too, once (not retried)
        raise ToolMisconfigured(misconfigured(name, str(e))) from e
    except Exception as e:  # a tool error is text for the policy, not a crash of the env
        return f"error: {type(e).__name__}: {e}"
    return tool_text(value)


class GuardedEnv:
    """What ``make`` returns: the user's env behind the rules of the contract."""

    def __init__(self, env: Env, spec: EnvSpec):
        self.env = env
        self.spec = spec
        self._needs_reset = True
        self._steps = 0
        self._closed = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Observation, dict]:
        if self._closed:
            raise EnvOrderError(f"{self.spec.id}: reset() of a closed environment; make a new one")
        out = self.env.reset(seed=seed, options=options)
        if not (isinstance(out, tuple | list) and len(out) == 2 and isinstance(out[1], Mapping)):
            # unpacked as it came, a two-letter string was obs "h" and info "i"
            raise TypeError(
                f"{self.spec.id}: reset() must return (observation, info dict), got {type(out).__name__} "
                f"{out!r:.100}"
            )
        obs, info = out
        self._needs_reset = False
        self._steps = 0
        return as_observation(obs), dict(info)

    def step(self, action: Any) -> StepResult:
        if self._needs_reset:
            raise EnvOrderError(
                f"{self.spec.id}: step() before reset() (or after the episode ended); call reset()"
            )
        text = check_action(action, self.spec.max_action_bytes)
        out: Any = self.env.step(text)
        # validated as the pool will read it: pydantic never validates an instance again, and
        # its fields may have been set to anything after it was built (obs="text",
        # terminated="no": a truthy string here, False on the pool's side)
        if isinstance(out, StepResult):
            out = out.model_dump(warnings=False)
        res = StepResult.model_validate(out)
        if not math.isfinite(res.reward):
            raise ValueError(f"{self.spec.id} returned a non-finite reward {res.reward}")
        self._steps += 1
        limit = self.spec.max_episode_steps
        if limit is not None and self._steps >= limit and not res.terminated:
            res.truncated = True
        if res.done:
            self._needs_reset = True
        return res

    def require_reset(self) -> None:
        """The next ``step`` needs a ``reset`` first: the episode under way is not the next
        caller's (a container's server reuses its environment across sessions)."""
        self._needs_reset = True

    def close(self) -> None:
        """Close the environment; idempotent. A closed environment takes no more resets or steps."""
        self._needs_reset = True
        if not self._closed:
            self._closed = True
            self.env.close()


#: The registry ``envpool.register``/``envpool.make`` use.
default_registry = EnvRegistry(builtins="envpool.envs")
register = default_registry.register
make = default_registry.make
