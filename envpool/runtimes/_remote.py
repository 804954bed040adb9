"""What the remote runtimes (kubernetes, docker, modal) share: the server command of a
container with its own network, starting through SDK calls that cannot be cancelled, and
the error of a container whose server found no such image (it exits with
``EXIT_IMAGE_NOT_FOUND``; each runtime reads the exit code its way)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from envpool.runtimes.base import proc_stat_fields

T = TypeVar("T")


def owner_id(instance: str) -> str:
    """``host/pid:start/instance``: whose containers these are, for reaping them once that
    process is gone (a crashed trainer). ``start`` is the process's start time (clock ticks
    since boot): a trainer restarted in its container most often gets the same small pid,
    which alone would make the crashed run's containers look alive."""
    pid = os.getpid()
    start = pid_start(pid)
    return f"{socket.gethostname()}/{pid}{'' if start is None else f':{start}'}/{instance}"


def parse_owner(owner: str) -> tuple[int, int | None, str] | None:
    """``(pid, start or None, instance)`` of an ``owner_id`` of this host; None for another
    host's, or what is not an owner id. (An id without a start: an older envpool's.)"""
    o_host, _, rest = owner.partition("/")
    o_pid, _, instance = rest.partition("/")
    pid, _, start = o_pid.partition(":")
    if o_host != socket.gethostname() or not pid.isdigit() or not (start.isdigit() or not start):
        return None
    return int(pid), int(start) if start else None, instance


def owner_is_this_process(owner: str) -> bool:
    parsed = parse_owner(owner)
    if parsed is None or parsed[0] != os.getpid():
        return False
    return parsed[1] is None or parsed[1] == pid_start(os.getpid())


def owner_gone(owner: str) -> bool:
    """True when ``owner`` (an ``owner_id``) is a process of this host that has exited: its
    pid is not alive, or is another process's now (not the start time it had). Another
    host's processes cannot be seen from here: never judged gone."""
    parsed = parse_owner(owner)
    if parsed is None or owner_is_this_process(owner):
        return False
    pid, start, _ = parsed
    if not pid_alive(pid):
        return True
    return start is not None and pid_start(pid) not in (None, start)


def pid_start(pid: int) -> int | None:
    """Process ``pid``'s start time, in clock ticks since boot (``/proc``); None if unread."""
    fields = proc_stat_fields(pid)
    # starttime is field 22
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


def image_not_found(config: Any, image: str | None, where: str) -> Exception:
    """The error of a container whose server exited with ``EXIT_IMAGE_NOT_FOUND``: the
    image is not at ``config.image_source`` (a wrong reference; never retried)."""
    from envpool.images.bundle import ImageRef
    from envpool.images.errors import ImageNotFound

    digest = ImageRef.parse(image).digest if image else "(no image)"
    return ImageNotFound(digest, [f"{config.image_source} (fetched by {where})"])


def server_command(config: Any, image: str | None) -> list[str]:
    """TCP on ``config.port``, no network namespace of its own (the container is one), and
    a custom image's bundle fetched by digest from ``config.image_source``."""
    cmd = ["python", "-m", "envpool.server", "--tcp", f"0.0.0.0:{config.port}", "--no-netns"]
    cmd += ["--heartbeat-s", str(config.heartbeat_s)]
    if config.faults.crash_rate or config.faults.hang_rate:
        cmd += ["--fault", json.dumps(config.faults.model_dump())]
    if image is not None:
        from envpool.images.bundle import ImageRef

        if not config.image_source:
            raise ValueError(
                f"image {image!r} needs runtime.image_source: the container fetches its bundle there"
            )
        cmd += ["--image-digest", ImageRef.parse(image).digest, "--image-source", config.image_source]
        cmd += ["--image-max-blob-bytes", str(config.image_max_blob_bytes)]
        cmd += ["--image-max-unpacked-bytes", str(config.image_max_unpacked_bytes)]
    return cmd


async def create_or_clean(create: Awaitable[T], clean: Callable[[T], Awaitable[None]]) -> T:
    """Await ``create`` (a blocking SDK call in a thread, which cancellation cannot stop);
    if the caller is cancelled meanwhile (a start timeout, a closing pool), let it finish
    and ``clean`` up what it made before the cancellation goes on: nothing is left running."""
    task = asyncio.ensure_future(create)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await clean(await task)
        raise
