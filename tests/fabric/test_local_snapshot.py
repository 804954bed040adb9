"""The local pool runs the code that was registered, whatever happens to the file on disk
since (a ``git checkout`` in the working copy during a days-long job): the source of the
module that defines a function is taken when it is registered, and the workers a pool
starts (the first ones, a scale-up, the replacement of a crashed or timed-out worker)
import that text, not the file. A deliberate registration (reload, then discover) still
moves to the new code. The version hashes that whole module, so an edit to a helper is a
new version. Real worker processes, real files edited on disk."""

from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import importlib.util
import itertools
import os
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from fabric.backends.base import LocalConfig
from fabric.backends.local import LocalBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result
from fabric.registry import Registry, load_entry_point, make_spec

_NAMES = itertools.count(1)

# {code} changes a module-level constant, {helper} a helper's body, {body} the function's
# own source; {top} shifts every line down (a traceback must quote the registered lines)
_MOD = """{top}
import os
import time
import fabric

CODE = "{code}"


def helper() -> str:
    return "{helper}"


@fabric.function(name="{name}", timeout_s={timeout}, max_concurrency=2, warm=1)
def answer(die: bool = False, hang: bool = False, fail: bool = False) -> dict:
    if die:
        os._exit(9)  # a crash: the worker is gone under the call
    if hang:
        time.sleep(60)  # past timeout_s: the pool kills the worker
    if fail:
        raise ValueError("failed in " + CODE)
    return {{"code": CODE, "body": "{body}", "helper": helper(), "pid": os.getpid(), "file": __file__}}
"""


def _module(name: str, *, code: str = "v1", helper: str = "v1", body: str = "v1", timeout: float = 30) -> str:
    top = "" if (code, helper, body) == ("v1", "v1", "v1") else "# edited\n# since\n"
    return textwrap.dedent(
        _MOD.format(top=top, name=name, code=code, helper=helper, body=body, timeout=timeout)
    )


