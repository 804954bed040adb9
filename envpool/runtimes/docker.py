"""The ``docker`` runtime: each container is a Docker container on an engine (docker SDK).

The container runs ``python -m envpool.server --tcp 0.0.0.0:<port>`` from ``config.image``
(an OCI image with rl-fabric installed); its port is published on the host's loopback at a
port the engine picks, and the pool speaks the session protocol to it over TCP. A custom
environment image (a bundle) is fetched by the server itself from ``config.image_source``.

A container is ready when its server has printed its ready line (its stdout, read back with
``logs``): docker-proxy binds the published port as the container starts, and accepts (then
resets) connections before the server listens, so a connect proves nothing. Where the
engine cannot read logs back (a logging driver such as ``none``) the connect is all there is.

The SDK is blocking: every call runs in a worker thread. Its errors are translated into
envpool's in ``_translate`` (one place), with messages that say what to do.

Every container is labelled ``app.kubernetes.io/managed-by: envpool`` and with its owner
(``envpool.owner``: host/pid:start/runtime instance, ``_remote.owner_id``).
``reap_orphans()`` removes containers whose owner on this host is gone; an exit hook
removes what this process still holds.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import secrets
import time
import weakref
from pathlib import Path
from typing import Any, TypeVar

from envpool.errors import ContainerStartError, EnvPoolError, EnvUsageError
from envpool.protocol import EXIT_IMAGE_NOT_FOUND
from envpool.runtimes._remote import create_or_clean, image_not_found, owner_gone, owner_id, server_command
from envpool.runtimes.base import Container, DockerRuntimeConfig, Runtime, proc_cpu_seconds

T = TypeVar("T")
log = logging.getLogger(__name__)

MANAGED_BY = {"app.kubernetes.io/managed-by": "envpool"}
"""Labels on every container the runtime starts (``docker ps --filter label=...`` finds them)."""
OWNER_LABEL = "envpool.owner"

_RUNTIMES: weakref.WeakSet[DockerRuntime] = weakref.WeakSet()


@atexit.register
def _remove_leftovers() -> None:
    # exit backstop: a pool that was never closed (or whose stops failed) leaves no container
    for rt in list(_RUNTIMES):
        for c in [*rt.live.values(), *rt.leaked.values()]:
            with contextlib.suppress(Exception):
                rt._client.containers.get(c.handle).remove(force=True)


def _import_docker() -> Any:
    try:
        import docker
    except ImportError as e:  # a base install stays light: the SDK is an extra
        raise ImportError("the docker runtime needs the docker SDK: pip install 'rl-fabric[docker]'") from e
    return docker


def run_kwargs(config: DockerRuntimeConfig, image: str | None, *, owner: str) -> dict[str, Any]:
    """The arguments of ``client.containers.run`` for one container (pure: tested as is)."""
    return {
        "image": config.image,
        "command": server_command(config, image),
        "detach": True,
        # the engine picks a free host port, bound to loopback only
        "ports": {f"{config.port}/tcp": ("127.0.0.1", None)},
        "labels": {**MANAGED_BY, OWNER_LABEL: owner},
        "nano_cpus": int(config.cpu * 1e9),
        "mem_limit": f"{config.memory_mb}m",
        "environment": dict(config.env),
        "network": config.network,
    }


def _in_container(pid: int, container_id: str) -> bool:
    """Whether process ``pid`` of this machine is in the cgroup of the container (docker
    names it after the full id: ``docker-<id>.scope``, ``/docker/<id>``). Read each time:
    once the container is gone, its pid may be another process's."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return container_id in f.read()
    except OSError:
        return False


def _translate(docker: Any, e: Exception, config: DockerRuntimeConfig, what: str) -> EnvPoolError:
    """A docker SDK error as an envpool error: a setup mistake is never retried, an engine
    hiccup is an ``InfraError`` the pool retries."""
    errors = docker.errors
    if isinstance(e, errors.ImageNotFound):
        return EnvUsageError(
            f"docker: image {config.image!r} is not on the engine and could not be pulled: "
            f"build or pull it (docker pull {config.image}), or set runtime.image ({e})"
        )
    if isinstance(e, errors.NotFound) and config.network and "network" in str(e.explanation or "").lower():
        # the setup's to fix: retried, it failed the same on every claim
        return EnvUsageError(
            f"docker: the engine has no network {config.network!r} ({e.explanation}): create it "
            f"(docker network create {config.network}), or set runtime.network"
        )
    if isinstance(e, errors.APIError):
        return ContainerStartError(f"docker: the engine refused to {what}: {e.explanation or e}")
    where = (
        config.base_url or os.environ.get("DOCKER_HOST") or "the local socket (unix:///var/run/docker.sock)"
    )
    return ContainerStartError(
        f"docker: engine not reachable at {where} ({e}); start Docker, or point "
        "runtime.base_url (or DOCKER_HOST) at a running engine"
    )


