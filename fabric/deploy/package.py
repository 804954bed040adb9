"""The Lambda deployment package: a zip, or a container image build context.

The zip holds the ``fabric`` and ``functions`` packages, the modules the deployed functions
live in and what those import from their own directory (without dotfiles and
dot-directories: ``.env``, ``.git``, ``.venv``; linked directories followed), and (unless
``deps=False``) the dependencies, installed by pip for Lambda's platform (manylinux x86_64
or aarch64, CPython 3.11, wheels only) rather than for this machine. boto3 is left out: the
Lambda Python runtime has it. The zip is deterministic (sorted entries, fixed timestamps), so
an unchanged package keeps its hash and terraform does not redeploy it.

Heavy functions (an LLM judge with a model, native toolchains for the code verifier) go
as a container image instead: ``image_context`` writes a Dockerfile on the AWS Lambda
Python base image and the code beside it; build and push it with your registry's tools
(no Docker engine is needed here).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from fabric.deploy.plan import HANDLER, DeployedFunction, DeployError

#: Lambda caps a directly uploaded zip at 50 MB (bigger goes through S3, up to 250 MB unzipped).
MAX_DIRECT_ZIP_BYTES = 50 * 1024 * 1024
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)
_SKIP_DIRS = {"__pycache__", ".mypy_cache", ".pytest_cache"}
#: Provided by the Lambda runtime; not worth 20 MB of the package.
_IN_RUNTIME = {"boto3", "botocore", "s3transfer", "jmespath"}
_EXTRAS = ("aws", "rewards")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise DeployError(f"cannot find the {name!r} package to put in the deploy package")
    return Path(spec.origin).parent


def code_roots(functions: Iterable[DeployedFunction]) -> dict[str, Path]:
    """Archive name -> local path of every code root the package needs: ``fabric``,
    ``functions``, the functions' modules, and what those import from their own directory
    (``_siblings``). Two different paths for one archive name are refused."""
    roots: dict[str, Path] = {"fabric": _package_dir("fabric"), "functions": _package_dir("functions")}
    for fn in functions:
        if fn.source_file is not None:
            path = Path(fn.source_file)
            if not path.is_file():
                raise DeployError(f"{fn.name}: entry file {fn.source_file!r} not found")
            _add(roots, path.name, path)
            continue
        top = fn.module.split(".")[0]
        if top in roots:
            continue
        spec = importlib.util.find_spec(top)
        if spec is not None and spec.origin is None and spec.submodule_search_locations:
            # a namespace package (a directory without __init__.py): its directory, as a
            # package's; one only, for one directory of that name is what the package holds
            portions = list(dict.fromkeys(spec.submodule_search_locations))
            if len(portions) > 1:
                raise DeployError(
                    f"{fn.name}: {top!r} is a namespace package in several directories "
                    f"({', '.join(portions)}); the deploy package holds one directory of that name: "
                    "merge them into one directory (a package with an __init__.py lies in one)"
                )
            _add(roots, top, Path(portions[0]))
            continue
        if spec is None or spec.origin is None:
            raise DeployError(f"{fn.name}: cannot find module {top!r} to package")
        origin = Path(spec.origin)
        if origin.name == "__init__.py":
            _add(roots, top, origin.parent)
        else:
            _add(roots, origin.name, origin)
    own = {"fabric", "functions"}
    todo = [path for arc, path in roots.items() if arc not in own]
    while todo:
        for arc, path in _siblings(todo.pop()).items():
            if arc not in roots:
                todo.append(path)
            _add(roots, arc, path)
    return roots


def _add(roots: dict[str, Path], arc: str, path: Path) -> None:
    """``roots[arc] = path``, unless another path has that name: one would overwrite the
    other in the package (two ``fns.py`` file entries from two directories)."""
    there = roots.get(arc)
    if there is None:
        roots[arc] = path
    elif there.resolve() != path.resolve():
        raise DeployError(
            f"{there} and {path} would both be {arc!r} in the deploy package, which holds the "
            "functions' modules at its root: rename one (or move them into a package)"
        )


#: Module names a sibling file must not take at the package's root: the runtime's own
#: imports would get it in place of the standard library's; and the package's own roots,
#: which go from where they were imported.
_NOT_SIBLINGS = (
    frozenset(sys.stdlib_module_names) | frozenset(sys.builtin_module_names) | {"fabric", "functions"}
)


def _siblings(root: Path) -> dict[str, Path]:
    """What the modules of ``root`` (a .py file, or a package's directory) import from the
    directory ``root`` is in: ``from helpers import x`` with helpers.py beside my_fns.py.
    Locally that directory was on sys.path (the working directory, $PYTHONPATH); on Lambda
    only the package's root is, so those go beside it. Read from the source (every import
    statement, those in functions too), so a module imported lazily goes as well. Nothing
    for a root that was installed (site-packages): its dependencies are pip's."""
    parent = root.parent
    if {"site-packages", "dist-packages"} & set(parent.resolve().parts):
        return {}
    found: dict[str, Path] = {}
    sources = [root] if root.is_file() else sorted(p for p, _ in _files(root, root.name) if p.suffix == ".py")
    for source in sources:
        for name in sorted(_imported(source) - _NOT_SIBLINGS):
            package, module = parent / name, parent / f"{name}.py"
            if (package / "__init__.py").is_file():
                found[name] = package
            elif module.is_file():
                found[f"{name}.py"] = module
            elif package.is_dir() and _namespace_here(name, package):
                found[name] = package
    return found


