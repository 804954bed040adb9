"""The ``Runtime`` ABC: starts and stops containers that run ``envpool.server``.

The public lifecycle (``start``/``stop``/``aclose``) lives here and handles timeouts,
metrics and idempotence; a runtime implements ``_start``/``_stop``/``_alive``. Whatever a
runtime starts, the pool talks to it over the session protocol at ``Container.endpoint``.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from envpool.errors import ContainerStartError


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Limits(_Config):
    as_bytes: int = 4 * 1024**3
    """Address space of the container's server process."""
    nofile: int = 1024
    fsize_bytes: int = 1024**3
    cpu_s: int = 0
    """CPU seconds (0: no limit; a long-lived container would hit any fixed one)."""


class ContainerFaults(_Config):
    """Chaos for benchmarks and tests, applied inside the container."""

    crash_rate: float = Field(0.0, ge=0, le=1)
    """Probability that a request kills the container."""
    hang_rate: float = Field(0.0, ge=0, le=1)


class ProcessRuntimeConfig(_Config):
    """The embedded default: a container is an isolated process group on this machine."""

    type: Literal["process"] = "process"
    root: Path | None = None
    """Where container directories (socket, scratch) go; default: a temp dir."""
    network_namespace: bool = True
    """Give each container its own (empty) network namespace where the kernel allows."""
    limits: Limits = Field(default_factory=Limits)
    zygote: bool = True
    """Fork containers from a pre-imported zygote (ms) instead of a fresh interpreter (~200 ms)."""
    heartbeat_s: float = Field(0.5, gt=0)
    start_timeout_s: float = Field(30.0, gt=0)
    faults: ContainerFaults = Field(default_factory=ContainerFaults)


RuntimeConfig = Annotated[ProcessRuntimeConfig, Field(discriminator="type")]
_adapter: TypeAdapter[Any] = TypeAdapter(RuntimeConfig)


@dataclass
class Container:
    id: str
    endpoint: str
    """Unix socket path of its server."""
    image: str | None
    runtime: str
    pid: int | None = None
    isolation: str = "none"
    started_at: float = field(default_factory=time.monotonic)
    episodes: int = 0
    failed: bool = False
    reaped: bool = False
    last_active: float = field(default_factory=time.monotonic)
    """Last request of the session holding it: the reaper's clock."""
    handle: Any = None
    """Runtime-private (a Popen, a pod name, a sandbox id)."""


class Runtime(ABC):
    kind: ClassVar[str]

    def __init__(self) -> None:
        self.live: dict[str, Container] = {}
        self.metrics: Counter[str] = Counter()

    async def start(self, image: str | None, bundle: Path | None, *, timeout_s: float) -> Container:
        t0 = time.monotonic()
        try:
            c = await asyncio.wait_for(self._start(image, bundle), timeout_s)
        except TimeoutError:
            self.metrics["start_timeouts"] += 1
            raise ContainerStartError(
                f"{self.kind}: container for {image or 'built-ins'} not ready in {timeout_s} s"
            ) from None
        except ContainerStartError:
            self.metrics["start_failures"] += 1
            raise
        self.live[c.id] = c
        self.metrics["started"] += 1
        self.metrics["start_ms_total"] += int((time.monotonic() - t0) * 1e3)
        return c

    async def stop(self, c: Container) -> None:
        if self.live.pop(c.id, None) is None:
            return
        self.metrics["stopped"] += 1
        await asyncio.shield(self._stop(c))

    async def alive(self, c: Container) -> bool:
        return c.id in self.live and await self._alive(c)

    async def aclose(self) -> None:
        await asyncio.gather(*(self.stop(c) for c in list(self.live.values())), return_exceptions=True)

    @abstractmethod
    async def _start(self, image: str | None, bundle: Path | None) -> Container: ...

    @abstractmethod
    async def _stop(self, c: Container) -> None: ...

    @abstractmethod
    async def _alive(self, c: Container) -> bool: ...


def make_runtime(config: Any) -> Runtime:
    """A runtime from its config (or a dict with a ``type``). Other kinds plug in here."""
    cfg = config if isinstance(config, ProcessRuntimeConfig) else _adapter.validate_python(config)
    from envpool.runtimes.process import ProcessRuntime

    return ProcessRuntime(cfg)
