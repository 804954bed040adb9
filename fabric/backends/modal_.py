"""Modal: call the functions ``fabric deploy --backend modal`` deployed.

Each call is ``Function.from_name(app, prefix + name).remote.aio(envelope)``: the fabric
``Invocation`` goes in, the ``Result`` the container built comes back (see
``fabric.deploy.modal_runtime``). Lookups are lazy and cached per function. Modal's
exceptions are translated here: a missing token or a refused one is ``Unauthorized`` and
final (the message says how to log in); a function that is not deployed is
``UnknownFunction``; Modal's timeout is ``FunctionTimeout``; anything else on the way is a
retryable ``TransportError``.
"""

from __future__ import annotations

import time
from typing import Any

from fabric.backends.base import Backend, ModalConfig
from fabric.errors import ConfigError, ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry


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
        except exc.AuthError as e:
            return self._fail(
                inv,
                ErrorCode.UNAUTHORIZED,
                f"Modal: {e} (run `modal token new`, or set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)",
            )
        except exc.NotFoundError as e:
            name = self.config.function_prefix + inv.function
            return self._fail(
                inv,
                ErrorCode.UNKNOWN_FUNCTION,
                f"Modal: {e} ({name!r} in app {self.config.app_name!r}; "
                "run `fabric deploy --backend modal`?)",
            )
        except exc.FunctionTimeoutError as e:
            return self._fail(inv, ErrorCode.TIMEOUT, f"Modal: {e}")
        except Exception as e:  # connection faults, lost containers: Modal's own retries are spent
            return self._fail(inv, ErrorCode.TRANSPORT, f"Modal: {type(e).__name__}: {e}")
        try:
            result = Result.model_validate(data)
        except ValueError as e:
            return self._fail(inv, ErrorCode.TRANSPORT, f"Modal returned something that is not a Result: {e}")
        result.timings.total_ms = (time.perf_counter() - t0) * 1e3
        return result

    def _fail(self, inv: Invocation, code: ErrorCode, message: str) -> Result:
        return Result.failure(code, message, function=inv.function, request_id=inv.request_id, worker="modal")

    def stats(self) -> dict[str, Any]:
        return {"modal": {"calls": self._calls, "functions": len(self._functions)}}
