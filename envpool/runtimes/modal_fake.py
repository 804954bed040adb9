"""A fake ``modal`` module for tests: the subset ``ModalRuntime`` uses, with each sandbox a
real local process, so a pool under test really talks to a server.

    fake = FakeModal()
    runtime = ModalRuntime(config, modal_module=fake)

``Sandbox.create`` starts the given command (``python`` is this interpreter; a listen address
``0.0.0.0:<port>`` becomes ``127.0.0.1:0``). As on Modal, each open port's tunnel exists as
soon as the sandbox does, before the server inside listens: ``tunnels()`` answers at once with
a local TCP proxy that accepts every connection and resets the ones that come before the
server listens (Modal's tunnel has no backend to forward them to yet). A ``readiness_probe``
(``Probe.with_tcp``) and ``wait_until_ready`` are Modal's way to wait for the server.
``FakeModal(authenticated=False)`` raises ``AuthError`` like Modal without a token.
``running()`` lists the sandboxes still running; ``kill(id)`` makes one die;
``create_delay_s`` makes ``create`` slow (a window for cancellation tests);
``listen_delay_s`` holds the server's port closed that long after it is ready (a slow start
inside the sandbox: an image pulled, a bundle fetched); ``fail_next`` makes the next API
calls raise, ``fail_next_terminate`` the next terminates. ``create`` refuses what Modal's does
(an unknown argument, open ports with ``block_network``, an environment variable name Modal
rejects), creating nothing. ``Sandbox.list(app_id=..., tags=...)`` lists the running
sandboxes that carry at least the given tags.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

_LIVE_GROUPS: set[int] = set()


@atexit.register
def _kill_leftovers() -> None:
    # exit backstop: a test that forgot a sandbox still leaves no process behind
    for pgid in list(_LIVE_GROUPS):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)


class Error(Exception):
    """``modal.exception.Error``."""


class AuthError(Error):
    """``modal.exception.AuthError``."""


class NotFoundError(Error):
    """``modal.exception.NotFoundError``."""


class InvalidError(Error):
    """``modal.exception.InvalidError``: arguments Modal refuses."""


class ConflictError(InvalidError):
    """``modal.exception.ConflictError``: ``wait_until_ready`` on a sandbox that has finished."""


class ModalTimeoutError(Error):
    """``modal.exception.TimeoutError`` (named apart from the builtin here): ``wait_until_ready``
    past its timeout."""


exception = SimpleNamespace(
    Error=Error,
    AuthError=AuthError,
    NotFoundError=NotFoundError,
    InvalidError=InvalidError,
    ConflictError=ConflictError,
    TimeoutError=ModalTimeoutError,
)


@dataclass(frozen=True)
class Probe:
    """``modal.Probe`` (modal 1.4.1+): a sandbox's readiness probe."""

    tcp_port: int | None = None
    exec_argv: tuple[str, ...] | None = None
    interval_ms: int = 100

    @classmethod
    def with_tcp(cls, port: int, *, interval_ms: int = 100) -> Probe:
        if not isinstance(port, int) or not 0 < port <= 65535:
            raise InvalidError(f"Probe.with_tcp() expects `port` in [1, 65535], got {port}")
        return cls(tcp_port=port, interval_ms=interval_ms)


# keyword arguments of the real ``Sandbox.create`` (modal 1.6): any other is a TypeError there
_CREATE_KWARGS = frozenset(
    {
        "name", "tags", "env", "secrets", "network_file_systems", "timeout", "idle_timeout",
        "workdir", "gpu", "cloud", "region", "cpu", "memory", "runtime", "block_network",
        "outbound_cidr_allowlist", "outbound_domain_allowlist", "cidr_allowlist",
        "inbound_cidr_allowlist", "volumes", "pty", "encrypted_ports", "h2_ports",
        "unencrypted_ports", "custom_domain", "proxy", "include_oidc_identity_token",
        "readiness_probe", "verbose", "experimental_options", "client",
    }
)  # fmt: skip
_ENV_KEY = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _check_create(kw: dict[str, Any]) -> None:
    """What the real ``Sandbox.create`` refuses before it creates anything."""
    unknown = sorted(set(kw) - _CREATE_KWARGS)
    if unknown:
        raise TypeError(f"Sandbox.create() got an unexpected keyword argument {unknown[0]!r}")
    ports = [*kw.get("encrypted_ports", ()), *kw.get("h2_ports", ()), *kw.get("unencrypted_ports", ())]
    if kw.get("block_network") and ports:
        raise InvalidError("Cannot specify open ports when `block_network` is enabled")
    for key in kw.get("env") or {}:
        if not _ENV_KEY.match(key):
            raise InvalidError(
                f"Secret key name {key!r} is invalid for environment variables. "
                "Only letters, numbers, and underscores are allowed."
            )
    memory = kw.get("memory")
    if isinstance(memory, tuple) and memory[1] < memory[0]:
        raise InvalidError(f"Cannot specify a memory limit lower than request: {memory[1]} < {memory[0]}")


