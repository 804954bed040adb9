"""Errors of the code sandbox.

    SandboxError        the sandbox itself failed (not the program): retryable
    └── SandboxUnavailable   this machine cannot run it (not Linux, not root, no namespaces)

What a *program* does (crash, loop, exhaust memory) is never an exception: it is a status in
the run's result.
"""

from __future__ import annotations

from fabric.errors import Unavailable


class SandboxError(Unavailable):
    """The sandbox failed to run a program (its zygote died, a namespace could not be made)."""


class SandboxUnavailable(SandboxError):
    """The code sandbox cannot run on this machine; the message says why."""
