"""The gateway: the AWS Lambda Invoke API in front of the local warm pools (the protocol:
``_lambda_api``).

``Gateway`` is built in layers, each in a sibling module on the one before: how a call runs
through its tenant's quota and its function's fair gate (``_calls``), the HTTP routes
(``_routes``), and this module's lifecycle: start (bind check, warm-up, listener), drain and
close.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import socket
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from fabric.backends.base import Backend, make_backend
from fabric.errors import BackendClosedError, BackendError, ConfigError, EntryPointError, SetupFailedError
from fabric.registry import Registry, default_registry
from fabric.serve._lambda_api import CLIENT_CLOSED, DRAINED, INVOKE_ROUTE
from fabric.serve._routes import GatewayRoutes
from fabric.serve.config import ServeConfig
from fabric.serve.drain import InFlight, cleanup_within, drain_timeout
from fabric.serve.gate import FairGate, Quotas, RateLimiter, TenantConnections
from fabric.serve.metrics import ServeMetrics

__all__ = ["CLIENT_CLOSED", "DRAINED", "INVOKE_ROUTE", "Gateway"]

log = logging.getLogger("fabric.serve")


class _QuietMalformed(logging.Filter):
    """aiohttp logs every request it cannot parse as an ERROR with a traceback, so a
    port scan or a fuzz floods the server's log. The client already got a 400 with the
    parser's reason; here it is one DEBUG line. A body it cannot decode (a bad
    Content-Encoding) is logged again as aiohttp drains it after our 400: the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            reason = " ".join(str(getattr(exc, "message", "") or exc).split())
            log.debug("malformed HTTP request (answered 400): %s", _redacted(reason)[:300])
            return False
        return True


_QUIET_MALFORMED = _QuietMalformed()

#: An authorization header's value in a parser's reason, which quotes the line it refused:
#: a valid token with a stray control character after it is still the token
_AUTH_VALUE = re.compile(r"(authorization\s*:).*", re.IGNORECASE)


def _redacted(reason: str) -> str:
    return _AUTH_VALUE.sub(r"\1 <redacted>", reason)


def _idle(conn: RequestHandler) -> bool:
    """Whether an aiohttp connection waits for its next request (none being read, answered
    or written). aiohttp says so nowhere public: its handler awaits ``_waiter`` then. One
    whose next request has begun to arrive, not yet whole, reads as idle too: closed then,
    that request is lost as one sent as a keep-alive timeout closes its connection.

    An aiohttp without ``_waiter`` (a private name: a later release may rename it) has every
    connection read as busy: the bound on open connections still holds, with 429s where
    idle ones would have been closed; a warning says so once."""
    waiter: object = getattr(conn, "_waiter", _NO_WAITER)
    if waiter is _NO_WAITER:
        global _warned_no_waiter
        if not _warned_no_waiter:
            _warned_no_waiter = True
            log.warning(
                "this aiohttp's connections have no _waiter: idle connections cannot be told "
                "apart, so a tenant over max_connections gets 429 rather than its idle "
                "connections closed; install the aiohttp rl-fabric was tested with (3.9 to 3.14)"
            )
        return False
    return isinstance(waiter, asyncio.Future) and not waiter.done()


_NO_WAITER = object()
_warned_no_waiter = False


#: aiohttp inflates a compressed request body as it arrives, on the event loop, and drains
#: (inflating) one not read for up to 10 s after the answer: a megabyte of gzip is a gigabyte
#: of zeros. The routes refuse a Content-Encoding on its headers (``refuse_encoded``); this
#: keeps the bytes that still arrive raw. An aiohttp whose handler has no such option (it
#: came after 3.9) inflates them while it drains: the refusal still comes at once.
_NO_INFLATING: dict[str, Any] = (
    {"auto_decompress": False}
    if "auto_decompress" in inspect.signature(RequestHandler.__init__).parameters
    else {}
)


def _closed(conn: RequestHandler) -> bool:
    return conn.transport is None  # aiohttp drops it as the connection closes


def _close(conn: RequestHandler) -> None:
    conn.force_close()


