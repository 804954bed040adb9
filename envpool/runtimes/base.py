"""The ``Runtime`` ABC: starts and stops containers that run ``envpool.server``.

The public lifecycle (``start``/``stop``/``aclose``) lives here and handles timeouts,
metrics and idempotence; a runtime implements ``_start``/``_stop``/``_alive``. Whatever a
runtime starts, the pool talks to it over the session protocol at ``Container.endpoint``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from envpool.errors import ContainerStartError

log = logging.getLogger(__name__)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Config):
    """Resource limits of a container's server process; 0 means no limit. (A negative one
    is refused: setrlimit read it as no limit, silently.)"""

    as_bytes: int = Field(4 * 1024**3, ge=0)
    """Address space of the container's server process."""
    nofile: int = Field(1024, ge=0)
    fsize_bytes: int = Field(1024**3, ge=0)
    cpu_s: int = Field(0, ge=0)
    """CPU seconds (0: no limit; a long-lived container would hit any fixed one)."""


class ContainerFaults(_Config):
    """Chaos for benchmarks and tests, applied inside the container."""

    crash_rate: float = Field(0.0, ge=0, le=1)
    """Probability that a request kills the container."""
    hang_rate: float = Field(0.0, ge=0, le=1)


class _RuntimeCommon(_Config):
    heartbeat_s: float = Field(0.5, gt=0)
    """How often a container's server heartbeats while a request runs."""
    start_timeout_s: float = Field(30.0, gt=0)
    faults: ContainerFaults = Field(default_factory=ContainerFaults)


class ProcessRuntimeConfig(_RuntimeCommon):
    """The embedded default: a container is an isolated process group on this machine."""

    type: Literal["process"] = "process"
    root: Path | None = None
    """Where container directories (socket, scratch) go; default: a temp dir."""
    network_namespace: bool = True
    """Give each container its own (empty) network namespace where the kernel allows."""
    limits: Limits = Field(default_factory=Limits)
    memory_layer_bytes: int = Field(1024**3, ge=0)
    """Where ``root``'s file system takes no overlay upper dir (overlayfs: /tmp and the root
    in a Docker container), each container's writable layer over its image is a tmpfs of at
    most this many bytes and one file per 4 KiB of them (ENOSPC past either), in memory,
    charged to its memory cgroup, gone with
    it; elsewhere the layer is on disk, in its directory. 0: no layer in memory, the image
    read-only there (EROFS). ``Container.image_layer`` says which a container got.
    (``envpool.isolation.private_view``)"""
    zygote: bool = True
    """Fork containers from a pre-imported zygote (ms) instead of a fresh interpreter (~200 ms)."""


# an OCI image reference, as registries and engines parse it (distribution/reference):
# [domain[:port]/]path[/path...][:tag][@algorithm:hex]
_HOST_PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_DOMAIN = rf"(?:{_HOST_PART}(?:\.{_HOST_PART})*(?::[0-9]+)?/)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_OCI_REF = re.compile(
    rf"^(?P<name>{_DOMAIN}{_PATH}(?:/{_PATH})*)(?::[\w][\w.-]{{0,127}})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)


class _RemoteCommon(_RuntimeCommon):
    """Runtimes whose containers run an OCI image with rl-fabric installed and serve the
    session protocol over TCP; a custom environment image (a bundle) is fetched by the
    container's server from ``image_source`` (an HTTP mirror or origin of bundles)."""

    image: str = "rl-fabric-env:latest"
    """OCI image with rl-fabric installed; its command is replaced by ``python -m envpool.server``."""
    port: int = Field(7000, ge=1, le=65535)
    """Port the server listens on inside the container."""
    image_source: str | None = None
    """Base URL (``GET {url}/blobs/sha256:<hex>``) the container fetches bundles from."""

    @field_validator("image")
    @classmethod
    def _oci_reference(cls, v: str) -> str:
        # checked here, once: the engine ("invalid reference format"), the kubelet
        # (InvalidImageName) and Modal refuse it on each container, a start failure retried
        # on every claim
        m = _OCI_REF.match(v)
        if m is None or len(m["name"]) > 255:
            raise ValueError(
                f"image {v!r} is not an OCI image reference ([registry/]name[:tag][@sha256:...], "
                "the name in lowercase)"
            )
        return v

    @field_validator("image_source")
    @classmethod
    def _http_source(cls, v: str | None) -> str | None:
        # checked here, once: each container's server would fail to fetch from it and exit,
        # a start failure retried on every claim
        if v is not None:
            try:
                url = urlsplit(v)
                ok = url.scheme in ("http", "https") and bool(url.hostname)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"image_source {v!r} must be an http:// or https:// URL with a host")
        return v

    image_max_blob_bytes: int = Field(2 * 2**30, gt=0)
    """The most bytes of a bundle the container downloads from ``image_source`` (its HTTP
    tier's ``max_blob_bytes``, 2 GiB by default): raise it for an image that big."""
    image_max_unpacked_bytes: int = Field(8 * 2**30, gt=0)
    """The most a bundle the container fetched may unpack to (its cache's
    ``max_unpacked_bytes``, 8 GiB by default): raise it for an image that big."""
    # (the cache's defaults, written out: importing envpool.images here costs every pool
    # httpx and the cache, which a pool of built-in environments never uses)

    cpu: float = Field(1.0, gt=0)
    memory_mb: int = Field(1024, ge=64)
    env: dict[str, str] = Field(default_factory=dict)


