"""The ``modal`` runtime: each container is a ``modal.Sandbox`` running ``envpool.server``.

The sandbox serves the session protocol on ``config.port``, exposed through an unencrypted
Modal tunnel (the protocol is plain TCP); the pool connects to the tunnel's TCP socket. A
sandbox is found again by its id (``reconnect``), so a pool that restarts can reattach to
sandboxes it started. A custom environment image (a bundle) is fetched by the server itself
from ``config.image_source``.

A sandbox is ready when its server listens, which Modal's readiness probe checks inside the
sandbox (``Probe.with_tcp``, modal 1.4.1+): its tunnel is up, and accepts connections, before
that, and a connection that comes early is reset, so a connect through the tunnel proves
nothing.

``modal`` is imported lazily; tests inject ``envpool.runtimes.modal_fake`` instead, which
runs each sandbox as a local process. Modal's errors are translated in ``_translate``.

Every sandbox is tagged ``managed-by: envpool`` with its host and owner (``envpool-owner``:
host/pid:start/runtime instance, ``_remote.owner_id``). ``reap_orphans()`` (a pool calls it
as it opens) terminates the app's sandboxes whose owner on this host is gone (a crashed
trainer's); an exit hook
terminates the sandboxes this process still holds (a pool never closed); a sandbox ends by
itself at ``timeout_s`` all the same.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import logging
import math
import secrets
import socket
import time
import weakref
from pathlib import Path
from typing import Any

from envpool.errors import ContainerDied, ContainerStartError, EnvPoolError, EnvUsageError, InfraError
from envpool.protocol import EXIT_IMAGE_NOT_FOUND
from envpool.runtimes._remote import create_or_clean, image_not_found, owner_gone, owner_id, server_command
from envpool.runtimes.base import Container, ModalRuntimeConfig, Runtime

MANAGED_BY = {"managed-by": "envpool"}
"""Tags on every sandbox the runtime starts (``modal.Sandbox.list(tags=...)`` finds them)."""
HOST_TAG = "envpool-host"
"""The host of the sandbox's owner: a reaper lists only its own host's (it can judge no other)."""
OWNER_TAG = "envpool-owner"

_RUNTIMES: weakref.WeakSet[ModalRuntime] = weakref.WeakSet()
log = logging.getLogger(__name__)
_hook_registered = False


def _terminate_leftovers() -> None:
    # exit backstop: a pool that was never closed (or whose stops failed) leaves no sandbox
    # running, and billed, until its timeout_s
    for rt in list(_RUNTIMES):
        for c in [*rt.live.values(), *rt.leaked.values()]:
            with contextlib.suppress(Exception):
                rt.modal.Sandbox.from_id(c.handle).terminate()


def _register_exit_hook() -> None:
    # registered once modal is imported, not when this module is: atexit runs hooks last
    # registered first, and modal's own (synchronicity's) closes the loop its sync calls need
    global _hook_registered
    if not _hook_registered:
        atexit.register(_terminate_leftovers)
        _hook_registered = True


def _import_modal() -> Any:
    try:
        import modal
    except ImportError as e:  # a base install stays light: the SDK is an extra
        raise ImportError("the modal runtime needs the modal SDK: pip install 'rl-fabric[modal]'") from e
    return modal


async def _list(fn: Any, **kw: Any) -> list[Any]:
    """What a Modal listing (a generator; ``.aio`` an async one) yields, all of it."""
    aio = getattr(fn, "aio", None)
    if aio is not None:
        return [x async for x in aio(**kw)]
    return await asyncio.to_thread(lambda: list(fn(**kw)))


async def _call(fn: Any, *args: Any, **kw: Any) -> Any:
    """Modal's async variant (``fn.aio``) where it has one, else the call in a thread."""
    aio = getattr(fn, "aio", None)
    if aio is not None:
        return await aio(*args, **kw)
    return await asyncio.to_thread(fn, *args, **kw)


