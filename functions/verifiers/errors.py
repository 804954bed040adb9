"""Errors of the code sandbox.

    SandboxError        the sandbox itself failed (not the program): retryable
    └── SandboxUnavailable   this machine cannot run it (not Linux, not root, no namespaces)
    InvalidTests        the caller's tests cannot judge any program (a ValueError: bad
                        input, not retried)

What a *program* does (crash, loop, exhaust memory) is never an exception: it is a status in
the run's result.
"""

from __future__ import annotations

from fabric.errors import Unavailable


class SandboxError(Unavailable):
    """The sandbox failed to run a program (its zygote died, a namespace could not be made)."""


class SandboxUnavailable(SandboxError):
    """The code sandbox cannot run on this machine; the message says why."""


class InvalidTests(ValueError):
    """The caller's assert-style tests cannot judge any program: they do not compile, they
    ran nothing (only definitions, a ``doctest.testmod()`` with no example, a unittest run
    with no test), a test takes pytest fixtures, or ``check(candidate)`` has no entry point
    to check. A 0 or a 1 would be a reward for the tests' fault; the message says what to
    fix."""