_K8S_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def k8s_label_problem(key: str, value: str) -> str | None:
    """Why the API server would refuse the pod label ``key: value`` (422 Invalid), or None.
    Kubernetes' rules: a key is a name of at most 63 characters (alphanumerics, ``-_.``,
    alphanumeric at both ends) with an optional DNS-subdomain prefix and ``/``; a value is
    empty or such a name."""
    rule = "at most 63 alphanumerics, '-', '_' or '.', alphanumeric at both ends"
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not all(_DNS1123_LABEL.match(p) for p in prefix.split("."))):
        return f"label key {key!r}: its prefix must be a lowercase DNS subdomain"
    if len(name) > 63 or not _K8S_NAME.match(name):
        return f"label key {key!r}: {rule}"
    if value and (len(value) > 63 or not _K8S_NAME.match(value)):
        return f"label {key!r} value {value!r}: {rule}"
    return None


class KubernetesRuntimeConfig(_RemoteCommon):
    """Each container is a pod, created through the official Kubernetes client."""

    type: Literal["kubernetes"] = "kubernetes"
    namespace: str = "default"
    kubeconfig: str | None = None
    """Path of a kubeconfig; None: in-cluster config, else ~/.kube/config."""
    host: str | None = None
    """API server URL, overriding the kubeconfig's server (its credentials kept); without a
    kubeconfig, an API server without auth (tests point this at the fake API)."""
    labels: dict[str, str] = Field(default_factory=dict)
    service_account: str | None = None

    @field_validator("labels")
    @classmethod
    def _valid_labels(cls, v: dict[str, str]) -> dict[str, str]:
        # checked here, once: the API server refuses such a pod (422), a start failure
        # retried on every claim
        for key, value in v.items():
            if (problem := k8s_label_problem(key, value)) is not None:
                raise ValueError(problem)
        return v

    @field_validator("namespace")
    @classmethod
    def _valid_namespace(cls, v: str) -> str:
        if len(v) > 63 or not _DNS1123_LABEL.match(v):
            raise ValueError(f"namespace {v!r} is not a DNS-1123 label (lowercase, digits, '-'; at most 63)")
        return v

    start_timeout_s: float = Field(120.0, gt=0)
    image_pull_grace_s: float = Field(60.0, ge=0)
    """How long a pod's image pull may keep failing (ErrImagePull, ImagePullBackOff: a
    registry's 5xx, a timeout, a rate limit, which the kubelet retries after a back-off of
    10 s, 20 s, 40 s...) before its start fails, naming the image and the kubelet's reason. A
    pull the registry answers with not found or access denied fails it at once, not retried
    (``EnvUsageError``); 0: any other fails the start at once too, as a retryable failure."""


class DockerRuntimeConfig(_RemoteCommon):
    """Each container is a Docker container on the local engine (docker SDK)."""

    type: Literal["docker"] = "docker"
    base_url: str | None = None
    """Docker engine URL; None: the environment's (DOCKER_HOST or the local socket). The
    engine must run on this machine: a container's port is published on the engine host's
    loopback, which a remote engine's (``tcp://``, ``ssh://``) is not."""
    network: str | None = None


