"""An image's ``envpool.json``: what environments a bundle registers, read and checked.

    {"modules": ["coin_env"]}                                       # modules that call envpool.register
    {"register": [{"id": "coin-v0", "entry_point": "coin_env:Coin", "max_episode_steps": 2}]}

A container loads it (``envpool.server.load_bundle``) with the bundle directory first on
``sys.path`` and as its working directory. ``registered_by(root)`` does the same in a child
process and says which environments the bundle adds to the built-ins, each entry point
loaded once: a manifest that is not JSON, a module that does not import, or an entry point
with a typo is a ``ManifestError`` naming the entry, found before a job starts rather than
in every container it would start. In a child, because the image's modules would otherwise
be imported into the caller (its registry, ``sys.modules``), where environment code never
runs: two images may hold modules of the same name.

``python -m envpool.manifest DIR [PARENT_PID]`` is the child (it dies with PARENT_PID): one
JSON line, ``{"envs": {id: spec}}`` or ``{"error": "..."}`` (exit code 1).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envpool.errors import EnvRegistryError

MANIFEST = "envpool.json"
#: The child's wall-clock limit: an image whose modules take longer to import is refused.
INSPECT_TIMEOUT_S = 120.0


class ManifestError(EnvRegistryError):
    """An image's ``envpool.json`` is missing, not JSON, or registers something that does not load."""


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    modules: list[str] = []
    """Modules of the bundle to import; they call ``envpool.register`` themselves."""
    entries: list[dict[str, Any]] = Field([], alias="register")
    """(``register``) ``envpool.register`` keyword arguments: ``id``, ``entry_point``, options."""


def read_manifest(root: Path) -> Manifest:
    """The manifest of the bundle directory ``root``; ``ManifestError`` saying what to fix."""
    path = Path(root) / MANIFEST
    try:
        # bytes: json detects UTF-8/16/32 itself (read_text would take the locale's encoding)
        text = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(
            f"{root} has no {MANIFEST}: add one naming what the image registers, "
            '{"modules": ["my_env"]} (modules that call envpool.register) or '
            '{"register": [{"id": "my-env-v0", "entry_point": "my_env:MyEnv"}]}'
        ) from None
    except OSError as e:
        raise ManifestError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes of no encoding
        raise ManifestError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ManifestError(f"{path} is not valid JSON: nested too deeply") from None
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the document"
        raise ManifestError(
            f'{path}: {where}: {first["msg"]} (expected {{"modules": [names]}} and/or '
            '{"register": [{"id": ..., "entry_point": "module:Class"}]})'
        ) from None
    return manifest


def load_manifest(root: Path, manifest: Manifest, registry: Any) -> None:
    """Import the manifest's modules and register its entries into ``registry`` (the
    process's default registry: the modules register there). ``root`` must already be
    first on ``sys.path``. A failure is a ``ManifestError`` naming the entry."""
    for i, module in enumerate(manifest.modules):
        try:
            importlib.import_module(module)
        except Exception as e:
            raise ManifestError(
                f"{root / MANIFEST}: modules[{i}] {module!r} does not import: {type(e).__name__}: {e}"
            ) from e
    for i, reg in enumerate(manifest.entries):
        try:
            registry.register(**reg)
        except Exception as e:
            raise ManifestError(f"{root / MANIFEST}: register[{i}]: {type(e).__name__}: {e}") from e


def registered_by(root: str | os.PathLike[str], *, timeout_s: float = INSPECT_TIMEOUT_S) -> dict[str, Any]:
    """The environments the bundle directory ``root`` registers beyond the built-ins (id ->
    its spec as a dict), loaded in a child process as a container loads them, with every
    entry point imported once. ``ManifestError`` if the manifest or any of it fails."""
    root = Path(root).absolute()
    read_manifest(root)  # the common mistakes, without a process
    # a module may start a helper process at import (a simulator, a game server), which
    # inherits the child's output: waiting for EOF on pipes would wait for the helper (then
    # blame a slow import), so the output goes to files and the child's own exit ends the
    # wait. The child leads a process group of its own, killed then: no helper outlives it
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "envpool.manifest", str(root), str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=root,
            # as a container's: the caller's import path, the bundle put first by the child;
            # no __pycache__ written into the bundle (it would change the bundle's digest)
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
                "PYTHONDONTWRITEBYTECODE": "1",
            },
            start_new_session=True,
        )
        try:
            exited = wait_unreaped(proc.pid, timeout_s)
        finally:
            # before the child is reaped: until then its pid, the group's id, is nobody else's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not exited:
            raise ManifestError(f"{root / MANIFEST}: loading it took over {timeout_s:.0f} s")
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    lines = stdout.strip().splitlines()
    try:
        row = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        row = {}
    if "envs" in row and proc.returncode == 0:
        envs: dict[str, Any] = row["envs"]
        return envs
    why = row.get("error") or (stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    raise ManifestError(why)


def wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the child ``pid`` to exit, leaving it unreaped (its pid,
    and its process group's id, stay its own until it is: a ``killpg`` then is safe)."""
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _inspect(root: Path) -> dict[str, Any]:
    import envpool.envs  # noqa: F401 - the built-ins, as in every container
    from envpool.api import default_registry, load_class

    builtins = {i: default_registry.spec(i) for i in default_registry.ids()}
    sys.path.insert(0, str(root))
    load_manifest(root, read_manifest(root), default_registry)
    out: dict[str, Any] = {}
    for env_id in default_registry.ids():
        spec = default_registry.spec(env_id)
        if builtins.get(env_id) == spec:
            continue
        try:
            load_class(spec.entry_point)
        except Exception as e:
            raise ManifestError(
                f"{root / MANIFEST}: {env_id!r} has the entry point {spec.entry_point!r}, "
                f"which does not load: {e}"
            ) from None
        out[env_id] = spec.model_dump(mode="json")
    return out


def _die_with(parent: int) -> None:
    """SIGKILL when ``parent`` dies: a driver killed (or dead of OOM) runs none of the check's
    end, which kills the child's group, and an import that hangs would run on for good."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def _main(argv: list[str]) -> int:
    if len(argv) > 1:
        _die_with(int(argv[1]))
    out = os.dup(1)
    os.dup2(2, 1)  # what the image's modules print goes to stderr, not into the answer
    try:
        row: dict[str, Any] = {"envs": _inspect(Path(argv[0]))}
    except ManifestError as e:
        row = {"error": str(e)}
    os.write(out, (json.dumps(row) + "\n").encode())
    return 0 if "envs" in row else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
