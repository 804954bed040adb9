"""The examples run end to end, as `make demo` runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_demo_runs_end_to_end():
    env = {"COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "examples/demo.py"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "exact_match -> 1.0" in text
    assert "a handler that raises is data: ok=False UserError" in text
    assert "scripted path -> reward 1.0, terminated=True" in text
    assert "tool call through the pool and the fabric -> 395" in text
    assert "answer 395 -> reward 1.0" in text
    # the overhead over a direct call is shown from the bench one call at a time, not at 64
    assert (
        '"overhead_p50_ms"' not in text.split("(5,000 calls at concurrency 64)")[1].split("one at a time")[0]
    )
    assert '"overhead_p50_ms"' in text.split("one at a time")[1]
