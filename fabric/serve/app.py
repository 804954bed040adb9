"""The gateway: the AWS Lambda Invoke API in front of the local warm pools.

``POST /2015-03-31/functions/{name}/invocations`` is what boto3's ``lambda.invoke`` sends,
so the Lambda backend (and the AWS CLI, and any Lambda SDK) talks to this server or to AWS
with the same code. The function name may carry a qualifier (``name:live``, an ARN, or
``?Qualifier=``); ``$LATEST``, ``live`` and the function's version hash are served.

Two body shapes, told apart by the body itself:

* **envelope**: a fabric ``Invocation`` whose ``function`` is the name in the path (what
  the Lambda backend sends, and what the Lambda handler takes in AWS). The reply is the
  fabric ``Result``, a failure included: a failure is data, as with the handler in AWS.
* **raw**: any other JSON object is the function's keyword arguments (``aws lambda invoke
  --payload '{"prediction": "4", "reference": "4"}'``). The reply is the bare value; a
  failed call answers ``X-Amz-Function-Error: Unhandled`` with Lambda's error object
  (``errorType``, ``errorMessage``, ``stackTrace``).

The caller's tenant comes from its token, never from the body. Errors are Lambda's: 400
``InvalidRequestContentException``/``InvalidParameterValueException``, 401/403 (missing or
wrong token), 404 ``ResourceNotFoundException``, 413 ``RequestTooLargeException``,
429 ``TooManyRequestsException``, with the code in ``x-amzn-ErrorType`` where botocore looks.
``GET /healthz`` needs no token and says only ``ok``; ``GET /metrics`` (Prometheus) needs one
and shows a tenant only its own tenant-labelled series (``metrics: all``: every tenant's).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import socket
import time
from urllib.parse import unquote

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import ValidationError

from fabric.backends.base import Backend, make_backend
from fabric.errors import ConfigError, ErrorCode, SetupFailedError
from fabric.protocol import Invocation, Result, decode_payload, new_request_id, to_strict_json
from fabric.registry import Registry, default_registry
from fabric.serve.config import ServeConfig
from fabric.serve.drain import InFlight, cleanup_within, drain_timeout
from fabric.serve.gate import FairGate, QuotaExceeded, Quotas, RateLimiter
from fabric.serve.metrics import ServeMetrics

log = logging.getLogger("fabric.serve")

INVOKE_ROUTE = "/2015-03-31/functions/{name}/invocations"
_TYPES = ("RequestResponse", "Event", "DryRun")
_JSON = "application/json"
#: The status a request whose client hung up before its answer is counted under (nginx's).
CLIENT_CLOSED = 499
#: Answers a backend may give while the call still runs: at the caller's deadline, and at
#: timeout_s where the run cannot be stopped (an inproc thread; the local pool kills the worker)
_MAY_RUN_ON = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.TIMEOUT})
#: An envelope's ``deadline`` is wall-clock seconds; past this it is not a deadline anyone
#: meant (the year 33658), and the pool's arithmetic on it would overflow.
_MAX_DEADLINE = 1e12


class _QuietMalformed(logging.Filter):
    """aiohttp logs every request it cannot parse as an ERROR with a traceback, so a
    port scan or a fuzz floods the server's log. The client already got a 400 with the
    parser's reason; here it is one DEBUG line. A body it cannot decode (a bad
    Content-Encoding) is logged again as aiohttp drains it after our 400: the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError | RequestPayloadError):
            reason = " ".join(str(getattr(exc, "message", "") or exc).split())
            log.debug("malformed HTTP request (answered 400): %s", reason[:300])
            return False
        return True


_QUIET_MALFORMED = _QuietMalformed()


class _Reply(Exception):
    """An early answer (an error before the function runs)."""

    def __init__(self, status: int, code: str, message: str, *, close: bool = False):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.close = close
        """End the connection after the answer: the rest of the request is not coming."""


def _error_response(status: int, code: str, message: str, request_id: str) -> web.Response:
    # botocore's rest-json parser reads the code from x-amzn-ErrorType, the text from "message"
    body = json.dumps({"__type": code, "Type": "User", "message": message})
    return web.Response(
        status=status,
        body=body.encode(),
        content_type=_JSON,
        headers={"x-amzn-ErrorType": code, "x-amzn-RequestId": request_id},
    )


