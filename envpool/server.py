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
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import pydantic_core

from envpool.isolation import (
    MEMORY_LAYER_BYTES,
    apply_limits,
    die_with_parent,
    image_layer,
    isolate_network,
    private_view,
)
from envpool.manifest import MANIFEST, load_manifest, read_manifest
from envpool.protocol import (
    EXIT_IMAGE_NOT_FOUND,
    HEADER,
    MAX_FRAME,
    FrameError,
    array_value,
    encode,
    error_payload,
    recv_frame,
)

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
code around them awaits nothing, and a signal to this process does not unwind (``handle``)."""


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


class Server:
    def __init__(self, registry: Any, fault: dict[str, float]):
        self.registry = registry
        self.env: Any = None
        self.env_key: tuple[str, str] | None = None
        self.write_lock = threading.Lock()
        self.conn: socket.socket | None = None
        self.busy = threading.Event()
        self.fault = fault
        self.rng = random.Random()
        self.closed_said: dict[str, Any] = {}
        """What this session's open says of the previous environment's close (``open_env``)."""
        self.queued: deque[dict[str, Any]] = deque()
        """Frames read while the environment waited on a tool's answer (``call_tool``), read
        again, in order, before the socket: the session's goodbye, sent while a step ran, was
        thrown away there, never answered, and the pool discarded a healthy container."""
        self.reading = threading.Condition()
        """Guards the socket's reads, ``queued``, ``answers`` and ``reader``: one thread reads
        the socket at a time and hands each frame to the thread it is for (``read``)."""
        self.reader = False
        """Whether a thread is reading the socket now (the others wait on ``reading``)."""
        self.answers: dict[int, str] = {}
        """Tool results read by another thread than the one whose call they answer."""
        self.asking: set[int] = set()
        """The tool calls waiting for their results (``tool_id``)."""
        self.phase: str | None = None
        """What the server does during a request that is not the request's own code, said in
        its heartbeats: ``"close"`` while an open closes the previous environment, so that
        an open that hangs there is blamed on that close, not on the new constructor."""

    # -- io
    def send(self, msg: dict[str, Any]) -> None:
        data = encode(msg)
        if len(data) > MAX_FRAME:  # the environment's answer is too big: its bug, not the pool's
            message = f"reply of {len(data):,} bytes is over the {MAX_FRAME:,}-byte frame limit"
            err = {"type": "ObservationTooLarge", "message": message, "logic": True, "reusable": True}
            data = encode({"id": msg.get("id"), "ok": False, "error": err})
        self.write(data)

    def write(self, data: bytes) -> None:
        with self.write_lock:
            if self.conn is not None:
                self.conn.sendall(data)

    def heartbeat(self, interval: float) -> None:
        while True:
            time.sleep(interval)
            if self.busy.is_set():
                with contextlib.suppress(OSError):
                    self.beat()

    def beat(self) -> None:
        """One heartbeat, with the ``phase`` read under the write lock: a beat of a phase
        that has ended never follows the beat that said it ended."""
        with self.write_lock:
            msg: dict[str, Any] = {"op": "heartbeat"}
            if self.phase is not None:
                msg["phase"] = self.phase
            if self.conn is not None:
                self.conn.sendall(encode(msg))

    def recv(self, conn: socket.socket) -> dict[str, Any]:
        """The session's next request."""
        msg = self.read(conn, None)
        assert isinstance(msg, dict)
        return msg

    def read(self, conn: socket.socket, tool_id: int | None) -> dict[str, Any] | str:
        """The next request (``tool_id`` None), or the result of the tool call ``tool_id``.
        An environment may call tools from threads of its own, and the session's loop reads
        its next request while one of them may still wait: each reading the socket itself,
        two read it at once (one a frame's header, the other its body), and a thread that
        read another's answer dropped it (that one waited for good). So one thread reads
        at a time and hands on what it reads that is another's: a request to ``queued``, a
        tool result to ``answers``."""
        with self.reading:
            while True:
                if tool_id is None and self.queued:
                    return self.queued.popleft()
                if tool_id is not None and tool_id in self.answers:
                    return self.answers.pop(tool_id)
                if not self.reader:
                    self.reader = True
                    break
                self.reading.wait()
        try:
            while True:
                msg = recv_frame(conn)  # (outside the lock: the others wait for what it brings)
                with self.reading:
                    if msg.get("op") != "tool_result":
                        if tool_id is None:
                            return msg
                        self.queued.append(msg)  # (a request, the goodbye most often: read after this one)
                    elif msg.get("tool_id") == tool_id and tool_id is not None:
                        return str(msg.get("result", ""))
                    elif msg.get("tool_id") in self.asking:
                        self.answers[msg["tool_id"]] = str(msg.get("result", ""))
                    # (else an answer nobody waits for: dropped, as before)
                    self.reading.notify_all()
        finally:
            with self.reading:
                self.reader = False
                self.reading.notify_all()  # the next waiter reads, or finds its frame

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Ask the pool to run a fabric tool; the container itself has no network."""
        tool_id = self.rng.getrandbits(48)
        data = encode({"op": "tool", "tool_id": tool_id, "name": name, "arguments": arguments})
        if len(data) - HEADER.size > MAX_FRAME:
            # the policy's arguments (or what the environment built of them) are too big to
            # send: text for the policy, as the fabric's PayloadTooLarge is. Through ``send``
            # it became an ObservationTooLarge reply with no request id, a protocol error
            # that ended the session (and this call waited for an answer that never came)
            return (
                f"error: the tool call's arguments are {len(data) - HEADER.size:,} bytes as JSON, "
                f"too big for the {MAX_FRAME:,}-byte frame limit; the tool was not run"
            )
        conn = self.conn
        assert conn is not None
        with self.reading:
            self.asking.add(tool_id)
        try:
            self.write(data)
            result = self.read(conn, tool_id)
        finally:
            with self.reading:
                self.asking.discard(tool_id)
                self.answers.pop(tool_id, None)
        assert isinstance(result, str)
        return result

    # -- sessions
    def serve(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            self.conn = conn
            try:
                self.session(conn)
            except (EOFError, ConnectionError, OSError):
                pass  # the pool hung up: wait for the next session
            except (FrameError, ValueError, TypeError) as e:
                # a garbled request ends that connection, never the container
                with contextlib.suppress(OSError):
                    self.send(
                        {"id": None, "ok": False, "error": {"type": "ProtocolError", "message": str(e)}}
                    )
            finally:
                with self.write_lock:
                    self.conn = None
                with self.reading:
                    self.queued.clear()  # (the last connection's: none of the next session's)
                    self.answers.clear()
                conn.close()

    def session(self, conn: socket.socket) -> None:
        hello = recv_frame(conn)
        token = hello.get("token")
        kwargs = hello.get("kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            # the client's mistake, not the constructor's: said as the protocol's
            message = f"open: kwargs must be a JSON object, not {type(kwargs).__name__}"
            self.send({"id": 0, "ok": False, "error": {"type": "ProtocolError", "message": message}})
            return
        self.busy.set()  # a slow constructor still heartbeats
        try:
            self.open_env(str(hello.get("env_id")), kwargs or {})
        except _ENV_RAISES as e:  # (its sys.exit() too: see ``handle``)
            from envpool.errors import EnvPoolError

            err = _env_error_payload(e)
            if not isinstance(e, EnvPoolError):  # (an unknown id is the registry's, by its name)
                err["logic"] = True  # the constructor's own, whatever its class is called
            if sound_after(e, kwargs) and not self.closed_said.get("retire"):
                # a clean error of the environment's code (or an id this image lacks, or a
                # path that is not there): this process is as sound as before, and its
                # container may serve the next session. Not after a MemoryError or an OSError
                # of resources: the constructor may have run it short of memory, file
                # descriptors or disk, or left them held; the pool replaces it
                err["reusable"] = True
            self.send({"id": 0, "ok": False, "error": err})
            return
        finally:
            self.busy.clear()
        spec = self.env.spec
        info = {
            "pid": os.getpid(),
            "deterministic": spec.deterministic,
            "max_action_bytes": spec.max_action_bytes,
            **self.closed_said,
        }
        self.send({"id": 0, "ok": True, "result": info})
        while True:
            msg = self.recv(conn)
            rid = int(msg.get("id", -1))
            if msg.get("token") != token:
                from envpool.errors import SessionTokenError

                refused = SessionTokenError("this request carries another session's token; it was refused")
                self.send({"id": rid, "ok": False, "error": error_payload(refused)})
                continue
            op = msg.get("op")
            if op == "close":
                self.send({"id": rid, "ok": True, "result": None})
                return
            self.send(self.handle(rid, op, msg.get("args")))

    def open_env(self, env_id: str, kwargs: dict[str, Any]) -> None:
        """Make (or reuse) the session's environment. What the open says of the previous
        one's close, where that raised, goes to ``closed_said``: ``close_error``, and
        ``retire`` where the process may no longer be sound after it (``sound_after``)."""
        said: dict[str, Any] = {}
        self.closed_said = said
        key = (env_id, json.dumps(kwargs, sort_keys=True))
        if self.env_key != key:
            # forgotten before its close: one that raises leaves none behind, closed, under its kwargs
            env, old, self.env, self.env_key = self.env, self.env_key, None, None
            if env is not None:
                self.phase = "close"
                try:
                    # said at once: a close that holds the interpreter lock silences the beats
                    with contextlib.suppress(OSError):
                        self.beat()
                    env.close()
                except _ENV_RAISES as e:
                    # the last session's environment's bug, not this session's: raised into this
                    # open, it failed a session that had done nothing wrong (not retried, and
                    # blamed on its own env_kwargs). Said to the pool (and logged here) instead
                    traceback.print_exc(file=sys.stderr)
                    said["close_error"] = f"{type(e).__name__}: {e}"[:1000]
                    if not sound_after(e, json.loads(old[1]) if old else None):
                        said["retire"] = True  # short of memory, say: the pool runs no episode here
                finally:
                    self.phase = None
                    with contextlib.suppress(OSError):
                        self.beat()  # the close is over: what hangs from here is the constructor
            self.env = self.registry.make(env_id, tool_caller=self.call_tool, **kwargs)
            self.env_key = key
        else:
            # reused: the last session's episode (half played, maybe) is not this one's
            self.env.require_reset()

    def handle(self, rid: int, op: Any, args: Any) -> dict[str, Any]:
        from envpool.errors import EnvUsageError

        if args is None:
            args = {}
        elif not isinstance(args, dict):  # a bug of the client's, not the environment's
            message = f"{op}: args must be a JSON object, not {type(args).__name__}"
            return {"id": rid, "ok": False, "error": {"type": "ProtocolError", "message": message}}
        self.busy.set()
        try:
            self.maybe_crash()
            if op == "ping":
                result: Any = {"pid": os.getpid()}
            elif op == "reset":
                obs, info = self.env.reset(seed=args.get("seed"), options=args.get("options"))
                result = jsonable("reset", {"obs": obs, "info": info})
            elif op == "step":
                result = jsonable("step", self.env.step(args.get("action")))
            else:
                return {
                    "id": rid,
                    "ok": False,
                    "error": {"type": "ProtocolError", "message": f"unknown op {op!r}"},
                }
            return {"id": rid, "ok": True, "result": result}
        except EnvUsageError as e:
            return {"id": rid, "ok": False, "error": {**error_payload(e), "reusable": True}}
        except _ENV_RAISES as e:  # the environment's own bug: data for the caller, the server lives on
            # its sys.exit() or KeyboardInterrupt too: left to end the process, the pool read
            # it as a dead container, retried and replayed the step on fresh ones until its
            # attempts ran out (SessionLost). No signal to this process raises one here: it
            # ignores SIGINT (``run``: the pool stops it, by SIGKILL), and a SIGTERM's default
            # action ends it without unwinding; only a handler the environment installed
            # itself could, and then the signal was the environment's to take
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6))[-4000:]
            err = {**_env_error_payload(e, traceback=tb), "logic": True}
            if sound_after(e, [json.loads(self.env_key[1]) if self.env_key else None, args]):
                # as for a failed open: after a MemoryError or an OSError of resources this
                # process may be short of memory, file descriptors or disk (or hold them
                # still), so the pool plays this episode out on it and then retires it
                err["reusable"] = True
            return {"id": rid, "ok": False, "error": err}
        finally:
            self.busy.clear()

    def maybe_crash(self) -> None:
        # fault injection for benchmarks and tests: the whole container dies mid-request
        if self.fault.get("crash_rate") and self.rng.random() < self.fault["crash_rate"]:
            os._exit(17)
        if self.fault.get("hang_rate") and self.rng.random() < self.fault["hang_rate"]:
            # or freezes: every thread stops, the heartbeat's too, as in a frozen container (a
            # sleep here heartbeated on, and read as the environment hanging: EnvHung)
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(3600)  # (should it be continued)


def fetch_image(
    digest: str, source: str, *, max_blob_bytes: int | None = None, max_unpacked_bytes: int | None = None
) -> Path:
    """A remote container fetches its image bundle itself, through the tiered cache
    (verified by digest, retried), from the mirror or origin the pool named, within the
    runtime's caps (``image_max_blob_bytes``, ``image_max_unpacked_bytes``; None: the
    cache's defaults)."""
    import asyncio
    import tempfile

    from envpool.images import HttpTier, MirrorTierConfig, TieredCache
    from envpool.images.cache import DEFAULT_MAX_UNPACKED_BYTES
    from envpool.images.tiers.http import DEFAULT_MAX_BLOB_BYTES

    if not source:
        raise ValueError(f"image {digest} given without an image source to fetch it from")

    async def get() -> Path:
        blob = DEFAULT_MAX_BLOB_BYTES if max_blob_bytes is None else max_blob_bytes
        tiers = [HttpTier(MirrorTierConfig(url=source, max_blob_bytes=blob))]
        unpacked = DEFAULT_MAX_UNPACKED_BYTES if max_unpacked_bytes is None else max_unpacked_bytes
        # not byte-compiled as a whole: this container alone uses it, and compiles what it
        # imports as it imports it (the rest would only delay its start)
        unpack_dir = Path(tempfile.mkdtemp(prefix="envpool-image-"))
        async with TieredCache(
            tiers, unpack_dir=unpack_dir, max_unpacked_bytes=unpacked, precompile=False
        ) as cache:
            return await cache.get(digest)

    return asyncio.run(get())


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
