"""libclang's precompiled header for the read of a ``<bits/stdc++.h>`` program
(``native_pch.clang_header``, ``cdecls.py``): built on the host from fixed text, a tenth of
the read's CPU (``benchmarks/clang_pch_read.py``), and only a speed-up: a header libclang
cannot use (truncated, garbage, built with other flags, gone) leaves the read exactly what
it is without one."""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from functions.verifiers import native, native_pch
from functions.verifiers.languages import get_language
from functions.verifiers.sandbox import Sandbox

BASE_UID = 462_000

pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ (its include directories)"),
    pytest.mark.skipif(not native.available(), reason="libclang is not installed (pip install libclang)"),
]

PROGRAM = (
    "#include<assert.h>\n#include<bits/stdc++.h>\nusing namespace std;\n"
    "std::vector<long> incr_list(std::vector<long> l) {\n    for (auto& x : l) x += 1;\n    return l;\n}\n"
    "std::map<std::string, long> histogram(std::string s) { return {}; }\n"
    "long long add(long long a, long long b) { return a + b; }\n"
    "int counter;\nint main() {}\n"
)


@pytest.fixture
def pch_dir(tmp_path, monkeypatch) -> Path:
    """A directory of this test's own for the headers (the real one is root's and shared)."""
    d = tmp_path / "pch"
    d.mkdir()
    monkeypatch.setattr(native_pch, "PCH_DIR", str(d))
    monkeypatch.setattr(native_pch, "prepare_pch_dir", lambda: (str(d),))
    monkeypatch.setattr(native_pch, "_checked", set())
    monkeypatch.setattr(native_pch, "_failed", set())
    return d


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> str:
    """One ``.pch`` for the module's reads (a build is seconds of CPU)."""
    d = tmp_path_factory.mktemp("pch")
    mp = pytest.MonkeyPatch()
    mp.setattr(native_pch, "PCH_DIR", str(d))
    mp.setattr(native_pch, "prepare_pch_dir", lambda: (str(d),))
    try:
        path = native_pch.clang_header(native.CLANG_PCH_TEXT, native.parse_args("cpp"))
    finally:
        mp.undo()
    assert path is not None and Path(path + ".pch").is_file()
    return path + ".pch"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> tuple[dict, str]:
    """``PROGRAM`` read without a header: what every read of it with one must print (a read
    is a second of CPU, a parse of the whole library: made once for the module's tests)."""
    return read(tmp_path_factory.mktemp("plain"), PROGRAM, None)


def read(tmp_path: Path, code: str, pch: str | None) -> tuple[dict, str]:
    """What ``cdecls.py`` prints of ``code`` (as the sandbox runs it), and its stderr."""
    run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    run.mkdir()
    for name, data in native.parse_files("cpp", code, pch).items():
        (run / name).write_bytes(data)
    done = subprocess.run(
        [sys.executable, "cdecls.py"], cwd=run, capture_output=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout), done.stderr.decode()


def used(stderr: str) -> bool:
    """Whether the read said it started from the header (its output is the same either way;
    what it saves, a tenth of the parse's CPU, is benchmarks/clang_pch_read.py's figure)."""
    cdecls = runpy.run_path(str(native.CDECLS))  # a program of the run's, not a module

    if cdecls["PCH_USED"] in stderr.splitlines():
        return True
    assert cdecls["PCH_SKIPPED"] in stderr, stderr
    return False


def test_the_read_from_the_precompiled_header_is_the_plain_read(tmp_path, built, plain):
    plain_out, plain_err = plain
    fast, fast_err = read(tmp_path, PROGRAM, built)
    assert fast == plain_out and used(fast_err)
    assert "precompiled header" not in plain_err
    assert {f["name"] for f in plain_out["functions"]} == {"incr_list", "histogram", "add", "main"}
    assert not any(f["invalid"] for f in plain_out["functions"])
    assert "bits/stdc++.h" in fast["includes"] and ["counter", "var_decl"] in fast["others"]


