"""Decorators and the ``Registry`` object.

``@fabric.reward`` / ``@fabric.tool`` / ``@fabric.function(kind=...)`` work bare or with
arguments. They return the original function, unchanged and still callable in-process,
with its ``FunctionSpec`` attached as ``__fabric_spec__``; they also add it to the default
registry. Fresh ``Registry()`` objects (tests, several jobs in one process) pick functions
up through ``discover()``, which reads that attribute, so nothing depends on which registry
happened to be live when a module was first imported.

What the decorators build on lives beside this module, its names importable from here too:
``fabric.registry_imports`` (importing modules, files and ``module:attr`` entry points),
``fabric.registry_code`` (a function's code and version as registered) and
``fabric.registry_spec`` (its ``FunctionSpec``, from its signature and the options).
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, TypeVar, overload

from fabric.errors import DuplicateFunctionError, RegistryError, UnknownFunctionError
from fabric.registry_code import (
    KEPT_SOURCE_ATTR,
    KEPT_TEXTS,
    FunctionCode,
    ModuleSource,
    capture_code,
    source_version,
)
from fabric.registry_imports import (
    _import_error,
    entry_point_of,
    file_module_name,
    import_module_or_file,
    import_name_of,
    import_problem,
    load_entry_point,
)
from fabric.registry_spec import make_spec
from fabric.spec import FunctionSpec, Kind

F = TypeVar("F", bound=Callable[..., Any])
SPEC_ATTR = "__fabric_spec__"
SETUP_ATTR = "__fabric_setup__"
CODE_ATTR = "__fabric_code__"

# the split-off modules' names are re-exported: they lived here before the split, and other
# code, the docs and users' code import them (and name them in module:attr strings) from here
__all__ = [
    "CODE_ATTR",
    "KEPT_SOURCE_ATTR",
    "KEPT_TEXTS",
    "SETUP_ATTR",
    "SPEC_ATTR",
    "FunctionCode",
    "ModuleSource",
    "NoFunctionsWarning",
    "Registry",
    "capture_code",
    "default_registry",
    "entry_point_of",
    "file_module_name",
    "import_module_or_file",
    "import_name_of",
    "import_problem",
    "load_entry_point",
    "make_spec",
    "source_version",
]


class NoFunctionsWarning(UserWarning):
    """A module named for discovery (``-m``, ``$FABRIC_MODULES``, an integration's
    ``modules``, a job's ``fabric.discover``) registers no fabric function: their decorator
    forgotten, or another module named. Silent, it surfaced later as "unknown function"."""


class Registry:
    """Named functions. Use the default one through the module-level decorators, or a
    fresh one per test or per job."""

    def __init__(self) -> None:
        self._specs: dict[str, FunctionSpec] = {}
        self._fns: dict[str, Callable[..., Any]] = {}
        self._versions: dict[str, list[str]] = {}

    # -- decorators
    @overload
    def function(self, fn: F, /) -> F: ...
    @overload
    def function(self, fn: None = None, /, **options: Any) -> Callable[[F], F]: ...
    def function(self, fn: Any = None, /, *, kind: Kind = "function", **options: Any) -> Any:
        def deco(f: F) -> F:
            setup = options.get("setup")
            code = capture_code(f, setup)  # read once: the version and the code kept are the same
            spec = make_spec(f, kind=kind, code=code, **options)
            setattr(f, SPEC_ATTR, spec)
            setattr(f, SETUP_ATTR, setup)
            setattr(f, CODE_ATTR, code)
            self.add(f)
            return f

        return deco(fn) if fn is not None else deco

    def reward(self, fn: Any = None, /, **options: Any) -> Any:
        return self.function(fn, kind="reward", **options)

    def tool(self, fn: Any = None, /, **options: Any) -> Any:
        return self.function(fn, kind="tool", **options)

    # -- contents
    def add(self, fn: Callable[..., Any]) -> FunctionSpec:
        """Add a function that was decorated (with any registry)."""
        spec: FunctionSpec | None = getattr(fn, SPEC_ATTR, None)
        if spec is None:
            raise RegistryError(
                f"{fn!r} is not a fabric function; decorate it with @fabric.reward/tool/function"
            )
        old = self._specs.get(spec.name)
        if old is not None and old.entry != spec.entry:
            raise DuplicateFunctionError(
                f"function name {spec.name!r} is taken by {old.entry}; {spec.entry} needs another name "
                "(pass name=... to the decorator)"
            )
        # the same entry again (a module reloaded) replaces the old definition
        self._specs[spec.name] = spec
        self._fns[spec.name] = fn
        versions = self._versions.setdefault(spec.name, [])
        if not versions or versions[-1] != spec.version:
            versions.append(spec.version)
        return spec

    def get(self, name: str) -> FunctionSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownFunctionError(name, list(self._specs)) from None

    def find(self, name: str) -> FunctionSpec | None:
        """The spec registered under ``name`` now, or None (``get`` without the error: a
        client asks at every call, to notice a function registered again with new code)."""
        return self._specs.get(name)

    def versions(self, name: str) -> list[str]:
        """The versions of the code registered under ``name``, oldest first, one for each
        change of code: a client tells the answers of code registered since it sent a call
        (its own code, which the local backend may run a call queued before on) from those of
        other code (a deployment not redeployed). Empty for a name never registered."""
        return self._versions.get(name, [])

    def callable(self, name: str) -> Callable[..., Any]:
        self.get(name)
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[FunctionSpec]:
        return [self._specs[n] for n in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __len__(self) -> int:
        return len(self._specs)

    def __iter__(self) -> Iterator[FunctionSpec]:
        return iter(self.specs())

    # -- discovery
    def discover(self, *targets: str) -> list[FunctionSpec]:
        """Import modules, packages (recursively) or ``module:attr`` strings and add every
        fabric function found. Returns the specs added."""
        found: list[FunctionSpec] = []
        for target in targets:
            if ":" in target:
                obj = load_entry_point(target)
                found.append(self.add(obj))
                continue
            try:
                module = import_module_or_file(target)
            except (Exception, SystemExit) as e:  # the user's module may raise anything at import
                raise _import_error(target, "for discovery", e) from e
            for mod in _walk(module):
                for obj in list(vars(mod).values()):
                    spec = getattr(obj, SPEC_ATTR, None)
                    # only where it was defined: re-exports would be found twice
                    if isinstance(spec, FunctionSpec) and getattr(obj, "__module__", None) == mod.__name__:
                        found.append(self.add(obj))
        return found

    def discover_yours(self, target: str, warn: Callable[[str], None] | None = None) -> list[FunctionSpec]:
        """``discover`` for one module the user named: one that adds nothing is told to
        ``warn`` (default: a ``NoFunctionsWarning``, shown once per process)."""
        found = self.discover(target)
        if not found:
            text = (
                f"{target!r} defines no fabric function: decorate yours with @fabric.reward, "
                "@fabric.tool or @fabric.function"
            )
            if warn is None:
                warnings.warn(NoFunctionsWarning(text), stacklevel=2)
            else:
                warn(text)
        return found


def _walk(module: ModuleType) -> Iterator[ModuleType]:
    yield module
    path = getattr(module, "__path__", None)
    if path is None:
        return
    for info in pkgutil.walk_packages(path, prefix=module.__name__ + "."):
        try:
            yield importlib.import_module(info.name)
        except (Exception, SystemExit) as e:
            raise _import_error(info.name, "during discovery", e) from e


#: The registry the module-level decorators write to.
default_registry = Registry()
