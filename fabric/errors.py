"""Errors raised by the fabric SDK.

The tree (every class derives from ``FabricError``)::

    FabricError
    ├── RegistryError            bad registration or lookup
    │   ├── DuplicateFunctionError
    │   ├── SignatureError
    │   ├── UnknownFunctionError   (lists the known names)
    │   └── EntryPointError        (``module:attr`` cannot be imported)
    ├── PayloadError             refused before sending
    │   ├── PayloadNotSerializableError
    │   ├── PayloadTooLargeError
    │   └── InvalidArgumentsError
    ├── BackendError             a backend could not be started or used
    │   ├── BackendClosedError
    │   └── SetupFailedError       (``warmup``: a function's import or setup hook failed)
    ├── ConfigError              a config failed validation at the edge
    ├── InvocationError          raised by ``Result.unwrap()``; carries the Result
    ├── Unavailable              raised *by a function*: a transient failure, retried
    └── Misconfigured            raised *by a function*: its own setup is wrong (a bad key,
                                 a missing model, a tool not installed): final, never scored

A failing *call* is not an exception: the client returns ``Result(ok=False)`` with an
``ErrorInfo`` whose ``type`` is one of the codes in ``ErrorCode``. Only the caller decides
to raise (``Result.unwrap()``).

Every error pickles back whole, its message and its attributes (``pickled_whole``): they
cross processes (a Ray actor's, a worker's).
"""

from __future__ import annotations

import difflib
import sys
from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError

    from fabric.protocol import Result


class ErrorCode(StrEnum):
    """Error ``type`` values in a failed ``Result``. ``RETRYABLE`` says which ones are retried."""

    USER_ERROR = "UserError"  # the handler raised
    INVALID_ARGUMENTS = "InvalidArguments"
    UNKNOWN_FUNCTION = "UnknownFunction"
    PAYLOAD_TOO_LARGE = "PayloadTooLarge"
    PAYLOAD_NOT_SERIALIZABLE = "PayloadNotSerializable"
    RESULT_NOT_SERIALIZABLE = "ResultNotSerializable"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    TIMEOUT = "FunctionTimeout"  # ran past timeout_s; its worker was killed and replaced
    WORKER_LOST = "WorkerLost"  # the worker died while running the call (it may have had effects)
    NOT_STARTED = "NotStarted"  # the worker died before the call started: safe to retry anything
    SETUP_FAILED = "SetupFailed"  # the setup hook raised: no worker can serve
    THROTTLED = "Throttled"
    TRANSPORT = "TransportError"
    CIRCUIT_OPEN = "CircuitOpen"
    BACKEND_CLOSED = "BackendClosed"
    CANCELLED = "Cancelled"
    UNAUTHORIZED = "Unauthorized"  # the backend refused our credentials or token
    UNAVAILABLE = "Unavailable"  # the function raised ``Unavailable``: a dependency failed transiently
    # the function raised ``Misconfigured``: its setup is wrong, not its input; final, and not
    # the function's answer to the payload (not kept under a key: once fixed, a call runs again)
    MISCONFIGURED = "Misconfigured"
    # an earlier call under this idempotency key of a side-effecting function ended in an unknown
    # state (WorkerLost, FunctionTimeout, ...): its effect may have happened, so the client does
    # not run it again under that key (a new key does)
    OUTCOME_UNKNOWN = "OutcomeUnknown"
    # the backend ran other code than the caller's registry holds (a deployment made before
    # the function was edited), refused by ``ClientConfig(version_check="refuse")``. It ran, so
    # not retried (another attempt runs the same code); final, but not the caller's code's
    # answer: not kept under a key (once redeployed, a call runs again), but for a side effect
    VERSION_MISMATCH = "VersionMismatch"


RETRYABLE: frozenset[str] = frozenset(
    {
        ErrorCode.TIMEOUT,
        ErrorCode.WORKER_LOST,
        ErrorCode.NOT_STARTED,
        ErrorCode.THROTTLED,
        ErrorCode.TRANSPORT,
        ErrorCode.UNAVAILABLE,
    }
)


#: Retryable failures after which the call provably did not run: the only ones retried for
#: functions declared ``side_effects=True``.
SAFE_TO_RETRY: frozenset[str] = frozenset({ErrorCode.NOT_STARTED, ErrorCode.THROTTLED})

#: Outcomes that are the function's own answer: cached under an idempotency key. Anything
#: else (an infrastructure failure, a deadline) lets a later call with the key try again.
FINAL_ERRORS: frozenset[str] = frozenset(
    {
        ErrorCode.USER_ERROR,
        ErrorCode.INVALID_ARGUMENTS,
        ErrorCode.RESULT_NOT_SERIALIZABLE,
    }
)


