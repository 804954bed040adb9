"""The code of a registered function as it was registered (``capture_code``): its
version, a hash of its source and of its module's whole file and the modules beside it,
and those files' texts, which a local pool keeps for its workers and a deploy ships.
Split from ``fabric.registry``, which re-exports its names."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType
from typing import Any

from fabric import siblings
from fabric.registry_imports import import_name_of

#: A loader class's mark (True) that the module it loads is the kept text of a registered one,
#: which its ``get_data(path)`` returns: a worker's (``fabric.backends._pool_snapshot``)
KEPT_SOURCE_ATTR = "fabric_kept_source"
#: The text of each module file this process imports in place of the file (a worker's
#: kept modules, ``fabric.backends._pool_snapshot.install``), by its real path: a version
#: computed here reads it for the modules beside a function's, as it does the function's
#: own module through its loader, and a pool started here keeps it for its own workers.
KEPT_TEXTS: dict[Path, bytes] = {}


@dataclass(frozen=True)
class ModuleSource:
    """A module file that defines a registered function (or its setup hook), as it was
    read when the function was registered."""

    name: str
    """What a worker imports it as (``import_name_of``): a module name, or a .py path."""
    path: str
    """Its file (``__file__``)."""
    data: bytes
    """The file's bytes then."""
    plain: bool
    """A .py file read by Python's own source loader: a worker can import ``data`` in its
    place (``fabric.backends._pool_snapshot``). So is the kept text a worker imported (a
    pool started in a worker keeps it for its own workers). Not so from a zip, or through
    an import hook that rewrites the source (pytest's, in test modules): those are imported
    as they are when the worker starts."""
    digest: bytes = field(default=b"", repr=False)
    """sha256 of ``data``: what a version hashes of it."""


def _plain_loader(loader: Any) -> bool:
    """Whether ``loader`` compiles the text its ``get_data`` reads from the file: Python's
    own source loader (the exact class: a subclass may compile other text, an import hook),
    or the worker's loader of a kept module, marked (``KEPT_SOURCE_ATTR``)."""
    return (
        type(loader) is importlib.machinery.SourceFileLoader
        or getattr(type(loader), KEPT_SOURCE_ATTR, False) is True
    )


@dataclass(frozen=True)
class FunctionCode:
    """The code of a registered function as it was registered: its version, and the module
    files (its own, its setup hook's) that the version hashes."""

    version: str
    modules: tuple[ModuleSource, ...] = ()
    beside: tuple[tuple[str, str], ...] = ()
    """The modules beside those that the version hashes too, as (name in a deploy package,
    path): what they import from their own directory (``fabric.siblings``)."""
    helpers: tuple[ModuleSource, ...] = ()
    """The module files under ``beside`` as the version hashed them, each by its module
    name: kept as ``modules`` are, those that are ``plain``. Not plain: a module that
    ``import`` does not find there (another of its name comes first), or that this process
    imported through an import hook."""


def _module_source(module_name: str) -> ModuleSource | None:
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    loader: Any = getattr(module, "__loader__", None)
    if not isinstance(path, str) or (loader is None and not path.endswith(".py")):
        return None  # a notebook's cell, a built-in module
    name = import_name_of(module_name)
    # a script that a tool ran from its file itself (runpy.run_path: pdb, the debugpy
    # debugger, launchers) has no loader, or one that reads nothing (coverage's); its workers
    # import the file by its path (import_name_of) with Python's own loader, as they import
    # the kept text
    by_path = name.endswith(".py") and path.endswith(".py") and not hasattr(loader, "get_data")
    try:
        if path.endswith(".py") and hasattr(loader, "get_data"):
            data = loader.get_data(path)  # the bytes of the file (also in a zip), not a cache's
        elif path.endswith(".py"):
            # its bytes, as a worker's loader reads them, not inspect.getsource's text (decoded,
            # its newlines changed): the version a worker computes must be the same
            data = Path(path).read_bytes()
        else:
            data = inspect.getsource(module).encode()  # type: ignore[arg-type]
    except (OSError, TypeError, ImportError):  # no source: a .pyc alone, an extension module
        return None
    # the worker's loader of a kept module is plain too: its get_data gave the text it
    # compiled, so a pool started in a worker sends its own workers that text, not the file
    return _shared(name, path, data, _plain_loader(loader) or by_path)


