"""What goes into the deploy package of the user's code: the modules a ``file.py`` entry
imports from its own directory, entries that would land on one name, namespace packages
and symlinked directories. Each as the handler would find it on Lambda: the zip unpacked,
its root the working directory and the first sys.path entry (``/var/task``)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from fabric.deploy import DeployError, plan_functions
from fabric.deploy.package import build_zip, image_context
from fabric.registry import Registry

FN = (
    "from fabric.registry import Registry\n"
    "REG = Registry()\n"
    "@REG.function\n"
    "def {name}(x: int) -> int:\n"
    "    return {body}\n"
)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _names(zip_path: Path) -> set[str]:
    return set(zipfile.ZipFile(zip_path).namelist())


def _call_as_lambda(zip_path: Path, module: str, name: str, x: int, where: Path) -> str:
    """Unpack the zip and, in a fresh interpreter whose working directory and first path
    entry are its root, discover ``module`` (RL_FABRIC_MODULES) and call ``name``."""
    root = where / "task"
    zipfile.ZipFile(zip_path).extractall(root)
    code = (
        "import sys; sys.path.insert(0, '.')\n"
        "from fabric.registry import Registry\n"
        f"reg = Registry(); reg.discover({module!r})\n"
        f"print(reg.callable({name!r})({x}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture(autouse=True)
def _forget_imports():
    """The modules a test imports are forgotten after it: the next test's package of that
    name lies in another directory (find_spec answers from sys.modules)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


# -- 1. a file entry's imports from its own directory


def test_a_file_entry_ships_what_it_imports_from_its_own_directory(tmp_path, monkeypatch):
    """``-m rewards/my_fns.py`` whose file imports ``rk_helpers`` (rk_helpers.py beside it)
    shipped my_fns.py alone: on Lambda its import failed, "No module named 'rk_helpers'",
    and every call was SetupFailed. What it imports from its directory goes with it (and
    what those import, a package among them, and an import inside a function); what it
    does not import stays out."""
    rewards = tmp_path / "rewards"
    src = _write(
        rewards / "rk_fns.py",
        "from fabric.registry import Registry\n"
        "from rk_helpers import bonus\n"
        "REG = Registry()\n"
        "@REG.function\n"
        "def rk_scored(x: int) -> int:\n"
        "    import rk_lazy\n"
        "    return bonus(x) + rk_lazy.LAZY\n",
    )
    _write(
        rewards / "rk_helpers.py", "from rk_shared.consts import BASE\ndef bonus(x):\n    return x + BASE\n"
    )
    _write(rewards / "rk_shared" / "__init__.py", "")
    _write(rewards / "rk_shared" / "consts.py", "BASE = 100\n")
    _write(rewards / "rk_lazy.py", "LAZY = 1000\n")
    _write(rewards / "rk_unused.py", "raise SystemExit('not imported')\n")
    monkeypatch.syspath_prepend(str(rewards))  # as the user ran it: PYTHONPATH, or cwd
    reg = Registry()
    reg.discover(str(src))
    plan = plan_functions(reg, ["rk_scored"])
    names = _names(build_zip(plan, tmp_path / "f.zip", deps=False))
    mine = {n for n in names if n.startswith("rk_")}
    assert mine == {
        "rk_fns.py",
        "rk_helpers.py",
        "rk_lazy.py",
        "rk_shared/__init__.py",
        "rk_shared/consts.py",
    }, mine
    assert _call_as_lambda(tmp_path / "f.zip", plan[0].module, "rk_scored", 1, tmp_path) == "1101"
    code = image_context(plan, tmp_path / "image") / "code"
    assert (code / "rk_helpers.py").is_file() and (code / "rk_shared" / "consts.py").is_file()