def pickled_whole(e: BaseException) -> tuple[Any, ...]:
    """``__reduce__`` of an exception that pickles back as it is: its ``args`` (the message)
    and its attributes, without calling its ``__init__`` again. Python's default rebuilds it
    as ``type(*e.args)``, which fails for an ``__init__`` that takes its parts (a name and
    the known names) instead of the message; and exceptions cross processes (a Ray actor
    pickles what it raises back to the driver), where one that cannot be rebuilt arrives as
    a TypeError of unpickling instead of the error."""
    # an OSError keeps errno, strerror and filename outside args and __dict__: its own
    # __reduce__'s arguments carry them (the filename beside args)
    args = OSError.__reduce__(e)[1] if isinstance(e, OSError) else e.args
    return (_made, (type(e), args), e.__dict__)


def _made(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    # what unpickling does with any object: made without __init__ (BaseException.__new__
    # sets args, nothing else), then its attributes set from the pickled __dict__
    e = cls.__new__(cls, *args)
    if isinstance(e, OSError):
        # OSError.__new__ leaves args, errno and the rest to OSError.__init__ for a class
        # with its own __init__ (a no-op for the others, which __new__ filled)
        OSError.__init__(e, *args)
    return e


class FabricError(Exception):
    """Base class of every error the fabric SDK raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_whole(self)


class RegistryError(FabricError):
    """Bad registration or lookup."""


class DuplicateFunctionError(RegistryError):
    """Two functions registered under one name."""


class SignatureError(RegistryError):
    """A function or setup hook whose signature the fabric cannot call."""


class UnknownFunctionError(RegistryError):
    def __init__(self, name: str, known: list[str]):
        self.name = name
        self.known = sorted(known)
        shown = ", ".join(self.known) if self.known else "(none registered)"
        hint = ""
        if "functions.rewards" not in sys.modules:
            # the commonest miss: a script calling a built-in (exact_match, code_verify, ...)
            # that never imported them; the CLI discovers them, a user's own client does not
            hint = (
                "; the built-in functions register when their package is discovered: "
                "fabric.default_registry.discover('functions')"
            )
        # a near miss (math_answr) is named first: a list of a dozen names hides it; the
        # default cutoff (0.6) offered tool_use_reward for no_such_reward
        close = difflib.get_close_matches(name, self.known, n=1, cutoff=0.75)
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        super().__init__(f"unknown function {name!r}{meant}; known functions: {shown}{hint}")


class EntryPointError(RegistryError):
    """A ``module:attr`` entry point that cannot be imported."""


class PayloadError(FabricError):
    code: ErrorCode = ErrorCode.INVALID_ARGUMENTS


class PayloadNotSerializableError(PayloadError):
    code = ErrorCode.PAYLOAD_NOT_SERIALIZABLE


class PayloadTooLargeError(PayloadError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class InvalidArgumentsError(PayloadError):
    code = ErrorCode.INVALID_ARGUMENTS


class BackendError(FabricError):
    """A backend could not be started or used."""


class BackendClosedError(BackendError):
    """A call on a backend that was closed."""


class SetupFailedError(BackendError):
    """A function's workers cannot start: its import or setup hook raised, or they did not
    become ready in time. Raised by ``warmup``; a call gets the same failure as a
    ``SetupFailed`` result. ``traceback`` is the worker's, when there is one."""

    def __init__(self, message: str, traceback: str | None = None):
        self.message = message
        self.traceback = traceback
        # the excerpt is part of the text: a CLI that prints the error shows where setup broke
        super().__init__(f"{message}\n{traceback.rstrip()}" if traceback else message)


class ConfigError(FabricError):
    """A config that failed validation at the edge."""


def validation_problems(e: ValidationError, model: type[BaseModel]) -> str:
    """pydantic's errors from validating ``model``, for a ``ConfigError``: each key as the
    caller wrote it (``hedge.enabled``) and what is wrong with it; an unknown key names the
    closest known one, worded as a job config's errors are (``fabric.config_messages``)."""
    from fabric.config_messages import one_line

    return one_line(e, model)


class InvocationError(FabricError):
    """Raised by ``Result.unwrap()`` on a failed result."""

    def __init__(self, result: Result):
        self.result = result
        err = result.error
        assert err is not None
        super().__init__(f"{result.function}: {err.type}: {err.message}")


class Unavailable(FabricError):
    """Raise this from a function when it failed for a transient reason of its own
    infrastructure (a sandbox died, a judge endpoint is overloaded), not because of its input:
    the call fails with ``Unavailable``, which is retryable. Any other exception is a final
    ``UserError`` (or ``Misconfigured``, below)."""


class Misconfigured(FabricError):
    """Raise this from a function when it cannot run because of how it was set up, not
    because of its input: the endpoint it calls refused its key (401/403) or does not know its
    model or URL (404), a required setting is missing, a tool it needs is not installed, a
    fixed argument from the job's config is wrong. The call fails with ``Misconfigured``:
    final (retrying will not fix it), not kept under an idempotency key (once the setup is
    fixed, the call runs again), and never scored by a reward's ``failure_score``, which
    stands in only for failures the response caused (``UserError``): a setup fault fails
    every trajectory alike, and scoring them would train the policy on a constant. Say in the
    message what to fix."""
