"""The embedded default runtime: each container is an ``envpool.server`` in its own
session (process group), its own network namespace where the kernel allows, under
resource limits, with a private directory for its socket and scratch files, and a private
view of its image's bundle there (``envpool.isolation.private_view``). A stop kills
its process group, then what it started outside the group, found by the mark on all its
processes' environments (``envpool.escapees``, which says why a mark and where it fails).

With ``zygote=True`` (the default) containers are forked from a pre-imported zygote
(``envpool.zygote``): a few ms per container instead of an interpreter start. The root of
the containers' directories, its owner's lock on it, and the reaping of those whose owners
are gone: ``envpool.runtimes._process_root``."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envpool import escapees, isolation
from envpool.errors import ContainerStartError
from envpool.runtimes._process_root import make_root, reap_dead_roots
from envpool.runtimes.base import Container, ProcessRuntimeConfig, Runtime, proc_cpu_seconds

_LIVE_GROUPS: set[int] = set()
_LIVE_MARKS: set[str] = set()
"""The marks (``envpool.escapees``) of the containers not swept yet (a sweep that failed
leaves its marks here, for the exit backstop)."""


@atexit.register
def _kill_leftovers() -> None:
    # exit backstop: a pool that was never closed still leaves no container behind, nor what
    # its containers started outside their groups
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    escapees.sweep(set(_LIVE_MARKS))


log = logging.getLogger(__name__)
_KILL_REPORT_S = 10.0  # how long a stop waits for a killed container's exit report
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its terminating NUL


def _child_env(cdir: Path, mark: str) -> dict[str, str]:
    # no cloud credentials inside a container; its scratch space is its own directory; its
    # mark (a container's token, the zygote's placeholder) is on all it starts
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MODAL_", "RAY_"))}
    env.update(PYTHONPATH=os.pathsep.join(p for p in sys.path if p), TMPDIR=str(cdir), HOME=str(cdir))
    env[escapees.MARK] = mark
    return env


@dataclass(eq=False)
class _Forked:
    """A container the zygote forked (its ``Container.handle``). The pool names it to the
    zygote by the request that forked it, never by pid: once the zygote has reaped it, its
    pid may be another process's (another session's container, after a pid wrap)."""

    req: int
    mark: str
    """Its token (``envpool.escapees``): what bears it is swept by the pool once the zygote
    reports the container reaped (or dead with the zygote), off the zygote's loop."""
    pid: int = 0
    reaped: bool = False
    """The zygote reported it reaped (after killing what was left of its group), or the
    zygote itself died (its children die with it): its pid is no longer its own."""
    swept: asyncio.Future[None] | None = None
    """The sweep of its mark asked for at its exit report."""
    exited: bool = False
    """Reaped, and what bore its mark swept (or its sweep failed: the exit backstop's then)."""


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether a fresh interpreter's container ended, without reaping it: until it is reaped
    its pid, its process group's id, stays ours (``_stop`` may still kill the group)."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


async def _read_line(pipe: Any) -> bytes:
    """The first line of ``pipe``, read on the loop; the pipe is closed after it."""
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    try:
        return await reader.readline()
    finally:
        # the server sends its stdout to stderr after this line: nothing more comes here
        transport.close()


