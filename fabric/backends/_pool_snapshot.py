"""The registered code of a function, imported by the local pool's workers in place of the
files on disk.

A pool's workers start at any time in a long job: the first ones, a scale-up, the
replacement of one that crashed or ran past its timeout. Each imports the function then; had
its module file changed since it was registered (a ``git checkout`` in the working copy), it
would import other code, and the pool refuses such a worker as stale (its version differs):
right for the rewards' integrity, but with every worker gone, every call fails. So the
module files a function's version hashes (its own module's, its setup hook's, and the
helper modules and packages they import from their own directory, ``fabric deploy``'s
siblings, transitively: see ``fabric.registry_code.capture_code``) are read when it is
registered, kept by its pool in memory, and sent to each worker with its start; the worker
imports that text under the module's own name (a helper package's each module under its
dotted name):

* the module's ``__name__``, ``__package__`` and ``__file__`` are its own: relative imports
  resolve in its package (a regular or a namespace package; a function in a package's
  ``__init__.py`` keeps the package's ``__path__``), and data read beside ``__file__`` is
  found (as it is on disk now: only the source is kept);
* a traceback, ``inspect.getsource`` and the worker's version read the kept text, not the
  file (``linecache`` holds it under the file's name; the helpers' for the version,
  ``fabric.registry_code.KEPT_TEXTS``): the helpers' texts are those the version hashed, one
  listing for both (``fabric.siblings.sources``);
* no bytecode is read or written for it: the file's ``__pycache__`` is the file's as it is
  now;
* other modules (an installed one, the other modules of a function's own package, its
  ``__init__.py`` for a function in a submodule) are imported as they are on disk when the
  worker starts: they are not in its version either. A helper beside that ``import`` does
  not find (another module of its name comes first on sys.path) is not kept: the worker
  imports what this process imported.

A pool started in a worker (a function that starts a ``Client`` of its own) keeps the text
that worker imported, for its own workers: the loader here is marked so
(``fabric.registry_code.KEPT_SOURCE_ATTR``). A module that is not a plain ``.py`` file read by
Python's own source loader (from a zip, through an import hook), or a helper not kept, is
imported as it is then; the stale refusal stays as the backstop, saying so. So does a
helper's file removed, or a module added to a helper package, since: the worker's version
lists the modules beside as they are on disk. Nothing is written to disk: nothing is left
behind when the pool closes.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import io
import linecache
import os
import sys
from collections.abc import Iterable
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

from fabric.registry import KEPT_TEXTS, FunctionCode, file_module_name

#: What a pool sends a worker: (name as imported, its file, the file's registered bytes).
Snapshot = list[tuple[str, str, bytes]]


def snapshot_of(code: FunctionCode | None) -> tuple[Snapshot, list[str]]:
    """The modules of ``code`` a worker can import as registered (its own, its setup hook's,
    the helpers beside them), and the names of those it cannot (imported as they are when
    the worker starts): a helper by its top-level module or package."""
    if code is None:
        return [], []
    kept: Snapshot = []
    unkept: list[str] = []
    names: set[str] = set()
    for helper, m in [(False, m) for m in code.modules] + [(True, m) for m in code.helpers]:
        if m.name in names:  # a setup hook's module beside the function's is a helper too
            continue
        names.add(m.name)
        if m.plain:
            kept.append((m.name, m.path, m.data))
        elif (name := m.name.partition(".")[0] if helper else m.name) not in unkept:
            unkept.append(name)
    return kept, unkept


def _lines(data: bytes) -> list[str]:
    """The lines of ``data`` as ``linecache`` reads them from a file: the registering process
    hashed the function's source from those (``capture_code``), so the worker's version must
    see the same text: decoded by its coding cookie, newlines made ``\\n``, and a last line
    without one given it (a function at the end of a file with no final newline)."""
    lines = io.StringIO(importlib.util.decode_source(data)).readlines()
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return lines


class _RegisteredSourceLoader(importlib.machinery.SourceFileLoader):
    """Python's loader of a .py file, reading the registered bytes for the file itself."""

    #: KEPT_SOURCE_ATTR: its get_data(path) is the text the module was compiled from, which
    #: capture_code keeps as it keeps a plain file's (it takes any other subclass of Python's
    #: loader for an import hook)
    fabric_kept_source = True

    def __init__(self, fullname: str, path: str, data: bytes):
        super().__init__(fullname, path)
        self._data = data

    def get_data(self, path: str) -> bytes:
        if path == self.path:
            return self._data
        return super().get_data(path)

    def path_stats(self, path: str) -> dict[str, float]:
        # no stats, no bytecode: the .pyc beside the file may be of the file edited since
        raise OSError(f"{path}: its registered source is imported, not its bytecode cache")


class _RegisteredSourceFinder:
    """Finds the kept modules, by their exact names, before any other finder."""

    def __init__(self, modules: dict[str, tuple[str, bytes]]):
        self._modules = modules

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        found = self._modules.get(fullname)
        if found is None:
            return None
        origin, data = found
        loader = _RegisteredSourceLoader(fullname, origin, data)
        # a package's __init__.py (the loader says so by its file's name) gets its __path__
        return importlib.util.spec_from_file_location(fullname, origin, loader=loader)

    def invalidate_caches(self) -> None:
        """The finder protocol's hook (``importlib.invalidate_caches`` calls it): nothing to
        drop, the kept texts are fixed for the worker's life."""


def install(snapshot: Iterable[tuple[str, str, bytes]], entry: str) -> None:
    """In a worker, before it imports ``entry``: the kept modules are imported from their
    registered text from now on."""
    modules: dict[str, tuple[str, bytes]] = {}
    for name, path, data in snapshot:
        # a script's path (absolute, import_name_of's), or a module's name (a helper
        # package's module py.py is pkg.py)
        by_path = name.endswith(".py") and os.path.isabs(name)
        modules[file_module_name(Path(name)) if by_path else name] = (path, data)
        # a traceback, inspect.getsource (the worker's version is computed from it) read
        # these lines; an entry without a modification time is never checked against the file
        try:
            linecache.cache[path] = (len(data), None, _lines(data), path)
        except (SyntaxError, UnicodeDecodeError, LookupError):
            # not text Python reads (a module of a helper package no one imports, in another
            # encoding): its import fails as the file's would, if it is ever imported
            pass
        # and the version of the helpers beside the function's module reads their text here
        KEPT_TEXTS[Path(path).resolve()] = data
    if not modules:
        return
    sys.meta_path.insert(0, _RegisteredSourceFinder(modules))
    module = entry.partition(":")[0]
    if module.endswith(".py"):
        name = file_module_name(Path(module))
        if name in modules:
            # a file entry is imported by its path (fabric.registry_imports._import_file), which asks
            # no finder: imported here by its name, it is the module that import finds
            from fabric.errors import EntryPointError

            try:
                importlib.import_module(name)
            except Exception as e:  # the user's module may raise anything at import
                raise EntryPointError(
                    f"cannot import {module!r} for {entry!r}: {type(e).__name__}: {e}"
                ) from e
