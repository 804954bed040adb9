"""``PoolConfig``: how an ``EnvPool`` runs its containers (runtime, warm and total counts,
timeouts, retries); and what a pool takes from outside: an image cache (``ImageResolver``)
and a tool bridge (``inprocess_tools`` by default)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envpool.api import inprocess_tool_caller, misconfigured, not_a_tool, tool_text
from envpool.errors import PoolConfigError, ToolMisconfigured, ToolUnavailable
from envpool.runtimes.base import ProcessRuntimeConfig, RuntimeConfig


class RetryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    attempts: int = Field(5, ge=1)
    initial_backoff_s: float = Field(0.05, gt=0)
    max_backoff_s: float = Field(2.0, gt=0)


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    runtime: RuntimeConfig = Field(default_factory=ProcessRuntimeConfig)
    """Where containers run: ``process`` (the embedded default), ``kubernetes``, ``docker``, ``modal``."""

    @field_validator("runtime", mode="before")
    @classmethod
    def _default_runtime_type(cls, v: Any) -> Any:
        # {"heartbeat_s": 0.1} means the embedded default; other kinds name their type, and
        # "docker" alone is {"type": "docker"} (as a job's config writes `runtime: docker`)
        if isinstance(v, str):
            return {"type": v}
        if isinstance(v, dict) and "type" not in v:
            return {**v, "type": "process"}
        return v

    min_warm: int = Field(2, ge=0)
    """Idle containers kept ready per image (once the image has been used or prewarmed)."""
    warm_idle_s: float = Field(1800.0, gt=0)
    """An image stops being kept warm (its idle containers are stopped) once no session has
    asked for it or held it open for this long; the next session starts it cold. Keep it
    above the gap between rollout phases (a training step). An image that fails for good
    (``ImageNotFound``) is let go at once, and past ``max_containers`` idle containers wanted
    in all, the least recently asked images are let go."""
    max_containers: int = Field(64, ge=1)
    """All containers of the pool, idle and claimed."""
    max_episodes: int = Field(100, ge=1)
    """A container is recycled after this many episodes."""
    reset_timeout_s: float = Field(60.0, gt=0)
    step_timeout_s: float = Field(30.0, gt=0)
    close_timeout_s: float = Field(10.0, gt=0)
    """How long an environment's close may take. A container's previous environment's
    ``close()`` (run as the next session opens another environment there) still running
    after this long is taken for hung: its container is discarded and the session claims
    another (``EnvCloseHung``), at this bound (and at most a heartbeat window more), not at
    the open's whole ``reset_timeout_s``. A session's goodbye gets this long for its answer
    after the requests ahead of it had their own time (a step still running in another
    task); past it the container is discarded rather than reused."""
    heartbeat_misses: int = Field(4, ge=2)
    """A request whose container sends neither reply nor heartbeat for this many heartbeat
    periods is declared hung: the container is killed and replaced. At least 2: heartbeats
    come a period apart at best, so with 1 any jitter reads as a frozen container."""
    claim_timeout_s: float = Field(120.0, gt=0)
    session_ttl_s: float = Field(3600.0, gt=0)
    """The reaper reclaims a container whose session made no request for this long (leaked);
    that session then ends ``infra_failed``."""
    retry: RetryConfig = Field(default_factory=RetryConfig)
    """Retries of a session's requests through infrastructure failures."""
    stop_retry: RetryConfig = Field(
        default_factory=lambda: RetryConfig(attempts=5, initial_backoff_s=1.0, max_backoff_s=10.0)
    )
    """Attempts at stopping a container the pool let go (an engine or API may refuse a
    removal for a while). A container still not stopped after these (at most ~15 s of
    backoff by default) is logged as leaked and frees its slot (``containers_leaked``);
    the runtime's close and exit hook try it once more."""
    leaked_retry_s: float = Field(300.0, gt=0)
    """A leaked container (its stop gave up, above) is tried again this often while the
    pool runs, not only at its close: on a shared engine or cluster it may hold a CPU, a
    GPU or a node for the rest of a long run (``leaked_stopped`` counts the ones that went)."""
    tool_threads: int = Field(32, ge=1)
    """Threads of the default tool bridge (``inprocess_tools``), the pool's own: at most this
    many tool calls run at once, and a tool that hangs holds one until it returns (a thread
    cannot be killed; ``tool_threads_stuck`` counts them). A call that finds none free in
    its time fails the step as an infrastructure failure (``ToolUnavailable``)."""
    stop_timeout_s: float = Field(120.0, gt=0)
    """A stop that has not returned after this long (an engine or API that hangs rather
    than fails) counts as a failed attempt of ``stop_retry``, so a hung stop cannot hold a
    slot for the rest of a run; the stop itself goes on in the background."""

    @model_validator(mode="after")
    def _warm_fits(self) -> PoolConfig:
        # more warm containers than the pool may hold: the maintenance loop tried to start
        # the missing ones every tick, forever, each refused for capacity
        if self.min_warm > self.max_containers:
            if "min_warm" in self.model_fields_set:
                raise ValueError(
                    f"min_warm ({self.min_warm}) is more than max_containers ({self.max_containers}): "
                    "lower min_warm or raise max_containers"
                )
            self.min_warm = self.max_containers  # the default 2 under max_containers: 1
        return self


