"""A function's version covers the modules ``fabric deploy`` ships beside its module: what
that module imports from its own directory (a helper module, a package, a namespace
package, and what those import in turn). The version is what the client, a local pool and
a deployed handler compare to tell stale code: a helper edited while the function's module
was not kept the version, so a deployment of the old helper answered as the caller's code.
And a deployed handler, whose package holds the dependencies beside the modules, computes
the caller's version still."""

from __future__ import annotations

import gc
import importlib
import os
import subprocess
import sys
import weakref
import zipfile
from pathlib import Path

import pytest

from fabric import siblings
from fabric.deploy import package as package_mod
from fabric.deploy import plan_functions
from fabric.deploy.package import build_zip, code_roots
from fabric.registry import CODE_ATTR, Registry

FNS = (
    "from fabric.registry import Registry\n"
    "from vs_helpers import bonus\n"
    "REG = Registry()\n"
    "@REG.function\n"
    "def vs_scored(x: int) -> int:\n"
    "    import vs_lazy\n"
    "    return bonus(x) + vs_lazy.LAZY\n"
)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture(autouse=True)
def _forget_imports():
    """Each import reads the files as they are now: the modules a test imported are
    forgotten after it (and between the versions it compares)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Path:
    rewards = tmp_path / "rewards"
    _write(rewards / "vs_fns.py", FNS)
    _write(rewards / "vs_helpers.py", "from vs_pkg.consts import BASE\ndef bonus(x):\n    return x + BASE\n")
    _write(rewards / "vs_pkg" / "__init__.py", "")
    _write(rewards / "vs_pkg" / "consts.py", "BASE = 100\n")
    _write(rewards / "vs_lazy.py", "LAZY = 1000\n")
    _write(rewards / "vs_unused.py", "UNUSED = 1\n")
    monkeypatch.syspath_prepend(str(rewards))  # as the user ran it: PYTHONPATH, or cwd
    return rewards


def _version() -> str:
    for name in [n for n in sys.modules if n.startswith("vs_")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    reg = Registry()
    reg.discover("vs_fns")
    return reg.get("vs_scored").version


@pytest.mark.parametrize(
    ("edited", "text"),
    [
        ("vs_helpers.py", "from vs_pkg.consts import BASE\ndef bonus(x):\n    return x + BASE + 1\n"),
        ("vs_lazy.py", "LAZY = 2000\n"),  # imported inside the function
        ("vs_pkg/consts.py", "BASE = 200\n"),  # a helper's own import, a package's module
    ],
)
def test_a_helper_shipped_beside_the_module_is_in_its_version(tree, edited, text):
    first = _version()
    (tree / edited).write_text(text)
    assert _version() != first, f"{edited} changed, the version did not"


def test_what_the_module_does_not_import_is_not_in_its_version(tree):
    first = _version()
    (tree / "vs_unused.py").write_text("UNUSED = 2\n")
    _write(tree / "vs_pkg" / "data.txt", "not a module\n")
    assert _version() == first


def test_the_version_hashes_what_the_deploy_ships(tree):
    """One reading for both (``fabric.siblings``): the modules the version covers are the
    deploy package's roots beside the function's module."""
    reg = Registry()
    reg.discover("vs_fns")
    shipped = code_roots(plan_functions(reg, ["vs_scored"]))
    code = getattr(reg.callable("vs_scored"), CODE_ATTR)
    covered = {arc: Path(path) for arc, path in code.beside}
    assert set(covered) == {"vs_helpers.py", "vs_lazy.py", "vs_pkg"}, covered
    assert covered == {k: v for k, v in shipped.items() if k not in ("fabric", "functions", "vs_fns.py")}


@pytest.mark.parametrize("entry", ["vs_fns", "vs_fns.py"], ids=["module", "file"])
def test_a_deployed_handler_with_its_dependencies_beside_computes_the_caller_s_version(
    tree, tmp_path, monkeypatch, entry
):
    """On Lambda the zip's root holds the dependencies pip installed beside the modules: a
    module that imports one (numpy, here vs_dep) finds it there as it would a helper; the
    local directory has none. Had the deployed handler hashed it, every call's version
    differed from the caller's (a warning each, or VersionMismatch under "refuse")."""
    _write(
        tree / "vs_fns.py",
        FNS.replace("    import vs_lazy\n", "    import vs_lazy\n    import vs_dep  # noqa\n"),
    )

    def fake_install(target: Path, **_: object) -> None:  # no network: what pip would leave
        _write(target / "vs_dep" / "__init__.py", "DEP = 1\n")
        _write(target / "vs_dep-1.0.dist-info" / "METADATA", "Name: vs-dep\nVersion: 1.0\n")
        _write(target / "vs_dep_single.py", "X = 1\n")

    monkeypatch.setattr(package_mod, "install_deps", fake_install)
    reg = Registry()
    reg.discover(str(tree / entry) if entry.endswith(".py") else entry)  # -m rewards/vs_fns.py
    plan = plan_functions(reg, ["vs_scored"])
    task = tmp_path / "task"
    zipfile.ZipFile(build_zip(plan, tmp_path / "p.zip", deps=True)).extractall(task)
    assert (task / "vs_dep" / "__init__.py").is_file() and (task / "vs_helpers.py").is_file()
    code = (
        "import sys; sys.path.insert(0, '.')\n"
        "from fabric.registry import Registry\n"
        f"reg = Registry(); reg.discover({plan[0].module!r})\n"
        "print(reg.get('vs_scored').version)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=task, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == reg.get("vs_scored").version


def test_a_reload_after_a_helper_edit_is_a_new_version(tree):
    """A module's body reads the modules beside it once as it runs, for all its functions:
    run again (importlib.reload, the module's own text unchanged) it reads them anew."""
    import vs_fns

    reg = Registry()
    reg.discover("vs_fns")
    first = reg.get("vs_scored").version
    (tree / "vs_lazy.py").write_text("LAZY = 3000\n")
    importlib.reload(vs_fns)
    reg = Registry()
    reg.discover("vs_fns")
    assert reg.get("vs_scored").version != first


def test_the_modules_beside_are_kept_as_the_version_hashed_them(tree):
    """A local pool keeps the modules beside for its workers (``FunctionCode.helpers``):
    each module file under the roots the version covers, by the name a worker imports it
    as, with the bytes the version hashed."""
    reg = Registry()
    reg.discover("vs_fns")
    code = getattr(reg.callable("vs_scored"), CODE_ATTR)
    assert {m.name: Path(m.path) for m in code.helpers} == {
        "vs_helpers": tree / "vs_helpers.py",
        "vs_lazy": tree / "vs_lazy.py",
        "vs_pkg": tree / "vs_pkg" / "__init__.py",
        "vs_pkg.consts": tree / "vs_pkg" / "consts.py",
    }
    assert all(m.plain and m.data == Path(m.path).read_bytes() for m in code.helpers)


def test_a_module_of_many_functions_reads_the_modules_beside_once(tree, monkeypatch):
    """Its body lists (and reads) the modules beside once for all its functions, which
    share one copy of each."""
    listed = []
    sources = siblings.sources
    monkeypatch.setattr(siblings, "sources", lambda *a: listed.append(a) or sources(*a))
    text = "from fabric.registry import Registry\nfrom vs_helpers import bonus\nREG = Registry()\n"
    text += "".join(f"@REG.function\ndef vs_f{i}(x: int) -> int:\n    return bonus(x)\n" for i in range(50))
    _write(tree / "vs_many.py", text)
    reg = Registry()
    reg.discover("vs_many")
    assert len(listed) == 1
    codes = [getattr(reg.callable(f"vs_f{i}"), CODE_ATTR) for i in range(50)]
    assert all(c.helpers == codes[0].helpers for c in codes)
    assert all(a is b for c in codes for a, b in zip(c.helpers, codes[0].helpers, strict=True))


def test_the_modules_kept_beside_go_with_the_functions(tree):
    """Shared between the functions that import them, the helpers' texts are not held for
    them after they are gone."""
    reg = Registry()
    reg.discover("vs_fns")
    kept = [weakref.ref(m) for m in getattr(reg.callable("vs_scored"), CODE_ATTR).helpers]
    assert kept
    del reg
    for name in [n for n in sys.modules if n.startswith("vs_")]:
        del sys.modules[name]
    gc.collect()
    assert [ref() for ref in kept] == [None] * len(kept)
