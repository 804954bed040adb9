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

import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from fabric.deploy.plan import HANDLER, DeployedFunction, DeployError
from fabric.siblings import DEPENDENCIES, CodeTreeError, beside, files, siblings

#: Lambda caps a directly uploaded zip at 50 MB (bigger goes through S3, up to 250 MB unzipped).
MAX_DIRECT_ZIP_BYTES = 50 * 1024 * 1024
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)
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
    (``fabric.siblings``, which a function's version hashes too). Two different paths for one
    archive name are refused."""
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
    try:
        for root in [path for arc, path in roots.items() if arc not in own]:
            for arc, path in beside(siblings(root)):
                _add(roots, arc, path)
    except CodeTreeError as e:
        raise DeployError(str(e)) from None
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


def _files(root: Path, arcname: str, *, hidden: bool = False) -> Iterator[tuple[Path, str]]:
    """``fabric.siblings.files``: a link that makes a cycle, or a link to nothing, is a
    ``DeployError``."""
    try:
        yield from files(root, arcname, hidden=hidden)
    except CodeTreeError as e:
        raise DeployError(str(e)) from None


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
            installed = [
                (p, a)
                for p, a in _files(site, "", hidden=True)
                if not a.startswith(("bin/", "fabric/", "functions/")) and ".dist-info/RECORD" not in a
            ]
            # the names they take at the root, beside the functions' modules: there, not
            # beside them locally, so no function's version hashes them (fabric.siblings)
            tops = {a.lstrip("/").split("/")[0].split(".")[0] for _, a in installed}
            listed = Path(tmp) / DEPENDENCIES
            listed.write_text("".join(f"{name}\n" for name in sorted(t for t in tops if t.isidentifier())))
            entries += [*installed, (listed, DEPENDENCIES)]
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
