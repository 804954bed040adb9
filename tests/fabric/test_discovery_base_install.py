"""Discovery on a base install (no extras) and of modules that end the interpreter at import.

`fabric ls`, `fabric invoke`, `fabric serve`, a job and the integrations discover the built-in
``functions`` package by default: it walks every module in it, so one module that needs an
extra at import (libclang, sympy, torch...) broke them all where that extra is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fabric
from fabric.errors import EntryPointError
from fabric.registry import Registry

#: every optional extra's top-level import name (pyproject.toml's optional-dependencies), and
#: the dev tools: none of them is in a base install
EXTRAS = [
    "aiohttp",
    "aws_lambda_powertools",
    "boto3",
    "botocore",
    "clang",
    "docker",
    "kubernetes",
    "matplotlib",
    "megatron",
    "modal",
    "moto",
    "numpy",
    "prometheus_client",
    "ray",
    "safetensors",
    "sympy",
    "torch",
    "vllm",
]

_BLOCKED = f"""
import sys
for name in {EXTRAS!r}:
    sys.modules[name] = None  # `import name` (and its submodules) raises ImportError
"""

_ROOT = str(Path(fabric.__file__).resolve().parent.parent)


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _ROOT, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED + textwrap.dedent(code)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_builtins_are_discovered_without_any_extra(tmp_path: Path) -> None:
    p = _run(
        """
        from fabric.registry import Registry
        print(sorted(s.name for s in Registry().discover("functions")))
        """,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    for name in ("exact_match", "math_answer", "code_verify", "calculator", "env_return"):
        assert repr(name) in p.stdout, p.stdout


def test_fabric_ls_lists_the_builtins_without_any_extra(tmp_path: Path) -> None:
    p = _run(
        """
        import sys
        from fabric.cli import main
        sys.argv = ["fabric", "ls"]
        main()
        """,
        tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "exact_match" in p.stdout and "code_verify" in p.stdout, p.stdout


def _package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exit_code: str) -> None:
    pkg = tmp_path / "exits_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text(
        "import fabric\n\n@fabric.reward\ndef fine(x: str) -> float:\n    return 1.0\n"
    )
    (pkg / "script.py").write_text(f"import sys\nsys.exit({exit_code})\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("code", ["87", "'no libclang'", "None"])
def test_a_module_that_exits_at_import_is_an_entry_point_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    _package(tmp_path, monkeypatch, code)
    registry = Registry()
    # walked in a package, imported by name, by file and as an entry point: each is an error
    # of that module, and this process goes on
    with pytest.raises(EntryPointError, match=r"'exits_pkg\.script' during discovery: it called sys\.exit"):
        registry.discover("exits_pkg")
    with pytest.raises(EntryPointError, match=r"'exits_pkg\.script' for discovery: it called sys\.exit"):
        registry.discover("exits_pkg.script")
    with pytest.raises(EntryPointError, match=r"script\.py' for discovery: it called sys\.exit"):
        registry.discover(str(tmp_path / "exits_pkg" / "script.py"))
    with pytest.raises(EntryPointError, match=r"'exits_pkg\.script' for 'exits_pkg\.script:f'"):
        registry.discover("exits_pkg.script:f")