def test_a_sibling_that_shadows_the_standard_library_is_not_shipped(tmp_path, monkeypatch):
    """A ``json.py`` beside the file does not go for ``import json``: at the root of the
    package it would take the standard library's place for the runtime as well."""
    src = _write(tmp_path / "std" / "std_fns.py", "import json\n" + FN.format(name="std_fn", body="x"))
    _write(tmp_path / "std" / "json.py", "")
    reg = Registry()
    reg.discover(str(src))
    names = _names(build_zip(plan_functions(reg, ["std_fn"]), tmp_path / "f.zip", deps=False))
    assert "std_fns.py" in names and "json.py" not in names


# -- 2. entries of one name


def test_two_file_entries_of_one_name_are_refused(tmp_path):
    """``a/fns.py`` and ``b/fns.py`` both went to ``fns.py`` at the package's root: one
    overwrote the other (the zip held two entries of that name), and the functions of the
    lost one were missing on Lambda."""
    reg = Registry()
    reg.discover(str(_write(tmp_path / "a" / "same_fns.py", FN.format(name="from_a", body="x"))))
    reg.discover(str(_write(tmp_path / "b" / "same_fns.py", FN.format(name="from_b", body="x"))))
    plan = plan_functions(reg, ["from_a", "from_b"])
    with pytest.raises(DeployError) as info:
        build_zip(plan, tmp_path / "f.zip", deps=False)
    text = str(info.value)
    assert "same_fns.py" in text and str(tmp_path / "a") in text and str(tmp_path / "b") in text
    assert "rename" in text
    assert not (tmp_path / "f.zip").exists()


# -- 3. namespace packages


def test_a_namespace_package_is_packaged(tmp_path, monkeypatch):
    """A module in a directory without ``__init__.py`` (``-m ns_rewards.mod``): find_spec
    gives a namespace package no origin, and the deploy failed "cannot find module". Its
    directory goes in, as a package's does."""
    src = tmp_path / "src"
    _write(src / "ns_rewards" / "ns_mod.py", FN.format(name="ns_fn", body="x + 1"))
    _write(src / "ns_rewards" / "data" / "table.txt", "1\n")
    monkeypatch.syspath_prepend(str(src))
    reg = Registry()
    reg.discover("ns_rewards.ns_mod")
    plan = plan_functions(reg, ["ns_fn"])
    names = _names(build_zip(plan, tmp_path / "f.zip", deps=False))
    assert {"ns_rewards/ns_mod.py", "ns_rewards/data/table.txt"} <= names
    assert _call_as_lambda(tmp_path / "f.zip", "ns_rewards.ns_mod", "ns_fn", 1, tmp_path) == "2"


def test_a_namespace_package_in_several_directories_says_what_to_do(tmp_path, monkeypatch):
    for portion in ("one", "two"):
        _write(
            tmp_path / portion / "ns_split" / f"ns_{portion}.py", FN.format(name=f"ns_{portion}", body="x")
        )
        monkeypatch.syspath_prepend(str(tmp_path / portion))
    reg = Registry()
    reg.discover("ns_split.ns_one")
    with pytest.raises(DeployError, match=r"ns_split.* namespace package .*several directories.*__init__"):
        build_zip(plan_functions(reg, ["ns_one"]), tmp_path / "f.zip", deps=False)


# -- 4. symlinked directories


def _linked_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Registry]:
    pkg = tmp_path / "src" / "linked_rewards"
    _write(pkg / "__init__.py", FN.format(name="linked", body="x"))
    _write(tmp_path / "elsewhere" / "corpus" / "pi.txt", "3.14\n")
    (pkg / "corpus").symlink_to(tmp_path / "elsewhere" / "corpus", target_is_directory=True)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    reg = Registry()
    reg.discover("linked_rewards")
    return pkg, reg


def test_a_symlinked_directory_in_a_code_root_is_packaged(tmp_path, monkeypatch):
    """os.walk does not follow a link to a directory: ``linked_rewards/corpus -> ...`` was
    left out of the zip without a word (and the image's copy followed it: the two differed)."""
    _, reg = _linked_package(tmp_path, monkeypatch)
    plan = plan_functions(reg, ["linked"])
    assert "linked_rewards/corpus/pi.txt" in _names(build_zip(plan, tmp_path / "f.zip", deps=False))
    code = image_context(plan, tmp_path / "image") / "code"
    assert (code / "linked_rewards" / "corpus" / "pi.txt").read_text() == "3.14\n"