class ModalRuntimeConfig(_RemoteCommon):
    """Each container is a ``modal.Sandbox``; a sandbox is found again by its id."""

    type: Literal["modal"] = "modal"
    app_name: str = "rl-fabric-envs"
    timeout_s: int = Field(3600, ge=10, le=86400)
    """Sandbox lifetime (Modal allows up to 24 h; it ends the sandbox then, whatever it runs).
    Within its last tenth (at most 5 min) a sandbox is retired at a claim or an idle probe,
    not handed to an episode."""

    @field_validator("env")
    @classmethod
    def _modal_env_names(cls, v: dict[str, str]) -> dict[str, str]:
        # Modal refuses the sandbox of any other name (InvalidError), on every start
        for key in v:
            if not re.match(r"^[a-zA-Z_][a-zA-Z0-9_]*$", key):
                raise ValueError(f"env name {key!r}: Modal allows letters, digits and '_' only")
        return v

    block_network: bool = False
    """True cuts the sandbox's outbound traffic (an empty outbound allow-list: Modal refuses
    ``block_network`` itself with the tunnel's open port); the tunnel still serves. Its server
    cannot fetch a bundle from ``image_source`` then: built-in environments only."""


RuntimeConfig = Annotated[
    ProcessRuntimeConfig | KubernetesRuntimeConfig | DockerRuntimeConfig | ModalRuntimeConfig,
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Any] = TypeAdapter(RuntimeConfig)


@dataclass
class Container:
    id: str
    endpoint: str
    """Where its server listens: a Unix socket path, or ``tcp://host:port``."""
    image: str | None
    runtime: str
    pid: int | None = None
    isolation: str = "none"
    image_view: str | None = None
    """How it sees its image's bundle (process runtime): ``"overlay"``, the bundle under a
    writable layer of its own (in its directory, or a tmpfs where that directory's file system
    takes no overlay layer: ``ProcessRuntimeConfig.memory_layer_bytes``); ``"read-only"``,
    the bundle read-only; ``"shared"``, the
    cache's directory itself, which its writes change for every later container (no mount
    namespace to be had). None: the runtime's containers have images of their own."""
    image_layer: str | None = None
    """Where an ``"overlay"`` view's writes go: ``"disk"``, its directory under the runtime's
    root; ``"memory"``, a tmpfs (that root's file system takes no overlay layer, as overlayfs
    in a Docker container does not), so what it writes holds RAM, charged to its memory
    cgroup, up to ``ProcessRuntimeConfig.memory_layer_bytes``; or that directory where the
    root is on a tmpfs itself (/tmp on many hosts), whose size bounds it. None: no layer (any
    other view)."""
    started_at: float = field(default_factory=time.monotonic)
    episodes: int = 0
    failed: bool = False
    reaped: bool = False
    last_active: float = field(default_factory=time.monotonic)
    """Last request of the session holding it: the reaper's clock."""
    in_flight: int = 0
    """Requests of the session holding it under way: the reaper leaves it alone meanwhile
    (a request ends by its own timeout; one slower than ``session_ttl_s`` is no leak)."""
    handle: Any = None
    """Runtime-private (a Popen, a pod name, a sandbox id)."""


