"""The embedded default runtime: each container is an ``envpool.server`` in its own
session (process group), its own network namespace where the kernel allows, under
resource limits, with a private directory for its socket and scratch files.

With ``zygote=True`` (the default) containers are forked from a pre-imported zygote
(``envpool.zygote``): a few ms per container instead of an interpreter start."""

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
from typing import Any

from envpool.errors import ContainerStartError
from envpool.runtimes.base import Container, ProcessRuntimeConfig, Runtime

_LIVE_GROUPS: set[int] = set()
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@atexit.register
def _kill_leftovers() -> None:
    # exit backstop: a pool that was never closed still leaves no container behind
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


def _child_env(cdir: Path) -> dict[str, str]:
    # no cloud credentials inside a container; its scratch space is its own directory
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MODAL_", "RAY_"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TMPDIR=str(cdir), HOME=str(cdir))
    return env


class _Zygote:
    """The pool's handle on ``python -m envpool.zygote``."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.exited: set[int] = set()
        self.ids = itertools.count(1)
        self.reader: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.cwds: dict[int, Path] = {}

    async def ensure(self) -> None:
        async with self.lock:  # concurrent first starts must share one zygote
            if self.proc is None or self.proc.returncode is not None:
                await self._spawn()

    async def _spawn(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "envpool.zygote", str(os.getpid())),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_env(Path(tempfile.gettempdir())),
            start_new_session=True,
        )
        _LIVE_GROUPS.add(self.proc.pid)
        self.reader = asyncio.get_running_loop().create_task(self._read(self.proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            msg = json.loads(line)
            if "exit" in msg:
                self.exited.add(int(msg["exit"]))
                _LIVE_GROUPS.discard(int(msg["exit"]))
                continue
            req = int(msg["req"])
            cwd = self.cwds.pop(req, None)
            fut = self.waiting.pop(req, None)
            if fut is None or fut.done():
                # its claim was cancelled (an aborted rollout) or timed out: nobody will own
                # this container, so it must not outlive the moment it reports in
                if "pid" in msg:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(int(msg["pid"]), signal.SIGKILL)
                if cwd is not None:
                    shutil.rmtree(cwd, ignore_errors=True)
                continue
            fut.set_result(msg)
        for fut in self.waiting.values():  # the zygote died: its children died with it
            if not fut.done():
                fut.set_exception(ContainerStartError("the zygote exited; it will be restarted"))
        self.waiting.clear()

    async def fork(self, opts: dict[str, Any], cwd: Path) -> dict[str, Any]:
        await self.ensure()
        assert self.proc is not None and self.proc.stdin is not None
        req = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[req] = fut
        self.cwds[req] = cwd
        line = json.dumps(
            {"req": req, "opts": opts, "cwd": str(cwd), "env": {"TMPDIR": str(cwd), "HOME": str(cwd)}}
        )
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()
        return await fut

    async def aclose(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
            _LIVE_GROUPS.discard(self.proc.pid)
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)


class ProcessRuntime(Runtime):
    kind = "process"

    def __init__(self, config: ProcessRuntimeConfig | None = None):
        super().__init__()
        self.config = config or ProcessRuntimeConfig()
        self._own_root = self.config.root is None
        self.root = Path(self.config.root or tempfile.mkdtemp(prefix="envpool-"))
        self._ids = itertools.count(1)
        self._zygote = _Zygote() if self.config.zygote else None

    def _opts(self, sock: Path, bundle: Path | None) -> dict[str, Any]:
        cfg = self.config
        return {
            "sock": str(sock),
            "bundle": str(bundle) if bundle is not None else None,
            "heartbeat_s": cfg.heartbeat_s,
            "limits": cfg.limits.model_dump(),
            "fault": cfg.faults.model_dump(),
            "netns": cfg.network_namespace,
        }

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        cid = f"p{os.getpid()}-{next(self._ids)}"
        cdir = self.root / cid
        cdir.mkdir(parents=True)
        sock = cdir / "s"  # short: Unix socket paths are limited to 108 bytes
        opts = self._opts(sock, bundle)
        if self._zygote is not None:
            info = await self._zygote.fork(opts, cdir)
            pid = int(info["pid"])
            _LIVE_GROUPS.add(pid)
            c = Container(id=cid, endpoint=str(sock), image=image, runtime=self.kind, pid=pid)
            if "error" in info:
                await self._stop(c)
                raise ContainerStartError(f"container {cid} failed to start: {info['error']}")
        else:
            c = await self._exec(cid, cdir, opts, image)
            info = {"isolation": c.isolation}
        c.isolation = info.get("isolation", "none")
        return c

    async def _exec(self, cid: str, cdir: Path, opts: dict[str, Any], image: str | None) -> Container:
        """A fresh interpreter per container (``zygote=False``)."""
        cmd = [
            sys.executable,
            "-m",
            "envpool.server",
            "--sock",
            opts["sock"],
            "--parent-pid",
            str(os.getpid()),
        ]
        cmd += ["--heartbeat-s", str(opts["heartbeat_s"]), "--limits", json.dumps(opts["limits"])]
        cmd += ["--fault", json.dumps(opts["fault"])]
        if opts["bundle"]:
            cmd += ["--bundle", opts["bundle"]]
        if not opts["netns"]:
            cmd.append("--no-netns")
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=_child_env(cdir),
            cwd=str(cdir),
            start_new_session=True,  # its own process group: killed as a whole
        )
        _LIVE_GROUPS.add(proc.pid)
        c = Container(
            id=cid, endpoint=opts["sock"], image=image, runtime=self.kind, pid=proc.pid, handle=proc
        )
        assert proc.stdout is not None
        try:
            line = await proc.stdout.readline()
            info = json.loads(line) if line else {}
        except (ValueError, asyncio.CancelledError):
            await self._stop(c)
            raise
        if not info.get("ready"):
            await self._stop(c)
            raise ContainerStartError(
                f"container {cid} exited before it was ready (exit code {proc.returncode})"
            )
        c.isolation = info.get("isolation", "none")
        return c

    async def _stop(self, c: Container) -> None:
        if c.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.pid, signal.SIGKILL)
            _LIVE_GROUPS.discard(c.pid)
        if c.handle is not None:
            await c.handle.wait()
        shutil.rmtree(Path(c.endpoint).parent, ignore_errors=True)

    def cpu_seconds(self, c: Container) -> float | None:
        if c.pid is None:
            return None
        try:
            with open(f"/proc/{c.pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None
        # past the command name (which may hold spaces or parentheses): state is field 3,
        # utime and stime fields 14 and 15, in clock ticks; the process's threads summed
        fields = stat.rpartition(b")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS

    async def _alive(self, c: Container) -> bool:
        if c.handle is not None:
            return c.handle.returncode is None
        return self._zygote is not None and c.pid not in self._zygote.exited

    async def aclose(self) -> None:
        await super().aclose()
        if self._zygote is not None:
            await self._zygote.aclose()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)
