"""A fake registry/origin for tests and benchmarks: real HTTP on 127.0.0.1, in a thread.

    with FakeOrigin({digest: data}, bandwidth_bps=40e6, faults=Faults(error_rate=0.05)) as origin:
        OriginTierConfig(url=origin.url)

It serves ``GET /blobs/sha256:<hex>`` from a dict or from a directory laid out like a
``DiskTier`` (``<dir>/sha256/<hex>``), so an origin over one node's L1 also stands in for a
peer. The bandwidth limit is one link shared by every download at once, like a saturated
registry uplink: 64 concurrent pulls each get 1/64 of it. Faults are drawn per blob request,
first from ``Faults.script`` in order, then at random from a seeded generator.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any, Literal
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field

from envpool.images.bundle import _DIGEST_RE, digest_of

Fault = Literal["ok", "error", "reset", "corrupt", "garble"]


class Faults(BaseModel):
    model_config = ConfigDict(extra="forbid")

    error_rate: float = Field(0.0, ge=0, le=1)
    """Probability of answering HTTP 500."""
    reset_rate: float = Field(0.0, ge=0, le=1)
    """Probability of a TCP reset halfway through the body."""
    corrupt_rate: float = Field(0.0, ge=0, le=1)
    """Probability of flipping bytes in the body (the length stays right)."""
    garble_rate: float = Field(0.0, ge=0, le=1)
    """Probability of a body that says ``Content-Encoding: gzip`` and is not gzip (a proxy
    that mangled a compressed reply): the client fails to decode it."""
    script: list[Fault] = Field(default_factory=list)
    """Faults for the first blob requests, in order, before the random draws start."""
    seed: int = 0


class _Bandwidth:
    """One shared link: each chunk reserves the next ``n / rate`` seconds of it."""

    def __init__(self, rate: float, stop: threading.Event):
        self.rate = rate
        self._stop = stop
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, n: int) -> bool:
        """Block until ``n`` bytes may go out; False if the server is stopping."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + n / self.rate
            wait = self._free_at - now
        return not self._stop.wait(wait)


class FakeOrigin:
    def __init__(
        self,
        blobs: Mapping[str, bytes] | str | os.PathLike[str] | None = None,
        *,
        bandwidth_bps: float | None = None,
        latency_s: float = 0.0,
        faults: Faults | None = None,
        chunk_size: int = 64 * 1024,
    ):
        self._dir: Path | None = None
        self._blobs: dict[str, bytes] = {}
        if isinstance(blobs, Mapping):
            self._blobs = dict(blobs)
        elif blobs is not None:
            self._dir = Path(blobs)
        self.latency_s = latency_s
        self.faults = faults or Faults()
        self.chunk_size = chunk_size
        self._stop = threading.Event()
        self._bandwidth = _Bandwidth(bandwidth_bps, self._stop) if bandwidth_bps else None
        self._lock = threading.Lock()
        self._rng = random.Random(self.faults.seed)
        self._script = list(self.faults.script)
        self.requests = 0
        self.bytes_served = 0
        self.blob_requests: Counter[str] = Counter()
        self.faults_injected: Counter[str] = Counter()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle
    def __enter__(self) -> FakeOrigin:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._server is not None:
            return
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-origin"
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving, cut open connections and join every thread."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stop.set()  # wakes handlers sleeping on latency or bandwidth
        server.shutdown()
        server.cut_connections()  # wakes handlers blocked reading a kept-alive connection
        server.server_close()  # joins the handler threads
        if self._thread is not None:
            self._thread.join()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeOrigin is not running: use `with FakeOrigin(...) as origin:`")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # -- content
    def add(self, data: bytes) -> str:
        """Serve ``data``; return its digest."""
        if self._dir is not None:
            raise RuntimeError("this origin serves a directory; write the blob there instead")
        digest = digest_of(data)
        with self._lock:
            self._blobs[digest] = data
        return digest

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.requests,
                "bytes_served": self.bytes_served,
                "blob_requests": dict(self.blob_requests),
                "faults_injected": dict(self.faults_injected),
            }

    def _lookup(self, digest: str) -> bytes | None:
        if not _DIGEST_RE.fullmatch(digest):
            return None
        if self._dir is None:
            with self._lock:
                return self._blobs.get(digest)
        try:
            return (self._dir / "sha256" / digest.removeprefix("sha256:")).read_bytes()
        except FileNotFoundError:
            return None

    def _next_fault(self) -> Fault:
        f = self.faults
        with self._lock:
            if self._script:
                fault = self._script.pop(0)
            else:
                x = self._rng.random()
                fault = "ok"
                for name, rate in (
                    ("error", f.error_rate),
                    ("reset", f.reset_rate),
                    ("corrupt", f.corrupt_rate),
                    ("garble", f.garble_rate),
                ):
                    if x < rate:
                        fault = name  # type: ignore[assignment]
                        break
                    x -= rate
            if fault != "ok":
                self.faults_injected[fault] += 1
        return fault

    def _count(self, *, request: bool = False, digest: str | None = None, sent: int = 0) -> None:
        with self._lock:
            self.requests += request
            if digest is not None:
                self.blob_requests[digest] += 1
            self.bytes_served += sent


