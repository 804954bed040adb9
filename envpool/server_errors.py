"""What the container's server makes of an environment's errors and values: whether its
process is sound after an error (``sound_after``: may its container serve on?), the error
said to the pool, and a value as the JSON the wire carries (``jsonable``). Split from
``envpool.server``, which re-exports its names."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import PurePath
from typing import Any

import pydantic_core

from envpool.protocol import array_value, error_payload

_PATH_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError)
_PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP})  # (no subclass of their own)


def _strings(value: Any) -> Iterator[str]:
    """The strings in a request's JSON value (its values, nested; not its keys, which name
    parameters, not paths)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def _named_by(filename: Any, given: Any) -> bool:
    """Whether ``filename`` is a path the caller named in ``given``: one of its strings, as a
    run of the path's parts (the last may be a file's stem: a level ``"7"`` read as
    ``levels/7.txt``), so under a directory it named too."""
    if not isinstance(filename, str | bytes | os.PathLike):
        return False
    parts = PurePath(os.fsdecode(filename)).parts
    for text in _strings(given):
        want = PurePath(text).parts if text.strip() else ()
        if want[-1:] == (PurePath(text).anchor,):
            continue  # "/" alone names no file of the caller's: every absolute path is under it
        n = len(want)
        for i in range(len(parts) - n + 1):
            got = parts[i : i + n]
            if n and got[:-1] == want[:-1] and want[-1] in (got[-1], PurePath(got[-1]).stem):
                return True
    return False


def sound_after(e: BaseException, given: Any = None) -> bool:
    """Whether this process is as sound after ``e`` as before it, so its container may serve
    the next session or episode (a failed open's or request's ``"reusable": true``). Not
    after a MemoryError, nor after an OSError that may say the process or its container is
    short of something (memory, file descriptors, disk, processes) or holds it still. But an
    OSError that only says a path is wrong (not there, not a directory, a directory, there
    already, too long, a loop of links) for a path the caller named (``given``: the session's
    env_kwargs and the request's args, which hold it or a directory above it) is a lookup
    that failed, as a KeyError is: replacing the container for it cost a cold start per bad
    argument and fixed nothing. One for a path the caller never named is the container's:
    the environment's own file or program gone (a module it ran deleted it, say), which every
    later session there would fail on too. (No EACCES or EPERM: a sandbox's or a resource
    limit's refusal says those too.)"""
    if isinstance(e, MemoryError) or not isinstance(e, Exception):
        # (not an Exception: a SystemExit, a KeyboardInterrupt or a CancelledError the
        # environment raised, which may have stopped its code anywhere, a lock held or a
        # cleanup cut short, and meant its process or its task to end: see ``Server.handle``)
        return False
    if isinstance(e, OSError):
        if not (isinstance(e, _PATH_ERRORS) or e.errno in _PATH_ERRNOS):
            return False
        named = [f for f in (e.filename, e.filename2) if f is not None]
        # (no path on it: the environment's own lookup, said as a FileNotFoundError)
        return all(_named_by(f, given) for f in named)
    return True


_ENV_RAISES = (BaseException,)
"""What an environment's code raising is its error, said to the pool (not the process's end):
anything, a SystemExit, a KeyboardInterrupt or an ``asyncio.CancelledError`` of its own (an
event loop it runs inside a step) too. Nothing else raises in its calls: the server's own
code around them awaits nothing, and a signal to this process does not unwind (``Server.handle``)."""


def _env_error_payload(e: BaseException, *, traceback: str | None = None) -> dict[str, Any]:
    err = error_payload(e, traceback=traceback)
    if not err["message"]:  # (a bare sys.exit() or KeyboardInterrupt says nothing by itself)
        if isinstance(e, SystemExit):
            err["message"] = "the environment called sys.exit(); its server does not exit for it"
        elif isinstance(e, KeyboardInterrupt):
            err["message"] = "raised by the environment's code (its server ignores SIGINT)"
    return err


class NotJSONSafe(TypeError):
    """An environment returned something the wire format cannot carry (its bug)."""


def jsonable(op: str, result: Any) -> Any:
    """``result`` as plain JSON values, converted here so that a value JSON cannot carry is
    the environment's error on its own request, not a reply that fails to send later. A
    numpy, torch or jax scalar or array goes as its value, as the fabric sends one."""
    try:
        return pydantic_core.to_jsonable_python(result, fallback=array_value)
    except (pydantic_core.PydanticSerializationError, TypeError) as e:  # (the fallback's: a TypeError)
        raise NotJSONSafe(
            f"{op}() returned a value that cannot be serialized as JSON ({e}); keep observations, "
            "info and rewards JSON-safe (plain values, or numpy, torch or jax scalars and arrays)"
        ) from None
