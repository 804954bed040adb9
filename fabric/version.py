"""``--version`` of the ``fabric`` and ``envpool`` commands. A module of its own: the
``envpool`` command takes it without importing the ``fabric`` command's subcommands."""

from __future__ import annotations

from typing import Annotated

import typer


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rl-fabric")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
        from fabric import __version__

        return __version__


def _print_version(value: bool) -> None:
    if value:
        print(f"rl-fabric {package_version()}")
        raise typer.Exit()


#: ``--version`` of the ``fabric`` and ``envpool`` commands: eager, so it answers before a
#: command is required
VersionOpt = Annotated[
    bool,
    typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
]
