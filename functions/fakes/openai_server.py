"""``FakeOpenAI``: a small, real OpenAI-compatible chat server for tests.

It listens on ``127.0.0.1`` (a free port) in a background thread and speaks enough of the
OpenAI API for a judge or a tool to be tested end to end, over real sockets, with no model
and no network::

    from functions.fakes import FakeOpenAI

    with FakeOpenAI(reply="Looks right. Score: 8/10") as srv:
        srv.fail_next(429, times=2, retry_after=1)  # then two rate-limit answers...
        srv.hang_next()                             # ...then one request held past any timeout
        os.environ.update(srv.env)                  # RL_FABRIC_JUDGE_BASE_URL/MODEL/API_KEY
        ...
        assert srv.chat_requests[-1].headers["authorization"] == "Bearer sk-fake"

Endpoints: ``POST /v1/chat/completions`` (non-streaming) and ``GET /v1/models``. Every
request is recorded (``srv.requests``) before it is answered. Scripted answers
(``enqueue``, ``fail_next``, ``garbage_next``, ``hang_next``) are used one per chat request,
in order; when none is queued the request gets a normal completion whose text is ``reply``
(a string, or a callable given the request's JSON body). ``usage`` is counted as one token
per four characters, like the clients' estimates.

Token-level answers, for inference engines: a request with ``"logprobs": true`` gets
``choices[0].logprobs.content``, one entry per fake token (``FakeOpenAI.tokenize``: four
characters each, ids and logprobs derived from the text, so tests can predict them). vLLM's
extra fields are honoured as vLLM does: ``return_token_ids`` adds ``prompt_token_ids`` and
``choices[0].token_ids``; ``return_tokens_as_token_ids`` names logprob tokens
``token_id:<id>``. ``srv.max_inflight`` is the most chat requests it held at once.

Leaving the ``with`` block (or ``close()``) releases held requests, closes every open
connection and joins every thread: nothing keeps running.

An exception in a ``reply`` callable (a test's own assertion, a bug) is not swallowed: the
request gets a 500 whose error message holds the traceback, the exception is kept in
``srv.errors``, and ``close()`` raises the first one, so the test fails with it rather than
with a client's "server disconnected".
"""

from __future__ import annotations

import json
import socket
import threading
import time
import traceback
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

DEFAULT_REPLY = "The response answers the question correctly and clearly.\nScore: 8/10"

Reply = str | Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class Scripted:
    """One scripted answer to one chat request."""

    status: int = 200
    text: str | None = None
    """Completion text for this request (instead of ``reply``)."""
    body: bytes | None = None
    """Raw response body instead of a chat completion (garbage, an error page)."""
    headers: Mapping[str, str] = field(default_factory=dict)
    hang_s: float = 0.0
    """Hold the request this long first (released early when the server closes)."""
    finish_reason: str = "stop"
    """``choices[0].finish_reason`` of the completion."""


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    """Header names in lower case."""
    body: bytes
    json: Any
    """The body parsed as JSON, or ``None`` when it is not JSON."""
    at: float
    """``time.monotonic()`` when the request arrived (for rate checks)."""


def _tokens(text: str) -> int:
    return (len(text) + 3) // 4


def _fake_tokens(text: str) -> list[tuple[int, str]]:
    # four characters a token (so there are as many as ``usage`` counts); ids from a hash
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    return [(1000 + zlib.crc32(p.encode()) % 30000, p) for p in pieces]


def _fake_logprob(token_id: int) -> float:
    return -((token_id % 7) + 1) / 8


