"""What a command line (``fabric``, ``envpool``) does around the user's code it runs in its
own process: importing their modules, calling a function in-process."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def prints_to_stderr() -> Iterator[None]:
    """Send what the user's code prints here (at import, in a setup hook, in a call) to
    stderr, as a worker's output goes: the commands print their answer (``--json``, an
    invoke's ``Result``, a server's URL line) on stdout, for scripts to parse. Python's
    ``sys.stdout`` only (every thread's): what writes to file descriptor 1 itself still
    lands there."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
