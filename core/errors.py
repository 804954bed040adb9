"""Errors raised by the core job.

The tree (every class derives from ``CoreError``)::

    CoreError
    ├── ConfigError          a job config failed validation (also a fabric ``ConfigError``);
    │                        ``problems`` lists every ``(key, message)`` found, all at once
    ├── BufferClosedError    ``SampleBuffer.get_batch`` on (or waiting when) the buffer closed
    ├── StreamClosedError    ``RewardStream.submit`` after the stream was closed
    ├── RolloutError         the rollout cannot make progress: every group fails (the job stops
    │                        with the trajectories' last error instead of spinning), or every
    │                        episode of an evaluation raised
    ├── TrainerTimeout       a call of the trainer actor ran past ``trainer.call_timeout_s``
    ├── ProxyDiedError       the LLM proxy actor died: the job cannot go on without it (resume)
    ├── StartupTimeout       the job's actors were not all made within ``engine.start_timeout_s``
    ├── DiskFullError        a file of the run (metrics, plots, a checkpoint) could not be
    │                        written: its disk is full; ``path`` names it
    └── StoppedError         a blocking step run in a worker thread (the policy build: corpus
                             play, pretraining) stopped because its caller asked (Ctrl-C)

A trajectory whose reward failed or whose environment broke is *data* (a masked ``Sample``),
never an exception: only misuse of the API, bad configs, a rollout where *every* group
fails (a deterministic fault such as a prompt longer than the model's context), a trainer
that stops answering and a proxy that died raise.

Every error pickles back whole, its message and its attributes (Ray pickles what an actor
raises back to the driver).
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fabric.errors import ConfigError as FabricConfigError
from fabric.errors import pickled_whole


class CoreError(Exception):
    """Base class of every error the core job raises."""

    def __reduce__(self) -> tuple[Any, ...]:
        # its message and attributes, not type(*args): raised in the trainer's, the proxy's or
        # an engine replica's Ray actor, an error made of parts came back as a TypeError
        return pickled_whole(self)


class ConfigError(CoreError, FabricConfigError):
    """A job config is invalid. ``problems`` holds every ``(key, message)`` found, so one
    run of the validator reports all of them; ``str()`` shows one per line."""

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        noun = "problem" if len(problems) == 1 else "problems"
        lines = [f"{key}: {msg}" if key else msg for key, msg in problems]
        super().__init__(f"invalid job config{where} ({len(problems)} {noun}):\n  " + "\n  ".join(lines))


class BufferClosedError(CoreError):
    """The sample buffer was closed; no batch will come."""


class StreamClosedError(CoreError):
    """The reward stream was closed; it takes no more trajectories."""


class RolloutError(CoreError):
    """Group after group was given up with no group completing, or every episode of an
    evaluation raised: the fault is not transient."""


class TrainerTimeout(CoreError):
    """The trainer actor did not answer a call within ``trainer.call_timeout_s``."""


class StartupTimeout(CoreError):
    """An engine replica, the proxy or the trainer was not ready within
    ``engine.start_timeout_s``: its constructor still ran, or Ray could not place it."""


class ProxyDiedError(CoreError):
    """The LLM proxy actor died. It is not restarted (``core.rollout.llm_proxy`` says why):
    the job stops, and ``--resume`` goes on from its latest checkpoint."""


class DiskFullError(CoreError):
    """A file of the run could not be written for want of space (``ENOSPC``, or a quota's
    ``EDQUOT``); ``path`` names it. Raised for the ``OSError`` in one line that says what to
    do: it was a traceback that did not say which file, nor that a resume goes on."""

    def __init__(self, path: str | Path, where: str | None = None):
        # the path alone is the exception's argument; __str__ makes the message from both
        super().__init__(str(path))
        self.path = str(path)
        self.where = where
        """Where the full disk may be, when the error named no file (``path`` is then the
        run directory, only one of the places the job writes to)."""

    def __str__(self) -> str:
        what = (
            f"to write {self.path!r}: free space there"
            if self.where is None
            else f"where the job writes ({self.where}): free space"
        )
        return (
            f"no space left on the device {what} (or choose another run_dir), then run again; "
            "with checkpoint.every, --resume goes on from the latest checkpoint"
        )


def disk_full(
    error: BaseException | None, path: str | Path | None = None, *, where: str | None = None
) -> DiskFullError | None:
    """``DiskFullError`` for an ``OSError`` that says the disk is full, naming its file (or
    ``path`` where it names none: a buffered write's flush does not; or, given ``where``, the
    places the write may have been to); None for any other."""
    if isinstance(error, DiskFullError):
        return error
    if not isinstance(error, OSError) or error.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    if error.filename is not None:
        return DiskFullError(error.filename)
    return DiskFullError(path or "?", where)


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Writes to ``path`` inside: a full disk raised as ``DiskFullError`` naming it."""
    try:
        yield
    except OSError as e:
        full = disk_full(e, path)
        if full is None:
            raise
        raise full from e


class StoppedError(CoreError):
    """A blocking step stopped early because its caller set its stop flag."""


def where_raised(traceback: str | None) -> str:
    """``my_env.py, line 30, in step``: the last frame of a traceback that came from another
    process (a reward worker's, an environment container's), where the user's code raised;
    "" when there is none."""
    frames = [ln.strip() for ln in (traceback or "").splitlines() if ln.strip().startswith('File "')]
    if not frames:
        return ""
    path, _, rest = frames[-1].removeprefix('File "').partition('"')
    return f"{Path(path).name}{rest}"