class _Zygote:
    """The pool's handle on ``python -m envpool.zygote``."""

    def __init__(self, sweeps: escapees.Sweeps) -> None:
        self.sweeps = sweeps
        self.proc: asyncio.subprocess.Process | None = None
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.children: dict[int, _Forked] = {}
        """Request id -> the container forked for it, while the zygote has not reported it
        gone: the current zygote's children (each zygote's reader holds its own)."""
        self.ids = itertools.count(1)
        self.reader: asyncio.Task[None] | None = None
        self.lock = asyncio.Lock()
        self.cwds: dict[int, Path] = {}
        self.sent: set[int] = set()
        """The current zygote's requests not answered yet: failed when it dies (each zygote's
        reader holds its own; a start sent to the next one is not the dead one's to fail)."""
        self.ended = False
        """The current zygote's output ended: it is dead, whether or not asyncio has reaped
        it (set its exit code) yet."""
        self.closed = False
        """``aclose`` began: no zygote is spawned from then on."""

    async def ensure(self) -> None:
        async with self.lock:  # concurrent first starts must share one zygote
            if self.closed:  # (a zygote spawned now would outlive the close)
                raise ContainerStartError("the runtime is closed")
            if self.proc is None or self.proc.returncode is not None or self.ended:
                await self._spawn()

    async def _spawn(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "envpool.zygote", str(os.getpid())),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_env(Path(tempfile.gettempdir()), escapees.PLACEHOLDER),
            start_new_session=True,
        )
        _LIVE_GROUPS.add(self.proc.pid)
        self.children, self.sent, self.ended = {}, set(), False
        self.reader = asyncio.get_running_loop().create_task(self._read(self.proc, self.children, self.sent))

    async def _read(
        self, proc: asyncio.subprocess.Process, children: dict[int, _Forked], sent: set[int]
    ) -> None:
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if not isinstance(msg, dict) or ("exit" not in msg and "req" not in msg):
                # not the protocol's (a module the zygote imported printed to stdout): the
                # reader must go on, or every start would wait out start_timeout_s for answers
                # nobody reads from a zygote that lives
                log.warning("zygote: ignored a line of its output that is not a message: %r", line[:200])
                continue
            if "exit" in msg:  # the zygote killed what was left of its group and reaped it
                child = children.pop(int(msg["of"]), None) if msg.get("of") is not None else None
                if child is not None and not child.reaped:
                    child.reaped = True
                    _LIVE_GROUPS.discard(child.pid)
                    # then what it started outside its group: swept here, off the zygote's loop,
                    # asked for in this step (a stop waiting for this report joins the sweep)
                    child.swept = self.sweeps.ask({child.mark})
                    child.swept.add_done_callback(functools.partial(self._swept, child))
                continue
            req = int(msg["req"])
            sent.discard(req)
            cwd = self.cwds.pop(req, None)
            fut = self.waiting.pop(req, None)
            if "pid" in msg and (child := children.get(req)) is not None:
                # (absent: it was reported gone already, its exit read before its answer)
                child.pid = int(msg["pid"])
                _LIVE_GROUPS.add(child.pid)
            if fut is None or fut.done():
                # its claim was cancelled (an aborted rollout) or timed out: nobody will own
                # this container, so it must not outlive the moment it reports in
                if "pid" in msg:
                    self._send({"req": next(self.ids), "kill": req})
                if cwd is not None:
                    isolation.remove_scratch(cwd)
                continue
            fut.set_result(msg)
        # the end of its output is its death (nothing else holds the pipe): a start from now on
        # gets a new zygote at once, not one that waits start_timeout_s for the dead one to
        # answer, as before asyncio had reaped it and set its exit code
        if self.proc is proc:
            self.ended = True
        # its children die with it (PR_SET_PDEATHSIG), but that kills each container's server,
        # not its process group: what an environment started (a subprocess) would run on under
        # init. Their groups are killed here, at once: the groups were the zygote's children's
        # until a moment ago, and a group's id is not given to another process while the
        # group has a member; one emptied meanwhile would need the pid space to wrap around in
        # that moment to be another's. No new zygote starts ours before this (ended is set in
        # this step). (Not a child subreaper instead: that is a setting of the whole process
        # this pool runs in, a trainer, which would inherit every orphan of everything it
        # runs as zombies to reap, and reaping those steals other children's exit statuses.)
        dead = [child for child in children.values() if not child.reaped]
        for child in dead:
            if child.pid:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(child.pid, signal.SIGKILL)
        # and what they started outside their groups, which the zygote did not live to sweep
        # (a container that never reported its pid had a mark all the same). Their pids are
        # no longer theirs, and their stops wait for this sweep (asked for in this step), not
        # for this reader, which waits for it
        swept = self.sweeps.ask({child.mark for child in dead})
        for child in dead:
            child.reaped, child.swept = True, swept
            swept.add_done_callback(functools.partial(self._swept, child))
            _LIVE_GROUPS.discard(child.pid)
        children.clear()
        # the kills it never answered fail now, not with the starts below: a stop waiting for
        # its answer is killing its group (``Sweeps.killing``), which this sweep waits for
        for req in [r for r in sent if r not in self.cwds]:
            sent.discard(req)
            fut = self.waiting.pop(req, None)
            if fut is not None and not fut.done():
                fut.set_exception(ContainerStartError("the zygote exited"))
        with contextlib.suppress(Exception):  # (failed: the marks stay live, for the exit hook)
            await asyncio.shield(swept)
        # reaped: its children were sent SIGKILL as it exited (PR_SET_PDEATHSIG), so what they
        # were starting in their directories has stopped before those go
        await proc.wait()
        _LIVE_GROUPS.discard(proc.pid)
        for req in sorted(sent):  # what it never answered: each start fails without its directory
            cwd = self.cwds.pop(req, None)
            if cwd is not None:
                isolation.remove_scratch(cwd)
            fut = self.waiting.pop(req, None)
            if fut is not None and not fut.done():
                fut.set_exception(ContainerStartError("the zygote exited; it will be restarted"))
        sent.clear()

    def _swept(self, child: _Forked, done: asyncio.Future[None]) -> None:
        child.exited = True
        if done.cancelled() or done.exception() is not None:
            return  # its mark stays live: the exit backstop (and the zygote's end) sweep it
        _LIVE_MARKS.discard(child.mark)
        # the zygote keeps the mark until told, for its own end should we die first
        if self.proc is not None and self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write(json.dumps({"swept": child.req}).encode() + b"\n")

    def _send(self, msg: dict[str, Any]) -> bool:
        if self.proc is None or self.proc.stdin is None or self.proc.stdin.is_closing():
            return False
        self.sent.add(int(msg["req"]))
        self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
        return True

    async def fork(self, opts: dict[str, Any], cwd: Path) -> tuple[dict[str, Any], _Forked]:
        await self.ensure()
        assert self.proc is not None and self.proc.stdin is not None
        req = next(self.ids)
        child = self.children[req] = _Forked(req, escapees.token(cwd))
        _LIVE_MARKS.add(child.mark)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[req] = fut
        self.cwds[req] = cwd
        env = {"TMPDIR": str(cwd), "HOME": str(cwd), escapees.MARK: child.mark}
        self.sent.add(req)
        self.proc.stdin.write(
            json.dumps({"req": req, "opts": opts, "cwd": str(cwd), "env": env}).encode() + b"\n"
        )
        try:
            with contextlib.suppress(ConnectionError):
                # the zygote died (a broken pipe): its reader fails this start at its output's end
                await self.proc.stdin.drain()
            return await fut, child
        except asyncio.CancelledError:
            if fut.cancelled() or not fut.done():  # (the cancellation of `await fut` cancels it)
                # killed now, by the request that forked it (the zygote knows its pid from the
                # fork): one that never reports in (its import hangs) would run on, with what
                # it started, for as long as the zygote. The reader kills it again if it
                # reports in meanwhile, and removes its directory when it is answered for
                fut.cancel()
                self._send({"req": next(self.ids), "kill": req})
            elif fut.exception() is None and "pid" in fut.result():
                # its answer was read in the loop turn that cancelled us: the reader handed the
                # container over and nobody will own it (not live, not counted, no pinned image)
                self._send({"req": next(self.ids), "kill": req})
                isolation.remove_scratch(cwd)
            raise

    async def kill(self, child: _Forked) -> None:
        """Have the zygote kill ``child``'s process group, and wait until it has, and what
        bore its mark is swept. It kills only while ``child`` is its unreaped child: the group
        cannot be another's. Its record goes when the zygote reports it reaped."""
        if not child.reaped and self.reader is not None and not self.reader.done():
            with self.sweeps.killing():  # its sweep joins those of the stops under way
                await self._kill_group(child)
        if child.swept is not None:
            with contextlib.suppress(Exception):  # failed: what bears its mark is the exit hook's
                await asyncio.shield(child.swept)

    async def _kill_group(self, child: _Forked) -> None:
        assert self.reader is not None
        req = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[req] = fut
        try:
            if self._send({"req": req, "kill": child.req}):
                await fut
        except (ContainerStartError, ConnectionError):
            pass  # the zygote died meanwhile: its children died with it
        finally:
            self.waiting.pop(req, None)
        # its answer says SIGKILL was sent, not that the group is gone: a container (one frozen
        # by SIGSTOP too) dies moments later, and its exit report follows. Stopped means gone,
        # as for a container of its own process, which stop() reaps; the bound only guards a
        # zygote that hangs (its children die with it when it is killed)
        deadline = asyncio.get_running_loop().time() + _KILL_REPORT_S
        while not child.reaped and not self.reader.done():
            if asyncio.get_running_loop().time() > deadline:
                log.warning(
                    "zygote: no exit report for container %s %.0f s after its kill", child.pid, _KILL_REPORT_S
                )
                break
            await asyncio.sleep(0.005)

    async def aclose(self) -> None:
        self.closed = True
        async with self.lock:  # a zygote being spawned now is killed too, once it has a pid
            pass
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
            _LIVE_GROUPS.discard(self.proc.pid)
        if self.reader is not None:
            await asyncio.gather(self.reader, return_exceptions=True)
        await self.sweeps.wait()  # (of the containers nobody owned: a start cancelled, say)