def _error(message: str, type_: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class FakeOpenAI:
    """A scriptable OpenAI-compatible server on ``127.0.0.1``; use as a context manager."""

    def __init__(
        self,
        reply: Reply = DEFAULT_REPLY,
        *,
        model: str = "fake-judge",
        api_key: str | None = "sk-fake",
    ):
        self.reply = reply
        self.model = model
        self.api_key = api_key
        """Requests must carry ``Authorization: Bearer <api_key>`` (``None``: no check)."""
        self.requests: list[RecordedRequest] = []
        self._script: deque[Scripted] = deque()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._inflight = 0
        self.max_inflight = 0
        """The most chat requests held at once (being answered or hanging)."""
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self.errors: list[Exception] = []
        """Exceptions the ``reply`` callable raised since ``start()`` (each answered 500)."""

    # -- lifecycle
    def start(self) -> FakeOpenAI:
        if self._server is not None:
            return self
        self._stopping.clear()  # set by the last close(): held requests would be dropped at once
        self.errors = []  # the last run's were raised by its close()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-openai"
        )
        self._thread.start()
        return self

    def close(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()  # held ("hanging") requests give up now
        server.shutdown()  # no new connections
        with self._lock:
            conns = list(self._conns)
        for conn in conns:  # idle keep-alive connections would otherwise keep their threads
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the client already closed it
        server.server_close()  # joins the handler threads
        assert self._thread is not None
        self._thread.join()
        if self.errors:  # nothing else reports them: the client only saw a 500
            raise self.errors[0]

    def __enter__(self) -> FakeOpenAI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- where it is
    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the fake server is not running; use `with FakeOpenAI() as srv:`")
        return int(self._server.server_address[1])

    @property
    def base_url(self) -> str:
        """The API root clients are given, e.g. ``http://127.0.0.1:41234/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that point the ``llm_judge`` reward at this server."""
        env = {"RL_FABRIC_JUDGE_BASE_URL": self.base_url, "RL_FABRIC_JUDGE_MODEL": self.model}
        if self.api_key is not None:
            env["RL_FABRIC_JUDGE_API_KEY"] = self.api_key
        return env

    # -- scripting
    def enqueue(self, *answers: Scripted) -> None:
        """Answer the next chat requests with these, one each, in order."""
        with self._lock:
            self._script.extend(answers)

    def fail_next(self, status: int = 500, *, times: int = 1, retry_after: float | None = None) -> None:
        """The next ``times`` chat requests get ``status`` (with ``Retry-After`` if given)."""
        headers = {} if retry_after is None else {"Retry-After": f"{retry_after:g}"}
        kind = "rate_limit_exceeded" if status == 429 else "server_error"
        body = _error(f"fake failure {status}", kind, kind)
        self.enqueue(*(Scripted(status=status, body=body, headers=headers) for _ in range(times)))

    def garbage_next(
        self, *, times: int = 1, body: bytes = b"<html><body>502 Bad Gateway</body></html>"
    ) -> None:
        """The next ``times`` chat requests get a 200 whose body is not JSON."""
        self.enqueue(*(Scripted(body=body, headers={"Content-Type": "text/html"}) for _ in range(times)))

    def hang_next(self, *, times: int = 1, seconds: float = 60.0) -> None:
        """Hold the next ``times`` chat requests ``seconds`` before answering them normally."""
        self.enqueue(*(Scripted(hang_s=seconds) for _ in range(times)))

    @staticmethod
    def tokenize(text: str) -> list[tuple[int, float, str]]:
        """``(token id, logprob, piece)`` per fake token of ``text``, as the server reports them."""
        return [(i, _fake_logprob(i), p) for i, p in _fake_tokens(text)]

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.path.endswith("/chat/completions")]

    # -- serving (handler threads)
    def _record(self, req: RecordedRequest) -> None:
        with self._lock:
            self.requests.append(req)

    def _next_scripted(self) -> Scripted | None:
        with self._lock:
            return self._script.popleft() if self._script else None

    def _completion(self, request: dict[str, Any], text: str | None, finish_reason: str = "stop") -> bytes:
        if text is None:
            text = self.reply(request) if callable(self.reply) else self.reply
        contents = [str(m.get("content") or "") for m in request["messages"] if isinstance(m, dict)]
        prompt = sum(_tokens(c) for c in contents)
        completion = _tokens(text)
        with self._lock:
            n = len(self.requests)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
        }
        body: dict[str, Any] = {
            "id": f"chatcmpl-fake-{n}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": request.get("model", self.model),
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
        tokens = self.tokenize(text)
        if request.get("logprobs"):
            as_ids = bool(request.get("return_tokens_as_token_ids"))
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{i}" if as_ids else p,
                        "logprob": lp,
                        "bytes": list(p.encode()),
                        "top_logprobs": [],
                    }
                    for i, lp, p in tokens
                ]
            }
        if request.get("return_token_ids"):
            choice["token_ids"] = [i for i, _, _ in tokens]
            body["prompt_token_ids"] = [i for c in contents for i, _, _ in self.tokenize(c)]
        return json.dumps(body).encode()

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.errors.append(e)

    def _enter(self) -> None:
        with self._lock:
            self._inflight += 1
            self.max_inflight = max(self.max_inflight, self._inflight)

    def _leave(self) -> None:
        with self._lock:
            self._inflight -= 1


