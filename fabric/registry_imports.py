"""Importing the user's code by name: a module, a package, a ``.py`` file, a
``module:attr`` entry point (discovery's, a worker's, a command line's), and the names a
worker imports a function by. Split from ``fabric.registry``, which re-exports its names."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from fabric.errors import EntryPointError

_FILE_MODULE_PREFIX = "_fabric_file_"


def import_name_of(module_name: str) -> str:
    """What a worker imports the module ``module_name`` of this process as: the module part
    of an entry point (a module name, or the path of a .py file)."""
    module = sys.modules.get(module_name)
    if module_name == "__main__" and module is not None:
        # ``python -m pkg.script`` runs a module of a package as __main__: workers import it
        # by that name (its relative imports need the package; the file alone has none)
        spec_name = getattr(getattr(module, "__spec__", None), "name", None)
        if spec_name and spec_name != "__main__":
            return str(spec_name)
    if module_name == "__main__" or module_name.startswith(_FILE_MODULE_PREFIX):
        path = getattr(module, "__file__", None)
        if path:
            return str(Path(path).resolve())
    return module_name


def entry_point_of(fn: Callable[..., Any]) -> str:
    """``module:qualname`` for ``fn``; a script's functions get ``path.py:qualname``."""
    return f"{import_name_of(fn.__module__)}:{fn.__qualname__}"


def _import_error(name: str, when: str, e: BaseException) -> EntryPointError:
    # a module that ends the interpreter as it is imported (a script's sys.exit outside its
    # `if __name__ == "__main__":`) would end the caller's process with it, `fabric ls` or a
    # job, with no word of which module it was: it is an import error of that module
    if isinstance(e, SystemExit):
        return EntryPointError(
            f"cannot import {name!r} {when}: it called sys.exit({e.code!r}) as it was imported; "
            "a script's exit belongs under `if __name__ == '__main__':`, or the script outside "
            "the package discovery walks"
        )
    return EntryPointError(f"cannot import {name!r} {when}: {import_problem(name, e)}")


def import_problem(target: str, e: BaseException) -> str:
    """Why ``target`` (a module name, ``module:attr`` or a file.py) did not import; when it
    was not found itself, rather than one of its own imports, where it was looked for and
    what to give instead (Python's "No module named 'x'" said nothing of either)."""
    module = target.partition(":")[0]
    if isinstance(e, FileNotFoundError) and module.endswith(".py") and not Path(module).exists():
        return f"no such file: {Path(module).resolve()} (a path is taken from the working directory)"
    if isinstance(e, ModuleNotFoundError) and e.name and (module + ".").startswith(e.name + "."):
        file = module.replace(".", "/") + ".py"
        return (
            f"no module {e.name!r} in the working directory or on PYTHONPATH: run from the directory "
            f"that holds it, add that directory to PYTHONPATH, or give its file ({file})"
        )
    return f"{type(e).__name__}: {e}"


def load_entry_point(entry: str) -> Any:
    """Import ``module:attr`` (or ``file.py:attr``) and return the attribute."""
    mod_name, _, attr = entry.partition(":")
    if not attr:
        raise EntryPointError(f"entry point {entry!r} must look like 'module:attr'")
    if "<locals>" in attr or "<lambda>" in attr:
        raise EntryPointError(
            f"{entry!r} is a nested function or a lambda; worker processes can only import "
            "functions defined at the top level of a module"
        )
    try:
        if mod_name.endswith(".py"):
            module = _import_file(Path(mod_name))
        else:
            module = importlib.import_module(mod_name)
    except (Exception, SystemExit) as e:  # the user's module may raise anything at import
        raise _import_error(mod_name, f"for {entry!r}", e) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EntryPointError(f"{mod_name!r} has no attribute {attr!r} (entry {entry!r})") from None
    return obj


def import_module_or_file(target: str) -> ModuleType:
    """The module named ``target``, or the file ``target`` when it ends in ``.py``."""
    return _import_file(Path(target)) if target.endswith(".py") else importlib.import_module(target)


def file_module_name(path: Path) -> str:
    """The name a .py file imported by its path gets in ``sys.modules``."""
    # a script run as __main__ is imported under another name so its main guard stays off
    return _FILE_MODULE_PREFIX + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]


def _import_file(path: Path) -> ModuleType:
    name = file_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no such file: {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a broken file must fail again next time, not look empty
        raise
    return module