def _v1(result: Result) -> None:
    assert result.ok, result.error
    assert (result.value["code"], result.value["body"], result.value["helper"]) == ("v1",) * 3, result.value


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A directory on sys.path (the workers get the parent's) for the test's modules; the
    modules it imported are forgotten after it."""
    monkeypatch.syspath_prepend(str(tmp_path))
    # no .pyc: a rewrite within the same second must not be read from a stale cache
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    before = set(sys.modules)
    prefix = f"snap_{request.node.name.split('[')[0][5:30]}_{next(_NAMES)}"
    yield tmp_path, prefix
    for name in set(sys.modules) - before:
        if name.startswith(("snap_", "_fabric_file_")):
            sys.modules.pop(name, None)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    importlib.invalidate_caches()


async def _call(b: LocalBackend, name: str, **payload: bool) -> Result:
    return await asyncio.wait_for(b.submit(Invocation(function=name, payload=payload)), 30)


async def _lose_the_worker(b: LocalBackend, name: str, how: str) -> None:
    """The pool's worker crashes (``die``) or is killed past its timeout (``hang``)."""
    r = await _call(b, name, **{how: True})
    want = ErrorCode.WORKER_LOST if how == "die" else ErrorCode.TIMEOUT
    assert not r.ok and r.error is not None and r.error.type == want, r


@pytest.mark.parametrize("how", ["die", "hang"])
async def test_a_replacement_worker_runs_the_registered_code_after_the_file_changed(modules, how):
    """The module file rewritten on disk (the function, a helper and a constant) and not
    registered again: the worker that replaced a crashed or timed-out one imported the new
    file, its version differed from the registered one and it was refused as stale; with
    no other worker every call failed SetupFailed. It imports the registered text now."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    _write(tmp / f"{prefix}.py", _module(name, timeout=1.5))
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        first = await _call(b, name)
        _v1(first)
        _write(tmp / f"{prefix}.py", _module(name, code="v2", helper="v2", body="v2", timeout=1.5))
        await _lose_the_worker(b, name, how)
        for _ in range(3):  # and the calls keep succeeding, on the registered code
            again = await _call(b, name)
            _v1(again)
        assert again.value["pid"] != first.value["pid"]
        # the module is the registered one under its own name and file
        assert again.value["file"] == str(tmp / f"{prefix}.py")
        # a traceback quotes the registered lines, not those at the same numbers in the new file
        failed = await _call(b, name, fail=True)
        assert not failed.ok and failed.error is not None, failed
        assert failed.error.message == "ValueError: failed in v1", failed.error
        assert 'raise ValueError("failed in " + CODE)' in (failed.error.traceback or ""), failed.error


async def test_a_replacement_worker_runs_the_registered_code_after_the_file_was_removed(modules):
    """A checkout of a branch without the module: a replacement found no module to import
    (SetupFailed for every call once the last worker was gone)."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    _write(tmp / f"{prefix}.py", _module(name))
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        _v1(await _call(b, name))
        (tmp / f"{prefix}.py").unlink()
        importlib.invalidate_caches()
        await _lose_the_worker(b, name, "die")
        _v1(await _call(b, name))
        failed = await _call(b, name, fail=True)  # its traceback still has the lines
        assert failed.error is not None and 'raise ValueError("failed in " + CODE)' in (
            failed.error.traceback or ""
        ), failed.error


@pytest.mark.parametrize("ending", ["no final newline", "crlf, no final newline", "latin-1"])
async def test_the_workers_version_is_the_registered_one_however_the_file_is_written(modules, ending):
    """A module whose last line (the function's, at the end of the file) has no newline:
    the worker's version hashes the function's source as the kept lines give it, which
    lacked the newline that Python's line cache adds to a file read from disk; every worker
    was refused as stale and each call failed SetupFailed, the file unchanged."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    text = f'import fabric\n\n\n@fabric.function(name="{name}", timeout_s=30)\ndef answer() -> str:\n'
    if ending == "latin-1":
        data = ("# -*- coding: latin-1 -*-\n" + text + '    return "caf\u00e9"\n').encode("latin-1")
    else:
        data = (text + '    return "caf\u00e9"').encode()
        if ending.startswith("crlf"):
            data = data.replace(b"\n", b"\r\n")
    (tmp / f"{prefix}.py").write_bytes(data)
    importlib.invalidate_caches()
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        r = await _call(b, name)
        assert r.ok and r.value == "caf\u00e9", r.error


async def test_the_code_survives_through_the_client_too(modules):
    """The same through a Client (its retries and its idempotency keys over the pool)."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    _write(tmp / f"{prefix}.py", _module(name))
    reg = Registry()
    reg.discover(prefix)
    async with Client(backend=LocalConfig(max_workers=1), registry=reg) as c:
        _v1(await c.call(name, {}))
        _write(tmp / f"{prefix}.py", _module(name, body="v2"))
        lost = await c.call(name, {"die": True})
        assert not lost.ok and lost.error is not None and lost.error.type == ErrorCode.WORKER_LOST, lost
        for r in await asyncio.gather(*(c.call(name, {}) for _ in range(4))):
            _v1(r)


async def test_an_edit_to_a_helper_is_a_new_version_and_not_run_unregistered(modules):
    """The version hashed only the function's (and its setup hook's) source: a helper or a
    constant of the same module edited gave the same version, so a replacement worker ran
    the new helper under the registered version (which keys the calls) silently, and a
    registration of the edit was not a new version. The whole module is hashed now."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    _write(tmp / f"{prefix}.py", _module(name))
    reg = Registry()
    reg.discover(prefix)
    old = reg.get(name)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        _v1(await _call(b, name))
        _write(tmp / f"{prefix}.py", _module(name, code="v2", helper="v2"))  # the function as it was
        await _lose_the_worker(b, name, "die")
        _v1(await _call(b, name))
        importlib.reload(sys.modules[prefix])
        reg.discover(prefix)
        assert reg.get(name).version != old.version
        new = await _call(b, name)
        assert new.ok and (new.value["code"], new.value["helper"]) == ("v2", "v2"), new


def test_the_version_follows_the_whole_module(tmp_path):
    """A function's version changes with anything in its module file (a helper, a
    constant), and only with the text: the same text in another file is the same version."""
    texts = {
        "a": "K = 1\n\ndef helper():\n    return K\n\ndef scorer(traj):\n    return helper()\n",
        "b": "K = 2\n\ndef helper():\n    return K\n\ndef scorer(traj):\n    return helper()\n",
        "c": "K = 1\n\ndef helper():\n    return K + 0\n\ndef scorer(traj):\n    return helper()\n",
        "d": "K = 1\n\ndef helper():\n    return K\n\ndef scorer(traj):\n    return helper()\n",
    }
    versions = {}
    for key, text in texts.items():
        (tmp_path / f"{key}.py").write_text(text)
        fn = load_entry_point(f"{tmp_path / f'{key}.py'}:scorer")
        versions[key] = make_spec(fn, kind="reward").version
    assert versions["a"] != versions["b"]  # a constant
    assert versions["a"] != versions["c"]  # a helper
    assert versions["a"] == versions["d"]  # the text, not the file it is in


async def test_a_registration_still_moves_to_the_new_code_and_keeps_it(modules):
    """An on-disk edit is not picked up, a registration is; and the code registered then is
    what the new pool's replacements run, whatever the file holds later."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    path = tmp / f"{prefix}.py"
    _write(path, _module(name))
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        _v1(await _call(b, name))
        _write(path, _module(name, code="v2", helper="v2", body="v2"))
        await _lose_the_worker(b, name, "die")
        _v1(await _call(b, name))

        importlib.reload(sys.modules[prefix])  # the deliberate registration of v2
        reg.discover(prefix)
        two = await _call(b, name)
        assert two.ok and two.value["body"] == "v2", two

        _write(path, _module(name, code="v3", helper="v3", body="v3"))
        await _lose_the_worker(b, name, "die")
        after = await _call(b, name)
        assert after.ok and (after.value["code"], after.value["body"]) == ("v2", "v2"), after
        assert after.value["pid"] != two.value["pid"]


