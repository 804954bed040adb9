"""The embedded default runtime: each container is ``python -m envpool.server`` in its own
session (process group), its own network namespace where the kernel allows, under
resource limits, with a private directory for its socket and scratch files."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from envpool.errors import ContainerStartError
from envpool.runtimes.base import Container, ProcessRuntimeConfig, Runtime

_LIVE_GROUPS: set[int] = set()


@atexit.register
def _kill_leftovers() -> None:
    # exit backstop: a pool that was never closed still leaves no container behind
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


class ProcessRuntime(Runtime):
    kind = "process"

    def __init__(self, config: ProcessRuntimeConfig | None = None):
        super().__init__()
        self.config = config or ProcessRuntimeConfig()
        self._own_root = self.config.root is None
        self.root = Path(self.config.root or tempfile.mkdtemp(prefix="envpool-"))
        self._ids = itertools.count(1)

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        cid = f"p{os.getpid()}-{next(self._ids)}"
        cdir = self.root / cid
        cdir.mkdir(parents=True)
        sock = cdir / "s"  # short: Unix socket paths are limited to 108 bytes
        cfg = self.config
        cmd = [sys.executable, "-m", "envpool.server", "--sock", str(sock), "--parent-pid", str(os.getpid())]
        cmd += ["--heartbeat-s", str(cfg.heartbeat_s), "--limits", cfg.limits.model_dump_json()]
        cmd += ["--fault", cfg.faults.model_dump_json()]
        if bundle is not None:
            cmd += ["--bundle", str(bundle)]
        if not cfg.network_namespace:
            cmd.append("--no-netns")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MODAL_", "RAY_"))}
        env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TMPDIR=str(cdir), HOME=str(cdir))
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=env,
            cwd=str(cdir),
            start_new_session=True,  # its own process group: killed as a whole
        )
        _LIVE_GROUPS.add(proc.pid)
        c = Container(id=cid, endpoint=str(sock), image=image, runtime=self.kind, pid=proc.pid, handle=proc)
        assert proc.stdout is not None
        try:
            line = await proc.stdout.readline()
            info = json.loads(line) if line else {}
        except (ValueError, asyncio.CancelledError):
            await self._stop(c)
            raise
        if not info.get("ready"):
            code = await self._kill(c)
            raise ContainerStartError(f"container {cid} exited before it was ready (exit code {code})")
        c.isolation = info.get("isolation", "none")
        return c

    async def _kill(self, c: Container) -> int | None:
        proc = c.handle
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _LIVE_GROUPS.discard(proc.pid)
        return await proc.wait()

    async def _stop(self, c: Container) -> None:
        await self._kill(c)
        shutil.rmtree(Path(c.endpoint).parent, ignore_errors=True)

    async def _alive(self, c: Container) -> bool:
        return c.handle.returncode is None

    async def aclose(self) -> None:
        await super().aclose()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
