"""How the Lambda backend reads what comes back, for both transports (``LambdaReplies``, the
layer under ``LambdaBackend``): a service's refusal by its error code or HTTP status, a
connection never made, Lambda's own error objects (a timeout, a crashed runtime, a package
that cannot start, a reply too large), the fabric ``Result`` a handler sent, or a plain
function's bare value. Each becomes a ``Result``; the messages say what to do."""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import pydantic_core

from fabric.backends.base import DEPLOY_PREFIX, LambdaConfig
from fabric.errors import ErrorCode
from fabric.protocol import Invocation, Result, lone_surrogate_problem

#: Lambda/service error codes -> fabric codes. Anything else: 5xx retryable, 4xx final.
_CLIENT_ERRORS: dict[str, ErrorCode] = {
    "TooManyRequestsException": ErrorCode.THROTTLED,
    "ThrottlingException": ErrorCode.THROTTLED,
    "EC2ThrottledException": ErrorCode.THROTTLED,
    "ResourceConflictException": ErrorCode.THROTTLED,  # the function is being updated: wait
    "ResourceNotReadyException": ErrorCode.THROTTLED,
    "ResourceNotFoundException": ErrorCode.UNKNOWN_FUNCTION,
    "RequestTooLargeException": ErrorCode.PAYLOAD_TOO_LARGE,  # Lambda's (and fabric serve's) 413
    "RequestEntityTooLargeException": ErrorCode.PAYLOAD_TOO_LARGE,  # fabric serve before it said so
    "InvalidRequestContentException": ErrorCode.INVALID_ARGUMENTS,
    "InvalidParameterValueException": ErrorCode.INVALID_ARGUMENTS,
    "UnrecognizedClientException": ErrorCode.UNAUTHORIZED,
    "MissingAuthenticationTokenException": ErrorCode.UNAUTHORIZED,
    "AccessDeniedException": ErrorCode.UNAUTHORIZED,
    "InvalidSignatureException": ErrorCode.UNAUTHORIZED,
    "ExpiredTokenException": ErrorCode.UNAUTHORIZED,
    "SerializedRequestEntityTooLargeException": ErrorCode.PAYLOAD_TOO_LARGE,
    # the function's configuration (its package, runtime, KMS key, VPC, EFS, SnapStart): no
    # call runs until it is fixed. Final, and not the function's answer to the payload (a 4xx
    # one was InvalidArguments, kept under the key as the function's final answer to the payload)
    **dict.fromkeys(
        (
            "InvalidZipFileException",
            "InvalidRuntimeException",
            "KMSAccessDeniedException",
            "KMSDisabledException",
            "KMSInvalidStateException",
            "KMSNotFoundException",
            "EC2AccessDeniedException",
            "InvalidSubnetIDException",
            "InvalidSecurityGroupIDException",
            "EFSMountFailureException",
            "SnapStartException",
        ),
        ErrorCode.SETUP_FAILED,
    ),
    # an execution environment Lambda could not make ready: the function did not run, so even
    # a side effect is retried (a TransportError, which may have run, ended it OutcomeUnknown)
    **dict.fromkeys(
        (
            "ENILimitReachedException",
            "SubnetIPAddressLimitReachedException",
            "EC2UnexpectedException",
            "EFSMountConnectivityException",
            "EFSMountTimeoutException",
            "SnapStartNotReadyException",
            "SnapStartTimeoutException",
        ),
        ErrorCode.NOT_STARTED,
    ),
    "EFSIOException": ErrorCode.TRANSPORT,  # while the function ran: it may have had effects
}
#: A refusal with no Lambda error code (a proxy's), by its HTTP status.
_BARE_STATUSES: dict[int, ErrorCode] = {
    401: ErrorCode.UNAUTHORIZED,
    403: ErrorCode.UNAUTHORIZED,
    404: ErrorCode.UNKNOWN_FUNCTION,
    413: ErrorCode.PAYLOAD_TOO_LARGE,
}
_RUNTIME_CRASHES = ("Runtime.ExitError", "Runtime.OutOfMemory", "Runtime.Unknown")
#: Lambda's errors for a package whose handler cannot be loaded: a deployment fault (a zip
#: built ``--no-deps`` without a layer, a wheel for the other architecture, a wrong handler),
#: never the function's answer to this payload.
_RUNTIME_INIT_FAILURES = (
    "Runtime.ImportModuleError",
    "Runtime.HandlerNotFound",
    "Runtime.UserCodeSyntaxError",
    "Runtime.MalformedHandlerName",
    "Runtime.InvalidEntrypoint",
)


