"""AWS Lambda: AWS itself through boto3, or ``fabric serve``, which speaks the same API.

Each registered function is a Lambda function named ``function_prefix + name``, invoked on
the ``live`` alias (provisioned concurrency, the warm pool, is configured on an alias or
version, never on ``$LATEST``). The request body is the fabric ``Invocation`` envelope, the
idempotency key included, which the Lambda handler (``functions.handler``) honours; the reply
is the ``Result`` it builds.

Two transports speak the Invoke API. ``boto3`` (AWS: SigV4 with the usual credential
chain; also ``fabric serve``, unsigned with ``Authorization: Bearer``) is synchronous, so
its calls run on threads and the event loop never blocks. Nothing can stop a boto3 call
once sent: one its caller abandons (a deadline, a losing hedge) holds its thread and
connection until Lambda answers or its read timeout passes. That timeout is the call's own
(``_read_limit``): its deadline, else, on AWS Lambda, its function's ``timeout_s`` (plus a
margin for a cold start), rounded up to one of a few steps, each with a botocore client of
its own (botocore takes the read timeout per client), and never past ``read_timeout_s``; a
fixed 910 s held a hung connection for 15 minutes after the call's time was up. So ``max_connections``
bounds the calls whose callers still wait, and the abandoned ones run beside them on up to
as many spare threads and connections; past that, an abandoned call keeps its slot until it
ends. A call whose deadline passes while it waits for a slot was never sent, and says so.
The ``http`` transport takes the same read timeout per request.

``http`` (aiohttp, on the event loop) is for ``fabric serve`` only: botocore spends
about 2 ms of CPU per call, which caps one process at a few hundred calls per second, while
a reward service wants thousands. ``auto`` picks ``http`` when a token is set.

A payload too large for Lambda's request goes to S3 first (``_lambda_spill.LambdaSpill``),
the request's envelope (``_lambda_envelope.envelope``) pointing at it.

Failures are translated in one place (``_lambda_replies.LambdaReplies``, the layer this
backend is built on): throttling (429), 5xx service faults, connection
faults and read timeouts are retryable (a connection that was never made, refused or past
``connect_timeout_s``, is ``NotStarted``: the request was not sent, so even a side effect is
retried); a ``FunctionError`` whose body is not a ``Result`` is Lambda's own error object
(a timeout or a crashed runtime is retryable, a response over the size limit is
``ResultNotSerializable``, a handler that cannot be loaded is ``SetupFailed``, anything
else is the function's ``UserError``); a whole reply that is not JSON is the function's
(``ResultNotSerializable``, or its ``UserError`` under a ``FunctionError``), unless it is
JSON cut short (a retryable ``TransportError``); Lambda's refusal for the function's own
configuration (its package, runtime, KMS key, VPC or EFS) is ``SetupFailed``, final, and one
for an execution environment it could not make ready ``NotStarted``; a missing
function (its message names the region it was looked for in), a region AWS Lambda does not
have (its endpoint never resolves: not a connection fault to retry), a refused token, a bad
request are final.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

from fabric.backends._lambda_envelope import _envelope_head
from fabric.backends._lambda_envelope import envelope as envelope  # its old home
from fabric.backends._lambda_replies import LambdaReplies
from fabric.backends._lambda_replies import _as_result as _as_result  # its old home
from fabric.backends._lambda_spill import _UNSENT_MARGIN_S, LambdaSpill, _call_soon
from fabric.backends.base import TOKEN_ENV, Backend, LambdaConfig
from fabric.errors import ConfigError, ErrorCode
from fabric.protocol import MAX_PAYLOAD_BYTES, Invocation, Result
from fabric.registry import Registry

#: How long after its function's ``timeout_s`` a call's reply may still come before its
#: connection is read as hung: Lambda's init phase (up to 10 s on a cold start) is not
#: counted in the function's timeout, and the reply has to travel back.
_READ_MARGIN_S = 15.0
#: How long after a call's deadline its connection is given up: the client answers the caller
#: at the deadline itself, and the handler stops there; this only frees the connection.
_DEADLINE_MARGIN_S = 1.0
#: OpenSSL's reasons that only a handshake gives (lower case, as in botocore's SSLError text):
#: no byte of the request was sent before them.
_HANDSHAKE_REASONS = (
    "wrong version number",
    "certificate verify failed",
    "hostname mismatch",
    "tlsv1 alert",
    "sslv3 alert handshake failure",
    "unsupported protocol",
    "no protocols available",
)
#: The read timeouts (s) a call's own rounds up to: botocore takes a read timeout per client,
#: so each step is a client (and a connection pool, idle connections kept) of its own, made
#: when first needed. Few and coarse: a call's deadline shrinks as it is retried, and its
#: attempts, and calls sent later, would otherwise each fill another pool (the idle
#: connections a ``fabric serve`` counts against the tenant's ``max_connections``); a hung
#: connection is still given up within a few times the call's own time.
_READ_STEPS = (2.0, 5.0, 15.0, 60.0, 240.0, 600.0)


class LambdaBackend(LambdaSpill, LambdaReplies, Backend):
    kind = "lambda"

    def __init__(self, registry: Registry | None = None, config: LambdaConfig | None = None):
        super().__init__(registry)
        self.config = config or LambdaConfig()
        self._client: Any = None
        """boto3: the client with the configured ``read_timeout_s`` (the ceiling)."""
        self._clients: dict[float, Any] = {}
        """boto3: a client per shorter read timeout (``_READ_STEPS``), made when first needed."""
        self._clients_lock = threading.Lock()  # boto3 sessions are not thread-safe
        self._boto_session: Any = None
        self._boto_options: dict[str, Any] = {}
        self._http_timeouts: dict[float, Any] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None
        """boto3: the calls whose callers still wait (``max_connections``)."""
        self._spill_executor: ThreadPoolExecutor | None = None
        self._spill_slots: asyncio.Semaphore | None = None
        """The spill uploads under way (``max_connections``), held until each ends."""
        self._abandoned = 0
        """boto3: calls abandoned while running whose slot went back to the live calls."""
        self._session: Any = None
        self._urls: dict[str, Any] = {}
        self._calls = 0
        self._spilled = 0
        self._spill_failed = 0
        self._errors: dict[str, int] = {}
        token = self.config.token.get_secret_value() if self.config.token else None
        if token is None and self.config.endpoint_url is not None:
            token = os.environ.get(TOKEN_ENV) or None
        if token is not None:
            # as fabric serve reads a token: a newline after it ($RL_FABRIC_TOKEN filled from
            # a file) made every request's header one the HTTP library refused, a retryable
            # TransportError for a call that could never be sent
            token = token.strip() or None
        self._token = token
        transport = self.config.transport
        if transport == "auto":
            transport = "http" if token is not None else "boto3"
        if transport == "http" and (token is None or self.config.endpoint_url is None):
            raise ConfigError(
                "transport 'http' speaks to a `fabric serve` endpoint with its token: set endpoint_url "
                "and token (or $RL_FABRIC_TOKEN); AWS itself needs transport 'boto3' (SigV4 signing)"
            )
        self.transport = transport
        self._s3: Any = None

    @property
    def max_payload_bytes(self) -> int:
        return self.config.max_spill_bytes if self.config.spill_bucket else MAX_PAYLOAD_BYTES

    async def _start(self) -> None:
        if self.config.spill_bucket:
            try:
                import boto3
            except ImportError as e:
                raise ConfigError(
                    f"spilling payloads to S3 needs boto3: pip install 'rl-fabric[aws]' ({e})"
                ) from None
            from botocore.config import Config

            self._s3 = boto3.session.Session().client(
                "s3",
                region_name=self.config.region,
                endpoint_url=self.config.s3_endpoint_url,
                # one upload an attempt, as one invoke: botocore's retries (3 uploads of over 6 MB,
                # with backoff sleeps on a thread past the call's deadline) ran under the client's
                # own retries of the NotStarted a failed spill is
                config=Config(
                    connect_timeout=self.config.connect_timeout_s,
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    max_pool_connections=self.config.max_connections,
                ),
            )
            # uploads of over 6 MB each ran on the loop's default executor: as many at once as
            # it has threads, whatever max_connections said, and ahead of what else it runs
            # (aiohttp's DNS lookups); a thread for each slot, so none waits for one
            self._spill_executor = ThreadPoolExecutor(
                self.config.max_connections, thread_name_prefix="fabric-spill"
            )
            self._spill_slots = asyncio.Semaphore(self.config.max_connections)
        if self.transport == "http":
            await self._start_http()
        else:
            self._start_boto3()

    def _start_boto3(self) -> None:
        try:
            import boto3
            from botocore import UNSIGNED
        except ImportError as e:
            raise ConfigError(f"the lambda backend needs boto3: pip install 'rl-fabric[aws]' ({e})") from None
        cfg = self.config
        options: dict[str, Any] = {
            # the live calls' connections, and as many for abandoned calls that run on
            "max_pool_connections": 2 * cfg.max_connections,
            "connect_timeout": cfg.connect_timeout_s,
            "read_timeout": cfg.read_timeout_s,
            # retries are the fabric client's (with its budget and idempotency), not botocore's
            "retries": {"total_max_attempts": 1, "mode": "standard"},
            "tcp_keepalive": True,
        }
        if self._token is not None:
            options["signature_version"] = UNSIGNED
        self._boto_session = boto3.session.Session()
        self._boto_options = options
        self._client = self._make_client(cfg.read_timeout_s)
        # a thread for every call that may run at once (live or abandoned): none waits for one
        self._executor = ThreadPoolExecutor(2 * cfg.max_connections, thread_name_prefix="fabric-lambda")
        self._slots = asyncio.Semaphore(cfg.max_connections)

    def _make_client(self, read_timeout_s: float) -> Any:
        from botocore.config import Config

        cfg = self.config
        options = {**self._boto_options, "read_timeout": read_timeout_s}
        client = self._boto_session.client(
            "lambda", region_name=cfg.region, endpoint_url=cfg.endpoint_url, config=Config(**options)
        )
        if self._token is not None:
            header = f"Bearer {self._token}"

            def add_token(request: Any, **_: Any) -> None:
                request.headers["Authorization"] = header

            client.meta.events.register("before-send.lambda.Invoke", add_token)
        return client

    def _client_for(self, read_s: float | None) -> Any:
        """The boto3 client whose read timeout is ``read_s`` (a step of ``_READ_STEPS``, or
        None: the configured ``read_timeout_s``). On a worker thread."""
        if read_s is None or read_s >= self.config.read_timeout_s:
            return self._client
        client = self._clients.get(read_s)
        if client is None:
            with self._clients_lock:
                client = self._clients.get(read_s)
                if client is None:
                    client = self._clients[read_s] = self._make_client(read_s)
        return client

    def _read_limit(self, inv: Invocation) -> tuple[float | None, bool]:
        """How long to wait for ``inv``'s reply: ``(seconds, by_deadline)``, the seconds a step
        of ``_READ_STEPS`` (None: the configured ``read_timeout_s``, the ceiling), and whether
        the call's deadline, not its function's ``timeout_s``, set them. A keyed execution's
        call goes with no deadline (``envelope``) and runs to its ``timeout_s``.

        Only AWS Lambda itself (no token) is bound by the function's ``timeout_s``: it runs a
        synchronous invoke at once or refuses it (429), so its reply comes by then. A ``fabric
        serve`` queues a call for room and for a worker, bounded by the call's deadline only,
        and a keyed call without one may wait there longer than its run takes."""
        cfg = self.config
        limit = cfg.read_timeout_s
        spec = self.registry.find(inv.function) if self._token is None else None
        if spec is not None:
            limit = min(limit, spec.timeout_s + _READ_MARGIN_S)
        by_deadline = False
        if inv.deadline is not None and not inv.wait_for_run:
            left = inv.deadline - time.time() + _DEADLINE_MARGIN_S
            if left < limit:
                limit, by_deadline = left, True
        step = next((x for x in _READ_STEPS if x >= limit), None)
        return (None if step is None or step >= cfg.read_timeout_s else step), by_deadline

    async def _start_http(self) -> None:
        try:
            import aiohttp
        except ImportError as e:
            raise ConfigError(
                f"transport 'http' needs aiohttp: pip install 'rl-fabric[serve]' ({e}), "
                "or use transport 'boto3'"
            ) from None
        cfg = self.config
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.max_connections),
            timeout=aiohttp.ClientTimeout(sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s),
            headers={"Authorization": f"Bearer {self._token}", "Content-Type": "application/json"},
        )

    async def _close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._spill_executor is not None:
            self._spill_executor.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()
        for client in self._clients.values():
            client.close()
        if self._s3 is not None:
            self._s3.close()
        if self._session is not None:
            await self._session.close()

    async def _invoke(self, inv: Invocation) -> Result:
        if not self._started:
            await self.start()
        t0 = time.perf_counter()
        body: bytes | Result
        head = _envelope_head(inv)
        # Lambda counts the whole request: a payload is spilled when it does not fit beside
        # the envelope's other fields, which a long idempotency key or tenant makes larger
        # than any fixed allowance (a fixed 4 KiB sent such a payload inline, to be refused)
        if self._s3 is not None and len(head) + len(inv.raw_payload) + 1 > MAX_PAYLOAD_BYTES:
            body = await self._spill_bounded(inv)
            if isinstance(body, Result):  # not sent: counted with the calls and their errors
                self._spill_failed += 1
        else:
            body = head + inv.raw_payload + b"}"
            if len(body) > MAX_PAYLOAD_BYTES:
                # the client checked the payload, Lambda counts the request: a payload just
                # under the limit went out whole, to be refused (413) for the envelope around it
                body = self._fail(
                    inv,
                    ErrorCode.PAYLOAD_TOO_LARGE,
                    f"{inv.function}: the request is {len(body):,} bytes (the payload and the envelope "
                    f"around it), over the {MAX_PAYLOAD_BYTES:,}-byte limit of a synchronous invoke; "
                    "send a reference instead (an S3 key), or set LambdaConfig.spill_bucket",
                )
        if isinstance(body, Result):
            result = body
        elif self.transport == "http":
            result = await self._invoke_http(inv, body)
        else:
            result = await self._invoke_boto3(inv, body)
        self._calls += 1
        if not result.ok and result.error is not None:
            self._errors[result.error.type] = self._errors.get(result.error.type, 0) + 1
        if result.timings.total_ms == 0.0:
            result.timings.total_ms = (time.perf_counter() - t0) * 1e3
        return result

    # -- boto3: a slot, then the blocking part on a thread
    async def _invoke_boto3(self, inv: Invocation, body: bytes) -> Result:
        slots, executor = self._slots, self._executor
        assert slots is not None and executor is not None
        if slots.locked():
            # every connection is busy with a call whose caller waits: wait for one, until
            # just before the deadline (a keyed execution's call waits for its run, as sent)
            wait = None
            if inv.deadline is not None and not inv.wait_for_run:
                wait = inv.deadline - time.time() - _UNSENT_MARGIN_S
            try:
                # not wait_for: on Python 3.11 a slot that frees up in the loop turn this call
                # is cancelled (a losing hedge, the client's deadline) wins over the cancel,
                # and the call would be sent with no one waiting for it
                async with asyncio.timeout(wait):
                    await slots.acquire()
            except TimeoutError:
                return self._fail(
                    inv,
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"{inv.function}: the call was not sent: its deadline passed while all "
                    f"{self.config.max_connections} connections (max_connections) were busy with other calls",
                    started=False,  # no connection had it: nothing went out
                )
        else:
            await slots.acquire()  # free: returns at once
        read_s, by_deadline = self._read_limit(inv)
        try:
            call = executor.submit(self._invoke_sync, inv, body, read_s, by_deadline)
        except BaseException:  # the executor was shut down (the backend closed)
            slots.release()
            raise
        try:
            result = await asyncio.wrap_future(call)
        except asyncio.CancelledError:
            # abandoned (a deadline, a losing hedge): boto3 cannot stop it, and its thread
            # runs on until Lambda answers. Its slot goes back to the live calls while spare
            # threads remain; past that, it keeps its slot until it ends
            loop = asyncio.get_running_loop()
            if call.done():
                slots.release()
            elif self._abandoned < self.config.max_connections:
                self._abandoned += 1
                slots.release()
                call.add_done_callback(lambda _: _call_soon(loop, self._abandoned_ended))
            else:
                call.add_done_callback(lambda _: _call_soon(loop, slots.release))
            raise
        except BaseException:
            slots.release()
            raise
        slots.release()
        return result

    def _abandoned_ended(self) -> None:
        self._abandoned -= 1

    def _read_timed_out(self, inv: Invocation, by_deadline: bool, e: Exception) -> Result:
        if by_deadline:
            # the caller's deadline passed (the client answered it then): not the function's
            # FunctionTimeout, which a job scores as the response's
            return self._fail(
                inv,
                ErrorCode.DEADLINE_EXCEEDED,
                f"no reply from {self._where()} by the call's deadline; the call was abandoned (the "
                f"function may run on to its end): {e}",
                started=True,
            )
        return self._fail(inv, ErrorCode.TIMEOUT, f"no reply from {self._where()} in time: {e}")

    def _invoke_sync(
        self, inv: Invocation, body: bytes, read_s: float | None = None, by_deadline: bool = False
    ) -> Result:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionError,
            ConnectTimeoutError,
            EndpointConnectionError,
            HTTPClientError,
            IncompleteReadError,
            ProxyConnectionError,
            ReadTimeoutError,
            SSLError,
        )

        name = self.config.function_prefix + inv.function
        kwargs: dict[str, Any] = {"FunctionName": name, "Payload": body}
        if self.config.qualifier:
            kwargs["Qualifier"] = self.config.qualifier
        try:
            response = self._client_for(read_s).invoke(**kwargs)
            body = response["Payload"].read()
        except ClientError as e:
            error = e.response.get("Error", {})
            meta = e.response.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode", 0) or 0)
            retry_after = meta.get("HTTPHeaders", {}).get("retry-after")  # botocore's names are lower case
            return self._refused(
                inv, str(error.get("Code", "")), status, str(error.get("Message", "")), retry_after
            )
        except ReadTimeoutError as e:
            return self._read_timed_out(inv, by_deadline, e)
        except (ConnectTimeoutError, EndpointConnectionError, ProxyConnectionError) as e:
            return self._not_connected(inv, e)
        except SSLError as e:
            # urllib3 names any TLS error so, the handshake's and (rarely) one mid-reply:
            # only a handshake's reasons say the request was never sent (as aiohttp's
            # ClientConnectorSSLError does on the http transport)
            if any(reason in str(e).lower() for reason in _HANDSHAKE_REASONS):
                return self._not_connected(inv, e)
            return self._fail(inv, ErrorCode.TRANSPORT, f"cannot reach {self._where()}: {e}")
        except ConnectionError as e:
            return self._fail(inv, ErrorCode.TRANSPORT, f"cannot reach {self._where()}: {e}")
        except (HTTPClientError, IncompleteReadError) as e:
            # the connection broke after the request went out (ConnectionClosedError) or while
            # the reply came in (ResponseStreamingError): as the http transport's aiohttp errors,
            # a transport fault after which the call may have run, not refused credentials
            return self._fail(inv, ErrorCode.TRANSPORT, f"no complete reply from {self._where()}: {e}")
        except BotoCoreError as e:  # credentials missing, a bad endpoint URL
            advice = ""
            if type(e).__name__ == "NoCredentialsError":
                advice = (
                    "; run `aws configure`, set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
                    " (boto3 signs requests to an endpoint_url too: any values do for moto), or call a"
                    " `fabric serve` with transport 'http' and its token"
                )
            return self._fail(inv, ErrorCode.UNAUTHORIZED, f"{type(e).__name__}: {e}{advice}")
        return self._reply(inv, body, response.get("FunctionError"))

    # -- http: the same API on the event loop
    async def _invoke_http(self, inv: Invocation, body: bytes) -> Result:
        import aiohttp
        from yarl import URL

        url = self._urls.get(inv.function)
        if url is None:  # built once per function: yarl's URL parsing is a noticeable share of a call
            name = quote(self.config.function_prefix + inv.function, safe="")
            qualifier = f"?Qualifier={quote(self.config.qualifier, safe='')}" if self.config.qualifier else ""
            url = self._urls[inv.function] = URL(
                f"{self.config.endpoint_url}/2015-03-31/functions/{name}/invocations{qualifier}", encoded=True
            )
        read_s, by_deadline = self._read_limit(inv)
        timeout = self._session.timeout  # read_timeout_s, the ceiling
        if read_s is not None:
            timeout = self._http_timeouts.get(read_s)
            if timeout is None:
                timeout = self._http_timeouts[read_s] = aiohttp.ClientTimeout(
                    sock_connect=self.config.connect_timeout_s, sock_read=read_s
                )
        try:
            async with self._session.post(url, data=body, timeout=timeout) as response:
                reply = await response.read()
                status = response.status
                headers = response.headers
        except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError) as e:
            # before the read timeout below: ConnectionTimeoutError is a ServerTimeoutError
            return self._not_connected(inv, e)
        except (aiohttp.ServerTimeoutError, TimeoutError) as e:
            return self._read_timed_out(inv, by_deadline, e)
        except aiohttp.ClientError as e:
            return self._fail(inv, ErrorCode.TRANSPORT, f"cannot reach {self._where()}: {e}")
        if status >= 300:
            code = headers.get("x-amzn-ErrorType", "").split(":")[0]
            message = ""
            try:
                data = json.loads(reply)
                code = code or str(data.get("__type", ""))
                message = str(data.get("message") or data.get("Message") or "")
            except (ValueError, AttributeError):
                message = reply[:200].decode(errors="replace")
            return self._refused(inv, code, status, message, headers.get("Retry-After"))
        return self._reply(inv, reply, headers.get("X-Amz-Function-Error"))

    def stats(self) -> dict[str, Any]:
        errors = {f"errors_{k}": v for k, v in self._errors.items()}
        out = {"calls": self._calls, "spilled": self._spilled, "spill_failed": self._spill_failed, **errors}
        if self.transport == "boto3":  # abandoned calls still running on their threads
            out["abandoned_running"] = self._abandoned
        return {"lambda": out}


__all__ = ["LambdaBackend", "LambdaConfig", "envelope"]
