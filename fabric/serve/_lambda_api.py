"""The AWS Lambda Invoke API, as ``fabric serve`` speaks it: the route, how a request names its
function, carries its token and body, and how answers and errors look.

``POST /2015-03-31/functions/{name}/invocations`` is what boto3's ``lambda.invoke`` sends,
so the Lambda backend (and the AWS CLI, and any Lambda SDK) talks to this server or to AWS
with the same code. The function name may carry a qualifier (``name:live``, an ARN, or
``?Qualifier=``, not both unless they agree); ``$LATEST``, ``live`` and the function's
version hash are served, and ``X-Amz-Executed-Version`` answers ``$LATEST`` or the hash, as
Lambda answers the version an alias points to. ``X-Amz-Log-Type: Tail`` (boto3's
``LogType='Tail'``) answers ``X-Amz-Log-Result``: the invocation's START/END/REPORT lines
(``log_tail``); a log type other than ``None`` and ``Tail`` is Lambda's 400.

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
wrong token; 403 ``AccessDeniedException`` for a tenant with ``invoke: false``), 404
``ResourceNotFoundException``, 413 ``RequestTooLargeException``, 429
``TooManyRequestsException`` (with Lambda's ``Reason`` and ``Retry-After``), 500
``ServiceException`` (``"Type": "Service"``), with the code in ``x-amzn-ErrorType`` where
botocore looks.
``GET /healthz`` needs no token and says only ``ok``; ``GET /metrics`` (Prometheus) needs one
and shows a tenant only its own tenant-labelled series (``metrics: all``: every tenant's).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import math
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import ValidationError

from fabric.errors import pickled_whole
from fabric.protocol import Invocation, Result, decode_payload, to_strict_json
from fabric.serve.config import ServeConfig

log = logging.getLogger("fabric.serve")

INVOKE_ROUTE = "/2015-03-31/functions/{name}/invocations"
INVOCATION_TYPES = ("RequestResponse", "Event", "DryRun")
#: ``X-Amz-Log-Type``'s values (botocore's ``LogType`` enum); absent is ``None``
LOG_TYPES = ("None", "Tail")
JSON = "application/json"
#: The status a request whose client hung up before its answer is counted under (nginx's).
CLIENT_CLOSED = 499
#: The status a request the server cut is counted under: still running when the drain ended
#: (or at a second Ctrl-C), its connection dropped with no answer. The server's doing, not
#: the client's: a 5xx on a dashboard, not a 499 read as callers giving up.
DRAINED = 503
#: Lambda's ``LogResult`` is the last 4 KB of the invocation's log.
_LOG_TAIL_BYTES = 4096
#: An envelope's ``deadline`` is wall-clock seconds; past this it is not a deadline anyone
#: meant (the year 33658), and the pool's arithmetic on it would overflow.
_MAX_DEADLINE = 1e12


class Reply(Exception):
    """An early answer (an error before the function runs)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        close: bool = False,
        reason: str | None = None,
        retry_after_s: int | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.close = close
        """End the connection after the answer: the rest of the request is not coming."""
        self.reason = reason
        """A 429's ``Reason`` (Lambda's ``ThrottleReason``): which limit refused it."""
        self.retry_after_s = retry_after_s
        """A 429's ``Retry-After``: seconds to wait before retrying (None: no header)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_whole(self)  # made of parts, not of its message


def throttled(
    message: str, *, reason: str | None = None, retry_after_s: float | None = None, close: bool = False
) -> Reply:
    """A 429 ``TooManyRequestsException`` in the shape of Lambda's (botocore's model): a
    ``Reason`` from its ``ThrottleReason`` enum (none where no limit refused: a drain) and,
    where the limit can say when room comes (``max_rps``'s bucket), ``Retry-After`` in whole
    seconds, at least one (HTTP's delay-seconds is an integer). None where it cannot (a
    call's end frees a ``max_concurrency`` slot, often within milliseconds): a constant there
    made the fabric client, which honours the header, wait a second per retry; without it
    the caller's own backoff decides."""
    return Reply(
        429,
        "TooManyRequestsException",
        message,
        close=close,
        reason=reason,
        retry_after_s=None if retry_after_s is None else max(1, math.ceil(retry_after_s)),
    )


def error_response(
    status: int, code: str, message: str, request_id: str, *, reason: str | None = None
) -> web.Response:
    # botocore's rest-json parser reads the code from x-amzn-ErrorType, the text from "message";
    # "Type" is Lambda's fault side: "Service" on its 5xx (ServiceException), "User" otherwise
    kind = "Service" if status >= 500 else "User"
    fields = {"__type": code, "Type": kind, "message": message}
    if reason is not None:
        fields["Reason"] = reason
    return web.Response(
        status=status,
        body=json.dumps(fields).encode(),
        content_type=JSON,
        headers={"x-amzn-ErrorType": code, "x-amzn-RequestId": request_id},
    )


def reply_response(e: Reply, request_id: str) -> web.Response:
    """``e``'s answer; a 429's with its ``Reason`` in the body and ``Retry-After`` in a header,
    where botocore reads them (``e.response["Reason"]``, the response's HTTP headers)."""
    response = error_response(e.status, e.code, e.message, request_id, reason=e.reason)
    if e.retry_after_s is not None:
        response.headers["Retry-After"] = str(e.retry_after_s)
    return response


def split_name(name: str, query_qualifier: str | None) -> tuple[str, str | None]:
    """``name``, ``name:qualifier``, ``arn:aws:lambda:region:account:function:name[:q]`` or
    the partial ARN ``account:function:name[:q]``: the forms Lambda's Invoke accepts.

    ``name`` as aiohttp's route hands it over, percent-decoded already (botocore's ``%3A``
    is a colon): decoded again, ``%2561dd`` was ``add``. A qualifier in the name and another
    in ``?Qualifier=`` is Lambda's 400 (the query's alone was taken: ``add:v9?Qualifier=live``
    ran); an empty ``?Qualifier=`` is none, as Lambda's pattern for it allows."""
    in_name: str | None = None
    parts = name.split(":")
    if name.startswith("arn:"):
        if len(parts) not in (7, 8) or parts[5] != "function":
            raise Reply(400, "InvalidParameterValueException", f"not a Lambda function ARN: {name!r}")
        name = parts[6]
        if len(parts) == 8:
            in_name = parts[7]
    elif len(parts) in (3, 4) and parts[1] == "function":
        name = parts[2]
        if len(parts) == 4:
            in_name = parts[3]
    elif ":" in name:
        name, _, in_name = name.partition(":")
    if query_qualifier and in_name and query_qualifier != in_name:
        raise Reply(
            400,
            "InvalidParameterValueException",
            "The derived qualifier from the function name does not match the specified qualifier.",
        )
    return name, query_qualifier or in_name


def tenant_of(request: web.Request, tokens: dict[bytes, str]) -> str:
    """The tenant whose token the request carries (``Authorization: Bearer``); 401 or 403."""
    # each refusal ends its connection (close=True): counted against no tenant's
    # max_connections, a client without a token held as many keep-alive ones as it opened
    auth = request.headers.get("Authorization")
    if not auth:
        raise Reply(
            401,
            "MissingAuthenticationTokenException",
            "missing 'Authorization: Bearer <token>' header",
            close=True,
        )
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Reply(
            401,
            "MissingAuthenticationTokenException",
            "the Authorization header must be 'Bearer <token>'",
            close=True,
        )
    # aiohttp hands over a header's bytes that are not UTF-8 as surrogates: encoded back
    # as they came (a strict encode raised, a 500 and a traceback per unauthenticated request)
    secret = token.strip().encode("utf-8", "surrogateescape")
    tenant = tokens.get(hashlib.sha256(secret).digest())
    if tenant is None:
        raise Reply(
            403,
            "UnrecognizedClientException",
            "The security token included in the request is invalid",
            close=True,
        )
    return tenant


def refuse_encoded(request: web.Request) -> None:
    """400 for a body sent with a ``Content-Encoding``, on its headers, its body unread.

    aiohttp inflates such a body by itself, on the event loop: a megabyte of gzip is a
    gigabyte of zeros, seconds of the server's one core per request that no quota bounds
    (and after our 413 aiohttp inflated the rest, draining it). No Lambda client compresses
    an Invoke body (boto3 does not, nor the lambda backend), and Lambda takes the bytes as
    they come. The connection closes: the body is not drained through the inflater either."""
    encoding = request.headers.get("Content-Encoding", "").strip()
    if encoding and encoding.lower() != "identity":
        raise Reply(
            400,
            "InvalidRequestContentException",
            f"Content-Encoding {encoding[:40]!r} is not accepted: send the JSON payload "
            "uncompressed, as Lambda's Invoke takes it",
            close=True,
        )


async def read_body(request: web.Request, kind: str, config: ServeConfig) -> bytes:
    """The request's body, within ``kind``'s size limit and ``body_timeout_s``; 413, 408 or 400."""
    limit = config.max_event_bytes if kind == "Event" else config.max_body_bytes
    too_large = Reply(
        413,
        "RequestTooLargeException",  # Lambda's code: boto3 raises its modeled exception
        f"Request must be smaller than {limit} bytes for the {kind} invocation type",
        # the rest of the body is not read: aiohttp read and dropped it for up to 10 s, on the
        # event loop, to keep the connection for another request
        close=True,
    )
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        # a body that stalls (a client that vanished without a FIN, or one that trickles
        # bytes) would hold its quota slot for as long as TCP keeps the connection
        async with asyncio.timeout(config.body_timeout_s):
            body = await request.read()
    except TimeoutError:
        raise Reply(
            408,
            "RequestTimeoutException",
            f"the body did not arrive within {config.body_timeout_s:g} s (body_timeout_s)",
            close=True,  # as HTTP says for a 408: the connection is in no state to reuse
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except RequestPayloadError as e:  # a body aiohttp cannot decode (a bad Content-Encoding)
        reason = " ".join(str(e).split())
        raise Reply(400, "InvalidRequestContentException", f"cannot read the body: {reason}") from None
    except ConnectionError:
        # the client hung up before its whole body came (a timeout, a crash): nobody reads
        # the answer, and it is not our error to log with a traceback
        log.debug("client hung up while sending the body of a %s request", kind)
        raise Reply(
            400, "InvalidRequestContentException", "the connection closed before the whole body arrived"
        ) from None
    if len(body) > limit:
        raise too_large
    return body


def parse_invocation(body: bytes, function: str, tenant: str, request_id: str) -> tuple[Invocation, bool]:
    """The ``Invocation`` a body asks for, and whether it came as an envelope (else raw
    keyword arguments); 400 for a body that is neither.

    The invocation carries its payload encoded (``raw``, what every backend sends), not
    parsed: parsed JSON takes many times the memory of its text (``[{}, {}, ...]``: some 25x),
    and a call keeps its invocation while it waits for room and runs. Kept, a tenant within
    its quota held that many times ``max_concurrency`` bodies, enough to have the server
    killed with every tenant's calls."""
    if not body.strip():
        body = b"{}"  # the AWS CLI sends no payload as an empty body
    try:
        data = decode_payload(body, "the request body")
    except ValueError as e:
        raise Reply(
            400, "InvalidRequestContentException", f"Could not parse request body into json: {e}"
        ) from None
    if not isinstance(data, dict):
        raise Reply(
            400,
            "InvalidRequestContentException",
            f"the payload must be a JSON object of keyword arguments, not {type(data).__name__}",
        )
    if data.get("function") == function and "payload" in data:
        try:
            inv = Invocation.model_validate(data)
        except ValidationError as e:
            raise Reply(
                400, "InvalidRequestContentException", f"not a valid fabric Invocation: {e}"
            ) from None
        if inv.deadline is not None and not (
            math.isfinite(inv.deadline) and abs(inv.deadline) < _MAX_DEADLINE
        ):
            raise Reply(
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
            raise Reply(
                400, "InvalidRequestContentException", f"not a valid fabric Invocation: payload: {e}"
            ) from None
        # the tenant is who the token says, whatever the body claims
        return inv.model_copy(update={"tenant": tenant, "raw": raw, "payload": {}}), True
    inv = Invocation.fast(
        function=function,
        payload={},  # in raw (see above)
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


def log_tail(result: Result, request_id: str, version: str) -> str:
    """``X-Amz-Log-Result`` (``LogType='Tail'``): the invocation's log as Lambda writes it
    (START, the runtime's ``[ERROR]`` line and traceback for a failure, END, REPORT), its last
    4 KB, base64. Only what the server knows of the call. Lambda's holds the function's own
    output too; here that goes to the server's stderr: a worker runs a function's async calls
    side by side, a subprocess's or C code's writes go to the process's descriptors (no
    capture splits them by call), and the worker protocol carries no output back."""
    lines = [f"START RequestId: {request_id} Version: {version}"]
    if result.error is not None:
        lines.append(f"[ERROR] {result.error.type}: {result.error.message}")
        lines.extend((result.error.traceback or "").splitlines())
    lines.append(f"END RequestId: {request_id}")
    lines.append(f"REPORT RequestId: {request_id}\tDuration: {result.timings.exec_ms:.2f} ms")
    # a handler's message may hold a lone surrogate ("\ud800"): escaped, not a 500
    data = ("\n".join(lines) + "\n").encode("utf-8", "backslashreplace")[-_LOG_TAIL_BYTES:]
    # cut inside a character: its leftover bytes dropped, so the log decodes as UTF-8
    data = data.decode("utf-8", "ignore").encode()
    return base64.b64encode(data).decode("ascii")


def result_response(
    result: Result, envelope: bool, request_id: str, *, version: str = "$LATEST", tail: bool = False
) -> web.Response:
    """The answer to a call that ran: the fabric ``Result`` (envelope) or Lambda's shape (raw).
    ``version``: what Lambda's ``X-Amz-Executed-Version`` says (``$LATEST``, or the version an
    alias or a version qualifier named); ``tail``: ``LogType='Tail'`` was asked for."""
    headers = {"x-amzn-RequestId": request_id, "X-Amz-Executed-Version": version}
    if tail:
        headers["X-Amz-Log-Result"] = log_tail(result, request_id, version)
    if envelope:
        return web.Response(body=result.model_dump_json().encode(), content_type=JSON, headers=headers)
    if result.ok:
        return web.Response(body=to_strict_json(result.value), content_type=JSON, headers=headers)
    assert result.error is not None
    headers["X-Amz-Function-Error"] = "Unhandled"
    trace = (result.error.traceback or "").splitlines()
    body = {"errorType": result.error.type, "errorMessage": result.error.message, "stackTrace": trace}
    return web.Response(body=json.dumps(body).encode(), content_type=JSON, headers=headers)