class LambdaReplies:
    """The translation part of a ``LambdaBackend``; its ``config`` is the backend's."""

    config: LambdaConfig
    _token: str | None
    """A ``fabric serve``'s token; ``None`` for AWS itself."""

    def _where(self) -> str:
        return self.config.endpoint_url or f"AWS Lambda in {self.config.region}"

    def _fail(self, inv: Invocation, code: ErrorCode, message: str, *, started: bool | None = None) -> Result:
        return Result.failure(
            code, message, function=inv.function, request_id=inv.request_id, worker="lambda", started=started
        )

    def _not_connected(self, inv: Invocation, e: Exception) -> Result:
        """No connection was made (refused, unresolvable, or the handshake ran past
        connect_timeout_s): the request never went out, so the call did not start, and a
        retry is safe even for a side effect. Unless the region is one AWS Lambda does not
        have (well formed, but made up or mistyped): its endpoint will never resolve, and
        retrying only spends the call's attempts and deadline."""
        region = self.config.region
        if self.config.endpoint_url is None and not _lambda_has(region):
            return self._fail(
                inv,
                ErrorCode.UNKNOWN_FUNCTION,
                f"{inv.function}: AWS Lambda has no region {region!r} (botocore knows none by that "
                f"name, and its endpoint does not answer: {e}); set LambdaConfig(region=...) or "
                "$AWS_REGION to the region `fabric deploy` deployed to",
            )
        return self._fail(
            inv, ErrorCode.NOT_STARTED, f"cannot connect to {self._where()} (the call was not sent): {e}"
        )

    def _refused(
        self, inv: Invocation, code_name: str, status: int, text: str, retry_after: str | None = None
    ) -> Result:
        """A service error (the call was refused before or instead of running); a throttle
        keeps its ``Retry-After`` header (``retry_after``), the wait the client's backoff
        then takes at least."""
        if code_name == str(status):  # botocore's stand-in when the reply names no code
            code_name = ""
        code = _CLIENT_ERRORS.get(code_name)
        if code is None and not code_name:
            # no Lambda error code: a proxy's answer (an auth gateway, nginx's body limit) or
            # an endpoint_url that is not the Invoke API; read as its status says, never as the
            # function refusing the payload (InvalidArguments is kept under the key)
            code = _BARE_STATUSES.get(status)
        if code is None and status == 408:
            # the request did not arrive whole in time (fabric serve's body_timeout_s, a
            # proxy's): not a request that is wrong whenever it is sent, nor a transport fault
            # after which the call may have run. Nothing ran: retried even for a side effect
            code = ErrorCode.NOT_STARTED
        if code is None:
            transport = status >= 500
            code = ErrorCode.THROTTLED if status == 429 else ErrorCode.TRANSPORT if transport else None
        message = f"{code_name or status}: {text}"
        if not code_name and status == 404:
            message += (
                f" (no Lambda error code: is endpoint_url {self._where()!r} the Invoke API's base URL?)"
            )
        if code is None:  # another 4xx: our request is wrong, retrying will not fix it
            code = ErrorCode.INVALID_ARGUMENTS
        aws = self.config.endpoint_url is None
        if code == ErrorCode.UNAUTHORIZED:
            message += (
                " (for fabric serve: set the token with LambdaConfig.token or $RL_FABRIC_TOKEN; for AWS: "
                "check the credentials and the lambda:InvokeFunction permission"
            )
            if aws and code_name == "UnrecognizedClientException":
                # what Lambda answers in an opt-in region the account has not enabled
                message += f", and that region {self.config.region!r} is enabled for the account"
            message += ")"
        elif code == ErrorCode.SETUP_FAILED:
            name = self.config.function_prefix + inv.function
            message += (
                f" (the configuration of {name!r}, not the payload: no call runs until it is fixed; "
                "then run `fabric deploy` again)"
            )
        elif code == ErrorCode.UNKNOWN_FUNCTION and self._token is None:
            # (a fabric serve's own message says what it serves and how it names functions)
            name = self.config.function_prefix + inv.function
            where = f" in {self.config.region}" if aws else ""
            if self.config.function_prefix:
                message += (
                    f" (called as {name!r}{where}; deployed with another --prefix? set "
                    "LambdaConfig(function_prefix=...) or `fabric invoke --prefix` to it; "
                    "or run `fabric deploy`"
                )
            else:  # a fabric serve's default, called for what a deploy with its default made
                message += (
                    f" (called as {name!r}{where}, with no function_prefix; `fabric deploy` names it "
                    f"'{DEPLOY_PREFIX}{inv.function}' unless given --prefix: "
                    f"LambdaConfig(function_prefix='{DEPLOY_PREFIX}'), or run `fabric deploy`"
                )
            if aws:  # deployed, but to another region than the one called
                message += (
                    "; deployed to another region? LambdaConfig(region=...), `fabric invoke --region` "
                    "or $AWS_REGION must name the region `fabric deploy` used"
                )
            message += ")"
        result = self._fail(inv, code, message)
        if code == ErrorCode.THROTTLED and result.error is not None:
            result.error.retry_after_s = _retry_after_s(retry_after)
        return result

    def _reply(self, inv: Invocation, body: bytes, function_error: str | None) -> Result:
        try:
            data = pydantic_core.from_json(body) if body else None
        except ValueError as e:
            return self._strict_json_refused(inv, body, function_error, e)
        return self._read(inv, data, body, function_error)

    def _strict_json_refused(
        self, inv: Invocation, body: bytes, function_error: str | None, e: ValueError
    ) -> Result:
        """A reply the strict parser refused. Lambda's Python runtime writes a string holding
        a lone surrogate (half of a UTF-16 pair, e.g. ``"\\ud800"``: text cut between the
        halves, bytes decoded with ``surrogateescape``) as JSON's escape, which the strict
        parser refuses as "unexpected end of hex escape". Python's parser takes it and says
        where it is. A value holding one is the function's answer that JSON cannot carry:
        ``ResultNotSerializable``, final, as the local backend's runner answers for the same
        value (retrying a ``TransportError`` got the same answer again; for a side effect the
        key kept ``OutcomeUnknown``). An error object or a failed ``Result`` holding one (a
        message quoting the text) is still that failure, its half pairs written as escapes.

        JSON the strict parser refused for its depth (past its recursion limit, about 200
        levels; Python's takes about a thousand) is read as any reply. A body that is not
        JSON at all is read by ``_not_json``."""
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return self._not_json(inv, body, function_error, e)
        problem = lone_surrogate_problem(data, f"the reply of {inv.function}")
        if problem is None:  # JSON after all, too deep for the strict parser
            return self._read(inv, data, body, function_error)
        result = _as_result(data)
        if function_error or (result is not None and not result.ok):
            return self._read(inv, _escaped(data), body, function_error)
        return self._fail(inv, ErrorCode.RESULT_NOT_SERIALIZABLE, problem)

    def _not_json(self, inv: Invocation, body: bytes, function_error: str | None, e: ValueError) -> Result:
        """A whole reply (a connection cut before its Content-Length or last chunk came is a
        transport fault, raised before this: aiohttp's ClientPayloadError, botocore's
        IncompleteReadError) that is not JSON. It was always a retryable TransportError, so a
        reply that is the same whenever it is asked was fetched again up to max_attempts (and
        for a side effect its key kept OutcomeUnknown). Per the Invoke API, a 200 body is what
        the function's runtime wrote, its error when ``X-Amz-Function-Error`` is set:

        * JSON cut short (the strict parser reached the end inside a value: "EOF while
          parsing ..."): a reply delimited by its connection's close and cut there, or a
          stream that broke, which may pass; a retryable ``TransportError`` (the call may
          have run);
        * with ``X-Amz-Function-Error``: the function's failure, whatever its runtime wrote
          (read as Lambda's error object, the body its message: a ``UserError``, or a
          ``FunctionTimeout`` when it says the task timed out);
        * else the function's answer, bytes that are not JSON (a custom runtime or container
          image writing raw text, or, behind an ``endpoint_url``, a proxy's page at 200): the
          same at every call, ``ResultNotSerializable``, final, as the local runner answers a
          value JSON cannot carry."""
        if str(e).startswith("EOF while parsing"):
            return self._fail(
                inv,
                ErrorCode.TRANSPORT,
                f"the reply of {inv.function} is JSON cut short ({e}): {body[:200]!r}",
            )
        if function_error:
            return self._read(inv, None, body, function_error)
        message = (
            f"the reply of {inv.function} is not JSON ({e}): {body[:200]!r}; its runtime wrote it "
            "(a custom runtime or container image must encode the answer as JSON)"
        )
        if self.config.endpoint_url is not None:
            message += f", unless something other than the Invoke API answers at {self._where()}"
        return self._fail(inv, ErrorCode.RESULT_NOT_SERIALIZABLE, message)

    def _read(self, inv: Invocation, data: Any, body: bytes, function_error: str | None) -> Result:
        result = _as_result(data)
        if result is not None:
            return result
        if function_error:  # Lambda's own error object: the handler never returned
            info = data if isinstance(data, dict) else {}
            etype = str(info.get("errorType", function_error))
            emsg = str(info.get("errorMessage", body[:500].decode(errors="replace")))
            if etype == "Sandbox.Timedout" or "Task timed out" in emsg:
                return self._fail(inv, ErrorCode.TIMEOUT, emsg)
            if etype in _RUNTIME_CRASHES:
                return self._fail(inv, ErrorCode.WORKER_LOST, f"{etype}: {emsg}")
            if etype in _RUNTIME_INIT_FAILURES:
                # as the handler's own start-up failure: SetupFailed, not a UserError that
                # the client keeps under the key and a reward's failure_score scores
                name = self.config.function_prefix + inv.function
                return self._fail(
                    inv,
                    ErrorCode.SETUP_FAILED,
                    f"{etype}: {emsg} (the deployment package of {name!r} cannot start: rebuild "
                    "it for Lambda's platform and run `fabric deploy` again)",
                )
            if etype == "Function.ResponseSizeTooLarge":
                # the function's answer, too large to send back (the handler refuses it first
                # when it can): final, as the runner's own ResultNotSerializable
                return self._fail(
                    inv,
                    ErrorCode.RESULT_NOT_SERIALIZABLE,
                    f"{etype}: {emsg.rstrip('.')}; return a reference (an S3 key) instead",
                )
            return self._fail(inv, ErrorCode.USER_ERROR, f"{etype}: {emsg}")
        # a plain function (not the fabric handler) answered with its bare value
        return Result.built(
            True, function=inv.function, request_id=inv.request_id, value=data, worker="lambda"
        )