class ProcessRuntime(Runtime):
    kind = "process"
    idle_probe_s = None  # known_dead tells at once

    def __init__(self, config: ProcessRuntimeConfig | None = None):
        super().__init__()
        self.config = config or ProcessRuntimeConfig()
        self._own_root = self.config.root is None
        # absolute, as of now: a container is given paths under it (its socket's) that it
        # reads from its own directory, and its mark is its directory's path (``escapees``)
        self._root = Path(self.config.root).absolute() if self.config.root else None
        self._owner_fd: int | None = None
        self._ids = itertools.count(1)
        self._sweeps = escapees.Sweeps()
        self._zygote = _Zygote(self._sweeps) if self.config.zygote else None
        self._warned_shared = False

    @property
    def root(self) -> Path:
        """The containers' directories' parent. Our own is made on the first start, not
        here: a pool made and never entered (and a runtime a test replaces) left an empty
        one in /tmp for good. Its name carries our pid, for ``reap_orphans``."""
        if self._root is None:
            self._root, self._owner_fd = make_root()  # (locked before it bears our name)
        return self._root

    async def reap_orphans(self) -> list[str]:
        """Remove the directories our kind of runtime made for owners that are gone (a driver
        SIGKILLed: nothing of its close ran; its containers died with it, their directories
        stayed). Only ``envpool-p<pid>-*`` in the temp dir whose ``pid`` is no live process:
        never another live process's, never a directory someone else named. What their
        containers left running (by their marks, ``envpool.escapees``) is killed first."""
        return await asyncio.to_thread(reap_dead_roots, Path(tempfile.gettempdir()))

    def _opts(self, sock: Path, bundle: Path | None) -> dict[str, Any]:
        cfg = self.config
        return {
            "sock": str(sock),
            "bundle": str(bundle) if bundle is not None else None,
            "scratch": str(sock.parent),  # its view of the bundle goes there (``isolation.private_view``)
            "memory_layer_bytes": cfg.memory_layer_bytes,
            "heartbeat_s": cfg.heartbeat_s,
            "limits": cfg.limits.model_dump(),
            "fault": cfg.faults.model_dump(),
            "netns": cfg.network_namespace,
        }

    async def _start(self, image: str | None, bundle: Path | None) -> Container:
        n = next(self._ids)
        cid = f"p{os.getpid()}-{n}"
        # named by its number alone (the root's name has the pid already), and the socket
        # "s": a Unix socket's path is at most 107 bytes, and a deep TMPDIR took the rest
        cdir = self.root / str(n)
        sock = cdir / "s"
        if len(os.fsencode(sock)) > _MAX_SOCKET_PATH:
            raise ContainerStartError(
                f"container {cid} cannot start: its socket path {str(sock)!r} is "
                f"{len(os.fsencode(sock))} bytes, over the {_MAX_SOCKET_PATH} a Unix socket allows; "
                "give runtime.root (or TMPDIR) a shorter directory"
            )
        cdir.mkdir(parents=True)
        opts = self._opts(sock, bundle)
        if self._zygote is not None:
            info, child = await self._zygote.fork(opts, cdir)
            pid = int(info["pid"])
            c = Container(id=cid, endpoint=str(sock), image=image, runtime=self.kind, pid=pid, handle=child)
            if "error" in info:
                await self._stop(c)
                raise ContainerStartError(f"container {cid} failed to start: {info['error']}")
        else:
            c = await self._exec(cid, cdir, opts, image)
            info = {"isolation": c.isolation, "image_view": c.image_view, "image_layer": c.image_layer}
        c.isolation = info.get("isolation", "none")
        c.image_view = info.get("image_view")
        c.image_layer = info.get("image_layer")
        if c.image_view == "shared" and not self._warned_shared:
            self._warned_shared = True  # (once per runtime: every container here gets the same)
            log.warning(
                "container %s runs in its image's shared directory (no mount namespace to be had "
                "here): what a container writes there, later containers of the image see",
                cid,
            )
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
            cmd += ["--bundle", opts["bundle"], "--scratch", opts["scratch"]]
            cmd += ["--memory-layer-bytes", str(opts["memory_layer_bytes"])]
        if not opts["netns"]:
            cmd.append("--no-netns")
        # a Popen, not an asyncio subprocess: asyncio reaps its children as they exit, and a
        # reaped container's pid may be another process's by the time it is stopped; this
        # one stays unreaped until _stop has killed its group. (fork+exec takes a few ms on
        # the loop, as asyncio's own spawn did.)
        proc = subprocess.Popen(  # noqa: ASYNC220
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=_child_env(cdir, escapees.token(cdir)),
            cwd=str(cdir),
            start_new_session=True,  # its own process group: killed as a whole
        )
        _LIVE_GROUPS.add(proc.pid)
        _LIVE_MARKS.add(escapees.token(cdir))
        c = Container(
            id=cid, endpoint=opts["sock"], image=image, runtime=self.kind, pid=proc.pid, handle=proc
        )
        line = b""
        try:
            line = await _read_line(proc.stdout)
            info = json.loads(line) if line else {}
        except BaseException as e:  # (not only a garbled line or a cancellation: an OSError too)
            await self._stop(c)
            if isinstance(e, ValueError):  # a start that failed, as the zygote's garbled line is
                raise ContainerStartError(
                    f"container {cid} sent a garbled ready line: {line[:200]!r}"
                ) from None
            raise
        if not isinstance(info, dict) or not info.get("ready"):
            await self._stop(c)
            raise ContainerStartError(
                f"container {cid} exited before it was ready (exit code {proc.returncode})"
            )
        c.isolation = info.get("isolation", "none")
        c.image_view = info.get("image_view")
        c.image_layer = info.get("image_layer")
        return c

    async def _stop(self, c: Container) -> None:
        # never os.killpg(c.pid) for a container that may have been reaped: its pid may be
        # another process's by now (a pid wrap hands it to the next container to start)
        if isinstance(c.handle, _Forked):
            assert self._zygote is not None
            await self._zygote.kill(c.handle)
        elif isinstance(c.handle, subprocess.Popen):
            proc = c.handle
            with self._sweeps.killing():  # its sweep joins those of the stops under way
                if proc.returncode is None:  # not reaped: its pid is still its group's id
                    # SIGKILL at once, no SIGTERM first: a container frozen by SIGSTOP (the hang
                    # fault) runs no handler, and a polite stop would wait out its whole grace
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                # reaped here, on the loop, with the record dropped in the same step (a process
                # exit has no awaitable without a child watcher: it dies within moments of SIGKILL)
                while proc.poll() is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
                _LIVE_GROUPS.discard(proc.pid)
            # then what it started outside its group (a helper in a session of its own):
            # found by its mark, as for the zygote's children once they are reported
            mark = escapees.token(Path(c.endpoint).parent)
            await self._sweeps.sweep({mark})
            _LIVE_MARKS.discard(mark)
        isolation.remove_scratch(Path(c.endpoint).parent)

    def cpu_seconds(self, c: Container) -> float | None:
        if c.pid is None or not self._alive_now(c):
            return None
        return proc_cpu_seconds(c.pid)

    async def _alive(self, c: Container) -> bool:
        return self._alive_now(c)

    def known_dead(self, c: Container) -> bool:
        # the flag the zygote's reader sets at its exit report, or a waitid: no one to ask
        return c.id in self.live and not self._alive_now(c)

    def _alive_now(self, c: Container) -> bool:
        if isinstance(c.handle, _Forked):
            return not c.handle.reaped
        if isinstance(c.handle, subprocess.Popen):
            return not _exited(c.handle)
        return False

    async def aclose(self) -> None:
        await super().aclose()
        if self._zygote is not None:
            await self._zygote.aclose()
        await self._sweeps.wait()
        if self._own_root and self._root is not None:
            isolation.remove_scratch(self._root)
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None