def _imported(source: Path) -> set[str]:
    """The top-level names ``source`` imports absolutely (``import a.b``, ``from a import
    b``: ``a``), anywhere in it; relative imports stay within their package."""
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except (SyntaxError, ValueError):
        return set()  # not Python this interpreter reads: it imports nothing we can tell
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
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


def _files(root: Path, arcname: str, *, hidden: bool = False) -> Iterator[tuple[Path, str]]:
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
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and (hidden or not d.startswith(".")))
        for d in dirnames:
            real = Path(dirpath, d).resolve()
            if real in chain:
                raise DeployError(
                    f"{Path(dirpath, d)}: a link to {real}, which holds it: a cycle the deploy package "
                    "cannot hold; remove the link or point it elsewhere"
                )
            within[os.path.join(dirpath, d)] = (*chain, real)
        for f in sorted(filenames):
            if f.endswith((".pyc", ".pyo")) or (not hidden and f.startswith(".")):
                continue
            path = Path(dirpath) / f
            if not path.exists():
                raise DeployError(f"{path}: a broken link (to {os.readlink(path)}): remove it or fix it")
            yield path, str(Path(arcname) / path.relative_to(root))


def linked_dirs(root: Path) -> list[Path]:
    """The links to directories under the directory ``root`` that ``_files`` follows (links
    within linked directories too), relative to ``root``: for a copier that does not follow
    them (Modal's). Raises as ``_files`` does on a cycle or a broken link."""
    found = set()
    for path, _ in _files(root, ""):
        found |= {p for p in path.relative_to(root).parents if p != Path(".") and (root / p).is_symlink()}
    return sorted(found)


def requirements(pip: Sequence[str] = ()) -> list[str]:
    """The runtime dependencies of rl-fabric's base install and its ``aws`` and ``rewards``
    extras, minus what the Lambda runtime has, and ``pip``: the deployed functions' own
    (``fabric deploy --pip``), which nothing else would put in the package."""
    try:
        reqs = importlib.metadata.requires("rl-fabric") or []
    except importlib.metadata.PackageNotFoundError:
        raise DeployError(
            "rl-fabric is not installed (pip install -e .); its requirements are unknown"
        ) from None
    out = []
    for req in reqs:
        spec, _, marker = req.partition(";")
        marker = marker.strip()
        if "extra ==" in marker:
            if not any(f'extra == "{e}"' in marker for e in _EXTRAS):
                continue
            keep = spec.strip()
        else:
            # a base dependency, perhaps for some Pythons or platforms only: with its marker,
            # for pip to evaluate (dropped with the extras', the function failed its import)
            keep = f"{spec.strip()}; {marker}" if marker else spec.strip()
        name = re.match(r"[A-Za-z0-9._-]*", spec.strip())
        if name is None or name.group(0).lower() in _IN_RUNTIME:
            continue
        out.append(keep)
    return sorted({*out, *pip})