def _shared(name: str, path: str, data: bytes, plain: bool) -> ModuleSource:
    """The module file ``path`` read as ``data``, kept once: the file is read for each
    function decorated in it (what it holds when that one is registered), and a module of
    200 functions would otherwise keep 200 copies (and hash each). By content, not by the
    file's stat: an edit within its timestamp's granularity, the same size, is another text."""
    last = _LAST_READ.get(path)
    if last is not None and (last.name, last.plain) == (name, plain) and last.data == data:
        return last
    source = ModuleSource(name, path, bytes(data), plain, hashlib.sha256(data).digest())
    _LAST_READ[path] = source
    return source


#: The last text read of each module file that a registered function's code holds (its
#: module's, a helper's beside it), by its path, while one holds it.
_LAST_READ: weakref.WeakValueDictionary[str, ModuleSource] = weakref.WeakValueDictionary()


def capture_code(*objs: Callable[..., Any] | None) -> FunctionCode:
    """The code of ``objs`` (a function and its setup hook) now: a short hash of their
    source (bytecode when the source is unavailable) and of the whole files of the modules
    that define them, and those files.

    The whole module, not only the functions: a helper or a constant the function uses is
    part of what it computes, and the version keys every call (a cached answer of the old
    code must not be served for the new) and tells a worker that imported other code than
    the registered (``FunctionPool``). It is also what a local pool keeps and its workers
    import, so the version names exactly the code they run. The cost: any edit of the file
    (a comment, another function) is a new version of each function in it.

    The modules they import from their own directory are in the version too, and kept
    with it (``FunctionCode.helpers``): ``fabric deploy`` ships them beside the function's
    module, and a helper edited under an unchanged version let a deployment of the old
    helper answer as the caller's code. Other modules they import (installed ones, the
    other modules of their own package) are in neither: keep in the function's module, or
    beside it, what must not change unseen."""
    h = hashlib.sha256()
    modules: dict[str, ModuleSource | None] = {}
    for obj in objs:
        if obj is None:
            continue
        try:
            h.update(inspect.getsource(obj).encode())
        except (OSError, TypeError):
            code = getattr(obj, "__code__", None)
            h.update(code.co_code if code is not None else repr(obj).encode())
        module_name = getattr(obj, "__module__", None)
        if isinstance(module_name, str) and module_name not in modules:
            modules[module_name] = _module_source(module_name)
    kept = tuple(m for m in modules.values() if m is not None)
    for m in kept:
        h.update(m.digest)
    beside = _beside_all(kept, next(iter(modules), None))
    h.update(beside.digest)
    return FunctionCode(h.hexdigest()[:12], kept, beside.roots, beside.helpers)


@dataclass(frozen=True)
class _Beside:
    """The modules beside a function's (``_beside_all``)."""

    digest: bytes
    """What the version hashes of them (``b""`` for none)."""
    roots: tuple[tuple[str, str], ...]
    """``FunctionCode.beside``."""
    helpers: tuple[ModuleSource, ...]
    """``FunctionCode.helpers``."""


#: The last ``_beside_all`` answer, for the module body that asked (its code object's), and
#: the kept modules it was for: a module of many functions walks the modules beside it once
#: as it runs, not once for each function (a package beside it of 300 files took 40 ms).
#: A new run of the body (a reload, a worker's import) is another code object: read anew.
#: The helpers' texts are held by the functions' code, not here (weakly, as ``_LAST_READ``).
_BESIDE_LAST: (
    tuple[
        weakref.ref[CodeType],
        tuple[tuple[str, bytes], ...],
        bytes,
        tuple[tuple[str, str], ...],
        tuple[weakref.ref[ModuleSource], ...],
    ]
    | None
) = None


