"""A ``modal.App`` from the registry: one Modal function per registered function.

The options follow the ``FunctionSpec``: ``warm`` -> ``min_containers`` (plus one
``buffer_containers`` so a burst finds a container ready; the plan's warm, which ``fabric
deploy`` sets to 0 unless given ``--keep-warm`` or ``--warm N``: billed while idle), ``max_concurrency`` ->
``max_containers``, ``timeout_s`` -> ``timeout``, ``resources`` -> ``cpu``/``gpu``,
``memory_mb`` -> ``memory``. ``retry`` is not Modal's: Modal retries nothing (``retries=0``).
Its retries would cover a lost or timed-out container, after which the call may have run,
side effects included, and the client retries each such call again (3 x 3 runs); the client
alone applies ``retry``, with its idempotency and side-effect rules. The image runs the Python
minor version that deploys it (the functions are pickled by value), installs rl-fabric's
runtime requirements and adds the code (``fabric``, ``functions`` and your modules).
Variables reach the functions through Modal secrets named at deploy (``--modal-secret``).

``deploy_modal`` needs a Modal token (``modal token new``, or ``MODAL_TOKEN_ID`` and
``MODAL_TOKEN_SECRET``); without one it stops at once and says so.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fabric.deploy.package import code_roots, linked_dirs, requirements
from fabric.deploy.plan import DeployedFunction, DeployError
from fabric.registry import Registry
from fabric.siblings import SKIP_DIRS

APP_NAME = "rl-fabric"
SCALEDOWN_WINDOW_S = 60
"""Idle containers beyond ``min_containers`` stop after this (the local pools' idle window)."""


def _modal() -> Any:
    try:
        import modal
    except ImportError:
        raise DeployError("the modal backend needs the modal SDK: pip install 'rl-fabric[modal]'") from None
    return modal


def modal_options(registry: Registry, fn: DeployedFunction) -> dict[str, Any]:
    """The keyword arguments of ``app.function`` for one function, as plain data."""
    spec = registry.get(fn.name)
    if fn.warm > spec.max_concurrency:
        # Modal refuses min_containers above max_containers while the app is built; the
        # decorator checks its own warm, but --warm N sets every function's
        raise DeployError(
            f"{fn.name}: --warm {fn.warm} is more than its max_concurrency={spec.max_concurrency} (Modal's "
            "max_containers, which min_containers cannot exceed): pass a smaller --warm, or --keep-warm "
            "for each function's own warm"
        )
    options: dict[str, Any] = {
        "name": fn.deployed_name,
        "min_containers": fn.warm,
        "buffer_containers": 1 if fn.warm > 0 else 0,
        "max_containers": spec.max_concurrency,
        "scaledown_window": SCALEDOWN_WINDOW_S,
        "timeout": fn.timeout_s,
        # the client retries (the module's docstring says why Modal does not)
        "retries": 0,
        "cpu": spec.resources.cpu,
        "memory": fn.memory_mb,
    }
    if spec.resources.gpu > 0:
        kind = spec.resources.gpu_type or "any"
        options["gpu"] = kind if spec.resources.gpu == 1 else f"{kind}:{spec.resources.gpu}"
    return options


def _left_out(rel: Path) -> bool:
    """What the image leaves out of the code, as the Lambda zip does (``fabric.siblings.files``):
    dotfiles and dot-directories (``.env``, ``.git``, ``.venv``) and bytecode. Modal's
    default keeps ``.py`` files only: the package data (``functions/data/corpus``, the JS
    verifier's ``functions/verifiers/js``) was missing on Modal."""
    return rel.name.endswith((".pyc", ".pyo")) or any(p.startswith(".") or p in SKIP_DIRS for p in rel.parts)


def _found_at(name: str, directory: Path) -> bool:
    """Whether the module ``name`` is found here (as ``add_local_python_source`` looks it
    up) in ``directory``."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None or spec.submodule_search_locations is None:
        return False
    return directory.resolve() in {Path(p).resolve() for p in spec.submodule_search_locations}


def _entry(name: str, module: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def entry(envelope: dict[str, Any]) -> dict[str, Any]:
        from fabric.deploy.modal_runtime import run

        return run(name, module, envelope)

    entry.__name__ = entry.__qualname__ = f"fabric_{name}"
    return entry


def build_app(
    registry: Registry,
    plan: list[DeployedFunction],
    app_name: str = APP_NAME,
    *,
    secrets: Sequence[str] = (),
    pip: Sequence[str] = (),
) -> tuple[Any, dict[str, Any]]:
    """``(app, functions)``: the app and its Modal functions by fabric name. ``secrets``:
    names of Modal secrets attached to every function, whose keys become their environment
    (a judge's model and API key: the functions get no other variables of the user's). ``pip``:
    the functions' own dependencies, installed beside rl-fabric's (``fabric deploy --pip``)."""
    modal = _modal()
    # looked up when the app deploys: a name Modal does not know fails the deploy, saying so
    attached = [modal.Secret.from_name(name) for name in secrets]
    roots = code_roots(plan)
    dirs = {arc: path for arc, path in roots.items() if path.is_dir()}
    named = sorted(arc for arc, path in dirs.items() if _found_at(arc, path))
    # the functions go serialized (cloudpickle sends their code by value), and a code object
    # loads only in the Python minor version that made it: the container runs the deploying
    # interpreter's (a fixed 3.11 made functions no container could load from 3.12 or 3.13)
    python = "{}.{}".format(*sys.version_info)
    image = (
        modal.Image.debian_slim(python_version=python)
        .pip_install(*requirements(pip))
        .add_local_python_source(*named, ignore=_left_out)
    )
    for arc in sorted(dirs.keys() - set(named)):
        # a package beside a file entry, whose directory is not on sys.path here: Modal looks
        # a name up there (ModuleNotMountable), so by its path
        image = image.add_local_dir(dirs[arc], f"/root/{arc}", ignore=_left_out)
    for arc, path in sorted(dirs.items()):
        # Modal's walk does not follow a link to a directory (the zip's does): each its own
        for link in linked_dirs(path):
            image = image.add_local_dir(path / link, f"/root/{arc}/{link.as_posix()}", ignore=_left_out)
    for arc, path in sorted(roots.items()):
        if path.is_file():
            # by its path: Modal looks a module up on sys.path, where a file entry from another
            # directory (`-m rewards/my_fns.py`) is not; /root is where the runtime loads it
            image = image.add_local_file(path, f"/root/{arc}")
    app = modal.App(app_name, image=image)
    functions = {}
    for fn in plan:
        functions[fn.name] = app.function(serialized=True, secrets=attached, **modal_options(registry, fn))(
            _entry(fn.name, fn.module)
        )
    return app, functions


def deploy_modal(
    registry: Registry,
    plan: list[DeployedFunction],
    *,
    app_name: str = APP_NAME,
    secrets: Sequence[str] = (),
    pip: Sequence[str] = (),
    echo: Callable[[str], None],
) -> None:
    modal = _modal()
    try:
        # inside: Modal refuses some options when a function is defined, not when it deploys
        app, _ = build_app(registry, plan, app_name, secrets=secrets, pip=pip)
        echo(f"deploying Modal app {app_name!r}: {', '.join(f.deployed_name for f in plan)}")
        with modal.enable_output():
            app.deploy()
    except modal.exception.AuthError as e:
        raise DeployError(
            f"Modal refused the deploy: {str(e).rstrip('.')}. Run `modal token new`, or set "
            "MODAL_TOKEN_ID and MODAL_TOKEN_SECRET."
        ) from None
    except modal.exception.Error as e:
        # a --modal-secret that does not exist, an option Modal refuses, a connection fault:
        # Modal's own words, not a traceback
        hint = " (is every --modal-secret created? `modal secret list`)" if secrets else ""
        raise DeployError(f"Modal refused the deploy: {type(e).__name__}: {e}{hint}") from None
    echo(f"deployed; call them with backend {{'type': 'modal', 'app_name': {app_name!r}}}")
