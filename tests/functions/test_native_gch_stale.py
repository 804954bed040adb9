"""gcc's precompiled headers (``native_pch.header``) against the headers they reached: gcc
does not check those, so after a header changes (a libc6-dev or libstdc++ upgrade) an old
``.gch`` would go on giving the old declarations. Its build records what it read
(``.gch.deps``); each process checks that once and builds it anew where a header differs.
Real g++ compiles, in a directory of the test's own (the real one is root's and shared)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from functions.verifiers import native_pch

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")

#: ``answer()`` is 41 or 42: the same size, so only the mtime and content tell them apart
DECL = "#pragma once\nconstexpr int answer() {{ return {}; }}\n"
PROGRAM = 'static_assert(answer() == 42, "a stale declaration");\nint main() {}\n'


@pytest.fixture
def dirs(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """The test's own header directory and include directory."""
    pch, inc = tmp_path / "pch", tmp_path / "inc"
    pch.mkdir()
    inc.mkdir()
    monkeypatch.setattr(native_pch, "PCH_DIR", str(pch))
    monkeypatch.setattr(native_pch, "prepare_pch_dir", lambda: (str(pch),))
    monkeypatch.setattr(native_pch, "_checked", set())
    monkeypatch.setattr(native_pch, "_failed", set())
    monkeypatch.setattr(native_pch, "_marked", {})
    return pch, inc


def flags(inc: Path) -> tuple[str, ...]:
    return ("-O1", "-std=gnu++17", f"-I{inc}")


def write_decl(inc: Path, value: int, mtime_ns: int | None = None) -> None:
    decl = inc / "decl.h"
    decl.write_text(DECL.format(value))
    if mtime_ns is not None:
        os.utime(decl, ns=(mtime_ns, mtime_ns))


def compile_with(path: str, inc: Path, tmp: Path) -> subprocess.CompletedProcess[str]:
    """The program compiled as the verifier does, its header first (``-H``: which it read)."""
    src = tmp / "prog.cpp"
    src.write_text(PROGRAM)
    argv = ["g++", "-include", path, *flags(inc), "-H", "-c", str(src), "-o", str(tmp / "prog.o")]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)


def test_a_changed_header_rebuilds_the_gch(dirs, tmp_path) -> None:
    _, inc = dirs
    write_decl(inc, 41)
    before = os.stat(inc / "decl.h").st_mtime_ns
    path = native_pch.header('#include "decl.h"\n', "g++", flags(inc))
    assert path is not None
    old = os.stat(path + ".gch")

    # the header changes: same size, a new mtime, other content (as an upgrade would)
    write_decl(inc, 42, mtime_ns=before + 1_000_000_000)
    assert len(DECL.format(41)) == len(DECL.format(42))
    native_pch._checked.clear()  # a new worker process
    assert native_pch.header('#include "decl.h"\n', "g++", flags(inc)) == path
    new = os.stat(path + ".gch")
    assert (new.st_ino, new.st_mtime_ns) != (old.st_ino, old.st_mtime_ns), "the stale .gch stayed"

    done = compile_with(path, inc, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]  # the new declaration
    assert f"! {path}.gch" in done.stderr  # and from the .gch, not the header's text
    assert str(inc / "decl.h") in Path(path + ".gch.deps").read_text()  # what it read


def test_the_check_is_once_per_process_and_content_decides(dirs, tmp_path) -> None:
    _, inc = dirs
    write_decl(inc, 42)
    path = native_pch.header('#include "decl.h"\n', "g++", flags(inc))
    assert path is not None
    built = os.stat(path + ".gch").st_ino

    # touched (new mtime, same content): the content decides, no rebuild
    mtime = os.stat(inc / "decl.h").st_mtime_ns
    os.utime(inc / "decl.h", ns=(mtime + 10**9, mtime + 10**9))
    native_pch._checked.clear()
    assert native_pch.header('#include "decl.h"\n', "g++", flags(inc)) == path
    assert os.stat(path + ".gch").st_ino == built

    # within one process an existing one is checked once, not per compile
    write_decl(inc, 41, mtime_ns=mtime + 2 * 10**9)
    assert native_pch.header('#include "decl.h"\n', "g++", flags(inc)) == path
    assert os.stat(path + ".gch").st_ino == built


def test_a_gch_without_its_list_is_rebuilt(dirs, tmp_path) -> None:
    """One built before the list was kept (or whose list is damaged) is not trusted."""
    _, inc = dirs
    write_decl(inc, 42)
    path = native_pch.header('#include "decl.h"\n', "g++", flags(inc))
    assert path is not None
    for damage in ("unlink", "garbage"):
        built = os.stat(path + ".gch").st_ino
        deps = Path(path + ".gch.deps")
        if damage == "unlink":
            deps.unlink()
        else:
            deps.write_text("[[1, 2]]")
        native_pch._checked.clear()
        assert native_pch.header('#include "decl.h"\n', "g++", flags(inc)) == path
        assert os.stat(path + ".gch").st_ino != built, damage
        assert Path(path + ".gch.deps").is_file()


def test_the_list_goes_with_its_header(dirs) -> None:
    """``remove_stale`` removes a header's list with it."""
    pch, inc = dirs
    write_decl(inc, 42)
    path = native_pch.header('#include "decl.h"\n', "g++", flags(inc))
    assert path is not None
    day_ago = os.stat(path).st_mtime - native_pch.STALE_S - 60
    os.utime(path, (day_ago, day_ago))
    native_pch._marked.clear()
    removed = native_pch.remove_stale(keep="")
    assert path + ".gch.deps" in removed
    assert not list(pch.iterdir())
