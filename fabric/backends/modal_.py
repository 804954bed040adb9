"""Modal: call the functions ``fabric deploy --backend modal`` deployed.

Each call is ``Function.from_name(app, prefix + name).remote.aio(envelope)``: the fabric
``Invocation`` goes in, the ``Result`` the container built comes back (see
``fabric.deploy.modal_runtime``). Lookups are lazy and cached per function. Modal's
exceptions are translated here (``_ERRORS``): a missing token (``AuthError``) or one without
access to the workspace (``PermissionDeniedError``) is ``Unauthorized`` and final (the
message says how to log in); a function that is not deployed is ``UnknownFunction``; Modal's
timeout is ``FunctionTimeout``; its rate limit (``ResourceExhaustedError``) is ``Throttled``,
retryable and safe to retry for a side effect (nothing ran); a request Modal refuses as
invalid is ``SetupFailed`` (the deployment's or the config's, not the payload's), and so is
an ``ImportError`` from the container (its image cannot import fabric's runtime) or a
``DeserializationError`` (it cannot load the function as deployed), one too
large ``PayloadTooLarge``, a request Modal's server does not implement
(``UnimplementedError``: the modal package is too old or too new) ``SetupFailed``, all final;
a full input queue (a plain ``Exception`` raised before anything is queued) is
``NotStarted``, safe to retry for a side effect; anything else on
the way (``ConnectionError``, ``InternalFailure``, ``ServiceError``, a lost container) is a
retryable ``TransportError``.
"""

from __future__ import annotations

import time
from typing import Any

from fabric.backends._lambda_replies import _as_result
from fabric.backends.base import Backend, ModalConfig
from fabric.errors import ConfigError, ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry

#: Modal's exception class names -> fabric codes, first match wins (the classes are looked
#: up in ``modal.exception`` so that the SDK is imported only when the backend starts).
_ERRORS: tuple[tuple[str, ErrorCode], ...] = (
    ("AuthError", ErrorCode.UNAUTHORIZED),
    ("PermissionDeniedError", ErrorCode.UNAUTHORIZED),
    ("NotFoundError", ErrorCode.UNKNOWN_FUNCTION),
    ("FunctionTimeoutError", ErrorCode.TIMEOUT),
    ("ResourceExhaustedError", ErrorCode.THROTTLED),
    # Modal's "you did something invalid": the app's deployment or this backend's config, the
    # same for every call, never the payload's (a fabric envelope is plain JSON). Final, and
    # not the function's answer: InvalidArguments was kept under the idempotency key and
    # scored by a reward's failure_score as if the trajectory had earned it
    ("InvalidError", ErrorCode.SETUP_FAILED),
    # raised by a container that cannot load the deployed (cloudpickled) function, before any
    # input runs, and re-raised here for the inputs Modal fails with it: no call runs until
    # the app is redeployed (from the Python version the image runs), as for an ImportError
    ("DeserializationError", ErrorCode.SETUP_FAILED),
    ("RequestSizeError", ErrorCode.PAYLOAD_TOO_LARGE),
    # gRPC's UNIMPLEMENTED: Modal's server does not implement what this client asks (a modal
    # package too old or too new for it); every call and retry asks the same
    ("UnimplementedError", ErrorCode.SETUP_FAILED),
)
#: Modal's client raises a plain ``Exception`` with this message when the server took none of
#: the inputs it put: nothing is queued, nothing ran. Its message is the only mark
_QUEUE_FULL = "input queue seems to be full"