class Runtime(ABC):
    kind: ClassVar[str]
    #: True when containers run on this machine and take an unpacked bundle directory; a
    #: remote runtime passes the image digest and its container fetches the bundle itself.
    uses_local_bundle: ClassVar[bool] = True
    #: How often the pool probes its idle containers (``alive``) to drop and replace the
    #: ones that died waiting: a remote container's probe is an API call, so seldom (a claim
    #: probes the container it takes all the same). None: never, ``known_dead`` tells.
    idle_probe_s: ClassVar[float | None] = 10.0

    def __init__(self) -> None:
        self.live: dict[str, Container] = {}
        """Containers started and not yet confirmed stopped (a failed stop stays here): what
        the pool counts against ``max_containers``."""
        self.leaked: dict[str, Container] = {}
        """Containers the pool gave up stopping (``abandon``): they no longer hold a slot, and
        ``aclose`` (and the runtime's exit hook) still try to stop them once more."""
        self.metrics: Counter[str] = Counter()
        self._stopping: dict[str, asyncio.Task[None]] = {}
        self.close_timeout_s: float | None = None
        """How long ``aclose`` waits for the stops it makes (``None``: as long as they take);
        the pool sets its ``stop_timeout_s``, so a stop that hangs cannot hang its close."""
        self.closed = False
        """``aclose`` began: ``start`` refuses from then on (what a start made after the
        close had stopped everything would run on, owned by nobody)."""
        self._waits: dict[asyncio.Task[Any], str] = {}
        """Start task -> what it waits for now (``_waiting_for``), said when it times out."""

    async def start(self, image: str | None, bundle: Path | None, *, timeout_s: float) -> Container:
        if self.closed:
            raise ContainerStartError(f"{self.kind}: the runtime is closed")
        t0 = time.monotonic()
        try:
            c = await self._start_within(image, bundle, timeout_s)
        except TimeoutError as e:
            self.metrics["start_timeouts"] += 1
            hint = getattr(e, "waiting_for", None)
            raise ContainerStartError(
                f"{self.kind}: container for {image or 'built-ins'} not ready in {timeout_s:g} s"
                + (f": still waiting for {hint}" if hint else "")
            ) from None
        except ContainerStartError:
            self.metrics["start_failures"] += 1
            raise
        self.live[c.id] = c
        if self.closed:
            # it started while the close stopped everything it knew: nothing else would stop
            # it. (A stop that fails leaves it live, for the exit hook or the reaper.)
            with contextlib.suppress(Exception):
                await self.stop(c)
            raise ContainerStartError(f"{self.kind}: the runtime was closed while a container started")
        self.metrics["started"] += 1
        self.metrics["start_ms_total"] += int((time.monotonic() - t0) * 1e3)
        return c

    async def _start_within(self, image: str | None, bundle: Path | None, timeout_s: float) -> Container:
        """``_start`` bounded by ``timeout_s``, in a task of its own: a second cancellation
        (an aborted claim, then a closing pool) cannot cut short the cleanup of what it was
        creating. Not ``wait_for``: on Python 3.11 it returns a start that ended in the loop
        turn its caller was cancelled, and the cancellation is lost (the claim runs on)."""
        task = asyncio.ensure_future(self._start_open(image, bundle))
        self._waits[task] = ""
        task.add_done_callback(lambda t: self._waits.pop(t, None))
        try:
            done, _ = await asyncio.wait((task,), timeout=timeout_s)
        except asyncio.CancelledError:
            if not task.done():
                task.cancel()  # it cleans up what it made; waited for unless cancelled again
                await asyncio.wait((task,))
            if task.done() and not task.cancelled() and task.exception() is None:
                # it ended just as we were cancelled: nobody will own it, stop it (shielded).
                # A stop that fails must not take the cancellation's place (a session's
                # recovery would retry it as an infra fault); it stays live, tried again at close
                c = task.result()
                self.live[c.id] = c
                with contextlib.suppress(Exception):
                    await self.stop(c)
            raise
        if not done:
            hint = self._waits.get(task)  # (read first: the task's end forgets it)
            task.cancel()
            await asyncio.wait((task,))
            if task.cancelled() or task.exception() is not None:
                timeout = TimeoutError()
                timeout.waiting_for = hint  # type: ignore[attr-defined]
                raise timeout
            c = task.result()  # ended as the timeout fired: stopped, as a start too late
            self.live[c.id] = c
            with contextlib.suppress(Exception):  # (a failed stop: live, tried again at close)
                await self.stop(c)
            raise TimeoutError
        return task.result()

    async def _start_open(self, image: str | None, bundle: Path | None) -> Container:
        # checked again where ``_start`` begins, a loop turn after ``start``'s check: a close
        # in between would find nothing to stop, and a runtime's first start makes what its
        # close removes (the process runtime's directory and zygote)
        if self.closed:
            raise ContainerStartError(f"{self.kind}: the runtime is closed")
        return await self._start(image, bundle)

    def _waiting_for(self, what: str) -> None:
        """Say what the start running in this task waits for now (a pod to be scheduled, a
        pull, a server to listen, and where to look): a start that times out says it, not
        only that it timed out. (The pool's timeout is the runtime's ``start_timeout_s``,
        so it comes before any wait of the runtime's own with that budget.)"""
        task = asyncio.current_task()
        if task in self._waits:  # (a start's own task; none other is ever forgotten)
            self._waits[task] = what

    async def stop(self, c: Container) -> None:
        """Stop ``c``: idempotent, concurrent calls share one stop, and a cancelled caller
        does not interrupt it. ``c`` leaves ``live`` only once ``_stop`` succeeded: a stop
        that failed (an engine or API hiccup) is tried again by ``aclose`` (and the
        runtime's exit hook) instead of being forgotten with the container still running."""
        if c.id not in self.live and c.id not in self.leaked:
            return
        task = self._stopping.get(c.id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._stop_tracked(c))
            self._stopping[c.id] = task
            task.add_done_callback(lambda t: self._stop_done(c.id, t))
        await asyncio.shield(task)

    async def _stop_tracked(self, c: Container) -> None:
        await self._stop(c)
        self.live.pop(c.id, None)
        self.leaked.pop(c.id, None)
        self.metrics["stopped"] += 1

    def stopping(self, c: Container) -> bool:
        """True while a stop of ``c`` is under way (one that hangs, say)."""
        return c.id in self._stopping

    def abandon(self, c: Container) -> bool:
        """Stop counting ``c`` as live: its stop kept failing, and a container that cannot be
        stopped must not hold a pool slot for the rest of a run. It moves to ``leaked``,
        where ``aclose`` (and the exit hook) try again. False if it was not live."""
        if self.live.pop(c.id, None) is None:
            return False
        self.leaked[c.id] = c
        self.metrics["leaked"] += 1
        return True

    def _stop_done(self, cid: str, task: asyncio.Task[None]) -> None:
        self._stopping.pop(cid, None)
        # read here: the caller it was shielded from may be gone (cancelled)
        if not task.cancelled() and task.exception() is not None:
            self.metrics["stop_failures"] += 1

    async def alive(self, c: Container) -> bool:
        return c.id in self.live and await self._alive(c)

    def known_dead(self, c: Container) -> bool:
        """``c`` is known to have exited from what this runtime learns without asking anyone
        (a local child's exit): the pool reads it on every housekeeping tick. False where
        only a probe (``alive``) could tell."""
        return False

    async def aclose(self) -> None:
        """Stop everything started; ``start`` refuses from now on. A runtime that overrides
        it calls it first."""
        self.closed = True
        everything = [*self.live.values(), *self.leaked.values()]
        if not everything:
            return
        stops = [asyncio.ensure_future(self.stop(c)) for c in everything]
        done, pending = await asyncio.wait(stops, timeout=self.close_timeout_s)
        for f in done:
            f.exception()  # read: a failed stop stays in live/leaked, which is what tells
        if not pending:
            return
        # a stop that hangs (an engine or API that never answers) must not hang the close:
        # what is left stays in live/leaked, for the exit hook (docker) or the reaper
        for f in pending:
            f.cancel()
        for c in everything:
            if (task := self._stopping.get(c.id)) is not None:
                task.cancel()
        left = [c.id for c in everything if c.id in self.live or c.id in self.leaked]
        self.metrics["close_stop_timeouts"] += len(left)
        log.warning(
            "envpool: %s runtime: %d container(s) did not stop within %g s of closing: %s",
            self.kind,
            len(left),
            self.close_timeout_s,
            ", ".join(left),
        )

    def cpu_seconds(self, c: Container) -> float | None:
        """CPU time ``c``'s process has used, where this runtime can read it cheaply (a local
        process, a container of a docker engine on this host); ``None`` where it cannot (a
        pod, a sandbox: only metrics APIs far coarser than a heartbeat period have it). The
        session's connection reads it when heartbeats stop: a process still on the CPU is
        busy in code that holds the interpreter lock (the environment hangs), one that is
        not is frozen (the infrastructure)."""
        return None

    async def reap_orphans(self) -> list[str]:
        """Remove containers left behind by owners that are gone (a crashed trainer);
        return what was removed. Local runtimes need nothing: their containers die with
        their parent."""
        return []

    @abstractmethod
    async def _start(self, image: str | None, bundle: Path | None) -> Container: ...

    @abstractmethod
    async def _stop(self, c: Container) -> None: ...

    @abstractmethod
    async def _alive(self, c: Container) -> bool: ...


