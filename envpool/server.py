"""The server inside a container: ``python -m envpool.server --sock PATH [--bundle DIR]``.

It makes the environments of its image available over the session protocol
(``envpool.protocol``): one session at a time, one Env instance reused across episodes
(the pool recycles the container after N episodes). While a request runs, a heartbeat
thread tells the pool the process is alive; a stuck environment is found by the pool's
step timeout, a dead or frozen process by missed heartbeats.

Isolation it applies to itself before it serves: its own network namespace (no network,
loopback included) where the kernel allows, resource limits, a private view of the bundle
directory as its working directory (``private_view``), and death with its parent
(``envpool.isolation``).

Its sessions (``Server``) are in ``envpool.server_session``, what it makes of an
environment's errors and values (``sound_after``, ``jsonable``) in ``envpool.server_errors``;
their names are importable from here too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from envpool.isolation import (
    MEMORY_LAYER_BYTES,
    apply_limits,
    die_with_parent,
    image_layer,
    isolate_network,
    private_view,
)
from envpool.manifest import MANIFEST, load_manifest, read_manifest
from envpool.protocol import EXIT_IMAGE_NOT_FOUND
from envpool.server_errors import NotJSONSafe, jsonable, sound_after
from envpool.server_session import Server

# the split-off modules' names are re-exported: they lived here before the split, and other
# code and the docs name them from here
__all__ = [
    "NotJSONSafe",
    "Server",
    "fetch_image",
    "jsonable",
    "listen",
    "load_bundle",
    "main",
    "run",
    "sound_after",
]


def load_bundle(bundle: Path | None) -> Any:
    """The registry of this image: the built-ins, plus what the bundle's ``envpool.json``
    adds: ``{"modules": [...]}`` to import (they register themselves) and/or
    ``{"register": [{"id": ..., "entry_point": ...}, ...]}``."""
    import envpool.envs  # noqa: F401 - registers the built-in environments
    from envpool.api import default_registry

    if bundle is not None:
        sys.path.insert(0, str(bundle))
        if (bundle / MANIFEST).exists():  # (a bundle without one serves the built-ins)
            load_manifest(bundle, read_manifest(bundle), default_registry)
    return default_registry


def fetch_image(
    digest: str, source: str, *, max_blob_bytes: int | None = None, max_unpacked_bytes: int | None = None
) -> Path:
    """A remote container fetches its image bundle itself, through the tiered cache
    (verified by digest, retried), from the mirror or origin the pool named, within the
    runtime's caps (``image_max_blob_bytes``, ``image_max_unpacked_bytes``; None: the
    cache's defaults). The bundle is unpacked into a work directory of its own in the
    container's temp dir; a fetch that fails removes it."""
    import asyncio
    import shutil
    import tempfile

    from envpool.images import DiskTier, DiskTierConfig, HttpTier, MirrorTierConfig, TieredCache
    from envpool.images.cache import DEFAULT_MAX_UNPACKED_BYTES
    from envpool.images.tiers.http import DEFAULT_MAX_BLOB_BYTES

    if not source:
        raise ValueError(f"image {digest} given without an image source to fetch it from")

    work = Path(tempfile.mkdtemp(prefix="envpool-image-"))
    blobs = work / "blobs"

    async def get() -> Path:
        blob = DEFAULT_MAX_BLOB_BYTES if max_blob_bytes is None else max_blob_bytes
        # a disk tier in front: the blob is streamed to a file a chunk at a time and unpacked
        # from it, never held whole in the container's memory (a multi-GB image would OOM it)
        tiers = [
            DiskTier(DiskTierConfig(path=blobs, max_bytes=blob)),
            HttpTier(MirrorTierConfig(url=source, max_blob_bytes=blob)),
        ]
        unpacked = DEFAULT_MAX_UNPACKED_BYTES if max_unpacked_bytes is None else max_unpacked_bytes
        # not byte-compiled as a whole: this container alone uses it, and compiles what it
        # imports as it imports it (the rest would only delay its start)
        async with TieredCache(
            tiers, unpack_dir=work, max_unpacked_bytes=unpacked, precompile=False
        ) as cache:
            return await cache.get(digest)

    try:
        path = asyncio.run(get())
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    # unpacked, the blob is spent: it would double the image's footprint on the container's disk
    shutil.rmtree(blobs, ignore_errors=True)
    return path


def listen(opts: dict[str, Any]) -> tuple[str, socket.socket]:
    """A Unix socket at ``opts["sock"]`` (process runtime), or TCP at ``opts["tcp"]`` =
    ``host:port`` (a container with its own network: docker, kubernetes, modal)."""
    if opts.get("tcp"):
        host, _, port = str(opts["tcp"]).rpartition(":")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, int(port)))
        listener.listen(4)
        bound_host, bound_port = listener.getsockname()[:2]
        return f"tcp://{bound_host}:{bound_port}", listener
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(opts["sock"])
    listener.listen(4)
    return str(opts["sock"]), listener