class ModalBackend(Backend):
    kind = "modal"

    def __init__(self, registry: Registry | None = None, config: ModalConfig | None = None):
        super().__init__(registry)
        self.config = config or ModalConfig()
        self._modal: Any = None
        self._functions: dict[str, Any] = {}
        self._calls = 0

    async def _start(self) -> None:
        try:
            import modal
        except ImportError:
            raise ConfigError(
                "the modal backend needs the modal SDK: pip install 'rl-fabric[modal]'"
            ) from None
        self._modal = modal

    def _function(self, name: str) -> Any:
        fn = self._functions.get(name)
        if fn is None:
            fn = self._modal.Function.from_name(
                self.config.app_name,
                self.config.function_prefix + name,
                environment_name=self.config.environment_name,
            )
            self._functions[name] = fn
        return fn

    async def _invoke(self, inv: Invocation) -> Result:
        if not self._started:
            await self.start()
        exc = self._modal.exception
        t0 = time.perf_counter()
        self._calls += 1
        envelope = inv.model_dump(mode="json")  # wait_for_run is off the dump
        if inv.wait_for_run:  # a keyed execution's call: no deadline, as for Lambda (envelope())
            envelope["deadline"] = None
        try:
            data = await self._function(inv.function).remote.aio(envelope)
        except Exception as e:
            return self._translate(inv, exc, e)
        # read as the lambda backend reads a handler's: a Result from a container deployed with
        # newer code (a field this client does not know) is still that Result, not a
        # TransportError retried until the client is upgraded
        result = _as_result(data)
        if result is None:
            return self._fail(
                inv, ErrorCode.TRANSPORT, f"Modal returned something that is not a Result: {str(data)[:200]}"
            )
        result.timings.total_ms = (time.perf_counter() - t0) * 1e3
        return result

    def _translate(self, inv: Invocation, exc: Any, e: Exception) -> Result:
        """The failed ``Result`` of a Modal exception (``_ERRORS``; else a transport fault:
        a connection fault, a lost container, Modal's internal failure)."""
        code = next(
            (c for name, c in _ERRORS if isinstance(e, getattr(exc, name, ()))),
            ErrorCode.TRANSPORT,
        )
        message = f"Modal: {type(e).__name__}: {e}"
        if type(e) is Exception and _QUEUE_FULL in str(e):
            # a TransportError may have run: a side effect's call was not retried, and ended
            # OutcomeUnknown, though Modal never queued it
            code = ErrorCode.NOT_STARTED
        elif isinstance(e, ImportError):
            # raised in the container and re-raised here by Modal: its entry cannot import
            # fabric's runtime (the function's own import failures come back as a Result), so
            # no call can run until the image is fixed: not a transport fault to retry
            code = ErrorCode.SETUP_FAILED
            message += (
                " (the Modal container cannot import fabric's runtime: its image lacks a package; "
                "redeploy with `fabric deploy --backend modal` from an environment with rl-fabric installed)"
            )
        elif isinstance(e, getattr(exc, "UnimplementedError", ())):
            message += (
                " (Modal's server does not implement what this modal client asks: upgrade it, "
                "pip install -U modal, and redeploy with `fabric deploy --backend modal`)"
            )
        elif isinstance(e, getattr(exc, "DeserializationError", ())):
            message += (
                " (the Modal container cannot load the function as deployed, made by another Python "
                "or library version: redeploy with `fabric deploy --backend modal`)"
            )
        elif code == ErrorCode.UNAUTHORIZED:
            message += (
                " (run `modal token new`, or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET for a "
                "workspace that can call the app)"
            )
        elif code == ErrorCode.SETUP_FAILED:
            message += (
                " (the deployment or ModalConfig, not the payload: redeploy with "
                "`fabric deploy --backend modal`?)"
            )
        elif code == ErrorCode.UNKNOWN_FUNCTION:
            name = self.config.function_prefix + inv.function
            message += (
                f" ({name!r} in app {self.config.app_name!r}; deployed to another app or --prefix? set "
                "ModalConfig(app_name=..., function_prefix=...) or `fabric invoke --modal-app/--prefix`; "
                "or run `fabric deploy --backend modal`)"
            )
        return self._fail(inv, code, message)

    def _fail(self, inv: Invocation, code: ErrorCode, message: str) -> Result:
        return Result.failure(code, message, function=inv.function, request_id=inv.request_id, worker="modal")

    def stats(self) -> dict[str, Any]:
        return {"modal": {"calls": self._calls, "functions": len(self._functions)}}
