"""What a command line (``fabric``, ``envpool``) does around the user's code it runs in its
own process: importing their modules, calling a function in-process."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


def search_cwd() -> None:
    """Let ``-m my_module`` find my_module.py in the current directory."""
    # `python -m fabric.cli` searches the current directory, an installed console script
    # (`fabric`, `envpool`) does not: `-m my_rewards` next to my_rewards.py must work with
    # both. Last, so a file here cannot shadow an installed package (the built-in
    # `functions` above all); worker processes get this sys.path, so they import it too
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


@contextlib.contextmanager
def prints_to_stderr() -> Iterator[None]:
    """Send what the user's code prints here (at import, in a setup hook, in a call) to
    stderr, as a worker's output goes: the commands print their answer (``--json``, an
    invoke's ``Result``, a server's URL line) on stdout, for scripts to parse. Python's
    ``sys.stdout`` only (every thread's): what writes to file descriptor 1 itself still
    lands there."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
