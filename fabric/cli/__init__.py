"""``fabric``: list, invoke and benchmark registered functions; run an RL job.

Functions are discovered from the built-in ``functions`` package, from ``--module/-m``
(module names, ``module:attr`` or ``file.py``), and from ``$FABRIC_MODULES``
(comma-separated). The core is async; this is its thin synchronous edge.
"""

from __future__ import annotations

import sys

# each module registers its commands on import: this order is `fabric --help`'s
# isort: off
from fabric.cli import calls, serve, deploy, run, integrate  # noqa: F401

# isort: on
from fabric.cli._app import app
from fabric.cli.integrate import openrlhf_serve

__all__ = ["app", "main", "openrlhf_serve"]


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