def test_a_symlink_cycle_in_a_code_root_is_refused_naming_the_link(tmp_path, monkeypatch):
    pkg, reg = _linked_package(tmp_path, monkeypatch)
    (pkg / "sub").mkdir()
    (pkg / "sub" / "up").symlink_to(pkg, target_is_directory=True)
    plan = plan_functions(reg, ["linked"])
    with pytest.raises(DeployError, match=r"sub/up.*cycle|cycle.*sub/up"):
        build_zip(plan, tmp_path / "f.zip", deps=False)
    with pytest.raises(DeployError, match=r"sub/up"):
        image_context(plan, tmp_path / "image")


def test_a_broken_symlink_in_a_code_root_is_a_deploy_error(tmp_path, monkeypatch):
    pkg, reg = _linked_package(tmp_path, monkeypatch)
    (pkg / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    with pytest.raises(DeployError, match=r"gone\.txt.*broken"):
        build_zip(plan_functions(reg, ["linked"]), tmp_path / "f.zip", deps=False)


# -- the same on Modal


def _modal_files(monkeypatch: pytest.MonkeyPatch, reg: Registry, names: list[str]) -> set[str]:
    """The container paths of every file ``build_app``'s image adds (mounts listed, not sent)."""
    import modal
    from modal.mount import _Mount

    from fabric.deploy.modal_ import build_app

    calls = []
    for method in ("add_local_python_source", "add_local_file", "add_local_dir"):
        real = getattr(modal.Image, method)

        def recording(self, *args, _method=method, _real=real, **kwargs):
            calls.append((_method, args, kwargs))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(modal.Image, method, recording)
    build_app(reg, plan_functions(reg, names))
    files = set()
    for method, args, kwargs in calls:
        if method == "add_local_file":
            files.add(str(args[1]))
            continue
        if method == "add_local_dir":
            mount = _Mount._add_local_dir(Path(args[0]), Path(args[1]), ignore=kwargs["ignore"])
        else:
            mount = _Mount._from_local_python_packages(*args, ignore=kwargs["ignore"])
        files |= {str(remote) for e in mount.entries for _, remote in e.get_files_to_upload()}
    return files


def test_the_modal_image_carries_a_file_entrys_sibling_package_from_off_sys_path(tmp_path, monkeypatch):
    """A package beside a file entry went to ``add_local_python_source`` by its name, which
    Modal looks up on sys.path: there it is not (the file imports it in a function), and the
    deploy failed (ModuleNotMountable). It goes by its path."""
    src = _write(
        tmp_path / "far" / "ms_fns.py",
        "from fabric.registry import Registry\nREG = Registry()\n"
        "@REG.function\ndef ms_fn(x: int) -> int:\n    import ms_shared.consts\n"
        "    return x + ms_shared.consts.BASE\n",
    )
    _write(tmp_path / "far" / "ms_shared" / "__init__.py", "")
    _write(tmp_path / "far" / "ms_shared" / "consts.py", "BASE = 1\n")
    reg = Registry()
    reg.discover(str(src))
    files = _modal_files(monkeypatch, reg, ["ms_fn"])
    assert {"/root/ms_fns.py", "/root/ms_shared/__init__.py", "/root/ms_shared/consts.py"} <= files


def test_the_modal_image_carries_a_symlinked_directory(tmp_path, monkeypatch):
    """Modal's walk of a package does not follow links either: as in the zip, the linked
    directory's files go in."""
    _, reg = _linked_package(tmp_path, monkeypatch)
    files = _modal_files(monkeypatch, reg, ["linked"])
    assert {"/root/linked_rewards/__init__.py", "/root/linked_rewards/corpus/pi.txt"} <= files
