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

T = TypeVar("T")


def owner_id(instance: str) -> str:
    """``host/pid/instance``: whose containers these are, for reaping them once that
    process is gone (a crashed trainer)."""
    return f"{socket.gethostname()}/{os.getpid()}/{instance}"


def owner_gone(owner: str) -> bool:
    """True when ``owner`` (an ``owner_id``) is a process of this host that has exited.
    Another host's processes cannot be seen from here: never judged gone."""
    o_host, _, rest = owner.partition("/")
    o_pid, _, _ = rest.partition("/")
    if o_host != socket.gethostname() or not o_pid.isdigit():
        return False
    return int(o_pid) != os.getpid() and not pid_alive(int(o_pid))


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
