"""A script run by a tool that executes its file itself rather than importing it:
``runpy.run_path`` (what ``python -m pdb``, the debugpy debugger and several launchers do).
Its ``__main__`` has a ``__file__`` but no ``__loader__``; the local pool's workers import
the file by its path (as for ``python script.py``) and must run the registered text. Real
processes: the script runs in a child Python, its pool's workers in grandchildren."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = """
import asyncio
import json
import os
import sys

from fabric.backends.base import LocalConfig
from fabric.backends.local import LocalBackend
from fabric.protocol import Invocation
from fabric.registry import Registry

reg = Registry()
CODE = "v1"


@reg.function(name="run_path_fn", timeout_s=30)
def answer(die: bool = False) -> str:
    if die:
        os._exit(9)
    return CODE


async def main() -> None:
    out = []
    async with LocalBackend(reg, LocalConfig(max_workers=1, start_timeout_s=60)) as b:
        async def call(**payload):
            r = await asyncio.wait_for(b.submit(Invocation(function="run_path_fn", payload=payload)), 60)
            out.append(r.value if r.ok else f"{r.error.type}: {r.error.message}")

        await call()
        with open(__file__, "w") as f:  # a checkout under the job
            f.write(open(__file__).read().replace('CODE = "v1"', 'CODE = "v2" # edited'))
        await call(die=True)
        await call()  # a replacement worker
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_script_run_by_run_path_runs_its_registered_text(tmp_path: Path):
    """Its ``__main__`` has no loader: its file was neither hashed nor kept, while its
    workers (importing the file by its path) hashed it into their version, so every worker
    was refused as stale and each call failed SetupFailed, the file unchanged."""
    path = tmp_path / "run_me.py"
    path.write_text(textwrap.dedent(_SCRIPT))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    code = f"import runpy; runpy.run_path({str(path)!r}, run_name='__main__')"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    first, lost, again = json.loads(lines[0][len("RESULT ") :])
    assert first == "v1"
    assert lost.startswith("WorkerLost"), lost
    assert again == "v1"  # the registered text, not the file edited since