def test_a_precompiled_header_libclang_cannot_use_leaves_the_read_as_it_is_without(
    tmp_path, built, pch_dir, plain
):
    bad = tmp_path / "bad"
    bad.mkdir()
    truncated = bad / "truncated.pch"
    truncated.write_bytes(Path(built).read_bytes()[: os.path.getsize(built) // 3])
    garbage = bad / "garbage.pch"
    garbage.write_bytes(b"CPCH" + os.urandom(4096))
    # one of another language standard (as another libclang's or other flags' would be)
    other = native_pch.clang_header(
        native.CLANG_PCH_TEXT,
        tuple("-std=gnu++14" if a == "-std=gnu++17" else a for a in native.parse_args("cpp")),
    )
    assert other is not None
    for pch in (str(truncated), str(garbage), other + ".pch", str(bad / "missing.pch")):
        out, err = read(tmp_path, PROGRAM, pch)
        assert out == plain[0] and not used(err), pch


def test_a_program_that_does_not_include_the_library_after_all_is_read_without_it(tmp_path, built):
    # its include is in a comment: gcc compiles it without its header, and the read must see
    # what gcc sees (std::vector undeclared: the declaration is invalid, never a guess)
    code = "// #include <bits/stdc++.h>\nstd::vector<long> f(long n) { return {}; }\n"
    assert native.wants_clang_pch("cpp", "#include <bits/stdc++.h>\n" + code)
    plain, _ = read(tmp_path, code, None)
    out, err = read(tmp_path, code, built)
    assert out == plain and not used(err)
    assert [f["invalid"] for f in plain["functions"]] == [True]


def test_a_precompiled_header_that_no_longer_loads_is_built_anew(pch_dir):
    args = native.parse_args("cpp")
    path = native_pch.clang_header(native.CLANG_PCH_TEXT, args)
    assert path is not None
    good = Path(path + ".pch").read_bytes()
    Path(path + ".pch").write_bytes(good[: len(good) // 2])  # the headers changed under it, say
    broken = os.stat(path + ".pch").st_ino
    # this process checked it already: it hands it out (the read falls back meanwhile) ...
    assert native_pch.clang_header(native.CLANG_PCH_TEXT, args) == path
    assert os.stat(path + ".pch").st_ino == broken
    # ... and the next process checks it before its first use, and builds it again
    native_pch._checked.clear()
    assert native_pch.clang_header(native.CLANG_PCH_TEXT, args) == path
    rebuilt = os.stat(path + ".pch")
    assert rebuilt.st_ino != broken and rebuilt.st_size > len(good) // 2
    # which loads: the next process's check keeps it
    native_pch._checked.clear()
    assert native_pch.clang_header(native.CLANG_PCH_TEXT, args) == path
    assert os.stat(path + ".pch").st_ino == rebuilt.st_ino
    # text libclang cannot build a header of: none (the read goes without)
    assert native_pch.clang_header("#error no\n", args) is None
    assert sorted(p.name for p in pch_dir.iterdir()) == sorted([Path(path).name, Path(path).name + ".pch"])


@pytest.fixture(scope="module")
def box(pair_box: Sandbox) -> Sandbox:  # tests/functions/conftest.py: this module's BASE_UID
    return pair_box


def test_the_sandboxed_read_starts_from_the_shared_precompiled_header(box):
    # as the verifier runs it: the header in the root-owned directory every run sees
    # read-only, under the compiler's limits (but open files: native.PCH_READ_NOFILE)
    assert native_pch.PCH_DIR in box.shared.split(",")
    path = native_pch.clang_header(native.CLANG_PCH_TEXT, native.parse_args("cpp"))
    assert path is not None
    limits = get_language("cpp").compile_limits
    outs = {}
    for pch in (None, path + ".pch"):
        out = box.run(
            mode="python",
            entry="cdecls.py",
            files=native.parse_files("cpp", PROGRAM, pch),
            limits=native.read_limits(limits, pch),
        )
        assert out.status == "exited" and out.exit_code == 0, out.stderr[-2000:]
        outs[pch] = (json.loads(out.stdout), out.stderr.decode())
    (plain, _), (fast, fast_err) = outs.values()
    assert fast == plain and used(fast_err)
    # under the compile's own limit of open files it cannot load: the plain read, as it was
    out = box.run(
        mode="python",
        entry="cdecls.py",
        files=native.parse_files("cpp", PROGRAM, path + ".pch"),
        limits=limits,
    )
    assert json.loads(out.stdout) == plain and not used(out.stderr.decode())
