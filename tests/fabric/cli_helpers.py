"""What the ``fabric`` command's test modules (test_cli.py, test_cli_serve.py,
test_cli_bench.py) share: typer's runner, and this directory (on a spawned command's
PYTHONPATH, for the test modules' functions)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

runner = CliRunner()
HERE = Path(__file__).resolve().parent
