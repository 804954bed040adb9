"""docs/fabric.md's Register and Call examples, run as written: ``reward_fns.py`` (the Register
block) and ``call_my_reward.py`` beside it in a fresh directory, on the local backend, print
what the text after them says they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "fabric.md").read_text()


def _block(holding: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC, flags=re.S)
    found = [b for b in blocks if holding in b]
    assert len(found) == 1, f"docs/fabric.md: {len(found)} python blocks hold {holding!r}"
    return found[0]


def test_call_my_reward_py_prints_what_the_doc_says(tmp_path):
    said = re.search(
        r"`\.venv/bin/python call_my_reward\.py` prints `([^`]*)`, then `([^`]*)`, then the three"
        r" streamed scores with their index",
        " ".join(DOC.split()),
    )
    assert said, "docs/fabric.md no longer says what call_my_reward.py prints"
    (tmp_path / "reward_fns.py").write_text(_block("def my_reward("))
    (tmp_path / "call_my_reward.py").write_text(_block("# call_my_reward.py"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "call_my_reward.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    assert lines[:2] == [said.group(1), said.group(2)], p.stdout
    # completion order is the workers', so the streamed lines are compared as a set
    assert sorted(lines[2:]) == ["0 0.0", "1 1.0", "2 0.0"], p.stdout