def _escaped(node: Any) -> Any:
    """``node`` (parsed JSON) with each lone surrogate in its strings and keys written as
    its escape (``"\\ud800"``, six characters): valid text, and what the sender wrote.

    A walk with a stack of its own: ``json.loads`` takes a reply nested about a thousand
    deep, and a recursive walk (two frames a level, with its comprehension) raised
    ``RecursionError`` out of the backend at a few hundred."""

    def text(s: str) -> str:
        return s.encode("utf-8", "backslashreplace").decode()

    def copy(v: Any, stack: list[tuple[Any, Any]]) -> Any:
        if isinstance(v, str):
            return text(v)
        if isinstance(v, dict | list):
            out: Any = {} if isinstance(v, dict) else []
            stack.append((v, out))  # filled in below, in place
            return out
        return v

    stack: list[tuple[Any, Any]] = []
    root = copy(node, stack)
    while stack:
        src, dst = stack.pop()
        if isinstance(src, dict):
            for k, v in src.items():
                dst[text(k) if isinstance(k, str) else k] = copy(v, stack)
        else:
            dst.extend(copy(v, stack) for v in src)
    return root


#: Fields every Result a fabric handler or ``fabric serve`` sends carries.
_RESULT_MARKS = frozenset({"ok", "function", "request_id", "timings", "worker"})


