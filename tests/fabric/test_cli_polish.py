"""What a user meets at the ``fabric`` command's edges: ``--version`` (of ``envpool`` too), a
server command without the ``serve`` extra, ``invoke`` against a ``fabric serve`` and the
backends it refuses, and a tenants file whose token is too short."""

from __future__ import annotations

from importlib.metadata import version

import pytest
from cli_helpers import runner

from envpool.cli import app as envpool_app
from fabric.cli import app


@pytest.mark.parametrize("cli", [app, envpool_app], ids=["fabric", "envpool"])
def test_version_prints_the_package_version(cli):
    """There was no --version: "No such option: --version", exit 2."""
    r = runner.invoke(cli, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.stdout == f"rl-fabric {version('rl-fabric')}\n"
