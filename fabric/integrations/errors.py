"""Errors of the framework adapters (``fabric.integrations``).

The tree, under ``fabric.errors.FabricError``::

    IntegrationError
    ├── BadBatchError          the trainer's batch is not what its framework sends
    │   │                      (lengths disagree, a completion that is not text or messages)
    │   └── RefusedArgumentsError  the function refused its values (a column of the wrong type)
    ├── MissingArgumentError   a required parameter of the function has no source in the batch
    │   └── UnexpectedArgumentError  ``args`` or ``constants`` name a parameter the function
    │                          does not take
    ├── RewardCallError        calls failed and no ``failure_score`` is set, or the setup is
    │                          wrong (``Misconfigured``, ``SetupFailed``, ...; whatever is
    │                          set): carries the failures
    ├── BatchDeadlineError     the batch did not finish within its deadline
    └── RewardClosedError      the adapter was closed (``close()``, the exit backstop) while
                               the batch was being scored: its calls were cancelled

A misconfigured adapter (an unknown function, a bad option) raises the SDK's own errors:
``UnknownFunctionError`` (lists the known names) and ``ConfigError``.
"""

from __future__ import annotations

from fabric.errors import FabricError
from fabric.protocol import ErrorInfo


class IntegrationError(FabricError):
    """Base class of the adapters' errors."""


class BadBatchError(IntegrationError, ValueError):
    """The batch handed to the adapter cannot be scored as given: nothing was sent, or the
    function refused the arguments (``InvalidArguments``), which no retry or score mends."""


class RefusedArgumentsError(BadBatchError):
    """The function refused the arguments of ``count`` of ``total`` samples (``InvalidArguments``);
    ``first`` is the first refusal, ``(index in the batch, ErrorInfo)``. Kept apart so a caller
    that knows a field was absent (the OpenRLHF server) can say so instead of "wrong type"."""

    def __init__(self, signature: str, count: int, total: int, first: tuple[int, ErrorInfo]):
        self.signature = signature
        self.count = count
        self.total = total
        self.first = first
        super().__init__(
            f"{signature} refused the arguments of {count} of {total} samples "
            f"(a column of the wrong type?); first: {self.first_refusal}"
        )

    @property
    def first_refusal(self) -> str:
        i, e = self.first
        return f"#{i} {e.type}: {_first_line(e.message)}"


class MissingArgumentError(IntegrationError, ValueError):
    """A required parameter of the reward function has no value in the batch."""


class UnexpectedArgumentError(MissingArgumentError):
    """``args`` or ``constants`` name a parameter the reward function does not take (a typo, or
    the wrong function). A subclass of ``MissingArgumentError``, which it was raised as before:
    code that catches that catches this too."""


class BatchDeadlineError(IntegrationError, TimeoutError):
    """A batch did not come back within the adapter's ``deadline_s`` (and its grace)."""


class RewardClosedError(IntegrationError):
    """The adapter was closed while this batch was being scored: its calls were cancelled
    and nothing was scored."""


class RewardCallError(IntegrationError):
    """Calls of a batch failed (the function raised, or the infrastructure failed after the
    client's retries) and the adapter has no ``failure_score``, or failed because the setup
    is wrong (``base.SETUP_ERRORS``: ``Misconfigured``, ``SetupFailed``, a token refused...,
    whatever the adapter has): the trainer must not read those
    samples as a reward of 0. ``failures`` holds ``(index in the batch, ErrorInfo)``."""

    def __init__(self, function: str, total: int, failures: list[tuple[int, ErrorInfo]], hint: str = ""):
        self.function = function
        self.total = total
        self.failures = failures
        shown = "; ".join(f"#{i} {e.type}: {_first_line(e.message)}" for i, e in failures[:5])
        more = f"; and {len(failures) - 5} more" if len(failures) > 5 else ""
        super().__init__(
            f"{function} failed on {len(failures)} of {total} samples (they were not scored): "
            f"{shown}{more}{hint}"
        )
        self.hint = hint


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit] + "..."