def _retry_after_s(header: str | None) -> float | None:
    """A ``Retry-After`` header's seconds (fabric serve's and Lambda's: a whole number), or
    ``None`` for none, HTTP's other form (a date, which a clock skewed from the server's would
    misread) and a value that is no wait (negative, not finite)."""
    try:
        seconds = float(header) if header is not None else math.nan
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _as_result(data: Any) -> Result | None:
    """The fabric ``Result`` the handler (or ``fabric serve``) sent, or ``None`` when the
    reply is something else: Lambda's own error object, or a plain function's value."""
    if not (isinstance(data, dict) and "ok" in data and ("value" in data or "error" in data)):
        return None
    try:
        result = Result.model_validate(data)
    except ValueError:
        # a newer handler's Result with a field this client does not know yet is still that
        # Result (read as ok=True with the whole object, a failure would have become a value);
        # what still does not validate is a user value that only looks like a Result
        known = {k: v for k, v in data.items() if k in Result.model_fields}
        if len(known) == len(data) or not _RESULT_MARKS <= known.keys():
            return None
        try:
            result = Result.model_validate(known)
        except ValueError:
            return None
    result.attempts = 1
    return result


@functools.cache
def _lambda_has(region: str) -> bool:
    """Whether botocore knows AWS Lambda in ``region``, in any partition (asked only when a
    connection to AWS failed: a botocore older than a new region says no, and that region's
    failures are then final, where its endpoint did not answer either)."""
    import botocore.session

    session = botocore.session.get_session()
    return any(
        region in session.get_available_regions("lambda", partition_name=partition)
        for partition in session.get_available_partitions()
    )
