"""Wire models shared by every backend: what goes out (``Invocation``) and what comes back
(``Result``), plus the RL data that reward functions take (``Trajectory``) and give
(``RewardResult``).

Everything here is JSON-safe so the same bytes can go to a local worker, the Lambda Invoke
API or Modal. Payloads are encoded once, at the client edge, with pydantic-core's encoder
(it understands pydantic models, dataclasses, datetimes) and the size is checked there:
a payload over the Lambda synchronous limit is refused before it is sent.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fabric.errors import (
    RETRYABLE,
    ErrorCode,
    InvocationError,
    PayloadNotSerializableError,
    PayloadTooLargeError,
)

#: AWS Lambda's synchronous invoke payload limit (request and response), in bytes.
MAX_PAYLOAD_BYTES = 6 * 1024 * 1024


def new_request_id() -> str:
    return uuid.uuid4().hex


#: Array libraries whose scalars and arrays a function may return or a caller send as they
#: are: a reward computed with numpy (``np.float32(0.5)``, ``arr.mean()``) or a reward
#: model's 0-d tensor was ResultNotSerializable on every call, and TRL trained on all None.
_ARRAY_MODULES = frozenset({"numpy", "torch", "jax", "jaxlib", "cupy"})


def array_fallback(value: Any) -> Any:
    """``pydantic_core.to_json``'s fallback, called only for a type it cannot write: an
    array library's scalar or array as the Python value ``tolist()`` gives (a 0-d one a
    float, int or bool; an array nested lists). Anything else is refused as before."""
    root = type(value).__module__.partition(".")[0]
    tolist = getattr(value, "tolist", None)
    if root in _ARRAY_MODULES and callable(tolist):
        return tolist()
    raise TypeError(f"Unable to serialize unknown type: {type(value)!r}")


def to_strict_json(value: Any) -> bytes:
    """JSON bytes of ``value``; ``ValueError`` for NaN/Infinity, which JSON cannot carry
    (pydantic-core would write the non-standard ``NaN`` token that Lambda rejects). numpy,
    torch and jax scalars and arrays are written as their values (``array_fallback``)."""
    raw = pydantic_core.to_json(value, inf_nan_mode="constants", fallback=array_fallback)
    # the tokens are rare; only then pay for a strict parse to tell them from text in strings
    if b"NaN" in raw or b"Infinity" in raw:
        try:
            json.loads(raw, parse_constant=_refuse_constant)
        except ValueError:
            raise ValueError("NaN or Infinity is not valid JSON; send None or a finite number") from None
    return raw


def _refuse_constant(token: str) -> Any:
    raise ValueError(token)


def lone_surrogate_problem(value: Any, what: str = "the payload") -> str | None:
    """What to tell the sender of ``value`` (parsed JSON, or what is to be encoded as JSON)
    when one of its strings or keys holds a lone surrogate (half of a UTF-16 pair, e.g.
    ``"\\ud800"``), naming where; ``None`` when none does. JSON text is UTF-8, which cannot
    carry one, so every JSON layer refuses it, in its own words ("unexpected end of hex
    escape", a codec error) that name neither the cause nor the place. Only called once a
    layer has refused, so the walk costs nothing on the way of a good payload."""
    stack: list[tuple[Any, str]] = [(value, "$")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            bad = _lone_surrogate(node)
            if bad is not None:
                return _surrogate_message(what, path, bad)
        elif isinstance(node, dict):
            items = list(node.items())
            for key, child in reversed(items):  # reversed: the first one found is the first in order
                stack.append((child, path + _step(key)))
            for key, _ in items:
                bad = _lone_surrogate(key) if isinstance(key, str) else None
                if bad is not None:
                    return _surrogate_message(what, f"a key of {path} ({key!r})", bad)
        elif isinstance(node, list | tuple):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(node))))
        elif isinstance(node, BaseModel):
            stack.append((node.__dict__, path))
    return None


def _lone_surrogate(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return text[e.start]
    return None


def _step(key: Any) -> str:
    if isinstance(key, str) and key.isidentifier():
        return f".{key}"
    return f"[{json.dumps(key)}]"  # ASCII-escaped: the message itself must be valid UTF-8


def _surrogate_message(what: str, where: str, char: str) -> str:
    return (
        f"{what} has a lone surrogate at {where}: {char!r} is half of a UTF-16 surrogate pair, "
        "not valid UTF-8, which JSON text must be. It usually comes from bytes decoded with "
        "errors='surrogateescape' (command-line arguments, environment variables, file names) "
        "or text cut between the two halves of a pair; repair the string (for example "
        "text.encode('utf-8', 'replace').decode() puts '?' in its place)"
    )


def encode_payload(payload: Any, *, limit: int = MAX_PAYLOAD_BYTES, what: str = "payload") -> bytes:
    """Encode ``payload`` as JSON bytes or raise a ``PayloadError`` that says what to do."""
    try:
        raw = to_strict_json(payload)
    except (pydantic_core.PydanticSerializationError, TypeError, ValueError) as e:
        problem = lone_surrogate_problem(payload, what)
        if problem is not None:
            raise PayloadNotSerializableError(problem) from None
        raise PayloadNotSerializableError(
            f"{what} is not JSON-serialisable: {e}. Pass plain JSON types (dict, list, str, numbers, "
            "bool, None) or pydantic models."
        ) from None
    if len(raw) > limit:
        raise PayloadTooLargeError(
            f"{what} is {len(raw) / 2**20:.2f} MiB ({len(raw):,} bytes), over the {limit / 2**20:.3g} MiB "
            f"({limit:,}-byte) limit of a synchronous "
            "invoke. Send a reference instead (an S3/local path or a trajectory id)."
        )
    return raw


def decode_payload(raw: bytes, what: str = "the payload") -> Any:
    """The value of JSON text ``raw``; ``ValueError`` for text that is not JSON, which
    says where a lone surrogate is when that is why (see ``lone_surrogate_problem``)."""
    try:
        return pydantic_core.from_json(raw)
    except ValueError as e:
        problem = lone_surrogate_in_json(raw, what)
        raise ValueError(problem or str(e)) from None


def lone_surrogate_in_json(raw: bytes, what: str = "the payload") -> str | None:
    """``lone_surrogate_problem`` of JSON text that a strict parser refused: Python's own
    parser takes a lone surrogate (escaped, or as the 3 bytes UTF-8 forbids), so it can
    say where one is. ``None`` for text refused for another reason."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return lone_surrogate_problem(value, what)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @classmethod
    def fast(cls, **values: Any) -> Any:
        """Build without validation or defaults: the per-call hot path, where every field is
        ours and given. (``model_construct`` costs ~10 us; this ~1 us.)"""
        obj = cls.__new__(cls)
        _set(obj, "__dict__", values)
        _set(obj, "__pydantic_fields_set__", set(values))
        _set(obj, "__pydantic_extra__", None)
        _set(obj, "__pydantic_private__", None)
        return obj


_set = object.__setattr__


MAX_DEADLINE = 1e12
"""The latest wall-clock deadline an ``Invocation`` may carry (``time.time()`` seconds)."""


class Invocation(_Model):
    """One request to run a function."""

    function: str
    payload: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the function, JSON-safe."""
    request_id: str = Field(default_factory=new_request_id)
    idempotency_key: str | None = None
    """Same key, same execution: a retry or hedge reuses the first result."""
    deadline: float | None = Field(None, allow_inf_nan=False, gt=0, lt=MAX_DEADLINE)
    """Absolute wall-clock deadline (``time.time()`` seconds); propagated to the worker. A
    finite time (the year 33658 at most): a worker's nanosecond clock overflows past it."""
    tenant: str = "default"
    attempt: int = 1
    hedge: bool = False
    """True for the duplicate sent after the function's observed p95 latency."""
    wait_for_run: bool = Field(False, exclude=True)
    """Set by the client for the one execution under a caller's idempotency key, whose
    callers each bound their own wait: ``deadline`` (the latest of theirs) bounds the run, so
    a queued call does not start after it and an async handler is cancelled at it (a
    ``FunctionTimeout``: it may have run part way), but a backend never answers such a call
    ``DeadlineExceeded`` while it runs: the answer is the run's own, and until it comes the
    key is busy. The local backends only: it never leaves the client (off the default dump;
    the remote backends send such a call without it and without its deadline, as before the
    mark existed, so a handler deployed from older code takes it, and the run is bounded by
    the function's ``timeout_s``). ``fabric serve`` reads it, should a request carry it."""

    raw: bytes | None = Field(None, exclude=True, repr=False)
    """The payload encoded once by the client, so no backend encodes it again (never sent
    as a field: it *is* the payload on the wire)."""

    @model_validator(mode="before")
    @classmethod
    def _no_raw_on_the_wire(cls, data: Any) -> Any:
        # only the client sets it (through ``fast``); from outside it would replace the payload
        if isinstance(data, dict) and data.get("raw") is not None:
            raise ValueError("'raw' is not a field of an Invocation on the wire; send the payload")
        return data

    @property
    def raw_payload(self) -> bytes:
        raw = self.raw
        if raw is None:
            raw = self.raw = encode_payload(self.payload)
        return raw

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.time()


class ErrorInfo(_Model):
    type: str
    message: str
    retryable: bool = False
    traceback: str | None = None
    """The last frames of the handler's traceback, for user errors."""
    retry_after_s: float | None = Field(None, exclude=True)
    """A throttle's ``Retry-After``: the seconds the service said to wait before the next
    attempt, which the client's backoff waits at least (``None``: it said nothing usable).
    Read by this process's backend from the 429 and kept off the wire: an older peer's
    ``ErrorInfo`` refuses a field it does not know, and refused, the whole Result was read
    as a plain value."""

    @classmethod
    def of(cls, code: ErrorCode | str, message: str, traceback: str | None = None) -> ErrorInfo:
        return cls(type=str(code), message=message, retryable=code in RETRYABLE, traceback=traceback)


class Timings(_Model):
    queue_ms: float = 0.0
    """Time from submission to the start of execution (dispatch, pipe, batching)."""
    exec_ms: float = 0.0
    """Time the handler itself ran."""
    total_ms: float = 0.0
    """Client-observed latency of the whole call, retries and hedges included."""


class Result(_Model):
    """The outcome of a call. A failure is data: only ``unwrap()`` raises."""

    ok: bool
    function: str = ""
    request_id: str = ""
    value: Any = None
    error: ErrorInfo | None = None
    timings: Timings = Field(default_factory=Timings)
    cold_start: bool = False
    worker: str | None = None
    attempts: int = 1
    hedged: bool = False
    """True when a hedge was sent for this call."""
    cached: bool = False
    """True when the result came from the idempotency cache (no new execution)."""
    index: int | None = None
    """Position of the payload in the input of ``Client.map``/``Client.stream``."""
    started: bool | None = None
    """Whether the function's execution had begun: ``True`` for an answer it gave, and for a
    failure that came while it ran or after (a ``FunctionTimeout``, a ``DeadlineExceeded``
    that cut it), or where it may have begun (a request sent to a remote function that did
    not answer in time: its effects may have happened, as the retry rules read such a call);
    ``False`` for one that provably never began (a ``DeadlineExceeded`` while it waited for a
    concurrency slot, a worker, a connection, or before it was sent; ``NotStarted``); ``None``
    where nothing is said: a peer with older code (the field is new on the wire, and a reader
    of such an answer reads it as before, by its type and message), or a failure whose maker
    does not say (arguments a worker refused, a cancellation). Of a hedged call: whether any
    copy began; of a retried one: its last attempt's (an earlier attempt's failure was the
    infrastructure's). On the wire: a reader with older code drops a top-level field it does
    not know (``_lambda_replies._as_result``), so it lives here rather than in ``ErrorInfo``,
    where it would be refused."""
    version: str | None = None
    """The version of the function's code that gave this answer (``FunctionSpec.version`` of
    the spec it ran: a local worker's, the Lambda handler's, a ``fabric serve``'s, a Modal
    container's), which the client checks against its own registry's
    (``ClientConfig.version_check``): a deployment made before the function was edited answers
    with the old code. ``None`` where no code answered (a refusal, an infrastructure failure)
    and from a peer with older code (new on the wire as ``started`` was, and dropped by an older
    reader the same way)."""
    cut_at_deadline: bool = Field(False, exclude=True, repr=False)
    """A keyed execution's ``FunctionTimeout`` that the backend cut at the call's deadline
    (the latest of its callers'), before the function's ``timeout_s``: the callers' doing,
    not the infrastructure's, so the circuit breaker does not count it. Set by the local
    backends (the only ones that send such a call its deadline); never on the wire."""

    @property
    def retryable(self) -> bool:
        return self.error is not None and self.error.retryable

    def unwrap(self) -> Any:
        if not self.ok:
            raise InvocationError(self)
        return self.value

    @classmethod
    def built(
        cls,
        ok: bool,
        *,
        function: str,
        request_id: str,
        value: Any = None,
        error: ErrorInfo | None = None,
        timings: Timings | None = None,
        cold_start: bool = False,
        worker: str | None = None,
        started: bool | None = None,
        version: str | None = None,
    ) -> Result:
        """Construct without validation: the hot path, where every field is our own.
        ``started`` left out: ``True`` for an answer, else what the error's type says
        (``started_of``)."""
        if started is None:
            started = True if ok else started_of(error.type if error is not None else "")
        return cls.fast(
            ok=ok,
            function=function,
            request_id=request_id,
            value=value,
            error=error,
            timings=timings if timings is not None else Timings.fast(queue_ms=0.0, exec_ms=0.0, total_ms=0.0),
            cold_start=cold_start,
            worker=worker,
            attempts=1,
            hedged=False,
            cached=False,
            index=None,
            started=started,
            version=version,
            cut_at_deadline=False,
        )

    @classmethod
    def failure(
        cls,
        code: ErrorCode | str,
        message: str,
        *,
        function: str = "",
        request_id: str = "",
        traceback: str | None = None,
        worker: str | None = None,
        started: bool | None = None,
    ) -> Result:
        error = ErrorInfo.of(code, message, traceback)
        return cls.built(
            False, function=function, request_id=request_id, error=error, worker=worker, started=started
        )


#: Error types that say by themselves whether the function's execution began.
_STARTED_BY_TYPE: dict[str, bool] = {
    ErrorCode.NOT_STARTED: False,
    # refused before anything ran: by the backend (Lambda's 429, 404, 413, 401/403 are
    # answered before an execution; a local pool's function unknown to its registry) or by
    # the client (its circuit open; a payload over the limit is not sent)
    ErrorCode.THROTTLED: False,
    ErrorCode.CIRCUIT_OPEN: False,
    ErrorCode.UNKNOWN_FUNCTION: False,
    ErrorCode.PAYLOAD_TOO_LARGE: False,
    ErrorCode.UNAUTHORIZED: False,
    ErrorCode.TIMEOUT: True,  # it ran past timeout_s (or a remote one did not answer in it: it may have)
    ErrorCode.WORKER_LOST: True,  # its worker died running it, or after
    ErrorCode.USER_ERROR: True,  # the handler raised
    ErrorCode.MISCONFIGURED: True,
    ErrorCode.UNAVAILABLE: True,
    ErrorCode.VERSION_MISMATCH: True,  # other code than the caller's answered: it ran
}


def started_of(error_type: str) -> bool | None:
    """``Result.started`` of a failure of type ``error_type`` when its maker says nothing
    more: ``None`` for a type that may come either way (a ``DeadlineExceeded``, whose maker
    says which)."""
    return _STARTED_BY_TYPE.get(error_type)


# ----------------------------------------------------------------------------- RL data


# RL data keeps NaN/Infinity as such when encoded (pydantic would write null): the strict
# encoder above then refuses them instead of letting a NaN reward become a silent null
_RL_DATA = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")
    id: str
    type: Literal["function"] = "function"
    function: dict[str, Any]
    """``{"name": ..., "arguments": "<json string>"}`` as in the OpenAI chat API."""


class Message(BaseModel):
    """An OpenAI-style chat message, stamped with the policy version that produced it."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    """``developer``: the system turn of newer OpenAI-style models (gpt-oss, o-series)."""
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    policy_version: int | None = None
    """For assistant turns: the weights version that generated this turn."""


class Trajectory(BaseModel):
    """A finished (or failed) multi-turn episode, as reward functions receive it."""

    model_config = _RL_DATA
    id: str = Field(default_factory=new_request_id)
    messages: list[Message] = Field(default_factory=list)
    task: dict[str, Any] = Field(default_factory=dict)
    """Task metadata, such as ``ground_truth``, ``tests`` or ``env_id``."""
    status: Literal["ok", "truncated", "aborted", "infra_failed"] = "ok"
    """``infra_failed`` trajectories are masked from training, never scored as zero."""
    env_reward: float | None = None
    info: dict[str, Any] = Field(default_factory=dict)

    def final_text(self) -> str:
        """Content of the last assistant message ('' if there is none, or if it is empty:
        an empty reply, or one that is only a tool call). Never an earlier one: the turns
        before the last can be the prompt's (a few-shot example in a TRL chat prompt), and
        an empty completion scored as that example's answer (found by review)."""
        for m in reversed(self.messages):
            if m.role == "assistant":
                return m.content or ""
        return ""

    def policy_versions(self) -> list[int]:
        return [
            m.policy_version for m in self.messages if m.role == "assistant" and m.policy_version is not None
        ]


class RewardResult(BaseModel):
    """A score plus the named components it was made of."""

    model_config = _RL_DATA
    score: float
    components: dict[str, float] = Field(default_factory=dict)
    info: dict[str, Any] = Field(default_factory=dict)
