"""Decorators and the ``Registry`` object.

``@fabric.reward`` / ``@fabric.tool`` / ``@fabric.function(kind=...)`` work bare or with
arguments. They return the original function, unchanged and still callable in-process,
with its ``FunctionSpec`` attached as ``__fabric_spec__``; they also add it to the default
registry. Fresh ``Registry()`` objects (tests, several jobs in one process) pick functions
up through ``discover()``, which reads that attribute, so nothing depends on which registry
happened to be live when a module was first imported.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import pkgutil
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, TypeVar, get_type_hints, overload

from pydantic import ValidationError

from fabric import siblings
from fabric.errors import (
    DuplicateFunctionError,
    EntryPointError,
    RegistryError,
    SignatureError,
    UnknownFunctionError,
    validation_problems,
)
from fabric.spec import CTX_PARAM, FunctionSpec, Kind, ParamSpec, Resources, RetryPolicy

F = TypeVar("F", bound=Callable[..., Any])
SPEC_ATTR = "__fabric_spec__"
SETUP_ATTR = "__fabric_setup__"
CODE_ATTR = "__fabric_code__"
#: A loader class's mark (True) that the module it loads is the kept text of a registered one,
#: which its ``get_data(path)`` returns: a worker's (``fabric.backends._pool_snapshot``)
KEPT_SOURCE_ATTR = "fabric_kept_source"
#: The text of each module file this process imports in place of the file (a worker's
#: kept modules, ``fabric.backends._pool_snapshot.install``), by its real path: a version
#: computed here reads it for the modules beside a function's, as it does the function's
#: own module through its loader, and a pool started here keeps it for its own workers.
KEPT_TEXTS: dict[Path, bytes] = {}
_FILE_MODULE_PREFIX = "_fabric_file_"


# ----------------------------------------------------------------------------- helpers


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


def _params_of(fn: Callable[..., Any], kind: Kind) -> tuple[tuple[ParamSpec, ...], bool]:
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise SignatureError(f"cannot read the signature of {name}: {e}") from None
    try:
        hints = get_type_hints(fn)
    except Exception:  # unresolvable forward references: validate those params as Any
        hints = {}
    params: list[ParamSpec] = []
    accepts_extra = False
    for p in sig.parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            raise SignatureError(
                f"{name}: *{p.name} is not supported; payloads are keyword arguments, "
                "so declare each argument by name"
            )
        if p.kind is p.POSITIONAL_ONLY:
            raise SignatureError(f"{name}: positional-only parameter {p.name!r} cannot be passed by name")
        if p.kind is p.VAR_KEYWORD:
            accepts_extra = True
            continue
        if p.name == CTX_PARAM:
            continue  # filled by the worker with the setup hook's return value
        hint = hints.get(p.name, p.annotation)
        ann = "Any" if hint is inspect.Parameter.empty else getattr(hint, "__name__", str(hint))
        params.append(ParamSpec(name=p.name, required=p.default is p.empty, annotation=ann))
    if kind == "reward" and not params and not accepts_extra:
        raise SignatureError(f"reward {name} takes no arguments; it needs at least the trajectory")
    return tuple(params), accepts_extra


#: FunctionSpec fields that ``make_spec`` derives from the function: never decorator options.
_DERIVED = frozenset({"version", "entry", "params", "is_async", "accepts_extra"})


def make_spec(
    fn: Callable[..., Any],
    *,
    kind: Kind,
    name: str | None = None,
    setup: Callable[[], Any] | None = None,
    retry: RetryPolicy | dict[str, Any] | None = None,
    resources: Resources | dict[str, Any] | None = None,
    code: FunctionCode | None = None,
    **options: Any,
) -> FunctionSpec:
    """The spec of ``fn``. ``code``: ``capture_code(fn, setup)``, taken by the caller that
    keeps it (the decorator), else here."""
    if not callable(fn) or inspect.isclass(fn):
        raise SignatureError(f"@{kind} decorates a function, got {fn!r}")
    derived = sorted(_DERIVED & options.keys())
    if derived:
        # read from the function itself; passed, they raised a bare TypeError (given twice)
        raise RegistryError(
            f"bad options for function {name or getattr(fn, '__name__', fn)!r}: "
            f"{', '.join(derived)} cannot be set, the decorator reads them from the function"
        )
    if not isinstance(getattr(fn, "__name__", None), str) or not hasattr(fn, "__qualname__"):
        # a functools.partial, a callable object: no name to register or to import it by
        raise SignatureError(
            f"@{kind} decorates a function defined with def; {fn!r} has no __name__ (a partial or a "
            "callable object): wrap it in a function"
        )
    if setup is not None and not callable(setup):
        raise SignatureError(f"setup= must be a callable, got {setup!r}")
    if setup is not None and not hasattr(setup, "__qualname__"):
        raise SignatureError(f"setup= must be a function defined with def (workers import it), got {setup!r}")
    if setup is not None:
        try:
            setup_params = inspect.signature(setup).parameters
        except (TypeError, ValueError) as e:
            raise SignatureError(f"cannot read the signature of the setup hook {setup!r}: {e}") from None
        if setup_params:
            raise SignatureError("the setup hook takes no arguments; it runs once per worker")
    params, accepts_extra = _params_of(fn, kind)
    fn_name = name if name is not None else fn.__name__  # name="" is refused, not ignored
    description = options.pop("description", None)
    if description is None:
        description = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
    try:
        return FunctionSpec(
            name=fn_name,
            kind=kind,
            entry=entry_point_of(fn),
            description=description,
            version=(code or capture_code(fn, setup)).version,
            is_async=inspect.iscoroutinefunction(fn),
            setup=entry_point_of(setup) if setup is not None else None,
            params=params,
            accepts_extra=accepts_extra,
            # validated as part of the spec: an error names retry.max_attempts, not max_attempts
            retry=retry if retry is not None else RetryPolicy(),
            resources=resources if resources is not None else Resources(),
            **options,
        )
    except ValidationError as e:
        raise RegistryError(
            f"bad options for function {fn_name!r}: {validation_problems(e, FunctionSpec)}"
        ) from None


# ----------------------------------------------------------------------------- registry


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
