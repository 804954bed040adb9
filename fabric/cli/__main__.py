"""``python -m fabric.cli``: the ``fabric`` command."""

from fabric.cli import main

main()
