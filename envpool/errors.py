"""Errors of envpool.

    EnvPoolError
    ├── PoolConfigError         a bad EnvPool config (also a ValueError)
    ├── EnvRegistryError        unknown id (lists the known ones), bad registration
    ├── EnvUsageError           the caller's mistake; never retried
    │   ├── EnvOrderError       step before reset, step after the episode ended
    │   ├── ActionError         not text, not UTF-8, over the size limit
    │   └── SessionTokenError   a request carrying another session's token
    ├── EnvLogicError           the environment's own code raised: data, never retried
    │   └── EnvHung             it ran past its timeout while its container was alive
    ├── ProtocolError           a message the session protocol does not allow: never retried
    │   └── GarbledFrame        bytes that are no frame (a bad length prefix, a body not JSON)
    ├── EnvConformanceError     check_env found problems (envpool.testing)
    ├── ImageError              envpool.images: bad reference, not found, unsafe bundle
    ├── PoolClosed              the pool was closed: no new claims
    └── InfraError              retryable: the machinery failed, not the environment
        ├── ContainerDied
        ├── ContainerStartError
        ├── ConnectionLost
        ├── StepTimeout         a container that missed its heartbeats, or a timeout
        │                       with no sign of life (or a tool call still pending)
        ├── EnvCloseHung        an open ran past its timeout in the previous environment's
        │                       close(): the container is discarded, the claim retried
        ├── ToolUnavailable     a tool call the pool brokers failed for the machinery's
        │   │                   reasons (the fabric's retries spent), not the tool's
        │   └── ToolMisconfigured  the tool's setup is wrong: infra_failed (not retried)
        ├── ImageFetchError     (from envpool.images)
        └── SessionLost         the session could not be saved: infra_failed (not retried)

Only ``InfraError`` is retried (exponential backoff, full jitter). A session that cannot be
saved ends its trajectory as ``infra_failed``: masked from training, never a fake zero.

Every error pickles back whole, its message and its attributes (``pickled_whole``).
"""

from __future__ import annotations

from typing import Any


def pickled_whole(e: BaseException) -> tuple[Any, ...]:
    """``__reduce__`` of an exception that pickles back as it is: its ``args`` (the message)
    and its attributes, without calling its ``__init__`` again. Python's default rebuilds it
    as ``type(*e.args)``, which fails for an ``__init__`` that takes its parts (an id and
    the known ids) instead of the message; and exceptions cross processes (a Ray actor
    pickles what it raises back to the driver), where one that cannot be rebuilt arrives as
    a TypeError of unpickling instead of the error. (As ``fabric.errors.pickled_whole``:
    envpool does not import the fabric.)"""
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


class EnvPoolError(Exception):
    """Base class of every envpool error."""

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_whole(self)


class PoolConfigError(EnvPoolError, ValueError):
    """A bad ``EnvPool`` config: each problem by its key (``retry.attempts``), an unknown key
    with the closest allowed one and the list of them. A ``ValueError`` too, as pydantic's
    ``ValidationError`` (raised before) is: code that caught that still catches this."""


class EnvRegistryError(EnvPoolError):
    """A bad registration, or an id that is not registered."""


class UnknownEnvError(EnvRegistryError):
    def __init__(self, env_id: str, known: list[str]):
        self.env_id = env_id
        self.known = sorted(known)
        super().__init__(f"unknown environment {env_id!r}; registered: {', '.join(self.known) or '(none)'}")


class EnvUsageError(EnvPoolError):
    """The caller's mistake: never retried, the session stays usable."""


class EnvOrderError(EnvUsageError):
    """step() before reset(), after the episode ended, or after close()."""


class ActionError(EnvUsageError):
    """An action that is not UTF-8 text or is over the size limit."""


class SessionTokenError(EnvUsageError):
    """A request carrying another session's token."""


class EnvLogicError(EnvPoolError):
    """The environment raised; carries the remote type, message and traceback."""

    def __init__(self, message: str, *, remote_type: str = "", traceback: str | None = None):
        self.remote_type = remote_type
        self.traceback = traceback
        super().__init__(message)


class EnvHung(EnvLogicError):
    """A request ran past its timeout while its container kept heartbeating, or (a local
    process) kept running on the CPU through missed heartbeats, in code that holds the
    interpreter lock: the process is alive and the environment's own code did not answer
    (it hangs on that input). Not
    retried: replaying a deterministic episode on a fresh container would hang the same
    way, for another timeout per attempt."""

    def __init__(self, message: str, *, op: str = "", timeout_s: float = 0.0):
        self.op = op
        self.timeout_s = timeout_s
        super().__init__(message, remote_type="EnvHung")


class ProtocolError(EnvPoolError):
    """A message the session protocol does not allow (a reply without a request id, an
    unknown op): a bug of the server or of the pool, which no retry fixes."""


class GarbledFrame(ProtocolError):
    """The container sent bytes that are no frame: a length prefix over the limit (often the
    start of text written to the socket: a print, a log line) or a body that is not a JSON
    object. Not a lost connection: the server read the request and may have run it, so a
    retry could run a step twice; and the stream is out of step, so the connection ends and
    the container is discarded. The pool's stats count it as ``garbled_frames`` (and, with
    every protocol error, ``protocol_errors``)."""


class InfraError(EnvPoolError):
    retryable = True


class ContainerDied(InfraError):
    """The container's process died."""


class ContainerStartError(InfraError):
    """A container did not become ready."""


class ConnectionLost(InfraError):
    """The session connection broke (usually: the container died)."""


class StepTimeout(InfraError):
    """The container went silent (missed heartbeats and, where the runtime can tell, no
    CPU used: frozen, not busy), or a request ran past its timeout
    with nothing to show the container alive (no heartbeat heard: ``step_timeout_s``
    shorter than a heartbeat period) or while a tool call the pool brokers was pending."""


class EnvCloseHung(InfraError):
    """An open's container closed its previous environment (another session's, made with
    other env_kwargs or another id) for longer than ``close_timeout_s`` (or the open's own
    timeout), its server heartbeating all the while: that environment's ``close()`` hangs.
    Not the new session's fault (its constructor never ran), so not an ``EnvHung`` of its
    own: the container is discarded and the session claims a fresh one (counted as
    ``env_close_hung``)."""


class ToolUnavailable(InfraError):
    """A tool call an environment made failed for the infrastructure's reasons (a worker
    lost, throttling past the fabric's retries, its circuit open, a call that could not
    start in its time), not because of its arguments (a tool that ran past its time limit
    on them is text for the policy). Raised by a tool bridge (``fabric_tools``): the
    request that made the call fails as an infrastructure failure (retried on a fresh
    container, its episode replayed; then ``infra_failed``), never an observation, which
    would teach the policy that its call was wrong. Any ``InfraError`` a bridge raises is
    taken so."""


class ToolMisconfigured(ToolUnavailable):
    """A tool an environment called cannot run as it is set up (it raised
    ``fabric.Misconfigured``: a key not set, a binary not installed). Not the policy's call
    either, so no observation; but not retried: the session's recovery (a fresh container,
    the episode replayed on it) ran the same tool with the same setup, which failed alike,
    several times over. The step fails once and the session ends ``infra_failed`` (masked),
    the tool and what to fix in the message."""

    retryable = False


class PoolClosed(EnvPoolError):
    """The pool was closed: no new claims."""


class SessionLost(InfraError):
    """The session's container failed and the session could not be saved: the trajectory
    is ``infra_failed``."""

    retryable = False
