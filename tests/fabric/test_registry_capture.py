"""What registration costs now that a function's version hashes, and its code keeps, the
whole file of its module (``fabric.registry.capture_code``): a module's file is read for
each function decorated in it, so what is kept must not grow with their number."""

from __future__ import annotations

import gc
import importlib.util
import sys
import textwrap
import tracemalloc
import weakref
from pathlib import Path

from fabric.registry import CODE_ATTR, capture_code


def _many_functions(path: Path, n: int, constant_bytes: int) -> str:
    lines = [
        "from fabric.registry import Registry",
        "reg = Registry()",
        f"TABLE = {'x' * constant_bytes!r}",
    ]
    for i in range(n):
        lines.append(
            textwrap.dedent(
                f"""
                @reg.function(name="f{i}")
                def f{i}(a: int = 0) -> int:
                    return a + {i} + len(TABLE)
                """
            )
        )
    text = "\n".join(lines)
    path.write_text(text)
    return text


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def test_the_functions_of_one_module_share_one_copy_of_its_file(tmp_path):
    """100 functions in a module of 512 kB (a table of data in the file): each function's
    code kept its own copy of the file, 51 MB for one module; now they share one."""
    n, size = 100, 512 * 1024
    path = tmp_path / "many_functions.py"
    _many_functions(path, n, size)
    name = "_fabric_test_many_functions"
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        module = _import(path, name)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        sys.modules.pop(name, None)
    codes = [getattr(module.reg.callable(f"f{i}"), CODE_ATTR) for i in range(n)]
    assert {c.version for c in codes} and all(len(c.modules) == 1 for c in codes)
    assert all(c.modules[0].data == path.read_bytes() for c in codes)
    # the module's text once (its constant, its code object's, its bytes kept), not n times
    assert kept < 8 * size, f"registering {n} functions kept {kept / 1e6:.1f} MB"


class _LoaderThatReadsNothing:
    """What ``coverage run -m pkg.mod`` gives the module it runs as ``__main__``: a loader
    with no ``get_data`` (coverage compiles the file itself)."""

    def __init__(self, fullname: str):
        self.fullname = fullname


def test_a_module_whose_loader_reads_nothing_hashes_the_files_bytes(tmp_path):
    """Such a module's file was hashed as ``inspect.getsource`` gives it (decoded, its
    newlines made ``\\n``, one added at its end, encoded as UTF-8), while a worker, importing
    it with Python's own loader, hashed the file's bytes: a file with CRLF line ends, or in
    latin-1, or without a final newline, made every worker's version differ, and each was
    refused as stale. The bytes of the file are hashed now, as the worker hashes them."""
    path = tmp_path / "reads_nothing.py"
    path.write_bytes(
        b"# -*- coding: latin-1 -*-\r\nfrom fabric.registry import Registry\r\nreg = Registry()\r\n"
        b'@reg.function(name="f")\r\ndef f() -> str:\r\n    return "caf\xe9"'
    )
    name = "_fabric_test_reads_nothing"
    module = _import(path, name)
    try:
        fn = module.reg.callable("f")
        as_a_worker_reads_it = getattr(fn, CODE_ATTR)
        module.__loader__ = _LoaderThatReadsNothing(name)
        code = capture_code(fn)
    finally:
        sys.modules.pop(name, None)
    assert [m.data for m in code.modules] == [path.read_bytes()]
    assert code.version == as_a_worker_reads_it.version
    assert not code.modules[0].plain  # imported by its name: the worker's loader is not known


def test_the_text_kept_goes_with_the_functions(tmp_path):
    """Shared between the functions of a module, its text is not held for them after
    they are gone (a job that registers code from many generated files)."""
    path = tmp_path / "goes_away.py"
    _many_functions(path, 3, 1024)
    name = "_fabric_test_goes_away"
    module = _import(path, name)
    sys.modules.pop(name, None)
    kept = weakref.ref(getattr(module.reg.callable("f0"), CODE_ATTR).modules[0])
    del module
    gc.collect()
    assert kept() is None