class _Server(ThreadingMixIn, HTTPServer):
    daemon_threads = False  # so server_close joins them: nothing outlives the origin
    block_on_close = True

    def __init__(self, addr: tuple[str, int], handler: type[_Handler], origin: FakeOrigin):
        self.origin = origin
        self._conns: set[socket.socket] = set()
        self._resets: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(addr, handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._conns_lock:
            self._conns.add(request)
        return True

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
            reset = request in self._resets
            self._resets.discard(request)
        if reset:
            # close without the FIN of a shutdown: with SO_LINGER 0 the peer gets an RST
            self.close_request(request)
        else:
            super().shutdown_request(request)

    def mark_reset(self, request: socket.socket) -> None:
        request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with self._conns_lock:
            self._resets.add(request)

    def cut_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):  # already closed by its client
                c.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as registries do
    server: _Server
    timeout = 60  # a client that goes silent frees its thread

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests and benchmarks read the counters instead

    def do_GET(self) -> None:
        origin = self.server.origin
        origin._count(request=True)
        path = self.path.split("?", 1)[0]
        if not path.startswith("/blobs/"):
            self._reply(404, b"not found: try GET /blobs/sha256:<hex>\n")
            return
        digest = unquote(path.removeprefix("/blobs/"))
        origin._count(digest=digest)
        if origin.latency_s and origin._stop.wait(origin.latency_s):
            self.close_connection = True
            return
        data = origin._lookup(digest)
        if data is None:
            self._reply(404, f"no blob {digest}\n".encode())
            return
        fault = origin._next_fault()
        if fault == "error":
            self._reply(500, b"injected fault\n")
            return
        if fault == "garble":
            data = b"not gzip: " + data  # whatever the blob is (a bundle is gzip), this is not
        if fault == "corrupt":
            body = bytearray(data)
            for i in range(0, len(body), max(1, len(body) // 8)):
                body[i] ^= 0xFF
            data = bytes(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        if fault == "garble":
            self.send_header("Content-Encoding", "gzip")  # and the body is not gzip
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Docker-Content-Digest", digest)
        self.end_headers()
        cut = len(data) // 2 if fault == "reset" else len(data)
        view = memoryview(data)
        sent = 0
        try:
            while sent < cut:
                chunk = view[sent : min(sent + origin.chunk_size, cut)]
                if origin._bandwidth is not None and not origin._bandwidth.take(len(chunk)):
                    break  # stopping
                self.wfile.write(chunk)
                sent += len(chunk)
                origin._count(sent=len(chunk))
        except OSError:  # the client went away
            self.close_connection = True
            return
        if sent < len(data):
            self.close_connection = True
            self.server.mark_reset(self.connection)

    def _reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