def parse_pool_config(config: PoolConfig | Mapping[str, Any] | None) -> PoolConfig:
    """``EnvPool``'s ``config`` (a ``PoolConfig``, a dict, or ``None`` for the defaults) as a
    ``PoolConfig``. A bad one raises ``PoolConfigError`` in the wording of the fabric's and
    the job's configs: pydantic's own named the model and said only "Extra inputs are not
    permitted" of a mistyped key, over several lines, with a documentation URL."""
    if isinstance(config, PoolConfig):
        return config
    try:
        return PoolConfig.model_validate(dict(config or {}))
    except ValidationError as e:
        raise PoolConfigError(f"bad EnvPool config: {_one_line(e)}") from None


def _one_line(e: ValidationError) -> str:
    # imported here: envpool runs in containers without the fabric's modules loaded
    from fabric.config_messages import one_line

    return one_line(e, PoolConfig)


class ImageResolver(Protocol):
    """What the pool needs of an image cache: the unpacked bundle of an image reference."""

    async def get(self, digest: str) -> Path: ...


@runtime_checkable
class PinningImageResolver(Protocol):
    """An image cache that evicts unpacked bundles (``TieredCache``): the pool pins the
    bundle of each container it starts (``acquire``) until the container has stopped."""

    async def get(self, digest: str) -> Path: ...

    async def acquire(self, digest: str) -> Path: ...

    def release(self, digest: str) -> None: ...


async def inprocess_tools(name: str, arguments: dict[str, Any]) -> str:
    """The default tool bridge: the fabric tool runs in this process, as ``envpool.make``
    runs it (in a thread: a tool may block). A job passes its fabric client's instead.
    A pool given this one (or none) runs it on threads of its own, each call bounded in
    time (``envpool.tool_threads.InprocessTools``); called directly, it runs on the loop's
    default executor, without a bound."""
    return await asyncio.to_thread(inprocess_tool_caller, name, arguments)


#: A failed tool call's error types that the call itself caused (the policy's arguments, the
#: tool refusing its input): an observation the policy learns from. Any other failure (a
#: worker lost, a timeout, throttling past the retries, an open circuit) is the machinery's.
TOOL_ERRORS = frozenset(
    {
        "UserError",
        "InvalidArguments",
        "UnknownFunction",
        "PayloadTooLarge",
        "PayloadNotSerializable",
        "ResultNotSerializable",
    }
)


#: What the fabric's ``DeadlineExceeded`` messages say of a call that never ran: the deadline
#: passed while it waited for a concurrency slot (``max_concurrency``), a worker, a pool's
#: room or a connection, or before it was sent or started. Read only of an answer that does
#: not say (``Result.started`` is ``None``): one from a Lambda handler, a Modal container or a
#: ``fabric serve`` deployed from code older than the field. Such peers are out of this
#: process's control and stay in use after an upgrade, so the fallback stays.
_NOT_RUN = (
    "concurrency slot",
    "before the call",
    "while queued",
    "did not run",
    "not sent",
    "nothing was sent",
)