def install_deps(
    target: Path, *, architecture: str = "x86_64", python: str = "3.11", pip: Sequence[str] = ()
) -> None:
    platform = "manylinux2014_x86_64" if architecture == "x86_64" else "manylinux2014_aarch64"
    cmd = [
        *(sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target)),
        *("--platform", platform, "--implementation", "cp", "--python-version", python),
        "--only-binary=:all:",
        *requirements(pip),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        # a --pip that is no requirement at all ('numpy>=>1') is a typo to fix, not a
        # dependency without a wheel, which the other advice is for
        advice = (
            "--pip takes pip requirements, as `pip install` does (e.g. 'numpy>=1.26')."
            if "Invalid requirement" in done.stderr
            else "A dependency without a wheel for that platform needs --image (a container image), "
            "or --no-deps with the dependencies in a Lambda layer."
        )
        raise DeployError(
            f"pip could not install the dependencies for Lambda ({platform}, Python {python}):\n"
            f"{done.stderr.strip()[-2000:]}\n{advice}"
        )


def build_zip(
    functions: list[DeployedFunction],
    out: Path,
    *,
    deps: bool = True,
    architecture: str = "x86_64",
    pip: Sequence[str] = (),
) -> Path:
    """Write ``out`` (a .zip) and return it. ``pip``: the functions' own dependencies, installed
    beside rl-fabric's (``deps`` only)."""
    roots = code_roots(functions)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fabric-deploy-") as tmp:
        entries: list[tuple[Path, str]] = []
        if deps:
            site = Path(tmp) / "site"
            install_deps(site, architecture=architecture, pip=pip)
            entries += [
                (p, a)
                for p, a in _files(site, "", hidden=True)
                if not a.startswith(("bin/", "fabric/", "functions/")) and ".dist-info/RECORD" not in a
            ]
        for arc, path in sorted(roots.items()):
            entries += list(_files(path, arc))
        partial = out.with_suffix(".zip.partial")
        with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
            for path, arc in sorted(entries, key=lambda e: e[1]):
                info = zipfile.ZipInfo(arc.lstrip("/"), date_time=_FIXED_TIME)
                info.external_attr = 0o644 << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())
        partial.replace(out)  # a failed build never leaves a half-written package behind
    return out


DOCKERFILE = """\
# rl-fabric functions as a Lambda container image (generated by `fabric deploy --image`).
# Build and push with your registry's tools, e.g.
#   docker build --platform linux/{arch} -t ACCOUNT.dkr.ecr.REGION.amazonaws.com/rl-fabric:TAG .
FROM public.ecr.aws/lambda/python:{python}
COPY requirements.txt ${{LAMBDA_TASK_ROOT}}/
RUN pip install --no-cache-dir -r ${{LAMBDA_TASK_ROOT}}/requirements.txt
COPY code/ ${{LAMBDA_TASK_ROOT}}/
CMD ["{handler}"]
"""


def image_context(
    functions: list[DeployedFunction],
    out: Path,
    *,
    python: str = "3.11",
    architecture: str = "x86_64",
    pip: Sequence[str] = (),
) -> Path:
    """A build context (Dockerfile, requirements.txt, code/) in ``out``; returns ``out``."""
    roots = code_roots(functions)
    # the zip's files: no dotfiles or dot-directories (.env, .git, .venv) from your tree,
    # linked directories followed; listed first, so a refused link leaves no half context
    files = [entry for arc, path in sorted(roots.items()) for entry in _files(path, arc)]
    if out.exists():
        shutil.rmtree(out)
    code = out / "code"
    code.mkdir(parents=True)
    for source, name in files:
        target = code / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    (out / "requirements.txt").write_text("\n".join(requirements(pip)) + "\n")
    arch = "amd64" if architecture == "x86_64" else "arm64"
    (out / "Dockerfile").write_text(DOCKERFILE.format(python=python, handler=HANDLER, arch=arch))
    return out
