"""The ``Backend`` ABC and the typed configs of every backend kind.

A backend turns an ``Invocation`` into a ``Result``. It never raises for a failed call:
failures come back as ``Result(ok=False)`` with a retryable flag the client acts on.
The public lifecycle (``start``/``aclose``/``submit``) lives here and is final in spirit;
backends override the narrow hooks ``_start``, ``_close`` and ``_submit``/``_invoke``.
"""

from __future__ import annotations

import asyncio
import difflib
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from fabric.errors import BackendClosedError, ConfigError, ErrorCode, PayloadError, validation_problems
from fabric.protocol import MAX_PAYLOAD_BYTES, Invocation, Result, encode_payload
from fabric.registry import Registry, default_registry

TOKEN_ENV = "RL_FABRIC_TOKEN"
"""The bearer token of ``fabric serve``, for the server and for the lambda backend."""
DEPLOY_PREFIX = "rl-fabric-"
"""``fabric deploy``'s default ``--prefix``: what the lambda and modal backends call unless
told otherwise (a lambda backend calling a ``fabric serve`` calls names as registered)."""


def default_region() -> str:
    """The AWS region when none is given: ``$AWS_REGION`` (Lambda's own, the SDKs'), else
    ``$AWS_DEFAULT_REGION`` (the AWS CLI's and boto3's), else ``us-east-1``; an empty value
    counts as unset. ``fabric deploy`` and the lambda backend both use it, so a client calls
    the region its functions were deployed to."""
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


#: An AWS region's shape (us-east-1, us-gov-west-1, us-isob-east-1, eusc-de-east-1): checked
#: at the edge, since botocore refuses some malformed names with its own exception at the
#: first call and sends the rest to a host that does not exist.
_REGION = re.compile(r"[a-z]{2,}(-[a-z]+)+-[0-9]+")


#: What botocore takes as a region with an endpoint of one's own: a host name label.
_REGION_LABEL = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?")


def region_problem(region: str) -> str | None:
    """Why ``region`` is not an AWS region name, or ``None`` when it looks like one."""
    if _REGION.fullmatch(region):
        return None
    return f"{region!r} is not an AWS region name (like us-east-1 or eu-west-1)"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InprocConfig(_Config):
    """Run functions in the calling process (tests, debugging). No isolation."""

    type: Literal["inproc"] = "inproc"


class FaultInjection(_Config):
    """Chaos for benchmarks and tests: hold back some replies without blocking the worker."""

    straggler_rate: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """Probability that a call's reply is delayed."""
    straggler_ms: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    seed: int = 0


class LocalConfig(_Config):
    """Warm pools of worker processes on this machine: the embedded default."""

    type: Literal["local"] = "local"
    max_workers: int | None = Field(None, ge=1)
    """Cap on worker processes per function (default: the number of CPUs). The function's
    own ``max_concurrency`` still bounds calls in flight."""
    warm: int | None = Field(None, ge=0)
    """Override every function's ``warm`` (e.g. 0 to measure cold starts)."""
    idle_window_s: float = Field(60.0, gt=0)
    """Workers beyond ``warm`` that stay idle this long are stopped."""
    start_timeout_s: float = Field(60.0, gt=0)
    """A worker that is not ready (imported and set up) by then is killed."""
    setup_failure_cooldown_s: float = Field(5.0, ge=0)
    """After a setup hook fails, calls fail fast this long before a new worker is tried."""
    fault: FaultInjection | None = None