#: A failed call's error types that say it ran out of time: the step's (``DeadlineExceeded``)
#: or the tool's own ``timeout_s`` (``FunctionTimeout``).
_TIME_ERRORS = frozenset({"DeadlineExceeded", "FunctionTimeout"})


def ran_too_long(kind: str, message: str, started: bool | None = None) -> bool:
    """Whether a failed fabric call says the tool ran into its time limit, the step's
    deadline or its own ``timeout_s`` (``FunctionTimeout``): the tool's time on these
    arguments, which the policy can learn to avoid. A limit that passed before the call
    ran (it waited for a slot, a worker, a thread) is the machinery's. The answer's
    ``started`` says which; only an answer without it (an older peer's) is read by its
    message (``_NOT_RUN``), where one the client gave up waiting on ("before the backend
    answered", "no reply from Lambda in time") counts as run, as the fabric itself counts
    a remote call it sent."""
    if kind not in _TIME_ERRORS:
        return False
    if started is not None:
        return started
    return not any(s in message for s in _NOT_RUN)


def takes_deadline(bridge: Callable[..., Any]) -> bool:
    """Whether a tool bridge takes ``deadline_s=`` (``fabric_tools``' and
    ``inprocess_tools`` do; a caller's own bridge may not)."""
    try:
        params = inspect.signature(bridge).parameters.values()
    except (TypeError, ValueError):  # (a builtin or C callable without one)
        return False
    return any(p.name == "deadline_s" or p.kind is p.VAR_KEYWORD for p in params)


def fabric_tools(client: Any) -> Callable[..., Awaitable[str]]:
    """The tool bridge of a job: each tool call goes to the fabric through ``client`` (a
    ``fabric.Client``, which retries what is retryable), within ``deadline_s`` (the time the
    step has left). Only ``@fabric.tool`` functions are run; the tool's own failure, and a
    tool that ran past the deadline or its own ``timeout_s``, are the ``error: ...`` text
    the policy sees; any other failure of the fabric (a call that could not run in time
    included) raises ``ToolUnavailable`` (the step fails as an infrastructure failure), and
    a tool whose setup is wrong (``Misconfigured``) ``ToolMisconfigured`` (it fails once)."""

    async def call_tool(name: str, arguments: dict[str, Any], *, deadline_s: float | None = None) -> str:
        reg = client.registry
        refused = not_a_tool(name, reg.find(name), [s.name for s in reg.specs() if s.kind == "tool"])
        if refused is not None:
            return refused
        # the step's time, or the client's own default deadline if that is sooner (a
        # deadline given replaces the default: the step's would have widened it)
        default = getattr(getattr(client, "config", None), "default_deadline_s", None)
        if default is not None:
            deadline_s = default if deadline_s is None else min(deadline_s, default)
        r = await client.call(name, arguments, deadline_s=deadline_s)
        if r.ok:
            return tool_text(r.value)
        kind, message = (r.error.type, r.error.message) if r.error else ("", "the tool failed")
        if kind in TOOL_ERRORS:
            return f"error: {message}"
        # (getattr: a caller's own client may give results of an older shape)
        if ran_too_long(kind, message, getattr(r, "started", None)):
            limits = [] if deadline_s is None else [deadline_s]
            if kind == "FunctionTimeout":  # its own timeout_s (or the deadline, if that cut it sooner)
                limits.append(float(reg.find(name).timeout_s))
            limit = f" {min(limits):.3g} s" if limits else ""
            return f"error: tool {name!r} ran past its{limit} time limit and was stopped"
        if kind == "Misconfigured":
            raise ToolMisconfigured(misconfigured(name, message))
        raise ToolUnavailable(f"tool {name!r} failed ({kind or 'no error given'}): {message}")

    return call_tool


def digest_of(image: str) -> str:
    """``name@sha256:hex`` or ``sha256:hex`` -> ``sha256:hex`` (``InvalidImageRef`` otherwise)."""
    from envpool.images.bundle import ImageRef

    return ImageRef.parse(str(image)).digest
