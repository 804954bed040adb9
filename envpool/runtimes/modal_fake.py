"""A fake ``modal`` module for tests: the subset ``ModalRuntime`` uses, with each sandbox a
real local process, so a pool under test really talks to a server.

    fake = FakeModal()
    runtime = ModalRuntime(config, modal_module=fake)

``Sandbox.create`` starts the given command (``python`` is this interpreter; a listen address
``0.0.0.0:<port>`` becomes ``127.0.0.1:0``), and ``tunnels()`` reports where the server
listens. ``FakeModal(authenticated=False)`` raises ``AuthError`` like Modal without a token.
``running()`` lists the sandboxes still running; ``kill(id)`` makes one die;
``create_delay_s`` makes ``create`` slow (a window for cancellation tests). ``create``
refuses what Modal's does (an unknown argument, open ports with ``block_network``, an
environment variable name Modal rejects), creating nothing.
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
import subprocess
import sys
import tempfile
import time
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


exception = SimpleNamespace(
    Error=Error, AuthError=AuthError, NotFoundError=NotFoundError, InvalidError=InvalidError
)

# keyword arguments of the real ``Sandbox.create`` (modal 1.x): any other is a TypeError there
_CREATE_KWARGS = frozenset(
    {
        "name", "tags", "env", "secrets", "network_file_systems", "timeout", "idle_timeout",
        "workdir", "gpu", "cloud", "region", "cpu", "memory", "block_network",
        "outbound_cidr_allowlist", "cidr_allowlist", "inbound_cidr_allowlist", "volumes", "pty",
        "encrypted_ports", "h2_ports", "unencrypted_ports", "verbose", "client",
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


class FakeModal:
    def __init__(self, *, authenticated: bool = True, create_delay_s: float = 0.0):
        self.authenticated = authenticated
        self.create_delay_s = create_delay_s
        """How long ``Sandbox.create`` takes after the sandbox exists (Modal's RPC latency)."""
        self.sandboxes: dict[str, _State] = {}
        self.apps: dict[str, Any] = {}
        self.exception = exception
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

            def tunnels(self, timeout: int = 50) -> dict[int, Tunnel]:
                host, port = fake._endpoint(self._s, timeout)
                return {p: Tunnel(host, port, host, port) for p in self._s.ports}

            def poll(self) -> int | None:
                return self._s.proc.poll()

            def terminate(self, *, wait: bool = False) -> int | None:
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
        self.sandboxes[state.object_id] = state
        return state

    def _endpoint(self, s: _State, timeout: float) -> tuple[str, int]:
        """Where the server listens: from its ready line (``{"endpoint": "tcp://h:p"}``)."""
        if s.endpoint is None:
            assert s.proc.stdout is not None
            deadline = time.monotonic() + timeout
            while not select.select([s.proc.stdout], [], [], 0.05)[0]:
                if s.proc.poll() is not None or time.monotonic() > deadline:
                    raise Error(f"sandbox {s.object_id} exited or timed out before its tunnels were ready")
            line = s.proc.stdout.readline()
            if not line:
                # as on Modal, a sandbox that ended has its exit code for poll() to report
                with contextlib.suppress(subprocess.TimeoutExpired):
                    s.proc.wait(timeout=10)
                raise Error(f"sandbox {s.object_id} exited before its tunnels were ready")
            host, _, port = json.loads(line)["endpoint"].removeprefix("tcp://").rpartition(":")
            s.endpoint = (host, int(port))
        return s.endpoint

    def _kill(self, s: _State) -> None:
        if s.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(s.proc.pid, signal.SIGKILL)
            s.proc.wait()
        _LIVE_GROUPS.discard(s.proc.pid)
        if s.proc.stdout is not None:
            s.proc.stdout.close()
        if s.tmp:
            shutil.rmtree(s.tmp, ignore_errors=True)
