"""Runs one registered function on encoded payloads; shared by the worker process and the
in-process backend so both validate, call and encode the same way.

An outcome is a plain tuple, cheap to pickle across the worker pipe:
``(True, value_json_bytes)`` or ``(False, (code, message, traceback))``.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import json
import signal
import threading
import time
import traceback as tb_mod
from collections.abc import Callable
from typing import Any, NotRequired, Required, get_type_hints

import pydantic_core
from pydantic import ConfigDict, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from fabric.errors import ErrorCode, Misconfigured, Unavailable, UnknownFunctionError
from fabric.protocol import (
    MAX_PAYLOAD_BYTES,
    ErrorInfo,
    Invocation,
    Result,
    Timings,
    lone_surrogate_in_json,
    to_strict_json,
)
from fabric.registry import SETUP_ATTR, SPEC_ATTR, load_entry_point
from fabric.spec import CTX_PARAM, FunctionSpec

Outcome = tuple[bool, Any]

_TB_FRAMES = 6


def args_adapter(fn: Callable[..., Any], spec: FunctionSpec) -> TypeAdapter[Any]:
    """A pydantic validator for the keyword arguments of ``fn`` (a TypedDict, so function
    defaults stay the function's own and any parameter name is allowed): what a worker checks
    each call's payload with, and what a config checks its fixed arguments with before a job
    starts (``core.config_rewards``), so that both read a value the same way."""
    try:
        # with their Annotated extras: a Field(ge=0) or a validator on an argument is checked
        # here, at the edge (InvalidArguments), not lost (the function then ran on -1)
        hints = get_type_hints(fn, include_extras=True)
    except Exception:
        hints = {}
    fields: dict[str, Any] = {}
    for p in spec.params:
        hint = hints.get(p.name, Any)
        fields[p.name] = Required[hint] if p.required else NotRequired[hint]
    td = TypedDict(f"{spec.name}_args", fields)  # type: ignore[misc]
    td.__pydantic_config__ = ConfigDict(  # type: ignore[attr-defined]
        extra="allow" if spec.accepts_extra else "forbid", arbitrary_types_allowed=True
    )
    return TypeAdapter(td)


# what the run in progress has left (in its task's context, or its thread's): a function that
# retries on its own (an LLM judge) reads it, to fail with its own error before the run's limit
# cuts it off with a bare timeout. An async run's reads its timer (moved when the deadline
# moves) and keeps its loop, not looking it up: the context reaches threads the run starts
# (asyncio.to_thread), which have no running loop. A synchronous run is cut from outside (its
# worker killed, its wait given up) and has no timer: it reads the instant its limit ends
_RUN_TIMER: contextvars.ContextVar[Callable[[], float | None] | None] = contextvars.ContextVar(
    "run_timer", default=None
)


def _timer_left(timer: asyncio.Timeout, loop: asyncio.AbstractEventLoop) -> Callable[[], float | None]:
    def left() -> float | None:
        when = timer.when()
        # loop.time() is a plain clock read (time.monotonic on asyncio's loops): safe from a thread
        return None if when is None else when - loop.time()

    return left


def time_left_s() -> float | None:
    """Seconds left before the limit of the function run in progress cuts it off (its
    ``timeout_s``, or the call's deadline if sooner); ``None`` outside a run or in a run without
    a limit. An async run's follows its deadline when it moves; a synchronous run's is the
    limit as it stood when the run started. Also on a thread the run started
    (``asyncio.to_thread``: it carries the run's context)."""
    left = _RUN_TIMER.get()
    return None if left is None else left()


def format_validation_error(spec: FunctionSpec, e: ValidationError) -> str:
    missing, unexpected, bad = [], [], []
    for err in e.errors(include_url=False):
        loc = ".".join(str(x) for x in err["loc"])
        if err["type"] == "missing" and len(err["loc"]) == 1:
            missing.append(repr(loc))
        elif err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            unexpected.append(repr(loc))
        elif err["type"] == "json_invalid":
            bad.append(f"payload is not valid JSON ({err['msg']})")
        else:
            bad.append(f"{loc}: {err['msg']}")
    parts = []
    if missing:
        parts.append("missing " + ", ".join(missing))
    if unexpected:
        parts.append("unexpected " + ", ".join(unexpected))
    parts.extend(bad[:5])
    sig = ", ".join(p.name + ("" if p.required else "=…") for p in spec.params)
    return f"{spec.name}({sig}): " + "; ".join(parts)


def _user_error(e: BaseException) -> tuple[str, str, str | None]:
    try:
        text = str(e)
    except Exception:
        # an exception whose str() raises is still the function's raise: that raise, out of
        # here, ended a worker (WorkerLost, retried), left an async call unanswered until its
        # worker was killed, and made the inproc backend's a TransportError
        text = "<exception str() failed>"  # as traceback writes it
    if isinstance(e, Unavailable):
        return (ErrorCode.UNAVAILABLE, text, None)
    frames = "".join(tb_mod.format_exception(type(e), e, e.__traceback__, limit=-_TB_FRAMES))[-4000:]
    if isinstance(e, Misconfigured):
        # the function's setup, not its input: a code of its own, so a reward's failure_score
        # (which scores a UserError as the response's fault) never scores it
        return (ErrorCode.MISCONFIGURED, text or type(e).__name__, frames)
    return (ErrorCode.USER_ERROR, f"{type(e).__name__}: {text}" if text else type(e).__name__, frames)


def _may_be_ctrl_c(e: BaseException) -> bool:
    """Whether ``e`` may be the user's Ctrl-C rather than the function's own raise: only a
    KeyboardInterrupt in a main thread that has a Python SIGINT handler. A worker ignores
    SIGINT and sync calls in-process run in a thread, so there it is always the function's."""
    if not isinstance(e, KeyboardInterrupt) or threading.current_thread() is not threading.main_thread():
        return False
    return signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, signal.SIG_DFL, None)


def _decode(raw: bytes) -> Any:
    """A value the runner encoded (``_encode``). The encoder writes values nested up to
    about 280 deep, pydantic-core's parser refuses past about 200 levels: Python's takes
    them (about a thousand). A raise here, in the local pool's socket protocol, left the
    call unanswered and tore its worker down."""
    try:
        return pydantic_core.from_json(raw)
    except ValueError:
        return json.loads(raw)


def outcome_to_result(
    inv: Invocation,
    ok: bool,
    out: Any,
    *,
    exec_ms: float,
    worker: str,
    queue_ms: float = 0.0,
    cold: bool = False,
    started: bool | None = None,
    version: str | None = None,
) -> Result:
    """The ``Result`` of an outcome tuple (decoding the JSON value). ``started``: whether
    the execution began, where the outcome's type does not say (``Result.built``);
    ``version``: that of the spec whose code gave the outcome (``Result.version``)."""
    timings = Timings.fast(queue_ms=queue_ms, exec_ms=exec_ms, total_ms=0.0)
    value, error = None, None
    if not ok:
        error = ErrorInfo.of(*out)
    else:
        try:
            value = _decode(out)
        except ValueError as e:
            # the encoder writes an int of any length, both parsers refuse one past 4,300
            # digits (a guard against quadratic int parsing): the function's result, which a
            # raise here (the local pool's socket protocol) left unanswered, its worker torn down
            ok, started = False, True
            error = ErrorInfo.of(
                ErrorCode.RESULT_NOT_SERIALIZABLE,
                f"{inv.function} returned a value that cannot be read back as JSON: {e}",
            )
    return Result.built(
        ok,
        function=inv.function,
        request_id=inv.request_id,
        value=value,
        error=error,
        timings=timings,
        cold_start=cold,
        worker=worker,
        started=started,
        version=version,
    )


def not_set_up(inv: Invocation, e: Exception) -> Result:
    """The answer to a call whose function could not be set up in this process (the
    in-process backends and the fake): an unknown name, or a setup hook (or an import) that
    raised, which is final, as the local pool's workers answer it (raised out of a backend,
    the client took it for a retryable TransportError and ran the hook again)."""
    if isinstance(e, UnknownFunctionError):
        return Result.failure(
            ErrorCode.UNKNOWN_FUNCTION, str(e), function=inv.function, request_id=inv.request_id
        )
    return Result.failure(
        ErrorCode.SETUP_FAILED, f"{type(e).__name__}: {e}", function=inv.function, request_id=inv.request_id
    )


class FunctionRunner:
    """Holds a function, its argument validator and what its setup hook returned."""

    def __init__(self, fn: Callable[..., Any], spec: FunctionSpec):
        self.fn = fn
        self.spec = spec
        self.is_async = inspect.iscoroutinefunction(fn)
        self.wants_ctx = CTX_PARAM in inspect.signature(fn).parameters
        self.ctx: Any = None
        self._setup_fn = getattr(fn, SETUP_ATTR, None)
        self._adapter = args_adapter(fn, spec)

    @classmethod
    def from_entry(cls, entry: str) -> FunctionRunner:
        fn = load_entry_point(entry)
        spec = getattr(fn, SPEC_ATTR, None)
        if not isinstance(spec, FunctionSpec):
            from fabric.errors import EntryPointError

            raise EntryPointError(f"{entry!r} is not a fabric function (no @fabric.reward/tool/function)")
        return cls(fn, spec)

    def setup(self) -> None:
        """Run the setup hook once (a worker calls this before serving)."""
        if self._setup_fn is not None:
            self.ctx = self._setup_fn()

    def _kwargs(self, raw: bytes) -> dict[str, Any]:
        """The call's arguments. A validator of the function's own (an ``AfterValidator``, a
        model's) that raises anything but ``ValueError`` or ``AssertionError`` raises through
        pydantic as it is: the function's code raised, a ``UserError`` to its callers (out of
        here it ended a worker, WorkerLost, or left an async call unanswered)."""
        kwargs = self._adapter.validate_json(raw)
        if self.wants_ctx:
            kwargs[CTX_PARAM] = self.ctx
        return kwargs

    def _bad_arguments(self, raw: bytes, e: ValidationError) -> str:
        # text that is not JSON: a lone surrogate was refused as "unexpected end of hex
        # escape", which names neither the cause nor where it is
        if any(err["type"] == "json_invalid" for err in e.errors()):
            problem = lone_surrogate_in_json(raw, f"the payload of {self.spec.name}")
            if problem is not None:
                return problem
        return format_validation_error(self.spec, e)

    def _encode(self, value: Any) -> Outcome:
        try:
            out = to_strict_json(value)
        except (pydantic_core.PydanticSerializationError, TypeError, ValueError) as e:
            return (
                False,
                (
                    ErrorCode.RESULT_NOT_SERIALIZABLE,
                    f"{self.spec.name} returned {type(value).__name__}, which is not JSON-serialisable: {e}",
                    None,
                ),
            )
        if len(out) > MAX_PAYLOAD_BYTES:
            return (
                False,
                (
                    ErrorCode.RESULT_NOT_SERIALIZABLE,
                    f"{self.spec.name} returned {len(out) / 1e6:.1f} MB, over the 6 MB response limit",
                    None,
                ),
            )
        return (True, out)

    def run(self, raw: bytes, ends_at: float | None = None) -> Outcome:
        """Run a synchronous function on an encoded payload. ``ends_at`` (``time.monotonic()``)
        is when its caller cuts the run: the function reads what is left (``time_left_s``)."""
        try:
            kwargs = self._kwargs(raw)
        except ValidationError as e:
            return (False, (ErrorCode.INVALID_ARGUMENTS, self._bad_arguments(raw, e), None))
        except BaseException as e:  # an argument's own check raised (see _kwargs)
            if _may_be_ctrl_c(e):
                raise
            return (False, _user_error(e))
        token = _RUN_TIMER.set(None if ends_at is None else lambda: ends_at - time.monotonic())
        try:
            value = self.fn(**kwargs)
        except BaseException as e:  # a user error is data, and must not end the worker
            if _may_be_ctrl_c(e):
                raise
            return (False, _user_error(e))
        finally:
            _RUN_TIMER.reset(token)
        return self._encode(value)

    async def _guarded(self, kwargs: dict[str, Any]) -> Outcome:
        """Await the function, its raises as outcomes. A task that raises KeyboardInterrupt
        or SystemExit re-raises it out of the event loop, ending the worker: it must be
        caught inside."""
        try:
            return (True, await self.fn(**kwargs))
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # a real cancellation (the caller's, or the timeout's) goes on
            return (False, e)  # the function's own (it awaited something cancelled)
        except BaseException as e:
            if _may_be_ctrl_c(e):
                raise
            return (False, e)

    async def run_async(
        self,
        raw: bytes,
        timeout_s: float | None,
        on_timer: Callable[[asyncio.Timeout], None] | None = None,
    ) -> Outcome:
        """Run a function (sync or async) from an event loop; async ones get ``timeout_s``.
        ``on_timer`` gets the timer of an async run, which its caller may move later
        (``reschedule``): a worker does when the call's deadline moves."""
        if not self.is_async:
            return self.run(raw, None if timeout_s is None else time.monotonic() + timeout_s)
        try:
            kwargs = self._kwargs(raw)
        except ValidationError as e:
            return (False, (ErrorCode.INVALID_ARGUMENTS, self._bad_arguments(raw, e), None))
        except BaseException as e:  # an argument's own check raised (see _kwargs)
            if _may_be_ctrl_c(e):
                raise
            return (False, _user_error(e))
        loop = asyncio.get_running_loop()
        started = loop.time()
        timer = asyncio.timeout(timeout_s)
        try:
            async with timer:
                if on_timer is not None:
                    on_timer(timer)
                token = _RUN_TIMER.set(_timer_left(timer, loop))
                try:
                    ok, value = await self._guarded(kwargs)
                finally:
                    _RUN_TIMER.reset(token)
        except TimeoutError:
            limit = (timer.when() or started) - started  # what it had, moved or not
            return (
                False,
                (ErrorCode.TIMEOUT, f"{self.spec.name} ran past its {limit:.3g} s limit", None),
            )
        if not ok:
            return (False, _user_error(value))
        return self._encode(value)