class LambdaConfig(_Config):
    """Call functions deployed to AWS Lambda (``fabric deploy``) or served by ``fabric serve``."""

    type: Literal["lambda"] = "lambda"
    endpoint_url: str | None = None
    """``None``: AWS. ``http://127.0.0.1:9000``: a ``fabric serve``."""
    region: str = Field(default_factory=default_region, validate_default=True)
    """Default: ``$AWS_REGION``, else ``$AWS_DEFAULT_REGION``, else ``us-east-1``, as ``fabric
    deploy`` chooses it."""
    function_prefix: str = DEPLOY_PREFIX
    """Deployed names are ``prefix + name`` (``fabric deploy --prefix``, ``fabric serve
    --prefix``). Unset (or ``None``): the default of what made them: ``""`` when calling a
    ``fabric serve`` (there is a token: given, or ``$RL_FABRIC_TOKEN`` with ``endpoint_url``),
    which serves names as registered; else ``rl-fabric-``, as ``fabric deploy`` names them
    (AWS, or moto and LocalStack at an ``endpoint_url``)."""
    qualifier: str | None = "live"
    """The alias with provisioned concurrency; ``None`` calls ``$LATEST`` (no warm pool)."""
    token: SecretStr | None = None
    """Bearer token for ``fabric serve`` (default ``$RL_FABRIC_TOKEN`` when ``endpoint_url``
    is set). With a token, requests are not SigV4-signed."""
    transport: Literal["auto", "boto3", "http"] = "auto"
    """``boto3``: botocore's client on a thread pool (AWS: SigV4, the credential chain).
    ``http``: an asyncio HTTP client speaking the same Invoke API with the bearer token, for
    ``fabric serve`` (botocore spends ~2 ms of CPU per call, which caps one process at a few
    hundred calls per second). ``auto``: ``http`` when there is a token, else ``boto3``."""
    max_connections: int = Field(64, ge=1)
    """Calls in flight whose callers still wait (the connection pool). With boto3 as many
    calls given up on may run on beside them, each on a spare thread and connection, until
    Lambda answers (a blocking invoke cannot be stopped). Large payloads' uploads to S3
    (spills) run on a pool of as many threads, at most this many at once."""
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(910.0, gt=0)
    """The longest a reply is waited for (longer than Lambda's 900 s maximum). Each call waits
    less: until its deadline (plus 1 s), else, on AWS Lambda, its function's ``timeout_s`` plus
    15 s (a cold start's init phase), rounded up to a step, so a hung connection is noticed
    when the call's time is up. This ceiling is what a function the client does not know gets,
    and a call without a deadline to a ``fabric serve`` (which queues it)."""
    spill_bucket: str | None = None
    """Payloads over 6 MB go to ``s3://spill_bucket/spill_prefix/...`` and the call carries a
    pointer (``fabric.spill``); ``None`` refuses them at the client, before sending."""
    spill_prefix: str = "spill"
    max_spill_bytes: int = Field(256 * 1024 * 1024, ge=1)
    s3_endpoint_url: str | None = None
    """S3 for spilled payloads (``None``: AWS)."""

    @model_validator(mode="before")
    @classmethod
    def _default_prefix(cls, data: Any) -> Any:
        # a deploy with the defaults names functions rl-fabric-NAME; a client with the
        # defaults called NAME, and every call was UnknownFunction
        if isinstance(data, Mapping) and data.get("function_prefix") is None:
            served = bool(data.get("token")) or (
                data.get("endpoint_url") is not None and bool(os.environ.get(TOKEN_ENV))
            )
            data = {**data, "function_prefix": "" if served else DEPLOY_PREFIX}
        return data

    @model_validator(mode="after")
    def _aws_region(self) -> LambdaConfig:
        # an endpoint of one's own (fabric serve, LocalStack, MinIO for the spill) may use a
        # region name that is no AWS one ("local"): only what botocore itself refuses there
        if self.endpoint_url is None:
            problem = region_problem(self.region)
        elif not _REGION_LABEL.fullmatch(self.region):
            problem = f"{self.region!r} is not a region name (letters, digits and '-', like us-east-1)"
        else:
            problem = None
        if problem is not None:
            raise ValueError(f"region: {problem}")
        return self


#: A Modal app's name, as Modal's ``check_object_name`` takes it (``fabric deploy`` is refused
#: one it does not).
_MODAL_APP = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: ``fabric deploy --prefix``'s characters: a Modal function name's less the '.', which
#: ``Function.from_name`` refuses (it takes a name with one for a class's method).
_MODAL_PREFIX = re.compile(r"[A-Za-z0-9_-]*")


class ModalConfig(_Config):
    """Call functions deployed to Modal (``fabric deploy --backend modal``)."""

    type: Literal["modal"] = "modal"
    app_name: str = "rl-fabric"
    """``fabric deploy --modal-app``: letters, digits, '-', '_' and '.', at most 64."""
    function_prefix: str = DEPLOY_PREFIX
    """Deployed names are ``prefix + name`` (``fabric deploy --prefix``)."""

    # checked here, when a job starts: Modal refused them at every call, each a SetupFailed
    @field_validator("app_name")
    @classmethod
    def _modal_app(cls, v: str) -> str:
        if not _MODAL_APP.fullmatch(v):
            raise ValueError(f"{v!r} is not a Modal app name (1 to 64 letters, digits, '-', '_' or '.')")
        return v

    @field_validator("function_prefix")
    @classmethod
    def _modal_prefix(cls, v: str) -> str:
        if not _MODAL_PREFIX.fullmatch(v):
            raise ValueError(f"{v!r} is not a prefix fabric deploy makes (letters, digits, '-' and '_' only)")
        return v

    environment_name: str | None = None
    """Modal environment; ``None`` is the workspace default."""