_WITH_SETUP = """
import os

import fabric
from {setup_module} import load


@fabric.function(name="{name}", setup=load, max_concurrency=1, warm=1)
def answer(ctx, die: bool = False) -> dict:
    if die:
        os._exit(9)
    return ctx
"""


async def test_a_setup_hook_in_another_module_runs_as_registered(modules):
    """The setup hook's source is part of the version: its module, edited since, made a
    replacement worker stale. Its module is kept as the function's is."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    setup_module = f"{prefix}_setup"
    _write(tmp / f"{setup_module}.py", "def load() -> dict:\n    return {'setup': 'v1'}\n")
    _write(tmp / f"{prefix}.py", textwrap.dedent(_WITH_SETUP.format(name=name, setup_module=setup_module)))
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        assert (await _call(b, name)).value == {"setup": "v1"}
        _write(tmp / f"{setup_module}.py", "def load() -> dict:\n    return {'setup': 'v2'}\n")
        await _lose_the_worker(b, name, "die")
        again = await _call(b, name)
        assert again.ok and again.value == {"setup": "v1"}, again


_PKG_INIT = """
import os

import fabric

from .sub import K  # a submodule of the package the function is defined in


@fabric.function(name="{name}_init", max_concurrency=1, warm=1)
def init_answer(die: bool = False) -> dict:
    if die:
        os._exit(9)
    return {{"code": "{code}", "k": K}}
"""

_PKG_MOD = """
import os
from pathlib import Path

import fabric

from . import helper  # relative imports resolve in the package as before
from .sub import K


@fabric.function(name="{name}_mod", max_concurrency=1, warm=1)
def mod_answer(die: bool = False) -> dict:
    if die:
        os._exit(9)
    data = (Path(__file__).parent / "data.txt").read_text()
    return {{"code": "{code}", "k": K, "helper": helper.H, "data": data, "file": __file__}}
