"""``fabric``: list, invoke and benchmark registered functions; run an RL job.

Functions are discovered from the built-in ``functions`` package, from ``--module/-m``
(module names, ``module:attr`` or ``file.py``), and from ``$FABRIC_MODULES``
(comma-separated). The core is async; this is its thin synchronous edge.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import typer

    from fabric.cli._app import app
    from fabric.cli.integrate import openrlhf_serve

__all__ = ["app", "main", "openrlhf_serve"]


def _commands() -> typer.Typer:
    # each module registers its commands on import: this order is `fabric --help`'s
    # isort: off
    from fabric.cli import calls, serve, deploy, run, integrate  # noqa: F401

    # isort: on
    from fabric.cli._app import app

    return app


def __getattr__(name: str) -> Any:
    # imported when first asked for, not with this package: the console script's
    # `from fabric.cli import main` comes before main's Ctrl-C handling, and a Ctrl-C in
    # these imports (typer, rich, the command modules) was a traceback from inside importlib
    if name == "app":
        return _commands()
    if name == "openrlhf_serve":
        _commands()
        from fabric.cli.integrate import openrlhf_serve

        return openrlhf_serve
    raise AttributeError(f"module 'fabric.cli' has no attribute {name!r}")


def main() -> None:
    try:
        _commands()()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