class _Server(ThreadingHTTPServer):
    # handler threads are joined on close (nothing left running), not abandoned as daemons
    daemon_threads = False
    block_on_close = True
    fake: FakeOpenAI

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (timeout) resets the connection: expected, not news


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as real servers and httpx's pool expect
    timeout = 30  # an idle connection cannot hold its thread forever, even if not tracked
    server: _Server

    def setup(self) -> None:
        super().setup()
        with self.server.fake._lock:
            self.server.fake._conns.add(self.connection)

    def finish(self) -> None:
        with self.server.fake._lock:
            self.server.fake._conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass  # the client hung up first: nothing left to flush

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests read srv.requests, not a log on stderr

    def _read(self) -> RecordedRequest:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        req = RecordedRequest(
            method=self.command,
            path=self.path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
            json=parsed,
            at=time.monotonic(),
        )
        self.server.fake._record(req)
        return req

    def _send(self, status: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        headers = dict(headers or {})
        headers.setdefault("Content-Type", "application/json")
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self, req: RecordedRequest) -> bool:
        key = self.server.fake.api_key
        if key is None or req.headers.get("authorization") == f"Bearer {key}":
            return True
        msg = "Incorrect API key provided (the fake server expects its api_key as a Bearer token)."
        self._send(401, _error(msg, "invalid_request_error", "invalid_api_key"))
        return False

    def do_GET(self) -> None:
        req = self._read()
        if req.path.rstrip("/") != "/v1/models":
            self._send(404, _error(f"no route {req.path}", "invalid_request_error"))
        elif self._authorized(req):
            fake = self.server.fake
            data = [{"id": fake.model, "object": "model", "created": 0, "owned_by": "fake"}]
            self._send(200, json.dumps({"object": "list", "data": data}).encode())

    def do_POST(self) -> None:
        req = self._read()
        fake = self.server.fake
        if req.path.rstrip("/") != "/v1/chat/completions":
            self._send(404, _error(f"no route {req.path}", "invalid_request_error"))
            return
        if not self._authorized(req):
            return
        body = req.json
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or "model" not in body:
            msg = "the body must be JSON with 'model' and a list of 'messages'"
            self._send(400, _error(msg, "invalid_request_error"))
            return
        if body.get("stream"):
            self._send(400, _error("the fake server does not stream", "invalid_request_error"))
            return
        step = fake._next_scripted() or Scripted()
        fake._enter()
        try:
            if step.hang_s and fake._stopping.wait(step.hang_s):
                self.close_connection = True  # closing: drop the request unanswered
                return
            if step.body is not None:
                self._send(step.status, step.body, step.headers)
                return
            try:
                answer = fake._completion(body, step.text, step.finish_reason)
            except Exception as e:  # the reply callable's: left to handle_error it was lost
                fake._failed(e)
                msg = f"the fake server's reply raised:\n{traceback.format_exc()}"
                self._send(500, _error(msg, "server_error", "fake_reply_raised"))
                return
            self._send(step.status, answer, step.headers)
        finally:
            fake._leave()