"""


@pytest.mark.parametrize("package", ["regular", "namespace"])
async def test_modules_of_a_package_keep_their_relative_imports_and_their_file(modules, package):
    """A module of a package (a regular one, or a namespace package: a directory without
    ``__init__.py``) runs its registered text under its own name: its relative imports
    resolve in the package, ``__file__`` is its file, so data beside it is found (read as
    it is on disk: only the module's source is kept). A function in a package's
    ``__init__.py`` keeps its submodules."""
    tmp, prefix = modules
    pkg = tmp / prefix
    name = prefix
    _write(pkg / "sub.py", "K = 'k1'\n")
    _write(pkg / "helper.py", "H = 'h1'\n")
    _write(pkg / "data.txt", "d1")
    _write(pkg / "mod.py", textwrap.dedent(_PKG_MOD.format(name=name, code="v1")))
    targets = [f"{prefix}.mod"]
    if package == "regular":
        _write(pkg / "__init__.py", textwrap.dedent(_PKG_INIT.format(name=name, code="v1")))
        targets.append(prefix)
    reg = Registry()
    for target in targets:
        reg.discover(target)
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        mod = await _call(b, f"{name}_mod")
        assert mod.ok and mod.value["code"] == "v1", mod
        _write(pkg / "mod.py", "# edited\n" + textwrap.dedent(_PKG_MOD.format(name=name, code="v2")))
        _write(pkg / "data.txt", "d2")
        await _lose_the_worker(b, f"{name}_mod", "die")
        mod = await _call(b, f"{name}_mod")
        assert mod.ok, mod.error
        assert mod.value == {
            "code": "v1",
            "k": "k1",
            "helper": "h1",
            "data": "d2",  # beside the module, as it is now
            "file": str(pkg / "mod.py"),
        }
        if package == "regular":
            init = f"{name}_init"
            assert (await _call(b, init)).ok
            _write(pkg / "__init__.py", textwrap.dedent(_PKG_INIT.format(name=name, code="v2")))
            lost = await _call(b, init, die=True)
            assert not lost.ok, lost
            again = await _call(b, init)
            assert again.ok and again.value == {"code": "v1", "k": "k1"}, again


async def test_a_script_file_runs_its_registered_text(modules):
    """A function registered from a file path (``discover("path/to/rewards.py")``, a script
    run as ``__main__``): its workers import the file by path, and get the registered text."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    path = tmp / "scripts" / f"{prefix}.py"
    _write(path, _module(name))
    reg = Registry()
    reg.discover(str(path))
    assert reg.get(name).entry == f"{path}:answer"
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        _v1(await _call(b, name))
        _write(path, _module(name, code="v2", body="v2"))
        await _lose_the_worker(b, name, "die")
        again = await _call(b, name)
        _v1(again)
        assert again.value["file"] == str(path)


async def test_a_module_from_a_zip_is_imported_as_it_is_and_refused_when_it_changed(modules):
    """A module that is not a plain .py file (here: in a zip on sys.path) has no snapshot:
    its workers import it as Python finds it then. Changed since it was registered, such a
    worker is refused as stale (the backstop), and the message says why it was not kept."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    archive = tmp / f"{prefix}.zip"

    def pack(text: str) -> None:
        part = tmp / "part.zip"
        with zipfile.ZipFile(part, "w") as z:
            z.writestr(f"{prefix}.py", text)
        os.replace(part, archive)

    pack(_module(name))
    sys.path.insert(0, str(archive))  # the fixture's monkeypatch restores sys.path
    importlib.invalidate_caches()
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1, setup_failure_cooldown_s=60)) as b:
        _v1(await _call(b, name))
        pack(_module(name, body="v2"))
        await _lose_the_worker(b, name, "die")
        refused = await _call(b, name)
        assert not refused.ok and refused.error is not None, refused
        assert refused.error.type == ErrorCode.SETUP_FAILED, refused.error
        message = refused.error.message
        assert "changed since it was registered" in message, message
        assert f"{prefix} is not a plain .py file" in message, message


async def test_nothing_is_left_behind(modules, monkeypatch):
    """The registered text lives in the parent's memory and goes to each worker with its
    start: no snapshot file or directory is written, so none is left when the pool closes
    (nor any process)."""
    tmp, prefix = modules
    scratch = tmp / "scratch"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    name = f"{prefix}_fn"
    _write(tmp / f"{prefix}.py", _module(name))
    reg = Registry()
    reg.discover(prefix)
    listing = sorted(p.name for p in tmp.iterdir())
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        _v1(await _call(b, name))
        _write(tmp / f"{prefix}.py", _module(name, body="v2"))
        await _lose_the_worker(b, name, "die")
        _v1(await _call(b, name))
        pids = b.stats()[name]["pids"]
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp.iterdir()) == listing
    deadline = time.monotonic() + 5
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, "a worker outlived its pool"
        await asyncio.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


_NESTED = """
import os
import fabric
from fabric.backends.base import LocalConfig

CODE = "{code}"


@fabric.function(name="{name}_inner", warm=0)
def inner() -> dict:
    return {{"code": CODE, "pid": os.getpid()}}


@fabric.function(name="{name}_outer", warm=0, timeout_s=60)
async def outer() -> dict:
    # a pool of its own, in the worker: started from the module this worker imported
    reg = fabric.Registry()
    reg.discover(__name__)
    async with fabric.Client(backend=LocalConfig(max_workers=1), registry=reg) as c:
        r = await c.call("{name}_inner", {{}})
    assert r.ok, r.error
    return {{"code": CODE, "inner": r.value, "pid": os.getpid()}}
"""


async def test_a_pool_started_in_a_worker_runs_the_registered_code_after_the_file_changed(modules):
    """A function that starts a local pool of its own (a reward that calls a tool through a
    Client): its module, in the worker, is the kept text, read by the snapshot's loader. The
    capture took only Python's own source loader (by its exact class) for a plain file, so
    the nested pool kept nothing and its workers imported the file as it is now: changed
    since, each was refused as stale, and every call failed SetupFailed. The snapshot's
    loader says that its text is the registered one, which the nested pool keeps too."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    _write(tmp / f"{prefix}.py", textwrap.dedent(_NESTED.format(name=name, code="v1")))
    reg = Registry()
    reg.discover(prefix)
    _write(tmp / f"{prefix}.py", "# edited since\n" + textwrap.dedent(_NESTED.format(name=name, code="v2")))
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        r = await asyncio.wait_for(b.submit(Invocation(function=f"{name}_outer", payload={})), 60)
    assert r.ok, r.error
    assert (r.value["code"], r.value["inner"]["code"]) == ("v1", "v1"), r.value
    assert r.value["inner"]["pid"] != r.value["pid"]  # the inner call ran in a nested worker


async def test_a_pool_started_in_a_worker_keeps_the_helpers_as_registered(modules):
    """A helper beside the module, edited since, is the registered text in the worker (its
    version reads it there), and a pool started in the worker keeps that text too."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    helper = tmp / f"{prefix}_helper.py"
    _write(helper, "CODE = 'v1'\n")
    text = textwrap.dedent(_NESTED.format(name=name, code="v1"))
    _write(tmp / f"{prefix}.py", text.replace('CODE = "v1"', f"from {prefix}_helper import CODE"))
    reg = Registry()
    reg.discover(prefix)
    _write(helper, "CODE = 'v2'\n")
    async with LocalBackend(reg, LocalConfig(max_workers=1)) as b:
        r = await asyncio.wait_for(b.submit(Invocation(function=f"{name}_outer", payload={})), 60)
    assert r.ok, r.error
    assert (r.value["code"], r.value["inner"]["code"]) == ("v1", "v1"), r.value


_ANSWER_WHICH = """
@fabric.function(name="{name}", max_concurrency=1, warm=1)
def answer(die: bool = False) -> dict:
    if die:
        import os

        os._exit(9)
    return {{"helper": which(), "file": which.__code__.co_filename}}
"""


def _answer_which(name: str, imports: str) -> str:
    return f"import fabric\n{imports}\n\n" + textwrap.dedent(_ANSWER_WHICH.format(name=name))


async def _edited_helpers_change_nothing(
    tmp: Path, prefix: str, edits: dict[Path, str], *, which_in: Path
) -> None:
    """The function ``{prefix}_fn`` answers v1, ``edits`` are written, its worker is lost: a
    new worker answers v1 from the registered text of ``which_in``."""
    name = f"{prefix}_fn"
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1, setup_failure_cooldown_s=60)) as b:
        assert (await _call(b, name)).value == {"helper": "v1", "file": str(which_in)}
        for path, text in edits.items():
            _write(path, text)
        await _lose_the_worker(b, name, "die")
        again = await _call(b, name)
        assert again.ok, again.error
        assert again.value == {"helper": "v1", "file": str(which_in)}, again.value


async def test_a_helper_module_beside_edited_since_runs_as_registered(modules):
    """A module the function's module imports from its own directory is in its version
    (``fabric.siblings``: ``fabric deploy`` ships it beside) but was not kept: edited since,
    every replacement worker imported the new text, its version differed and it was refused
    as stale (SetupFailed, which ends a training job). It is kept as the function's module
    is: the new worker imports the registered text, under its own name and file."""
    tmp, prefix = modules
    helper = tmp / f"{prefix}_helper.py"
    _write(helper, "def which() -> str:\n    return 'v1'\n")
    _write(tmp / f"{prefix}.py", _answer_which(f"{prefix}_fn", f"from {prefix}_helper import which"))
    await _edited_helpers_change_nothing(
        tmp, prefix, {helper: "def which() -> str:\n    return 'v2'\n"}, which_in=helper
    )


async def test_a_helper_a_helper_imports_runs_as_registered(modules):
    """What a helper imports from the same directory (here lazily, inside a function) is
    in the version too, and kept with it."""
    tmp, prefix = modules
    first, second = tmp / f"{prefix}_first.py", tmp / f"{prefix}_second.py"
    _write(first, f"def which() -> str:\n    from {prefix}_second import WHICH\n\n    return WHICH\n")
    _write(second, "WHICH = 'v1'\n")
    _write(tmp / f"{prefix}.py", _answer_which(f"{prefix}_fn", f"from {prefix}_first import which"))
    edits = {
        second: "WHICH = 'v2'\n",
        first: "def which() -> str:\n    return 'v2'\n",
    }
    await _edited_helpers_change_nothing(tmp, prefix, edits, which_in=first)


async def test_a_helper_package_beside_runs_as_registered(modules):
    """A package beside the function's module (a directory with ``__init__.py``): each of
    its modules is kept, with its relative imports; ``py.py`` is a module of it, not a
    script's path. One no worker imports, and that Python cannot read, does not stop it."""
    tmp, prefix = modules
    pkg = tmp / f"{prefix}_pkg"
    _write(pkg / "__init__.py", "from .core import which\n")
    _write(pkg / "core.py", "from . import py\n\n\ndef which() -> str:\n    return py.WHICH\n")
    _write(pkg / "py.py", "WHICH = 'v1'\n")
    (pkg / "latin.py").write_bytes(b"X = '\xe9'\n")  # not UTF-8, never imported: kept, not read
    _write(tmp / f"{prefix}.py", _answer_which(f"{prefix}_fn", f"from {prefix}_pkg import which"))
    edits = {
        pkg / "__init__.py": "def which() -> str:\n    return 'v2'\n",
        pkg / "core.py": "def which() -> str:\n    return 'v2'\n",
        pkg / "py.py": "WHICH = 'v2'\n",
    }
    await _edited_helpers_change_nothing(tmp, prefix, edits, which_in=pkg / "core.py")


async def test_a_module_beside_that_import_does_not_find_is_not_kept(modules):
    """A module beside the function's that ``import`` does not find (another of its name
    comes first on sys.path) is in the version, as ``fabric deploy`` ships it, but a worker
    imports what this process imported: its kept text would have replaced the other."""
    tmp, prefix = modules
    first = tmp / "first"
    _write(first / f"{prefix}_helper.py", "def which() -> str:\n    return 'v1'\n")
    _write(tmp / f"{prefix}_helper.py", "def which() -> str:\n    return 'beside'\n")
    _write(tmp / f"{prefix}.py", _answer_which(f"{prefix}_fn", f"from {prefix}_helper import which"))
    sys.path.insert(0, str(first))  # the fixture's monkeypatch restores sys.path
    importlib.invalidate_caches()
    await _edited_helpers_change_nothing(tmp, prefix, {}, which_in=first / f"{prefix}_helper.py")


async def test_a_helper_module_that_is_not_kept_makes_a_new_worker_stale(modules, monkeypatch):
    """The backstop: a module beside that is not kept (imported through an import hook,
    here any loader but Python's own) and edited since makes a replacement worker's version
    differ: it is refused as stale, saying which module was not kept."""
    tmp, prefix = modules
    name = f"{prefix}_fn"
    helper = f"{prefix}_helper"
    _write(tmp / f"{helper}.py", "def which() -> str:\n    return 'v1'\n")
    _write(tmp / f"{prefix}.py", _answer_which(name, f"from {helper} import which"))

    class HookLoader(importlib.machinery.SourceFileLoader):
        """An import hook's loader (it may compile other text than the file's)."""

    spec = importlib.util.spec_from_file_location(helper, tmp / f"{helper}.py", loader=None)
    assert spec is not None
    spec.loader = HookLoader(helper, str(tmp / f"{helper}.py"))
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, helper, module)
    spec.loader.exec_module(module)
    reg = Registry()
    reg.discover(prefix)
    async with LocalBackend(reg, LocalConfig(max_workers=1, setup_failure_cooldown_s=60)) as b:
        assert (await _call(b, name)).value["helper"] == "v1"
        _write(tmp / f"{helper}.py", "def which() -> str:\n    return 'v2'\n")
        await _lose_the_worker(b, name, "die")
        refused = await _call(b, name)
        assert not refused.ok and refused.error is not None, refused
        assert refused.error.type == ErrorCode.SETUP_FAILED, refused.error
        assert "a module it imports from its own directory" in refused.error.message, refused.error
        assert f"{helper} is not a plain .py file" in refused.error.message, refused.error
