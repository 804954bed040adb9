"""What a user's module imports from its own directory: the modules ``fabric deploy`` ships
beside it (``fabric.deploy.package.code_roots``) and a function's version hashes
(``fabric.registry_code.capture_code``), which a local pool keeps as hashed (``sources``) for
its workers. One reading for both: a helper shipped but not hashed
could change under an unchanged version (a deployment of the old helper answering as the
caller's code), and one hashed but not shipped would make every deployed call's version
differ from the caller's.

Locally that directory was on sys.path (the working directory, $PYTHONPATH); on Lambda only
the package's root is, so those modules go beside the function's module there, and the
handler finds them there again when it computes the version. The dependencies pip put in
that root (``DEPENDENCIES``, written by the zip's build) are not the user's modules: the
local directory has none of them.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from fabric.errors import FabricError

SKIP_DIRS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache"})
#: Module names a sibling file must not take at the package's root: the runtime's own
#: imports would get it in place of the standard library's; and the package's own roots,
#: which go from where they were imported.
NOT_SIBLINGS = (
    frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names) | {"fabric", "functions"}
)
#: A file at the root of a deploy package with dependencies: the top-level names pip
#: installed there, one a line. A module importing one finds it beside itself there, and
#: nowhere beside itself locally: not a sibling.
DEPENDENCIES = "fabric-dependencies.txt"


class CodeTreeError(FabricError):
    """A directory of the user's code that cannot be walked: a link that makes a cycle, or a
    link to nothing."""


class Texts:
    """How one reading (a deploy's, a version's) reads the module files: each once, and a
    registered module's (``fabric.registry_code.ModuleSource``) as registered, by its real path:
    a worker imports that text in place of the file, and computes its version from it."""

    def __init__(self, registered: Mapping[Path, bytes] | None = None):
        self._registered = dict(registered or {})
        self._names = {path.name for path in self._registered}
        self._read: dict[Path, bytes] = {}

    def __call__(self, path: Path) -> bytes:
        data = self._read.get(path)
        if data is None:
            if path.name in self._names:  # resolved only then: a path's resolve is the cost
                data = self._registered.get(path.resolve())
            if data is None:
                data = path.read_bytes()
            self._read[path] = data
        return data


def siblings(root: Path, texts: Texts | None = None) -> dict[str, Path]:
    """What the modules of ``root`` (a .py file, or a package's directory) import from the
    directory ``root`` is in: ``from helpers import x`` with helpers.py beside my_fns.py, as
    archive name -> path. Read from the source (every import statement, those in functions
    too), so a module imported lazily counts as well."""
    read = texts or Texts()
    sources = [root] if root.is_file() else sorted(p for p, _ in files(root, root.name) if p.suffix == ".py")
    names: set[str] = set()
    for source in sources:
        names |= imported(read(source), str(source))
    return found_in(names, root.parent)


def found_in(names: Iterable[str], directory: Path) -> dict[str, Path]:
    """Of the top-level module names ``names``, those a module or package in ``directory``
    has (archive name -> path). Nothing for a directory that was installed (site-packages):
    its modules' dependencies are pip's."""
    if {"site-packages", "dist-packages"} & set(directory.resolve().parts):
        return {}
    left_out = NOT_SIBLINGS
    deps = directory / DEPENDENCIES
    if deps.is_file():
        left_out = left_out | {line.strip() for line in deps.read_text().splitlines()}
    found: dict[str, Path] = {}
    for name in sorted(set(names) - left_out):
        package, module = directory / name, directory / f"{name}.py"
        if (package / "__init__.py").is_file():
            found[name] = package
        elif module.is_file():
            found[f"{name}.py"] = module
        elif package.is_dir() and _namespace_here(name, package):
            found[name] = package
    return found


def beside(found: dict[str, Path], texts: Texts | None = None) -> Iterator[tuple[str, Path]]:
    """``found`` (``found_in``'s), then what those import from their own directory, and so on:
    each root read once."""
    todo = list(found.items())
    seen: set[Path] = set()
    while todo:
        arc, path = todo.pop()
        yield arc, path
        real = path.resolve()
        if real not in seen:
            seen.add(real)
            todo += sorted(siblings(path, texts).items(), reverse=True)


def sources(roots: Iterable[tuple[str, Path]], texts: Texts | None = None) -> list[tuple[str, Path, bytes]]:
    """The modules (.py files) under ``roots`` (archive name, path) as (archive name, file,
    text), in their archive names' order: what a version hashes of the modules shipped
    beside a function's (``digest``), and what a local pool keeps of them for its workers
    (``fabric.registry_code.capture_code``), one reading for both. Their data files are not in
    it, as the function's own package's are not."""
    read = texts or Texts()
    return [
        (name, source, read(source))
        for arc, path in sorted(set(roots))
        for source, name in files(path, arc)
        if source.suffix == ".py"
    ]


def digest(listed: Iterable[tuple[str, Path, bytes]]) -> bytes:
    """A hash of the modules ``listed`` (``sources``'), by their archive names."""
    h = hashlib.sha256()
    for name, _, data in listed:
        h.update(f"{name}\0".encode())
        h.update(hashlib.sha256(data).digest())
    return h.digest()


#: The imports read of each source file, with the hash of the text they were read from: a
#: module of 200 functions is read for each, and parsing it again each time is the cost.
_IMPORTS: dict[str, tuple[bytes, frozenset[str]]] = {}


def imported(data: bytes, filename: str) -> frozenset[str]:
    """The top-level names the source ``data`` (of the file ``filename``) imports absolutely
    (``import a.b``, ``from a import b``: ``a``), anywhere in it; relative imports stay
    within their package."""
    key = hashlib.sha256(data).digest()
    last = _IMPORTS.get(filename)
    if last is not None and last[0] == key:
        return last[1]
    try:
        tree = ast.parse(data, filename=filename)
    except (SyntaxError, ValueError):
        names: frozenset[str] = frozenset()  # not Python this interpreter reads: nothing we can tell
    else:
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
        names = frozenset(found)
    _IMPORTS[filename] = (key, names)
    return names


def _namespace_here(name: str, directory: Path) -> bool:
    """Whether ``import name`` finds the directory ``directory`` (one without __init__.py):
    Python takes such a directory only when no module or package of that name is anywhere
    on sys.path, so a data directory named like an installed package is not it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return True
    found = spec.submodule_search_locations if spec.origin is None else None
    return bool(found) and directory.resolve() in {Path(p).resolve() for p in found or ()}


def files(root: Path, arcname: str, *, hidden: bool = False) -> Iterator[tuple[Path, str]]:
    """The files under ``root`` and their archive names. ``hidden=False`` (code roots: your
    package's tree) leaves out dotfiles and dot-directories: a ``.env`` with secrets, ``.git``,
    a ``.venv`` inside the package. The installed dependencies keep theirs.

    Links are followed (a directory linked into the package is part of it: os.walk's
    default left it out); a link to a directory that holds it is refused, which would
    never end, and so is a link to nothing."""
    if root.is_file():
        yield root, arcname
        return
    # the real directories each one walked lies in, its own included: a link to one of them
    # is a cycle (a link to a directory seen elsewhere is only a copy)
    within: dict[str, tuple[Path, ...]] = {os.fspath(root): (root.resolve(),)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        chain = within.pop(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and (hidden or not d.startswith(".")))
        for d in dirnames:
            real = Path(dirpath, d).resolve()
            if real in chain:
                raise CodeTreeError(
                    f"{Path(dirpath, d)}: a link to {real}, which holds it: a cycle the deploy package "
                    "cannot hold; remove the link or point it elsewhere"
                )
            within[os.path.join(dirpath, d)] = (*chain, real)
        # by strings: a version walks this for each function registered (pathlib's the cost)
        rel = os.path.relpath(dirpath, root)
        prefix = arcname if rel == "." else os.path.join(arcname, rel)
        for f in sorted(filenames):
            if f.endswith((".pyc", ".pyo")) or (not hidden and f.startswith(".")):
                continue
            path = os.path.join(dirpath, f)
            if not os.path.exists(path):
                raise CodeTreeError(f"{path}: a broken link (to {os.readlink(path)}): remove it or fix it")
            yield Path(path), os.path.join(prefix, f)
