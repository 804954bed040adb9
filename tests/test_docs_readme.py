"""README.md's Quickstart and envpool examples, run as written in a fresh directory: the
``my_rewards.py`` script, the ``fabric ls`` and ``fabric invoke`` commands beside it, and the
envpool session script."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


def _block(holding: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    found = [b for b in blocks if holding in b]
    assert len(found) == 1, f"README.md: {len(found)} python blocks hold {holding!r}"
    return found[0]


def _command(prefix: str) -> list[str]:
    """The README's backticked ``.venv/bin/fabric ...`` command, run by this interpreter."""
    found = re.findall(rf"`\.venv/bin/fabric ({re.escape(prefix)}[^`]*)`", README)
    assert len(found) == 1, f"README.md: {len(found)} commands start with 'fabric {prefix}'"
    return [sys.executable, "-m", "fabric.cli", *shlex.split(found[0])]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=100)


def test_the_quickstart_runs_as_written(tmp_path):
    (tmp_path / "my_rewards.py").write_text(_block("# my_rewards.py"))
    p = _run([sys.executable, "my_rewards.py"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.fullmatch(r"True 1\.0 contains_answer-\d+ \d+\.\d\d ms\n", p.stdout), p.stdout

    p = _run(_command("ls -m my_rewards.py"), tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "contains_answer" in p.stdout, p.stdout

    p = _run(_command("invoke contains_answer"), tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    result = json.loads(p.stdout)
    assert (result["ok"], result["value"]) == (True, 1.0), result


def test_the_envpool_example_runs_as_written(tmp_path):
    (tmp_path / "envpool_example.py").write_text(_block("import asyncio, envpool"))
    p = _run([sys.executable, "envpool_example.py"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("You moved right."), p.stdout