def _beside_all(kept: tuple[ModuleSource, ...], module_name: str | None) -> _Beside:
    """The modules beside ``kept`` (``_beside``): their hash and their texts, from one
    listing (``fabric.siblings.sources``), so the version names exactly the code kept."""
    global _BESIDE_LAST
    key = tuple((m.path, m.digest) for m in kept)
    body = _running_body(module_name)
    last = _BESIDE_LAST
    if body is not None and last is not None and last[0]() is body and last[1] == key:
        held = tuple(ref() for ref in last[4])
        if all(h is not None for h in held):
            return _Beside(last[2], last[3], held)  # type: ignore[arg-type]
    found: dict[str, Path] = {}
    # a module kept is read as kept (a setup hook's module beside the function's), and so is
    # what this process imported in place of a file (a worker's kept helpers): a worker
    # imports that text, and computes its version from it
    texts = siblings.Texts({**KEPT_TEXTS, **{Path(m.path).resolve(): m.data for m in kept}})
    listed: list[tuple[str, Path, bytes]] = []
    try:
        for m in kept:
            found.update(_beside(m, texts))
        listed = siblings.sources(found.items(), texts)
        digest = siblings.digest(listed) if found else b""
    except (siblings.CodeTreeError, OSError) as e:
        # a link that loops or leads nowhere (which the deploy refuses), a file unreadable:
        # the version says so, as the same text wherever it is computed (and nothing is kept)
        digest = f"{type(e).__name__}: {e}".encode()
        listed = []
    helpers = _helpers(listed, found)
    beside = _Beside(digest, tuple((arc, str(p)) for arc, p in sorted(found.items())), helpers)
    if body is not None:
        _BESIDE_LAST = (weakref.ref(body), key, digest, beside.roots, tuple(weakref.ref(h) for h in helpers))
    return beside


def _helpers(listed: list[tuple[str, Path, bytes]], found: dict[str, Path]) -> tuple[ModuleSource, ...]:
    """The module files ``listed`` (``fabric.siblings.sources``, under the roots ``found``)
    as kept: each by the name a worker imports it as (``helpers.py``: ``helpers``,
    ``pkg/sub/__init__.py``: ``pkg.sub``)."""
    found_here = {arc: _found_by_import(arc, root) for arc, root in found.items()}
    helpers = []
    for arc, path, data in listed:
        parts = arc.removesuffix(".py").split(os.sep)
        if len(parts) > 1 and parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        imported = sys.modules.get(name)
        # a module imported already, through an import hook: a worker's import is the hook's
        plain = found_here[arc.partition(os.sep)[0]] and (
            imported is None or _plain_loader(getattr(imported, "__loader__", None))
        )
        helpers.append(_shared(name, str(path), data, plain))
    return tuple(helpers)


def _found_by_import(arc: str, root: Path) -> bool:
    """Whether ``import`` finds the module or package ``root`` (a root of the modules beside
    a function's, ``arc`` its archive name) under its name, by Python's own loader: where
    another module of its name comes first on sys.path (or was imported already), a worker
    imports that one, and keeping this one's text would replace it there."""
    name = arc.removesuffix(".py")
    try:
        spec = importlib.util.find_spec(name)  # sys.modules' if imported, else found, not imported
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if spec.origin is None or not spec.has_location:  # a namespace package
        found = spec.submodule_search_locations or ()
        return root.resolve() in {Path(p).resolve() for p in found}
    file = root / "__init__.py" if root.is_dir() else root
    return Path(spec.origin).resolve() == file.resolve() and _plain_loader(spec.loader)


def _running_body(module_name: str | None) -> CodeType | None:
    """The code of the body of module ``module_name`` if it is running (a decorator in it
    called us), else None."""
    module = sys.modules.get(module_name) if module_name else None
    if module is None:
        return None
    namespace = vars(module)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is namespace and frame.f_code.co_name == "<module>":
            return frame.f_code
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _beside(m: ModuleSource, texts: siblings.Texts) -> dict[str, Path]:
    """The modules shipped beside the module ``m`` (``fabric.siblings``): what its registered
    text imports from the directory of its top-level module or package, and what those
    import in turn. Its own package is not among them (the deploy ships it whole anyway):
    the version hashes its module's file, not the package's others."""
    path = Path(m.path)
    if m.name.endswith(".py"):  # a file entry, a script: its own directory (deployed, the
        # module of its name at the package's root, whose own name is not a sibling)
        top, directory = path.stem, path.parent
    else:
        parts = m.name.split(".")
        top = parts[0]
        up = len(parts) - 1 + (path.name == "__init__.py")
        if top in siblings.NOT_SIBLINGS or up >= len(path.parents):
            return {}
        directory = path.parents[up]
    names = siblings.imported(m.data, m.path) - {top}
    return dict(siblings.beside(siblings.found_in(names, directory), texts))


def source_version(*objs: Callable[..., Any] | None) -> str:
    """A short hash of the source of ``objs`` and of their modules' files (``capture_code``)."""
    return capture_code(*objs).version