@dataclass(frozen=True)
class Tunnel:
    """``modal._tunnel.Tunnel``'s shape (an unencrypted port's tunnel)."""

    host: str
    port: int
    unencrypted_host: str
    unencrypted_port: int

    @property
    def tcp_socket(self) -> tuple[str, int]:
        return (self.unencrypted_host, self.unencrypted_port)


class _TunnelProxy:
    """One port's tunnel: accepts every connection (Modal's edge does, whatever runs inside)
    and forwards it to the server once that listens; one that comes earlier is reset."""

    def __init__(self, backend: Any):
        self.backend = backend  # () -> (host, port) where the server listens, or None
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self.stopped = threading.Event()
        self.conns: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="modal-fake-tunnel", daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                if not select.select([self.listener], [], [], 0.05)[0]:
                    continue
                client, _ = self.listener.accept()
            except (OSError, ValueError):
                return  # closed meanwhile (its fd -1: a ValueError for select)
            where = self.backend()
            server = None
            if where is not None:
                with contextlib.suppress(OSError):
                    server = socket.create_connection(where, timeout=5)
            if server is None:
                # no server behind the tunnel yet: the connection was accepted, and is reset
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()
                continue
            server.settimeout(None)
            with self.lock:
                self.conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        # one side ended: so does the other (the tunnel carries no half-open connection)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.stopped.set()
        self.listener.close()
        with self.lock:
            conns, self.conns = self.conns, set()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@dataclass
class _State:
    object_id: str
    proc: subprocess.Popen[bytes]
    ports: list[int]
    kwargs: dict[str, Any]
    app: Any
    image: Any
    tmp: str = ""
    endpoint: tuple[str, int] | None = None
    """Where the server listens, once its ready line said so."""
    listening_at: float = float("inf")
    """When its port opens (``time.monotonic``): the ready line plus ``listen_delay_s``."""
    tags: dict[str, str] | None = None
    tunnels: dict[int, _TunnelProxy] | None = None

    def listening(self) -> tuple[str, int] | None:
        if self.proc.poll() is None and time.monotonic() >= self.listening_at:
            return self.endpoint
        return None