def _split_name(raw: str, query_qualifier: str | None) -> tuple[str, str | None]:
    """``name``, ``name:qualifier``, ``arn:aws:lambda:region:account:function:name[:q]`` or
    the partial ARN ``account:function:name[:q]``: the forms Lambda's Invoke accepts."""
    name = unquote(raw)
    qualifier = query_qualifier
    parts = name.split(":")
    if name.startswith("arn:"):
        if len(parts) not in (7, 8) or parts[5] != "function":
            raise _Reply(400, "InvalidParameterValueException", f"not a Lambda function ARN: {name!r}")
        name = parts[6]
        if len(parts) == 8:
            qualifier = qualifier or parts[7]
    elif len(parts) in (3, 4) and parts[1] == "function":
        name = parts[2]
        if len(parts) == 4:
            qualifier = qualifier or parts[3]
    elif ":" in name:
        name, _, q = name.partition(":")
        qualifier = qualifier or q
    return name, qualifier


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


class Gateway:
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
        self.quotas = Quotas({name: t.max_concurrency for name, t in config.tenants.items()})
        self.rates = RateLimiter({name: t.max_rps for name, t in config.tenants.items()})
        self._gates: dict[str, FairGate] = {}
        self._events: set[asyncio.Task[None]] = set()
        self._draining = False
        """Set when ``aclose`` begins: no ``Event`` is accepted any more."""
        self._requests = InFlight()  # the requests being answered (stop_now cancels them)
        self.metrics = ServeMetrics(self)
        self._runner: web.AppRunner | None = None
        self.port: int = config.port
        self.not_ready: dict[str, str] = {}
        """Functions that could not start at warm-up (no ``-f``), with why."""

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
        except BaseException:
            await self.backend.aclose()  # no pool outlives a server that did not start
            raise
        app = web.Application(
            client_max_size=max(self.config.max_body_bytes, self.config.max_event_bytes) + 1,
            middlewares=[self._requests.middleware],
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
        set, a missing toolchain) is left out of the warm-up and recorded in ``not_ready``:
        its calls answer ``SetupFailed`` with the cause, and the rest are served."""
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
            elif isinstance(outcome, BaseException):
                raise outcome

    @property
    def inflight(self) -> int:
        """Requests being answered plus ``Event`` calls still running."""
        return len(self._requests) + len(self._events)

    def stop_now(self) -> None:
        """Cancel every call in flight (a second Ctrl-C): a closing server then stops at
        once instead of draining for up to ``drain_s``."""
        self._requests.cancel()
        for task in list(self._events):
            task.cancel()

    async def aclose(self) -> None:
        """Stop accepting, give the calls in flight up to ``drain_s`` to finish, cancel the
        rest, then stop the pools. An ``Event`` call accepted (202) and not finished by then
        is cut: each is logged at WARNING with its request id and counted in
        ``fabric_serve_events_dropped``; no new one is accepted once the drain begins."""
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
        await self.backend.aclose()

    # -- routes
    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenant(request)
        except _Reply as e:
            return _error_response(e.status, e.code, e.message, new_request_id())
        sees_all = self.config.tenants[tenant].metrics == "all"
        body, content_type = self.metrics.render(None if sees_all else tenant)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _invoke(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        request_id = new_request_id()
        tenant = function = "-"
        try:
            tenant = self._tenant(request)
            wait = self.rates.delay(tenant, time.monotonic())
            if wait is None:
                raise _Reply(
                    429,
                    "TooManyRequestsException",
                    f"Rate Exceeded: tenant {tenant!r} is more than "
                    f"{RateLimiter.MAX_DELAY_S:g} s of requests over its max_rps; retry with backoff",
                )
            if wait:
                await asyncio.sleep(wait)
            function, qualifier = _split_name(request.match_info["name"], request.query.get("Qualifier"))
            prefix = self.config.function_prefix
            if prefix and function.startswith(prefix):
                function = function[len(prefix) :]
            elif prefix:
                raise _Reply(404, "ResourceNotFoundException", f"Function not found: {function}")
            if function not in self.served:
                raise _Reply(404, "ResourceNotFoundException", f"Function not found: {function}")
            spec = self.registry.get(function)
            if qualifier not in (None, "$LATEST", "live", spec.version):
                raise _Reply(
                    404,
                    "ResourceNotFoundException",
                    f"Function not found: {function}:{qualifier} (served qualifiers: $LATEST, live, "
                    f"{spec.version})",
                )
            kind = request.headers.get("X-Amz-Invocation-Type", "RequestResponse")
            if kind not in _TYPES:
                raise _Reply(
                    400,
                    "InvalidParameterValueException",
                    f"X-Amz-Invocation-Type must be one of {', '.join(_TYPES)}; got {kind[:40]!r}",
                )
            # the quota is taken before the body is read: a request holds its body in memory
            # (up to 6 MB) from here on, so a tenant holds at most max_concurrency bodies, and
            # one that opens requests and sends their bodies slowly spends its own quota only
            try:
                self.quotas.take(tenant)
            except QuotaExceeded:
                limit = self.quotas.limits[tenant]
                raise _Reply(
                    429,
                    "TooManyRequestsException",
                    f"Rate Exceeded: tenant {tenant!r} already has {limit} calls in flight "
                    "(its max_concurrency); retry with backoff",
                ) from None
            handed_off = False
            try:
                body = await self._body(request, kind)
                inv, envelope = self._invocation(body, function, tenant, request_id)
                if kind == "DryRun":
                    response: web.StreamResponse = web.Response(
                        status=204, headers={"x-amzn-RequestId": request_id}
                    )
                elif kind == "Event":
                    if self._draining:
                        # accepted now, it would be cut when the drain ends, unseen by the caller
                        raise _Reply(
                            429,
                            "TooManyRequestsException",
                            "the server is draining (shutting down) and takes no new Event "
                            "invocations; nothing ran: retry with backoff",
                        )
                    self._start_event(inv, tenant)
                    handed_off = True  # the event gives the quota back when the call ends
                    response = web.Response(status=202, headers={"x-amzn-RequestId": request_id})
                else:
                    handed_off = True  # _call gives the quota back when the call no longer runs
                    result = await self._call(inv, tenant)
                    response = self._result_response(result, envelope, request_id)
            finally:
                if not handed_off:
                    self.quotas.give(tenant)
        except _Reply as e:
            response = _error_response(e.status, e.code, e.message, request_id)
            if e.close:
                response.force_close()
        except asyncio.CancelledError:
            # the client hung up (handler_cancellation): nobody reads an answer; counted as
            # nginx counts it, 499 "client closed request", so a metric shows abandoned calls
            label = function if function in self.served else "-"
            self.metrics.observe(tenant, label, CLIENT_CLOSED, time.perf_counter() - t0)
            raise
        except Exception:
            # a bug of ours: Lambda's own 500, in JSON, so boto3 raises ServiceException and
            # the lambda backend reads a retryable service fault, not aiohttp's text page
            log.exception("request %s to %s failed inside the server", request_id, function)
            response = _error_response(
                500, "ServiceException", f"internal error in fabric serve (request {request_id})", request_id
            )
        # unknown names are one label: a scan of made-up names must not grow the metrics
        label = function if function in self.served else "-"
        self.metrics.observe(tenant, label, response.status, time.perf_counter() - t0)
        return response

    # -- steps
    def _tenant(self, request: web.Request) -> str:
        auth = request.headers.get("Authorization")
        if not auth:
            raise _Reply(
                401, "MissingAuthenticationTokenException", "missing 'Authorization: Bearer <token>' header"
            )
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _Reply(
                401,
                "MissingAuthenticationTokenException",
                "the Authorization header must be 'Bearer <token>'",
            )
        # aiohttp hands over a header's bytes that are not UTF-8 as surrogates: encoded back
        # as they came (a strict encode raised, a 500 and a traceback per unauthenticated request)
        secret = token.strip().encode("utf-8", "surrogateescape")
        tenant = self._tokens.get(hashlib.sha256(secret).digest())
        if tenant is None:
            raise _Reply(
                403, "UnrecognizedClientException", "The security token included in the request is invalid"
            )
        return tenant

    async def _body(self, request: web.Request, kind: str) -> bytes:
        limit = self.config.max_event_bytes if kind == "Event" else self.config.max_body_bytes
        too_large = _Reply(
            413,
            "RequestTooLargeException",  # Lambda's code: boto3 raises its modeled exception
            f"Request must be smaller than {limit} bytes for the {kind} invocation type",
        )
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            # a body that stalls (a client that vanished without a FIN, or one that trickles
            # bytes) would hold its quota slot for as long as TCP keeps the connection
            async with asyncio.timeout(self.config.body_timeout_s):
                body = await request.read()
        except TimeoutError:
            raise _Reply(
                408,
                "RequestTimeoutException",
                f"the body did not arrive within {self.config.body_timeout_s:g} s (body_timeout_s)",
                close=True,  # as HTTP says for a 408: the connection is in no state to reuse
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None
        except RequestPayloadError as e:  # a body aiohttp cannot decode (a bad Content-Encoding)
            reason = " ".join(str(e).split())
            raise _Reply(400, "InvalidRequestContentException", f"cannot read the body: {reason}") from None
        except ConnectionError:
            # the client hung up before its whole body came (a timeout, a crash): nobody reads
            # the answer, and it is not our error to log with a traceback
            log.debug("client hung up while sending the body of a %s request", kind)
            raise _Reply(
                400, "InvalidRequestContentException", "the connection closed before the whole body arrived"
            ) from None
        if len(body) > limit:
            raise too_large
        return body

    def _invocation(
        self, body: bytes, function: str, tenant: str, request_id: str
    ) -> tuple[Invocation, bool]:
        if not body.strip():
            body = b"{}"  # the AWS CLI sends no payload as an empty body
        try:
            data = decode_payload(body)
        except ValueError as e:
            raise _Reply(
                400, "InvalidRequestContentException", f"Could not parse request body into json: {e}"
            ) from None
        if not isinstance(data, dict):
            raise _Reply(
                400,
                "InvalidRequestContentException",
                f"the payload must be a JSON object of keyword arguments, not {type(data).__name__}",
            )
        if data.get("function") == function and "payload" in data:
            try:
                inv = Invocation.model_validate(data)
            except ValidationError as e:
                raise _Reply(
                    400, "InvalidRequestContentException", f"not a valid fabric Invocation: {e}"
                ) from None
            if inv.deadline is not None and not (
                math.isfinite(inv.deadline) and abs(inv.deadline) < _MAX_DEADLINE
            ):
                raise _Reply(
                    400,
                    "InvalidRequestContentException",
                    f"not a valid fabric Invocation: deadline {inv.deadline!r} is not a wall-clock "
                    "time in seconds (time.time() + timeout)",
                )
            # encoded here, once, for the worker: a payload JSON cannot carry (NaN, Infinity:
            # 1e999 parses as one) failed in the pool's dispatch, where nothing answered the
            # call, and it held its quota and pool slots for good
            try:
                raw = to_strict_json(inv.payload)
            except ValueError as e:
                raise _Reply(
                    400, "InvalidRequestContentException", f"not a valid fabric Invocation: payload: {e}"
                ) from None
            # the tenant is who the token says, whatever the body claims
            return inv.model_copy(update={"tenant": tenant, "raw": raw}), True
        inv = Invocation.fast(
            function=function,
            payload=data,
            request_id=request_id,
            idempotency_key=None,
            deadline=None,
            tenant=tenant,
            attempt=1,
            hedge=False,
            wait_for_run=False,
            raw=body,  # already the payload's JSON: not encoded again on the way to the worker
        )
        return inv, False

    def _gate(self, function: str) -> FairGate:
        gate = self._gates.get(function)
        if gate is None:
            backend = self.backend
            # inproc has no bound of its own: the function's concurrency bound
            fallback = self.registry.get(function).max_concurrency

            def capacity() -> int:
                room = backend.capacity(function)
                return fallback if room is None else max(1, room)

            gate = self._gates[function] = FairGate(capacity)
            backend.watch_capacity(function, gate.admit)  # room gained is taken at once
        return gate

    async def _call(self, inv: Invocation, tenant: str) -> Result:
        """Run ``inv`` through the function's gate; the tenant's quota slot (taken by the
        caller) and the gate slot are given back when the call no longer runs. A call still
        waiting for the gate, or queued in the pool, is dropped when its client hangs up (it
        never runs). One already on a worker may run on past its answer (a deadline; timeout_s
        on an inproc thread) or its client (a hang-up): a synchronous handler runs to its end,
        and both slots stay held until the backend says its run ended, or a tenant could fill
        every worker with calls it gave up on while holding none of its quota."""
        try:
            gate = self._gate(inv.function)
            # the envelope's deadline bounds the wait for room too: a call still waiting at it
            # is answered then (nothing ran), not when a worker comes free, seconds later
            async with asyncio.timeout(None if inv.deadline is None else inv.deadline - time.time()):
                await gate.acquire(tenant)
        except TimeoutError:
            self.quotas.give(tenant)
            return Result.failure(
                ErrorCode.DEADLINE_EXCEEDED,
                "deadline passed while waiting for room in the pool (it did not run)",
                function=inv.function,
                request_id=inv.request_id,
            )
        except BaseException:
            self.quotas.give(tenant)
            raise
        try:
            fut = self.backend.submit(inv)
        except BaseException:
            self._release(tenant, gate)
            raise
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.cancel()  # a queued call never runs; an async handler is cancelled where it runs
            self._release_when_settled(inv.function, fut, tenant, gate)
            raise
        except BaseException:  # the backend's future failed (a bug of a backend)
            self._release(tenant, gate)
            raise
        if result.ok or result.error is None or result.error.type not in _MAY_RUN_ON:
            self._release(tenant, gate)  # the worker answered: it is done with the call
        else:
            self._release_when_settled(inv.function, fut, tenant, gate)
        return result

    def _release(self, tenant: str, gate: FairGate) -> None:
        gate.release()
        self.quotas.give(tenant)

    def _release_when_settled(
        self, function: str, fut: asyncio.Future[Result], tenant: str, gate: FairGate
    ) -> None:
        settled = self.backend.settled(function, fut)
        if settled is None:
            self._release(tenant, gate)
            return
        self.metrics.running_on += 1
        log.debug(
            "a call of %s runs on without its caller; %s's slots are held until it ends", function, tenant
        )

        def ended(_: object) -> None:
            self.metrics.running_on -= 1
            self._release(tenant, gate)

        settled.add_done_callback(ended)

    def _start_event(self, inv: Invocation, tenant: str) -> None:
        """Run an accepted ``Event`` call on its own task, which takes over its quota slot.
        A task cancelled before its first step (the server stopping in the loop turn that
        accepted it) never runs its coroutine, so ``_call`` never has the slot to give back:
        then the task's end gives it back."""
        begun = False

        async def run() -> None:
            nonlocal begun
            begun = True
            await self._run_event(inv, tenant)

        def ended(task: asyncio.Task[None]) -> None:
            self._events.discard(task)
            if not begun:
                self.quotas.give(tenant)
            self._event_ended(inv, tenant, task)

        task = asyncio.get_running_loop().create_task(run())
        self._events.add(task)
        task.add_done_callback(ended)

    async def _run_event(self, inv: Invocation, tenant: str) -> None:
        result = await self._call(inv, tenant)  # gives the quota back
        if not result.ok and result.error is not None:
            log.warning(
                "event %s %s failed: %s: %s",
                inv.request_id,
                inv.function,
                result.error.type,
                result.error.message,
            )

    def _event_ended(self, inv: Invocation, tenant: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            return
        # cancelled: the server stopped (the drain ran out, or a second Ctrl-C) before the call
        # ended; its caller got 202 long ago and hears of it nowhere else
        self.metrics.event_dropped(tenant, inv.function)
        log.warning(
            "event %s %s (tenant %s) dropped: the server stopped before it ended (drain_s=%g); "
            "it was queued or cut while running, so it may not have run, or run in part",
            inv.request_id,
            inv.function,
            tenant,
            self.config.drain_s,
        )

    def _result_response(self, result: Result, envelope: bool, request_id: str) -> web.Response:
        headers = {"x-amzn-RequestId": request_id, "X-Amz-Executed-Version": "$LATEST"}
        if envelope:
            return web.Response(body=result.model_dump_json().encode(), content_type=_JSON, headers=headers)
        if result.ok:
            return web.Response(body=to_strict_json(result.value), content_type=_JSON, headers=headers)
        assert result.error is not None
        headers["X-Amz-Function-Error"] = "Unhandled"
        trace = (result.error.traceback or "").splitlines()
        body = {"errorType": result.error.type, "errorMessage": result.error.message, "stackTrace": trace}
        return web.Response(body=json.dumps(body).encode(), content_type=_JSON, headers=headers)
