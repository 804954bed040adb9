"""What a user meets at the ``fabric`` command's edges: ``--version`` (of ``envpool`` too), a
server command without the ``serve`` extra, ``invoke`` against a ``fabric serve`` and the
backends it refuses, and a tenants file whose token is too short."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from cli_helpers import HERE, runner

import fabric
from envpool.cli import app as envpool_app
from fabric.cli import app

ROOT = str(Path(fabric.__file__).resolve().parent.parent)


@pytest.mark.parametrize("cli", [app, envpool_app], ids=["fabric", "envpool"])
def test_version_prints_the_package_version(cli):
    """There was no --version: "No such option: --version", exit 2."""
    r = runner.invoke(cli, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.stdout == f"rl-fabric {version('rl-fabric')}\n"


# aiohttp (and prometheus_client, the serve extra's other half) made unimportable: None in
# sys.modules is what Python's import system reads as "not installed"
_WITHOUT = (
    "import sys\n"
    "sys.modules[{module!r}] = None\n"
    "sys.argv = ['fabric', *sys.argv[1:]]\n"
    "from fabric.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize("module", ["aiohttp", "prometheus_client"])
@pytest.mark.parametrize(
    "command",
    [["serve"], ["integrate", "openrlhf-serve"]],
    ids=["serve", "openrlhf-serve"],
)
def test_a_server_command_without_the_serve_extra_names_it(tmp_path, command, module):
    """Both printed a traceback ending in "ModuleNotFoundError: import of aiohttp halted"."""
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT.format(module=module), *command, "-f", "exact_match", "--port", "0"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(HERE)])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "pip install 'rl-fabric[serve]'" in done.stderr and module in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("{token: short}", "a token must have at least 16 characters"),
        ("{token_file: missing.token}", "cannot read token_file"),
    ],
    ids=["short-token", "no-token-file"],
)
def test_a_tenants_file_token_problem_names_the_tenant_and_the_file(tmp_path, monkeypatch, body, said):
    """It said only "a token must have at least 16 characters": which of the file's tenants,
    and which file, were left to guess, where its other errors name both."""
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "tenants.yaml"
    f.write_text(f"tenants:\n  job-a: {{token: {'a' * 20}}}\n  job-b: {body}\n")
    r = runner.invoke(app, ["serve", "--tenants", str(f), "-f", "exact_match", "--port", "0"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert f"tenants file {str(f)!r}, tenant 'job-b': {said}" in text
