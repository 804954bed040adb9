"""A module the test writes, imports, and writes again and reloads: a function registered again
as a user's edited reward module is once discovered again."""

from __future__ import annotations

import contextlib
import importlib
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest


@contextlib.contextmanager
def module_loader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mod_name: str
) -> Iterator[Callable[[str], ModuleType]]:
    """For a fixture's ``with``: ``load(source)`` writes ``mod_name.py`` under ``tmp_path``
    (dedented) and imports it, or reloads it; the module is forgotten at the end."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no stale .pyc of the same second
    path = tmp_path / f"{mod_name}.py"

    def load(source: str) -> ModuleType:
        path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        module = sys.modules.get(mod_name)
        return importlib.import_module(mod_name) if module is None else importlib.reload(module)

    try:
        yield load
    finally:
        sys.modules.pop(mod_name, None)