def _said_ready(stdout: bytes | str) -> bool:
    """Whether a server's stdout holds its ready line (``{"ready": true, ...}``)."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            said = json.loads(line)
            if isinstance(said, dict) and said.get("ready") is True:
                return True
    return False


class DockerRuntime(Runtime):
    kind = "docker"
    uses_local_bundle = False  # the container fetches its bundle from image_source

    def __init__(self, config: DockerRuntimeConfig | None = None, *, client: Any = None):
        """``client``: a ``docker.DockerClient`` to use (tests pass a fake); by default one
        is connected on first use from ``config.base_url`` or the environment."""
        super().__init__()
        self.config = config or DockerRuntimeConfig()
        self._docker = _import_docker()
        self._client: Any = client
        self.owner = owner_id(secrets.token_hex(4))
        self._pids: dict[str, int] = {}
        """Container id -> the host pid of its server, as the engine reported it."""
        _RUNTIMES.add(self)

    async def _sdk(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run a blocking SDK call in a thread, its errors translated."""
        try:
            return await asyncio.to_thread(fn, *args, **kw)
        except self._docker.errors.DockerException as e:
            raise _translate(self._docker, e, self.config, what) from e

    def _connect(self) -> Any:
        # the client asks the engine its API version on construction: this is where an
        # unreachable engine shows
        if self.config.base_url:
            return self._docker.DockerClient(base_url=self.config.base_url)
        return self._docker.from_env()

    async def client(self) -> Any:
        if self._client is None:
            self._client = await self._sdk("connect", self._connect)
        return self._client

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        client = await self.client()
        kw = run_kwargs(self.config, image, owner=self.owner)
        # named, to be found when run() fails: it creates the container, then starts it, and
        # a start the engine refuses (an image without python) raises with it created
        name = f"envpool-{secrets.token_hex(6)}"
        self._waiting_for(f"the engine to start container {name} of {self.config.image} (pulling it)")
        run = asyncio.ensure_future(self._sdk("start a container", client.containers.run, name=name, **kw))
        try:
            ctr = await create_or_clean(run, lambda ctr: asyncio.to_thread(ctr.remove, force=True))
        except BaseException:
            await asyncio.shield(self._remove_named(client, name, run))
            raise
        c = Container(id=f"d-{ctr.id[:12]}", endpoint="", image=image, runtime=self.kind, handle=ctr.id)
        try:
            await self._sdk("inspect a container", ctr.reload)
            bound = (ctr.attrs["NetworkSettings"]["Ports"] or {}).get(f"{self.config.port}/tcp") or []
            if not bound:
                raise ContainerStartError(
                    f"docker: container {ctr.id[:12]} published no port for {self.config.port}/tcp "
                    f"(status {ctr.status}); see `docker logs {ctr.id[:12]}`"
                )
            c.endpoint = f"tcp://127.0.0.1:{bound[0]['HostPort']}"
            await self._wait_listening(c, ctr)
        except BaseException:  # a timeout (cancellation) too: nothing is left behind
            await asyncio.shield(self._discard(c))
            raise
        c.isolation = "docker"
        pid = int((ctr.attrs.get("State") or {}).get("Pid") or 0)
        if pid > 0:
            self._pids[c.id] = pid
        return c

    async def _discard(self, c: Container) -> None:
        """Remove the container of a start that failed. One whose remove fails too goes to
        ``leaked``, for ``aclose`` and the exit hook to try again: nothing else knows of it
        (its owner is alive, so no reaper takes it); the start raises its own error."""
        try:
            await self._stop(c)
        except Exception as e:
            self.leaked[c.id] = c
            self.metrics["leaked"] += 1
            log.warning("envpool: docker: container %s of a failed start not removed: %s", c.id, e)

    async def _remove_named(self, client: Any, name: str, run: asyncio.Future[Any]) -> None:
        """Remove the container ``name`` a failed (or cancelled) ``run`` may have left, once
        that call in its thread has returned; only if it is ours (the name of another's, a
        409 Conflict on create, is left alone)."""
        await asyncio.wait([run])
        if not run.cancelled():
            run.exception()  # read: it is the caller's error, raised there
        try:
            ctr = await asyncio.to_thread(client.containers.get, name)
        except self._docker.errors.NotFound:
            return  # never created: nothing to remove
        except Exception as e:  # the start's own error is the one to raise
            log.warning("envpool: docker: container %s of a failed start not removed: %s", name, e)
            return
        if (ctr.labels or {}).get(OWNER_LABEL) == self.owner:
            # as _discard: one whose remove fails goes to leaked, tried again at close
            await self._discard(
                Container(id=f"d-{ctr.id[:12]}", endpoint="", image=None, runtime=self.kind, handle=ctr.id)
            )

    async def _wait_listening(self, c: Container, ctr: Any) -> None:
        host, _, port = c.endpoint.removeprefix("tcp://").rpartition(":")
        budget = self.config.start_timeout_s
        deadline = time.monotonic() + budget
        read_logs = True
        self._waiting_for(
            f"container {ctr.id[:12]}'s server to say it is ready; see `docker logs {ctr.id[:12]}`"
        )
        while True:
            if read_logs:
                try:
                    if _said_ready(await asyncio.to_thread(ctr.logs, stdout=True, stderr=False)):
                        return
                except self._docker.errors.APIError as e:
                    log.warning(
                        "envpool: docker: cannot read container %s's logs (%s): taking a connect "
                        "to its port for its server's readiness",
                        ctr.id[:12],
                        e.explanation or e,
                    )
                    read_logs = False
            if not read_logs:
                with contextlib.suppress(OSError):
                    _, w = await asyncio.open_connection(host, int(port))
                    w.close()
                    return
            await self._sdk("inspect a container", ctr.reload)
            if ctr.status in ("exited", "dead"):
                if (ctr.attrs.get("State") or {}).get("ExitCode") == EXIT_IMAGE_NOT_FOUND:
                    raise image_not_found(self.config, c.image, f"container {ctr.id[:12]}")
                raise ContainerStartError(
                    f"docker: container {ctr.id[:12]} exited before it was ready; "
                    f"see `docker logs {ctr.id[:12]}`"
                )
            if time.monotonic() > deadline:
                raise ContainerStartError(
                    f"docker: container {ctr.id[:12]}'s server not ready in {budget:g} s "
                    f"(runtime.start_timeout_s); see `docker logs {ctr.id[:12]}`"
                )
            await asyncio.sleep(0.1)

    async def _get(self, c: Container) -> Any:
        """The SDK's container object, or None where the engine no longer has it."""
        client = await self.client()
        try:
            return await asyncio.to_thread(client.containers.get, c.handle)
        except self._docker.errors.NotFound:
            return None
        except self._docker.errors.DockerException as e:
            raise _translate(self._docker, e, self.config, "inspect a container") from e

    async def _stop(self, c: Container) -> None:
        ctr = await self._get(c)
        if ctr is not None:
            await self._remove(ctr)
        self._pids.pop(c.id, None)

    def cpu_seconds(self, c: Container) -> float | None:
        """The CPU time of the container's server, read from ``/proc`` by the host pid the
        engine reported, where this process sees that pid as the container's: its cgroup
        names the container. An engine on another host, or a pool in another pid namespace
        (a container with the engine's socket), sees pids that are not the container's
        (another process, or none): those are never read, and the probe is off (None)."""
        pid = self._pids.get(c.id)
        if pid is None or not _in_container(pid, str(c.handle)):
            return None
        return proc_cpu_seconds(pid)

    async def _remove(self, ctr: Any) -> None:
        try:
            await asyncio.to_thread(ctr.remove, force=True)
        except self._docker.errors.NotFound:
            pass  # gone already: that is what we wanted
        except self._docker.errors.DockerException as e:
            raise _translate(self._docker, e, self.config, "remove a container") from e

    async def _alive(self, c: Container) -> bool:
        ctr = await self._get(c)
        return ctr is not None and ctr.status == "running"

    async def reap_orphans(self) -> list[str]:
        """Remove envpool containers whose owner is gone: a process of this host that
        exited (a crashed trainer). Those of other hosts sharing the engine are left alone
        (their owner's liveness cannot be seen from here). Returns the ids removed."""
        client = await self.client()
        labels = [f"{k}={v}" for k, v in MANAGED_BY.items()]
        ctrs = await self._sdk("list containers", client.containers.list, all=True, filters={"label": labels})
        reaped = []
        for ctr in ctrs:
            if not owner_gone((ctr.labels or {}).get(OWNER_LABEL, "")):
                continue
            await self._remove(ctr)
            reaped.append(ctr.id)
        self.metrics["reaped_orphans"] += len(reaped)
        return reaped

    async def aclose(self) -> None:
        await super().aclose()
        if self.live or self.leaked:  # a stop failed again: the exit hook tries once more, with this client
            return
        _RUNTIMES.discard(self)
        if self._client is not None:
            await asyncio.to_thread(self._client.close)
            self._client = None