def run(opts: dict[str, Any], ready: Any) -> None:
    """Isolate, load the image, listen, report ``ready({...})``, serve until killed.
    ``opts``: sock, bundle, scratch (the container's own directory, for its view of the
    bundle), memory_layer_bytes (the bound of its layer where that is a tmpfs), heartbeat_s,
    limits, fault, netns. Shared by ``main`` (a fresh
    interpreter) and the zygote (a fork of a pre-imported one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pool stops us
    isolation = isolate_network() if opts.get("netns", True) else "none"
    apply_limits(opts.get("limits") or {})
    bundle = Path(opts["bundle"]) if opts.get("bundle") else None
    if bundle is None and opts.get("image_digest"):
        bundle = fetch_image(
            str(opts["image_digest"]),
            str(opts.get("image_source") or ""),
            max_blob_bytes=opts.get("image_max_blob_bytes"),
            max_unpacked_bytes=opts.get("image_max_unpacked_bytes"),
        )
    view = layer = None
    if bundle is not None:
        # a bundle of its own (fetched above, or in a container that has its own filesystem)
        # needs no view; the process runtime's is the node's cache's, shared
        view = "own"
        if opts.get("scratch"):
            bound = int(opts.get("memory_layer_bytes", MEMORY_LAYER_BYTES))
            bundle, view = private_view(bundle, Path(opts["scratch"]), memory_layer_bytes=bound)
            if view == "overlay":  # (its writes take the host's disk, or memory: told apart)
                layer = image_layer(Path(opts["scratch"]))
            if view == "shared":
                sys.dont_write_bytecode = True  # at least no __pycache__ in every container's image
            else:
                # bytecode beside the sources: the cache's, compiled as it unpacked, or in
                # the container's own layer; not in a PYTHONPYCACHEPREFIX every container
                # shares, where one could leave bytecode for the next to run
                sys.pycache_prefix = None
        os.chdir(bundle)
    registry = load_bundle(bundle)
    server = Server(registry, opts.get("fault") or {})
    endpoint, listener = listen(opts)
    threading.Thread(
        target=server.heartbeat, args=(float(opts.get("heartbeat_s", 1.0)),), daemon=True
    ).start()
    ready(
        {
            "ready": True,
            "pid": os.getpid(),
            "isolation": isolation,
            "image_view": view,
            "image_layer": layer,
            "endpoint": endpoint,
        }
    )
    server.serve(listener)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sock", help="Unix socket path to listen on")
    ap.add_argument("--tcp", help="host:port to listen on instead (containers with their own network)")
    ap.add_argument("--bundle", help="an unpacked image bundle directory")
    ap.add_argument("--scratch", help="the container's own directory: a private view of --bundle goes there")
    ap.add_argument("--image-digest", help="fetch this bundle (sha256:...) from --image-source first")
    ap.add_argument("--image-source", help="base URL serving GET /blobs/sha256:<hex>")
    ap.add_argument("--image-max-blob-bytes", type=int, help="the most bytes of the bundle to download")
    ap.add_argument("--image-max-unpacked-bytes", type=int, help="the most the bundle may unpack to")
    ap.add_argument(
        "--parent-pid", type=int, default=0, help="die with this process (0: no parent to follow)"
    )
    ap.add_argument(
        "--memory-layer-bytes",
        type=int,
        default=MEMORY_LAYER_BYTES,
        help="bound of the view's layer where it is a tmpfs (0: read-only there instead)",
    )
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--limits", default="{}")
    ap.add_argument("--fault", default="{}")
    ap.add_argument("--no-netns", action="store_true")
    args = ap.parse_args()
    if not args.sock and not args.tcp:
        ap.error("give --sock PATH or --tcp HOST:PORT")
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    opts = {
        "sock": args.sock,
        "tcp": args.tcp,
        "bundle": args.bundle,
        "scratch": args.scratch,
        "memory_layer_bytes": args.memory_layer_bytes,
        "image_digest": args.image_digest,
        "image_source": args.image_source,
        "image_max_blob_bytes": args.image_max_blob_bytes,
        "image_max_unpacked_bytes": args.image_max_unpacked_bytes,
        "heartbeat_s": args.heartbeat_s,
        "limits": json.loads(args.limits),
        "fault": json.loads(args.fault),
        "netns": not args.no_netns,
    }
    from envpool.images.errors import ImageNotFound

    # the runtime reads one line from stdout (a pipe it does not drain afterwards): kept apart
    # for it, and what the environment prints goes to stderr from the start, as in a zygote's
    # container: never into a pipe that fills and blocks its next print, nor ahead of the line
    # (a module of the image that printed as it was imported failed every start, its output
    # read as a garbled ready line)
    sys.stdout.flush()
    channel = os.dup(1)
    os.dup2(2, 1)

    def ready(info: dict[str, Any]) -> None:
        os.write(channel, json.dumps(info).encode() + b"\n")
        os.close(channel)

    try:
        run(opts, ready)
    except ImageNotFound as e:
        # a wrong reference, not a crash: the exit code tells the runtime not to retry it
        print(f"envpool.server: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_IMAGE_NOT_FOUND)


if __name__ == "__main__":
    main()
