"""What registration costs now that a function's version hashes, and its code keeps, the
whole file of its module (``fabric.registry.capture_code``): a module's file is read for
each function decorated in it, so what is kept must not grow with their number."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import tracemalloc
from pathlib import Path

from fabric.registry import CODE_ATTR


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