class FakeModal:
    def __init__(
        self, *, authenticated: bool = True, create_delay_s: float = 0.0, listen_delay_s: float = 0.0
    ):
        self.authenticated = authenticated
        self.create_delay_s = create_delay_s
        """How long ``Sandbox.create`` takes after the sandbox exists (Modal's RPC latency)."""
        self.listen_delay_s = listen_delay_s
        """How long the server's port stays closed after its ready line (a slow start inside)."""
        self.fail_next: list[Exception] = []
        """Errors the next API calls (lookup, create, from_id, list) raise, in order: a
        Modal API hiccup, e.g. ``exception.Error("UNAVAILABLE")``."""
        self.fail_next_terminate: list[Exception] = []
        """Errors the next ``terminate`` calls raise, in order (the sandbox runs on)."""
        self.sandboxes: dict[str, _State] = {}
        self.apps: dict[str, Any] = {}
        self.exception = exception
        self.Probe = Probe
        self._ids = itertools.count(1)
        fake = self

        class App:
            def __init__(self, name: str):
                self.name = name
                self.app_id = f"ap-{name}"

            @classmethod
            def lookup(cls, name: str, *, create_if_missing: bool = False, **_: Any) -> App:
                fake._check_auth()
                if name not in fake.apps:
                    if not create_if_missing:
                        raise NotFoundError(f"app {name!r} not found")
                    fake.apps[name] = cls(name)
                return fake.apps[name]  # type: ignore[no-any-return]

        class Image:
            def __init__(self, tag: str):
                self.tag = tag

            @classmethod
            def from_registry(cls, tag: str, **_: Any) -> Image:
                return cls(tag)  # lazy in Modal too: nothing is pulled until a sandbox needs it

        class Sandbox:
            def __init__(self, state: _State):
                self._s = state
                self.object_id = state.object_id

            @classmethod
            def create(cls, *args: str, app: Any = None, image: Any = None, **kw: Any) -> Sandbox:
                fake._check_auth()
                if app is None:
                    raise Error("Sandbox.create needs an app outside a running Modal function")
                _check_create(kw)
                state = fake._spawn(list(args), app, image, kw)
                time.sleep(fake.create_delay_s)
                return cls(state)

            @classmethod
            def from_id(cls, sandbox_id: str, **_: Any) -> Sandbox:
                fake._check_auth()
                if sandbox_id not in fake.sandboxes:
                    raise NotFoundError(f"sandbox {sandbox_id} not found")
                return cls(fake.sandboxes[sandbox_id])

            @staticmethod
            def list(
                *, app_id: str | None = None, tags: dict[str, str] | None = None, **_: Any
            ) -> Iterator[Sandbox]:
                """The running sandboxes (of ``app_id``) that carry at least ``tags``."""
                fake._check_auth()
                for s in list(fake.sandboxes.values()):
                    if s.proc.poll() is not None or (app_id is not None and s.app.app_id != app_id):
                        continue
                    if all((s.tags or {}).get(k) == v for k, v in (tags or {}).items()):
                        yield Sandbox(s)

            def get_tags(self) -> dict[str, str]:
                return dict(self._s.tags or {})

            def set_tags(self, tags: dict[str, str], **_: Any) -> None:
                self._s.tags = dict(tags)

            def tunnels(self, timeout: int = 50) -> dict[int, Tunnel]:
                # there as soon as the sandbox is: whether its server listens is another matter
                return {p: Tunnel(*t.address, *t.address) for p, t in (self._s.tunnels or {}).items()}

            def wait_until_ready(self, *, timeout: int = 300) -> None:
                probe = self._s.kwargs.get("readiness_probe")
                if probe is None:
                    raise InvalidError("Sandbox has no readiness probe configured")
                if timeout <= 0:
                    raise InvalidError(f"`timeout` must be positive, got: {timeout}")
                deadline = time.monotonic() + timeout
                while self._s.listening() is None:
                    if self._s.proc.poll() is not None:
                        raise ConflictError("Sandbox already finished")
                    if time.monotonic() > deadline:
                        raise ModalTimeoutError(f"Sandbox did not become ready within {timeout}s")
                    time.sleep(0.02)

            def poll(self) -> int | None:
                return self._s.proc.poll()

            def terminate(self, *, wait: bool = False) -> int | None:
                if fake.fail_next_terminate:
                    raise fake.fail_next_terminate.pop(0)
                fake._kill(self._s)
                return self._s.proc.returncode if wait else None

        self.App = App
        self.Image = Image
        self.Sandbox = Sandbox

    # -- what tests look at
    def running(self) -> list[str]:
        """Ids of the sandboxes whose process still runs."""
        return [sid for sid, s in self.sandboxes.items() if s.proc.poll() is None]

    def kill(self, sandbox_id: str) -> None:
        """Make a sandbox die (as if it crashed); it stays known to ``from_id``."""
        self._kill(self.sandboxes[sandbox_id])

    def close(self) -> None:
        for s in self.sandboxes.values():
            self._kill(s)

    # -- internals
    def _check_auth(self) -> None:
        if self.fail_next:
            raise self.fail_next.pop(0)
        if not self.authenticated:
            raise AuthError("Token missing. Could not authenticate client.")

    def _spawn(self, args: list[str], app: Any, image: Any, kw: dict[str, Any]) -> _State:
        if args and args[0] in ("python", "python3"):
            args = [sys.executable, *args[1:]]
        # the sandbox's own network is this machine's: listen on loopback, any free port
        args = [re.sub(r"^0\.0\.0\.0:\d+$", "127.0.0.1:0", a) for a in args]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MODAL_"))}
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # a sandbox's /tmp is its own and goes with it: here a dir removed when it is killed
        # (the server's image fetch unpacked into the host's /tmp and left it there)
        tmp = tempfile.mkdtemp(prefix="envpool-modal-fake-")
        env["TMPDIR"] = tmp
        env.update(kw.get("env") or {})
        try:
            proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, start_new_session=True
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _LIVE_GROUPS.add(proc.pid)
        ports = [*kw.get("unencrypted_ports", []), *kw.get("encrypted_ports", [])]
        state = _State(f"sb-fake{next(self._ids)}", proc, ports, kw, app, image, tmp=tmp)
        state.tags = dict(kw.get("tags") or {})
        state.tunnels = {p: _TunnelProxy(state.listening) for p in ports}
        self.sandboxes[state.object_id] = state
        threading.Thread(target=self._read_ready_line, args=(state,), daemon=True).start()
        return state

    def _read_ready_line(self, s: _State) -> None:
        """Where the server listens: from its ready line (``{"endpoint": "tcp://h:p"}``)."""
        assert s.proc.stdout is not None
        try:
            line = s.proc.stdout.readline()  # (b"" once the process died without one)
        finally:
            s.proc.stdout.close()  # the server closes it after the line; nothing else comes
        with contextlib.suppress(ValueError, KeyError, TypeError):
            host, _, port = json.loads(line)["endpoint"].removeprefix("tcp://").rpartition(":")
            s.endpoint = (host, int(port))
            s.listening_at = time.monotonic() + self.listen_delay_s

    def _kill(self, s: _State) -> None:
        if s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
        _LIVE_GROUPS.discard(s.proc.pid)
        for t in (s.tunnels or {}).values():
            t.close()
        if s.tmp:
            shutil.rmtree(s.tmp, ignore_errors=True)