BackendConfig = Annotated[
    InprocConfig | LocalConfig | LambdaConfig | ModalConfig, Field(discriminator="type")
]
_BY_TYPE: dict[str, type[InprocConfig] | type[LocalConfig] | type[LambdaConfig] | type[ModalConfig]] = {
    "inproc": InprocConfig,
    "local": LocalConfig,
    "lambda": LambdaConfig,
    "modal": ModalConfig,
}


def parse_backend_config(obj: Any) -> InprocConfig | LocalConfig | LambdaConfig | ModalConfig:
    """Validate a backend config given as a name (``"local"``), a dict or a config object."""
    if isinstance(obj, InprocConfig | LocalConfig | LambdaConfig | ModalConfig):
        return obj
    name = obj if isinstance(obj, str) else None  # a plain name: no keys to show
    if isinstance(obj, str):
        obj = {"type": obj}
    elif isinstance(obj, Mapping):  # any mapping, as pydantic took it (a MappingProxyType)
        obj = dict(obj)
    # the type first, then the keys of that type's config, each error worded by what failed:
    # "known types: ..." for {'type': 'local', 'max_worker': 2} sent the caller looking for
    # a type that was right, the key it mistyped deep in pydantic's text
    kind = obj.get("type") if isinstance(obj, dict) else None
    model = _BY_TYPE.get(kind) if isinstance(kind, str) else None
    if model is None:
        if not isinstance(obj, dict):
            what = "expected a backend name or a mapping with a 'type'"
        elif kind is None:
            what = "no 'type'"
        else:
            close = difflib.get_close_matches(str(kind), _BY_TYPE, n=1)
            what = f"unknown type {kind!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
        # the config's keys, never its values: a lambda config carries a token
        if name is not None:
            bad = f"bad backend {name!r}"
        elif isinstance(obj, dict):
            bad = f"bad backend config (with keys {sorted(map(str, obj))})"
        else:
            bad = f"bad backend config (of type {type(obj).__name__})"
        raise ConfigError(f"{bad}: {what}; known types: {', '.join(_BY_TYPE)}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise ConfigError(f"bad {kind} backend config: {validation_problems(e, model)}") from None


class Backend(ABC):
    """Runs invocations. Use as ``async with backend:``; ``start``/``aclose`` are idempotent."""

    kind: ClassVar[str]
    runs_registered_code: ClassVar[bool] = False
    """Whether it runs its registry's code as registered when a call runs (the local
    backends), and so may run a call sent before a registration on the code registered
    since; not a deployment's (Lambda, Modal, a ``fabric serve``), which runs the code it was
    made from, whatever is registered here."""

    def __init__(self, registry: Registry | None = None):
        self.registry = registry if registry is not None else default_registry
        self._started = False
        self._closed = False

    async def __aenter__(self) -> Backend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self._start()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # shielded: a cancelled caller must not leave worker processes behind
        await asyncio.shield(self._close())

    @property
    def max_payload_bytes(self) -> int:
        """The largest encoded payload this backend takes; the client refuses bigger ones
        before sending (Lambda's synchronous limit unless a backend can do better)."""
        return MAX_PAYLOAD_BYTES

    def submit(self, inv: Invocation) -> asyncio.Future[Result]:
        """Start ``inv`` and return a future of its ``Result``; cancelling the future
        abandons the call (a queued call is never run)."""
        if self._closed:
            return _answered(inv, ErrorCode.BACKEND_CLOSED, f"{self.kind} backend is closed", started=False)
        try:
            if inv.raw is None:  # encoded once here (the client did it already)
                # under this backend's own limit, as the client encodes: a lambda backend
                # with a spill bucket takes more than Lambda's 6 MB (it goes through S3)
                inv.raw = encode_payload(inv.payload, limit=self.max_payload_bytes)
        except PayloadError as e:
            # raised later, inside a backend's dispatch (the local pool's loop callback), it
            # left the call unanswered for good: NaN or Infinity in a payload sent without
            # the client (fabric serve's envelopes, a backend used directly)
            return _answered(inv, e.code, str(e))
        return self._submit(inv)

    async def invoke(self, inv: Invocation) -> Result:
        return await self.submit(inv)

    def settled(self, function: str, fut: asyncio.Future[Result]) -> asyncio.Future[None] | None:
        """For ``fut``, a done ``submit`` future of ``function`` (answered early, expired or
        cancelled): ``None`` when nothing of its call runs here any more, else a future done
        when its run ends. A call on a worker may outlive its future (a synchronous handler
        runs to its end): what admits calls by what the backend can hold (``fabric serve``'s
        quotas) counts it until then. Here: ``None``, nothing is known to run on."""
        return None

    def started(self, function: str, fut: asyncio.Future[Result]) -> bool | None:
        """Whether the call behind ``fut`` (a ``submit`` future of ``function`` not answered
        yet, or let go) has begun to run: asked by a client that stops waiting for it, whose
        answer says so (``Result.started``). ``None``: not known here. Here: ``None``; a
        remote backend cannot know of a request it sent (the client reads it as begun)."""
        return None

    def capacity(self, function: str) -> int | None:
        """Calls of ``function`` this backend runs at once without queueing any, as it stands
        now: what ``fabric serve`` admits to it, holding the rest in its fair gate. ``None``: no
        bound of the backend's own (the function's ``max_concurrency`` applies)."""
        return None

    def watch_capacity(self, function: str, grew: Callable[[], None]) -> None:  # noqa: B027
        """Have ``grew()`` called (on the loop) whenever ``capacity(function)`` grows, so that
        calls waiting for room take it at once instead of at the next call's end. Here: never
        (no bound of its own)."""

    def extend_deadline(self, function: str, idempotency_key: str, deadline: float | None) -> bool:
        """Move the deadline of the calls under ``idempotency_key`` that are queued or running
        to ``deadline``, a later one (``None``: none, the function's ``timeout_s`` only): a
        keyed execution's, when a caller with a later deadline joins it. False where this
        backend cannot: its calls keep the deadline they were sent with (an async handler is
        cancelled there, and a pure function's execution retries while a caller still waits;
        a side effect's ends ``OutcomeUnknown``). Remote backends need not: they send a keyed
        execution's calls with no deadline (see ``Invocation.wait_for_run``)."""
        return False

    async def warmup(self, names: list[str] | None = None) -> None:
        """Start warm instances of ``names`` (all registered functions by default) and wait.
        Raises ``BackendClosedError`` once the backend is closed: nothing would stop what it
        started (a closed local backend's new workers lived until the interpreter exited)."""
        if self._closed:
            raise BackendClosedError(f"{self.kind} backend is closed")
        await self._warmup(names)

    def stats(self) -> dict[str, Any]:
        return {}

    # -- hooks
    async def _start(self) -> None:  # noqa: B027 - optional hook
        pass  # a backend without this step has nothing to do here

    async def _close(self) -> None:  # noqa: B027 - optional hook
        pass  # a backend without this step has nothing to do here

    async def _warmup(self, names: list[str] | None) -> None:  # noqa: B027 - optional hook
        pass  # a backend without this step has nothing to do here

    def _submit(self, inv: Invocation) -> asyncio.Future[Result]:
        return asyncio.ensure_future(self._invoke(inv))

    @abstractmethod
    async def _invoke(self, inv: Invocation) -> Result: ...


def _answered(
    inv: Invocation, code: ErrorCode, message: str, *, started: bool | None = None
) -> asyncio.Future[Result]:
    """A future already holding ``inv``'s failed ``Result``."""
    fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
    failure = Result.failure(code, message, function=inv.function, request_id=inv.request_id, started=started)
    fut.set_result(failure)
    return fut


def make_backend(
    backend: str | dict[str, Any] | BaseModel | Backend, registry: Registry | None = None
) -> Backend:
    """A backend from a name, a config dict/object, or an existing backend (returned as is)."""
    if isinstance(backend, Backend):
        return backend
    cfg = parse_backend_config(backend)
    if isinstance(cfg, InprocConfig):
        from fabric.backends.inproc import InprocBackend

        return InprocBackend(registry, cfg)
    if isinstance(cfg, LambdaConfig):
        from fabric.backends.lambda_ import LambdaBackend

        return LambdaBackend(registry, cfg)
    if isinstance(cfg, ModalConfig):
        from fabric.backends.modal_ import ModalBackend

        return ModalBackend(registry, cfg)
    from fabric.backends.local import LocalBackend

    return LocalBackend(registry, cfg)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
