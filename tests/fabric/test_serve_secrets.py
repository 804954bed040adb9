"""``fabric serve`` speaks plain HTTP and takes bearer tokens: docs/serve.md says to put a
TLS-terminating proxy in front of it for other machines, and to give a token by file or by
environment, not as ``--token`` (which any user of the machine reads in ``ps``). The file
way works and keeps the token off the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
from cli_helpers import HERE

import fabric

DOC = Path(__file__).resolve().parents[2] / "docs" / "serve.md"


def _doc() -> str:
    return " ".join(DOC.read_text().split())


def test_the_doc_says_to_put_a_tls_terminating_proxy_in_front():
    text = _doc()
    assert re.search(r"plain HTTP", text), "the doc must say the server speaks plain HTTP"
    assert re.search(r"TLS-terminating (reverse )?proxy", text)
    assert "https://" in text  # how a client then reaches it


def test_the_doc_says_to_keep_the_token_off_the_command_line():
    text = _doc()
    assert re.search(r"`--token T?`[^.]*`ps`", text), "--token's exposure in ps must be said"
    for way in ("`--token-file", "`$RL_FABRIC_TOKEN`", "`token_file:"):
        assert way in text


def test_token_file_serves_with_the_file_s_token_and_not_on_the_command_line(tmp_path: Path):
    token = "f" * 24
    secret = tmp_path / "serve.token"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    root = str(Path(fabric.__file__).resolve().parent.parent)
    args = ["serve", "-f", "add", "-m", "sample_fns", "--workers", "1", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(HERE)])}
    env.pop("RL_FABRIC_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fabric.cli", *args, "--token-file", str(secret)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = json.loads(proc.stdout.readline())["port"]
        url = f"http://127.0.0.1:{port}/2015-03-31/functions/add/invocations"
        ok = httpx.post(url, json={"a": 2}, headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert ok.status_code == 200 and ok.json() == 2
        wrong = httpx.post(url, json={"a": 2}, headers={"Authorization": f"Bearer {'g' * 24}"}, timeout=30)
        assert wrong.status_code == 403
        cmdline = Path(f"/proc/{proc.pid}/cmdline")
        if cmdline.exists():  # Linux: what `ps` shows
            assert token not in cmdline.read_bytes().decode(errors="replace")
    finally:
        proc.terminate()
        proc.wait(30)