class ModalRuntime(Runtime):
    kind = "modal"
    uses_local_bundle = False  # the sandbox fetches its bundle from image_source

    def __init__(self, config: ModalRuntimeConfig | None = None, *, modal_module: Any = None):
        super().__init__()
        self.config = config or ModalRuntimeConfig()
        self.modal = modal_module if modal_module is not None else _import_modal()
        if not hasattr(self.modal, "Probe"):
            # without a readiness probe a start cannot tell a listening server from the tunnel
            # in front of it, and every first connection may be reset
            raise EnvUsageError(
                "the modal runtime needs modal 1.4.1 or newer (Sandbox readiness probes): "
                "pip install -U 'modal>=1.4.1'"
            )
        self._app: Any = None
        self.owner = owner_id(secrets.token_hex(4))
        _RUNTIMES.add(self)
        _register_exit_hook()

    def _translate(self, e: Exception, what: str) -> EnvPoolError:
        """A Modal error as an envpool error: a missing token or settings Modal refuses are
        the caller's to fix (never retried); anything else Modal raises is an ``InfraError``
        the pool retries."""
        exc = self.modal.exception
        if isinstance(e, exc.AuthError):
            return EnvUsageError(
                f"modal: not authenticated ({e}); run `modal token new`, or set "
                "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET"
            )
        if isinstance(e, exc.NotFoundError):
            return ContainerDied(f"modal: cannot {what}: {e} (the sandbox ended or the id is wrong)")
        if isinstance(e, exc.InvalidError) and not isinstance(e, exc.ConflictError):
            # arguments Modal refuses fail the same on every attempt (a ConflictError, a
            # sandbox that finished, is another matter)
            return EnvUsageError(
                f"modal: cannot {what}: {e}; Modal refuses these settings: check the runtime "
                "config (cpu, memory_mb, timeout_s, env, image)"
            )
        return ContainerStartError(f"modal: cannot {what}: {type(e).__name__}: {e}")

    async def _modal(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return await _call(fn, *args, **kw)
        except self.modal.exception.Error as e:
            raise self._translate(e, what) from e

    def create_args(self, image: str | None) -> tuple[list[str], dict[str, Any]]:
        """The arguments of ``modal.Sandbox.create`` (minus ``app`` and ``image``)."""
        cfg = self.config
        kw: dict[str, Any] = {
            "timeout": cfg.timeout_s,
            "unencrypted_ports": [cfg.port],  # the session protocol is plain TCP, not TLS
            "cpu": cfg.cpu,
            # (request, limit): a bare number is a request only, and a sandbox's memory grew
            # without bound where a pod's or a docker container's stops at it
            "memory": (cfg.memory_mb, cfg.memory_mb),
            # probed inside the sandbox: ready is the server listening, not the tunnel up
            "readiness_probe": self.modal.Probe.with_tcp(cfg.port),
            # at create, not after: a crash in between would leave one no reaper finds
            "tags": {**MANAGED_BY, HOST_TAG: socket.gethostname(), OWNER_TAG: self.owner},
        }
        if cfg.block_network:
            # not ``block_network=True``: Modal refuses it with open ports, and the tunnel is
            # one. An empty outbound allow-list blocks all outbound traffic, tunnel kept
            kw[self._allowlist_kwarg()] = []
        if cfg.env:
            kw["env"] = dict(cfg.env)
        return server_command(cfg, image), kw

    def _allowlist_kwarg(self) -> str:
        """``outbound_cidr_allowlist``, the name of modal 1.x since 2026 (``cidr_allowlist``,
        deprecated) where the SDK has it."""
        try:
            params = inspect.signature(self.modal.Sandbox.create).parameters
        except (TypeError, ValueError):
            return "outbound_cidr_allowlist"
        if "outbound_cidr_allowlist" not in params and "cidr_allowlist" in params:
            return "cidr_allowlist"
        return "outbound_cidr_allowlist"

    async def _app_handle(self) -> Any:
        if self._app is None:
            self._app = await self._modal(
                "look up the app", self.modal.App.lookup, self.config.app_name, create_if_missing=True
            )
        return self._app

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        m = self.modal
        await self._app_handle()
        args, kw = self.create_args(image)
        created = time.monotonic()  # its timeout_s runs from the create, not from ready
        self._waiting_for(f"Modal to create a sandbox of {self.config.image} (scheduling, image pull)")
        create = self._modal(
            "create a sandbox",
            m.Sandbox.create,
            *args,
            app=self._app,
            image=m.Image.from_registry(self.config.image),
            **kw,
        )
        sb = await create_or_clean(create, lambda sb: self._discard(sb, image))
        try:
            await self._wait_ready(sb)
            c = await self._container(sb, image)
            c.started_at = created
        except ContainerStartError as e:
            code = None
            with contextlib.suppress(Exception):
                code = await _call(sb.poll)
            await asyncio.shield(self._discard(sb, image))
            if code == EXIT_IMAGE_NOT_FOUND:  # its server found no such image: not worth a retry
                raise image_not_found(self.config, image, f"sandbox {sb.object_id}") from e
            raise
        except BaseException:  # a timeout (cancellation) too: nothing is left running
            await asyncio.shield(self._discard(sb, image))
            raise
        return c

    async def _discard(self, sb: Any, image: str | None) -> None:
        """Terminate the sandbox of a start that failed. One whose terminate fails too goes
        to ``leaked``, for ``aclose`` and the exit hook to try again: nothing else knows of
        it (its owner is alive, so no reaper takes it), and it would run until ``timeout_s``;
        the start raises its own error, not the terminate's."""
        try:
            await self._terminate(sb)
        except Exception as e:
            c = Container(
                id=f"m-{sb.object_id}",
                endpoint="",
                image=image,
                runtime=self.kind,
                isolation="modal",
                handle=sb.object_id,
            )
            self.leaked[c.id] = c
            self.metrics["leaked"] += 1
            log.warning("envpool: modal: sandbox %s of a failed start not terminated: %s", sb.object_id, e)

    async def _container(self, sb: Any, image: str | None) -> Container:
        tunnels = await self._modal("read the sandbox's tunnels", sb.tunnels)
        tunnel = tunnels.get(self.config.port)
        if tunnel is None:
            raise ContainerStartError(
                f"modal: sandbox {sb.object_id} has no tunnel for port {self.config.port}"
            )
        host, port = tunnel.tcp_socket
        return Container(
            id=f"m-{sb.object_id}",
            endpoint=f"tcp://{host}:{port}",
            image=image,
            runtime=self.kind,
            isolation="modal",
            handle=sb.object_id,
        )

    async def _wait_ready(self, sb: Any) -> None:
        """Until the sandbox's readiness probe sees its server listen, within
        ``start_timeout_s``; a sandbox that exits meanwhile fails the start at once."""
        exc = self.modal.exception
        budget = self.config.start_timeout_s
        deadline = time.monotonic() + budget
        self._waiting_for(
            f"sandbox {sb.object_id}'s server to listen on port {self.config.port}; see "
            f"`modal container logs {sb.object_id}`"
        )
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ContainerStartError(
                    f"modal: sandbox {sb.object_id}: its server was not listening on port "
                    f"{self.config.port} within {budget:g} s (runtime.start_timeout_s); see "
                    f"`modal container logs {sb.object_id}`"
                )
            try:
                # in slices (whole seconds, as Modal takes them): a sandbox that exited is
                # seen within one, not at the deadline
                await _call(sb.wait_until_ready, timeout=max(1, min(5, math.ceil(left))))
                return
            except (exc.TimeoutError, exc.ConflictError):
                pass  # not ready yet, or finished (ConflictError): its exit code tells
            except exc.Error as e:
                raise self._translate(e, "wait for the sandbox to be ready") from e
            code = await self._modal("poll a sandbox", sb.poll)
            if code is not None:
                raise ContainerStartError(
                    f"modal: sandbox {sb.object_id} exited (code {code}) before it was ready; see "
                    f"`modal container logs {sb.object_id}`"
                )

    async def reconnect(self, sandbox_id: str, image: str | None = None) -> Container:
        """The container of a sandbox started earlier (by this pool or a previous one), found
        by its id; it joins this runtime's live containers (``stop`` terminates it)."""
        sb = await self._modal(f"find sandbox {sandbox_id}", self.modal.Sandbox.from_id, sandbox_id)
        code = await self._modal("poll a sandbox", sb.poll)
        if code is not None:
            raise ContainerDied(f"modal: sandbox {sandbox_id} has exited (code {code})")
        c = await self._container(sb, image)
        # (its age is not to be had from Modal: its timeout_s is counted from now, and
        # Modal may end it before _near_end retires it)
        self.live[c.id] = c
        return c

    async def _terminate(self, sb: Any) -> None:
        try:
            await _call(sb.terminate)
        except self.modal.exception.NotFoundError:
            pass  # gone already: that is what we wanted
        except self.modal.exception.Error as e:
            raise self._translate(e, f"terminate sandbox {sb.object_id}") from e

    async def _stop(self, c: Container) -> None:
        try:
            sb = await _call(self.modal.Sandbox.from_id, c.handle)
        except self.modal.exception.NotFoundError:
            return
        except self.modal.exception.Error as e:
            raise self._translate(e, f"terminate sandbox {c.handle}") from e
        await self._terminate(sb)

    async def reap_orphans(self) -> list[str]:
        """Terminate the app's envpool sandboxes whose owner is gone: a process of this host
        that exited (a crashed trainer). Other hosts' are never listed (their owners'
        liveness cannot be seen from here). Returns the sandbox ids terminated."""
        app = await self._app_handle()
        tags = {**MANAGED_BY, HOST_TAG: socket.gethostname()}
        try:
            sandboxes = await _list(self.modal.Sandbox.list, app_id=app.app_id, tags=tags)
        except self.modal.exception.Error as e:
            raise self._translate(e, "list sandboxes") from e
        reaped = []
        for sb in sandboxes:
            try:
                owner = (await _call(sb.get_tags)).get(OWNER_TAG, "")
            except self.modal.exception.NotFoundError:
                continue  # ended meanwhile
            except self.modal.exception.Error as e:
                raise self._translate(e, f"read the tags of sandbox {sb.object_id}") from e
            if owner_gone(owner):
                await self._terminate(sb)
                reaped.append(sb.object_id)
        self.metrics["reaped_orphans"] += len(reaped)
        return reaped

    async def aclose(self) -> None:
        await super().aclose()
        if not self.live and not self.leaked:  # else the exit hook tries once more
            _RUNTIMES.discard(self)

    def _near_end(self, c: Container) -> bool:
        """Modal ends a sandbox at ``timeout_s`` whatever it runs: within the last tenth of
        it (at most 5 min) one is retired at a claim or an idle probe (not alive), not
        handed to an episode it would be cut out of."""
        left = self.config.timeout_s - (time.monotonic() - c.started_at)
        return left < min(300.0, self.config.timeout_s / 10)

    async def _alive(self, c: Container) -> bool:
        if self._near_end(c):
            return False
        exc = self.modal.exception
        try:
            sb = await _call(self.modal.Sandbox.from_id, c.handle)
            return await _call(sb.poll) is None
        except exc.NotFoundError:
            return False
        except exc.AuthError as e:
            raise self._translate(e, f"probe sandbox {c.handle}") from e
        except exc.Error as e:
            # an API hiccup says nothing of the sandbox: retryable, as docker's and a pod's
            # probe failures are (Modal's own error, unknown to the pool, ended the session)
            raise InfraError(f"modal: cannot probe sandbox {c.handle}: {type(e).__name__}: {e}") from e