def proc_stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` from the third (the state) on; None if it cannot
    be read (gone). They are read past the command name, which may hold spaces or
    parentheses: field N of proc(5) is item N - 3."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rpartition(b")")[2].split()


def proc_cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` of this machine has used (its threads summed), from
    ``/proc``; None if it cannot be read (gone)."""
    fields = proc_stat_fields(pid)
    if fields is None:
        return None
    # utime and stime are fields 14 and 15, in clock ticks
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def make_runtime(config: Any) -> Runtime:
    """A runtime from its config (or a dict with a ``type``); SDKs are imported only by the
    runtime that needs them."""
    cfg = config if isinstance(config, BaseModel) else _adapter.validate_python(config)
    if isinstance(cfg, KubernetesRuntimeConfig):
        from envpool.runtimes.kubernetes import KubernetesRuntime

        return KubernetesRuntime(cfg)
    if isinstance(cfg, DockerRuntimeConfig):
        from envpool.runtimes.docker import DockerRuntime

        return DockerRuntime(cfg)
    if isinstance(cfg, ModalRuntimeConfig):
        from envpool.runtimes.modal_ import ModalRuntime

        return ModalRuntime(cfg)
    from envpool.runtimes.process import ProcessRuntime

    assert isinstance(cfg, ProcessRuntimeConfig)
    return ProcessRuntime(cfg)
