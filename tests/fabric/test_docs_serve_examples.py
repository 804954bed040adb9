"""docs/serve.md's "Call it" examples, run as written against a server (only its port is the
test's): the ``call_serve.py`` script prints what the text says it prints, and the ``curl``
call answers what its comment says."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from fabric.backends.base import TOKEN_ENV, InprocConfig
from fabric.registry import Registry
from fabric.serve import Gateway, ServeConfig, TenantConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "serve.md").read_text()
TOKEN = "docs-serve-token-0123456789"
DOC_URL = "http://127.0.0.1:9000"


def _block(lang: str, holding: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", DOC, flags=re.S)
    found = [b for b in blocks if holding in b]
    assert len(found) == 1, f"docs/serve.md: {len(found)} {lang} blocks hold {holding!r}"
    return found[0]


async def _gateway() -> Gateway:
    reg = Registry()
    reg.discover("functions")
    cfg = ServeConfig(
        port=0,
        tenants={"default": TenantConfig(token=TOKEN)},
        functions=["exact_match"],
        backend=InprocConfig(),
        warm=False,
    )
    g = Gateway(cfg, reg)
    await g.start()
    return g


async def _run(*argv: str, cwd: Path | None = None) -> tuple[int, str, str]:
    """Run ``argv`` beside the server, which answers on this test's event loop."""
    env = {**os.environ, TOKEN_ENV: TOKEN, "PYTHONPATH": str(ROOT)}
    p = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(p.communicate(), 100)
    assert p.returncode is not None
    return p.returncode, out.decode(), err.decode()


async def test_call_serve_py_prints_what_the_doc_says(tmp_path):
    said = re.search(r"`\.venv/bin/python call_serve\.py` prints `([^`]*)`", DOC)
    assert said, "docs/serve.md no longer says what call_serve.py prints"
    script = _block("python", "# call_serve.py")
    g = await _gateway()
    try:
        (tmp_path / "call_serve.py").write_text(script.replace(DOC_URL, g.url))
        rc, out, err = await _run(sys.executable, "call_serve.py", cwd=tmp_path)
    finally:
        await g.aclose()
    assert rc == 0, err[-2000:]
    assert out.strip() == said.group(1), out + err[-2000:]


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
async def test_the_curl_call_answers_what_its_comment_says():
    block = _block("bash", "curl ")
    command, _, comment = block.partition("\n# ")
    g = await _gateway()
    try:
        rc, out, err = await _run("bash", "-c", command.replace(DOC_URL, g.url))
    finally:
        await g.aclose()
    assert rc == 0, err
    assert out.strip() == comment.strip(), out
