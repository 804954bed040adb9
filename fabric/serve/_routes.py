"""The gateway's HTTP routes: ``POST`` invocations (the Lambda Invoke API, see
``_lambda_api``), ``GET /healthz`` and ``GET /metrics``. An invocation is checked (token, rate,
name, qualifier, type), takes its tenant's quota slot before its body is read, and is handed
to the call layer below (``_calls``); its answer or error is counted in the metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from fabric.protocol import new_request_id
from fabric.serve._calls import GatewayCalls, StoppedBeforeRun, _shown
from fabric.serve._lambda_api import (
    CLIENT_CLOSED,
    DRAINED,
    INVOCATION_TYPES,
    LOG_TYPES,
    Reply,
    error_response,
    parse_invocation,
    read_body,
    refuse_encoded,
    reply_response,
    result_response,
    split_name,
    tenant_of,
    throttled,
)
from fabric.serve.config import UNAUTHENTICATED
from fabric.serve.gate import QuotaExceeded, RateLimiter, TenantConnections

log = logging.getLogger("fabric.serve")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: A refused request's body still coming is dropped for this long at most (aiohttp's
#: ``lingering_time``), and for as long as it keeps coming: a pause this long ends it.
_DROP_BODY_S = 10.0
_DROP_BODY_PAUSE_S = 1.0


async def _drop_body(request: web.Request) -> None:
    """Read and drop the rest of a refused request's body, then return: when it has all
    come, when it pauses for ``_DROP_BODY_PAUSE_S``, or after ``_DROP_BODY_S``. httpx (the
    lambda backend's http transport) and boto3 write a request whole before they read its
    answer: a connection closed with their body unread is reset under them, and the answer
    lost with it (a ReadError, not the 403 or 413)."""
    content = request.content
    loop = asyncio.get_running_loop()
    end = loop.time() + _DROP_BODY_S
    try:
        while not content.is_eof() and (left := end - loop.time()) > 0:
            async with asyncio.timeout(min(_DROP_BODY_PAUSE_S, left)):
                await content.readany()
    except Exception:  # a pause, the client gone, a bad chunk: the connection closes all the same
        pass


class GatewayRoutes(GatewayCalls):
    """The request handlers (see the module docstring)."""

    _tokens: dict[bytes, str]
    may_invoke: frozenset[str]
    served: frozenset[str]
    rates: RateLimiter
    connections: TenantConnections[Any]
    _draining: bool

    def _not_served(self, asked: str) -> str:
        """The 404's message for ``asked`` (the name as requested, with its prefix): what
        to do about it. The bare "Function not found" had the lambda backend advise as for
        AWS (`fabric deploy` names it rl-fabric-NAME), wrong for a server started without the
        function or with another prefix."""
        prefix = self.config.function_prefix
        shown = asked if len(asked) <= 200 else f"{asked[:200]}..."
        message = f"Function not found: {shown}"
        if prefix and not asked.startswith(prefix):
            # LambdaConfig's function_prefix; `fabric invoke --prefix`
            return (
                f"{message} (this server's functions are named {prefix}NAME: set function_prefix={prefix!r})"
            )
        if prefix:
            asked = asked[len(prefix) :]
        as_served = [n for n in self.served if asked.endswith(n) and asked != n]
        if as_served:  # called with a prefix this server does not use
            name = max(as_served, key=len)
            return f"{message} (this server serves it as {prefix + name!r}: set function_prefix={prefix!r})"
        if asked in self.registry:
            return (
                f"{message} (this server serves only {', '.join(sorted(self.served))}: restart it with "
                f"-f {asked} to serve it too)"
            )
        return (
            f"{message} (this server serves {', '.join(sorted(self.served)) or 'no function'}; one of "
            "your own is served once the server loads its module: fabric serve -m MODULE)"
        )

    async def _send(self, request: web.Request, response: web.Response, tenant: str) -> None:
        """Write a call's answer holding a slot of its tenant's quota, for body_timeout_s at
        most. Written by aiohttp once the handler returned, an answer held no slot (the call
        had given its back), and a client that never read its answers (a large result each)
        kept every one in the server's memory, on as many connections as it liked, for as
        long as it kept them open: a write has no timeout. Its slot comes back when the answer
        is written, or when the client has not taken it in time and the connection goes."""
        self.quotas.hold(tenant)  # the call gave its own back in this same step: no gap
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            log.debug(
                "an answer not taken in %g s (body_timeout_s): its connection closes",
                self.config.body_timeout_s,
            )
            if request.transport is not None:
                request.transport.abort()  # with the bytes queued on it
        except ConnectionError:  # the client went; aiohttp's own write would say nothing either
            pass
        finally:
            self.quotas.give(tenant)

    async def _close_after(self, request: web.Request, response: web.StreamResponse) -> None:
        """Write ``response`` (a refusal, ``Connection: close``), drop what is still coming of
        the request's body (``_drop_body``), and end the connection. Left to aiohttp, a
        connection answered so stayed open while aiohttp read on for up to 10 s (its
        ``lingering_time``) though nothing came: a tenant over ``max_connections`` held the
        socket it was refused, and a client without a token as many as it opened."""
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:  # an answer not taken: dropped with the connection, as in _send
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:
            pass
        else:
            await _drop_body(request)
        request.protocol.force_close()  # closes the transport once its answer is flushed

    def _tenant(self, request: web.Request) -> str:
        """The tenant whose token the request carries, its connection counted as the tenant's
        (``max_connections``); 401, 403, or 429 with every one of its connections busy."""
        tenant = tenant_of(request, self._tokens)
        if not self.connections.arrive(tenant, request.protocol):
            # Lambda's nearest: every one of the tenant's connections carries a request now
            raise self._throttled(
                tenant,
                f"already has {self.connections.limits[tenant]} connections open, every one busy "
                "(its max_connections); send on those, or retry with backoff",
                reason="ConcurrentInvocationLimitExceeded",
                close=True,
            )
        return tenant

    def _throttled(
        self, tenant: str, why: str, *, reason: str, retry_after_s: float | None = None, close: bool = False
    ) -> Reply:
        """The 429 of ``tenant``'s limit, counted as the quota's (the metric's promise), a
        metrics-only tenant's too."""
        self.quotas.throttled[tenant] += 1
        message = f"Rate Exceeded: tenant {tenant!r} {why}"
        return throttled(message, reason=reason, retry_after_s=retry_after_s, close=close)

    async def _pace(self, tenant: str) -> None:
        """Hold a request of ``tenant`` back to its ``max_rps`` (its token already checked);
        429 when it is more than ``MAX_DELAY_S`` of requests over. Every request a token
        makes, ``/metrics`` too: a render of every series costs more than a refused call."""
        now = time.monotonic()
        wait = self.rates.delay(tenant, now)
        if wait is None:
            # the tenant's own rate over all functions: Lambda's caller's, not a function's
            raise self._throttled(
                tenant,
                f"is more than {RateLimiter.MAX_DELAY_S:g} s of requests over its max_rps; "
                "retry with backoff",
                reason="CallerRateLimitExceeded",
                retry_after_s=self.rates.refused_for(tenant, now),
            )
        if wait:
            await asyncio.sleep(wait)

    async def _unknown_operation(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A middleware: the router's 404 and 405 in Lambda's JSON. aiohttp's were text
        (``404: Not Found``), so boto3 raised a ``ClientError`` coded ``404``, and a Lambda
        call this server does not serve (``aws lambda list-functions``) was told no more."""
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as e:
            if request.match_info.route.resource is not None:
                raise  # a route's own (none raises one now): left as it is
            message = (
                "fabric serve answers Lambda's Invoke (POST /2015-03-31/functions/NAME/invocations), "
                f"GET /healthz and GET /metrics only; not {request.method} {_shown(request.path)}"
            )
            response = error_response(e.status, "UnknownOperationException", message, new_request_id())
            if isinstance(e, web.HTTPMethodNotAllowed):
                response.headers["Allow"] = ",".join(sorted(e.allowed_methods))
            return response

    # what aiohttp's @web.middleware sets (see drain.InFlight.middleware)
    _unknown_operation.__middleware_version__ = 1  # type: ignore[attr-defined]

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            tenant = self._tenant(request)
            await self._pace(tenant)
        except Reply as e:
            response = reply_response(e, new_request_id())
            if e.close:
                response.force_close()
                await self._close_after(request, response)
            return response
        sees_all = self.config.tenants[tenant].metrics == "all"
        body, content_type = self.metrics.render(None if sees_all else tenant)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _invoke(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        request_id = new_request_id()
        tenant, function = UNAUTHENTICATED, "-"
        close = False
        try:
            tenant = self._tenant(request)
            if tenant not in self.may_invoke:
                # as Lambda refuses a caller without lambda:InvokeFunction: the lambda backend
                # reads it as Unauthorized, final (no retry gives the token the right)
                raise Reply(
                    403,
                    "AccessDeniedException",
                    f"tenant {tenant!r} may not invoke functions (invoke: false): its token may only "
                    "scrape metrics (GET /metrics). Call with the token of a tenant that may invoke, "
                    f"or let {tenant!r} invoke: set invoke: true on it (the default) in the server's "
                    "tenants file (--tenants) and restart the server",
                )
            await self._pace(tenant)
            function, qualifier = split_name(request.match_info["name"], request.query.get("Qualifier"))
            prefix = self.config.function_prefix
            if prefix and function.startswith(prefix):
                function = function[len(prefix) :]
            elif prefix:
                raise Reply(404, "ResourceNotFoundException", self._not_served(function))
            if function not in self.served:
                raise Reply(404, "ResourceNotFoundException", self._not_served(prefix + function))
            spec = self.registry.get(function)
            if qualifier not in (None, "$LATEST", "live", spec.version):
                raise Reply(
                    404,
                    "ResourceNotFoundException",
                    f"Function not found: {function}:{qualifier} (served qualifiers: $LATEST, live, "
                    f"{spec.version})",
                )
            kind = request.headers.get("X-Amz-Invocation-Type", "RequestResponse")
            if kind not in INVOCATION_TYPES:
                raise Reply(
                    400,
                    "InvalidParameterValueException",
                    f"X-Amz-Invocation-Type must be one of {', '.join(INVOCATION_TYPES)}; got {kind[:40]!r}",
                )
            log_type = request.headers.get("X-Amz-Log-Type", "None")
            if log_type not in LOG_TYPES:
                # as Lambda (it was ignored: the call ran, and a typo's caller got no log)
                raise Reply(
                    400,
                    "InvalidParameterValueException",
                    f"LogType (X-Amz-Log-Type) must be one of {', '.join(LOG_TYPES)}; got {log_type[:40]!r}",
                )
            refuse_encoded(request)
            # the quota is taken before the body is read: a request holds its body in memory
            # (up to 6 MB) from here on, so a tenant holds at most max_concurrency bodies, and
            # one that opens requests and sends their bodies slowly spends its own quota only
            try:
                self.quotas.take(tenant)
            except QuotaExceeded:
                limit = self.quotas.limits[tenant]
                # when one of its calls ends is not known here: no Retry-After (``throttled``)
                raise throttled(
                    f"Rate Exceeded: tenant {tenant!r} already has {limit} calls in flight "
                    "(its max_concurrency); retry with backoff",
                    reason="ConcurrentInvocationLimitExceeded",
                ) from None
            handed_off = False
            try:
                body = await read_body(request, kind, self.config)
                inv, envelope = parse_invocation(body, function, tenant, request_id)
                if kind == "DryRun":
                    response: web.StreamResponse = web.Response(
                        status=204, headers={"x-amzn-RequestId": request_id}
                    )
                elif kind == "Event":
                    if self._draining:
                        # accepted now, it would be cut when the drain ends, unseen by the caller
                        # no limit of the caller's refused it: no Reason, as Lambda's enum has none
                        raise throttled(
                            "the server is draining (shutting down) and takes no new Event "
                            "invocations; nothing ran: retry with backoff",
                        )
                    self._start_event(inv, tenant)
                    handed_off = True  # the event gives the quota back when the call ends
                    response = web.Response(status=202, headers={"x-amzn-RequestId": request_id})
                else:
                    handed_off = True  # _call gives the quota back when the call no longer runs
                    try:
                        result = await self._call(inv, tenant, say_if_stopped=True)
                    except StoppedBeforeRun:
                        # as an Event refused in the drain: Throttled to the lambda backend,
                        # retried even for a side effect
                        raise throttled(
                            "the server stopped (shutting down) before this call's turn in the pool "
                            "came: it did not run; retry with backoff",
                        ) from None
                    # as Lambda's: an alias or a version answers the version it ran, else $LATEST
                    version = "$LATEST" if qualifier in (None, "$LATEST") else spec.version
                    tail = log_type == "Tail"
                    response = result_response(result, envelope, request_id, version=version, tail=tail)
                    await self._send(request, response, tenant)
            finally:
                if not handed_off:
                    self.quotas.give(tenant)
        except Reply as e:
            response = reply_response(e, request_id)
            if e.close:
                response.force_close()
                close = True
        except asyncio.CancelledError:
            # the client hung up (handler_cancellation): nobody reads an answer; counted as
            # nginx counts it, 499 "client closed request", so a metric shows abandoned calls.
            # Or the server cut it (the drain's end, a second Ctrl-C): its own label, not the
            # client's doing
            label = function if function in self.served else "-"
            status = DRAINED if self._stopped_now.is_set() else CLIENT_CLOSED
            self.metrics.observe(tenant, label, status, time.perf_counter() - t0)
            raise
        except Exception:
            # a bug of ours: Lambda's own 500, in JSON, so boto3 raises ServiceException and
            # the lambda backend reads a retryable service fault, not aiohttp's text page
            log.exception("request %s to %s failed inside the server", request_id, function)
            response = error_response(
                500, "ServiceException", f"internal error in fabric serve (request {request_id})", request_id
            )
        # unknown names are one label: a scan of made-up names must not grow the metrics
        label = function if function in self.served else "-"
        self.metrics.observe(tenant, label, response.status, time.perf_counter() - t0)
        if close:
            await self._close_after(request, response)
        return response