async def _check_bindable(host: str, port: int) -> None:
    """Raise the ``OSError`` that binding ``host:port`` would (the port in use, an address
    not this machine's, a name that does not resolve), as aiohttp's listener binds it: every
    address the host resolves to, with ``SO_REUSEADDR``, skipping a family of which no
    socket can be made (as asyncio does: ``localhost`` is ``::1`` too on a machine without
    IPv6). Probe sockets, closed at once: the listener itself is bound after the warm-up, so
    a call is refused, not queued, till then."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    for family, kind, proto, _, address in infos:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # a family this machine lacks (IPv6 off): the listener skips it too
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds
            probe.bind(address)


class Gateway(GatewayRoutes):
    """``async with Gateway(config, registry) as gw:`` serves at ``gw.url`` until closed."""

    def __init__(self, config: ServeConfig, registry: Registry | None = None, backend: Backend | None = None):
        self.config = config
        self.registry = registry if registry is not None else default_registry
        self._tokens = config.token_index()  # reads token files now: a bad one fails at start
        served = config.functions if config.functions is not None else self.registry.names()
        unknown = [n for n in served if n not in self.registry]
        if unknown:
            raise ConfigError(f"--function names not registered: {', '.join(unknown)}")
        self.served = frozenset(served)
        self.backend = backend if backend is not None else make_backend(config.backend, self.registry)
        invokers = {name: t for name, t in config.tenants.items() if t.invoke}
        self.may_invoke = frozenset(invokers)
        """The tenants that may invoke (the rest read ``/metrics`` only, and hold no quota)."""
        self.quotas = Quotas({name: t.max_concurrency for name, t in invokers.items()}, config.tenants)
        self.rates = RateLimiter({name: t.max_rps for name, t in invokers.items()})
        self.connections = TenantConnections(
            {name: t.connection_limit for name, t in config.tenants.items()},
            idle=_idle,
            closed=_closed,
            close=_close,
        )
        self._gates: dict[str, FairGate] = {}
        self._events: set[asyncio.Task[None]] = set()
        self._running_on: set[asyncio.Future[None]] = set()
        self._stopped_now = asyncio.Event()
        """Set by ``stop_now``: the drain waits no longer for the runs given up on."""
        self._draining = False
        """Set when ``aclose`` begins: no ``Event`` is accepted any more."""
        self._requests = InFlight()  # the requests being answered (stop_now cancels them)
        self.metrics = ServeMetrics(self)
        self._runner: web.AppRunner | None = None
        self.port: int = config.port
        self.not_ready: dict[str, str] = {}
        """Functions that could not start at warm-up (no ``-f``), with why."""
        self.slow_to_start: set[str] = set()
        """Of ``not_ready``, those whose warm workers were only late (their calls wait for
        one); the others cannot start (their calls answer ``SetupFailed``)."""

    # -- lifecycle
    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"  # an IPv6 address in brackets

    async def start(self) -> None:
        # before the warm-up (a judge model loads for minutes): a port that is taken or an
        # address that is not this machine's fails now, not once every worker is up
        await _check_bindable(self.config.host, self.config.port)
        await self.backend.start()
        try:
            if self.config.warm:
                await self._warm()
            await self._listen()
        except BaseException:
            # no pool outlives a server that did not start: a warm-up that failed, a listener
            # that could not bind (the port taken during the warm-up), a cancelled start; and
            # `async with` never reaches __aexit__ when __aenter__ raised
            if self._runner is not None:
                await self._runner.cleanup()
                self._runner = None
            await self.backend.aclose()
            raise

    async def _listen(self) -> None:
        app = web.Application(
            client_max_size=max(self.config.max_body_bytes, self.config.max_event_bytes) + 1,
            middlewares=[self._requests.middleware, self._unknown_operation],
        )
        app.router.add_post(INVOKE_ROUTE, self._invoke)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        logging.getLogger("aiohttp.server").addFilter(_QUIET_MALFORMED)  # idempotent
        # handler_cancellation: a client that hangs up (its timeout, a hedge that lost, Ctrl-C)
        # cancels its call: one still queued never runs and gives its quota slot back at once.
        # (aiohttp's default ran it when a worker came free, side effects included, holding
        # the tenant's quota until then.) A call already on a worker may run on there, and
        # keeps its slots until it ends (_call)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            handler_cancellation=True,
            shutdown_timeout=drain_timeout(self.config.drain_s),
            keepalive_timeout=self.config.keepalive_s,  # aiohttp's is an hour
            **_NO_INFLATING,
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True)
        await site.start()
        server = site._server  # aiohttp exposes the bound port only here
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def _warm(self) -> None:
        """Start the warm workers. A function named with ``functions`` (``-f``) must start
        (one worker at least, a ``warm=0`` one's too), or the server does not; of all the
        registered ones (no ``-f``), one that cannot start (the LLM judge without its model
        set, a missing toolchain, an entry point that does not import, workers not ready in
        time) is recorded in ``not_ready`` with the cause, and the rest are served: its calls
        answer ``SetupFailed``, or wait for a worker where they were only slow to start."""
        if self.config.functions is not None:
            # each one named, warm=0 ones too (a worker each, gone when idle): "must start"
            # is checked now, not by the first call of some job
            await self.backend.warmup(sorted(self.served))
            return
        warm = [n for n in sorted(self.served) if self.registry.get(n).warm > 0]
        outcomes = await asyncio.gather(*(self.backend.warmup([n]) for n in warm), return_exceptions=True)
        for name, outcome in zip(warm, outcomes, strict=True):
            if isinstance(outcome, SetupFailedError):
                self.not_ready[name] = outcome.message
                log.info("%s cannot start; its calls answer SetupFailed: %s", name, outcome.message)
            elif isinstance(outcome, EntryPointError | BackendError) and not isinstance(
                outcome, BackendClosedError
            ):
                # one function's fault, as a failed setup hook is: an entry point the workers
                # cannot import (its calls answer SetupFailed), warm workers not ready in time
                # (its pool keeps trying). The rest are served; only a closed backend stops all
                self.not_ready[name] = str(outcome)
                if not isinstance(outcome, EntryPointError):
                    self.slow_to_start.add(name)
                log.info("%s is not ready: %s", name, outcome)
            elif isinstance(outcome, BaseException):
                raise outcome

    @property
    def inflight(self) -> int:
        """Requests being answered, ``Event`` calls still running, and runs still going on
        whose caller gave up (a hang-up, a deadline: a synchronous handler runs to its end)."""
        return len(self._requests) + len(self._events) + len(self._running_on)

    def stop_now(self) -> None:
        """Cancel every call in flight (a second Ctrl-C): a closing server then stops at
        once instead of draining for up to ``drain_s``."""
        self._stopped_now.set()
        self._requests.cancel()
        for task in list(self._events):
            task.cancel()

    async def aclose(self) -> None:
        """Stop accepting, give the calls in flight up to ``drain_s`` to finish, cancel the
        rest, then stop the pools. An ``Event`` call accepted (202) and not finished by then
        is cut: each is logged at WARNING with its request id and counted in
        ``fabric_serve_events_dropped_total``; no new one is accepted once the drain begins. Runs
        whose caller gave up are waited for within the same window (``stop_now`` ends the
        wait): stopping the pools then kills their workers (an inproc thread runs on)."""
        self._draining = True
        t0 = time.monotonic()
        if self._runner is not None:
            # waits for the requests in flight; at drain_s, stop_now cancels them (and the events)
            await cleanup_within(self._runner, self.config.drain_s, self.stop_now)
            self._runner = None
        events = list(self._events)  # asynchronous calls have what is left of the window
        left = self.config.drain_s - (time.monotonic() - t0)
        if events and left > 0:
            await asyncio.wait(events, timeout=left)
        for task in events:
            task.cancel()
        await asyncio.gather(*events, return_exceptions=True)
        await self._wait_for_running_on(self.config.drain_s - (time.monotonic() - t0))
        await self.backend.aclose()

    async def _wait_for_running_on(self, left: float) -> None:
        """Wait up to ``left`` seconds (or until ``stop_now``) for the runs given up on to end."""
        running_on = list(self._running_on)
        if not running_on or left <= 0 or self._stopped_now.is_set():
            return
        log.info("stopping: waiting up to %.3g s for %d runs whose callers gave up", left, len(running_on))
        # asyncio.wait cancels none of them (they are the backend's)
        ended = asyncio.ensure_future(asyncio.wait(running_on))
        stopped = asyncio.ensure_future(self._stopped_now.wait())
        try:
            await asyncio.wait({ended, stopped}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            stopped.cancel()
            await asyncio.gather(ended, stopped, return_exceptions=True)
