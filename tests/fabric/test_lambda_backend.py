"""The lambda backend: real boto3 over real HTTP to ``fabric serve`` (calls, errors, tokens,
qualifiers), how Lambda's replies, error objects and refusals are read, the transport's
choice, configs and regions. Transport faults and connections are in
test_lambda_backend_transport.py; moto's Lambda and S3 spills in test_lambda_backend_spill.py."""

from __future__ import annotations

import json

import pytest
from lambda_helpers import TOKEN, lam, transport_fixture  # noqa: F401 - by name=
from sample_fns import REG

from fabric.backends.base import LambdaConfig, LocalConfig, make_backend
from fabric.backends.lambda_ import LambdaBackend
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.protocol import Invocation
from fabric.serve import Gateway, ServeConfig, TenantConfig


@pytest.fixture
async def gw():
    cfg = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN, max_concurrency=64)},
        backend=LocalConfig(max_workers=2),
        warm=False,
    )
    async with Gateway(cfg, REG) as g:
        yield g


async def test_calls_reach_the_local_pool(gw, transport):
    async with Client(backend=lam(gw, transport), registry=REG) as c:
        r = await c.call("add", {"a": 2, "b": 5})
        assert r.ok and r.value == 7
        assert r.worker and r.worker.startswith("add-")  # the pool's worker, through the envelope
        assert r.timings.total_ms > 0 and r.timings.exec_ms >= 0
        results = await c.map("add", [{"a": i} for i in range(50)])
        assert [x.value for x in results] == list(range(50))
    assert gw.quotas.held["job"] == 0


async def test_user_error_is_final_and_not_retried(gw, transport):
    async with Client(backend=lam(gw, transport), registry=REG) as c:
        r = await c.call("boom", {"x": 3})
    assert not r.ok and r.error.type == ErrorCode.USER_ERROR and "bad x=3" in r.error.message
    assert r.attempts == 1


async def test_unknown_function_says_how_it_is_deployed(gw, transport):
    # a fabric serve says how it names its functions (`fabric deploy` is no advice for it)
    async with LambdaBackend(REG, lam(gw, transport, function_prefix="rl-")) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and not r.retryable
    assert "serves it as 'add': set function_prefix=''" in r.error.message, r.error.message
    # AWS: the name called, and the deploy that makes it
    b = LambdaBackend(REG, LambdaConfig(region="us-east-1", function_prefix="rl-"))
    r = b._refused(Invocation(function="add"), "ResourceNotFoundException", 404, "Function not found: rl-add")
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and "'rl-add'" in r.error.message
    assert "fabric deploy" in r.error.message and not r.retryable


async def test_unknown_function_without_a_prefix_names_deploys_default_prefix(transport):
    """`fabric deploy` names functions rl-fabric-NAME by default, while LambdaConfig's
    function_prefix defaults to "": the first call after a deploy with the defaults was
    UnknownFunction "(deployed as 'add'; run `fabric deploy`?)", pointing at a deploy that
    had been run. The message names the prefix the deploy used by default."""
    cfg = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN)},
        function_prefix="rl-fabric-",  # as `fabric deploy` names them
        backend=LocalConfig(max_workers=1),
        warm=False,
    )
    async with Gateway(cfg, REG) as g, LambdaBackend(REG, lam(g, transport)) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION, r.error
    assert "function_prefix='rl-fabric-'" in r.error.message, r.error.message


async def test_wrong_or_missing_token_is_unauthorized_and_final(gw, transport, monkeypatch):
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    async with LambdaBackend(REG, lam(gw, transport, token="not-the-token-0123456789")) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNAUTHORIZED and not r.retryable
    assert "RL_FABRIC_TOKEN" in r.error.message


async def test_token_from_the_environment(gw, monkeypatch):
    monkeypatch.setenv("RL_FABRIC_TOKEN", TOKEN)
    async with LambdaBackend(REG, LambdaConfig(endpoint_url=gw.url)) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 4}))
    assert r.ok and r.value == 4


async def test_qualifier_none_calls_latest(gw, transport):
    async with LambdaBackend(REG, lam(gw, transport, qualifier=None)) as b:
        assert (await b.invoke(Invocation(function="add", payload={"a": 1}))).value == 1


@pytest.mark.parametrize(
    ("body", "function_error", "code"),
    [
        (
            {"errorType": "Sandbox.Timedout", "errorMessage": "Task timed out after 3.00 seconds"},
            "Unhandled",
            "FunctionTimeout",
        ),
        (
            {"errorMessage": "2026-01-01 RequestId: x Error: Task timed out after 3.00 seconds"},
            "Unhandled",
            "FunctionTimeout",
        ),
        ({"errorType": "Runtime.ExitError", "errorMessage": "signal: killed"}, "Unhandled", "WorkerLost"),
        ({"errorType": "Runtime.OutOfMemory", "errorMessage": "out of memory"}, "Unhandled", "WorkerLost"),
        ({"errorType": "KeyError", "errorMessage": "'x'"}, "Unhandled", "UserError"),
        # a reply over Lambda's response limit: the function's answer is too large, final
        (
            {
                "errorType": "Function.ResponseSizeTooLarge",
                "errorMessage": "Response payload size exceeded maximum allowed payload size (6291556 bytes)",
            },
            "Unhandled",
            "ResultNotSerializable",
        ),
    ],
)
def test_lambda_error_objects_are_mapped(body, function_error, code):
    b = LambdaBackend(REG, LambdaConfig())
    inv = Invocation(function="add")
    r = b._reply(inv, json.dumps(body).encode(), function_error)
    assert not r.ok and r.error.type == code
    assert r.retryable == (code in ("FunctionTimeout", "WorkerLost"))


def test_a_request_timeout_is_a_call_that_did_not_start():
    # fabric serve's body_timeout_s, or a proxy's: not a wrong request that the client would
    # keep under the key as the function's InvalidArguments. Nor a TransportError, after
    # which the call may have run: the request never arrived whole, so nothing ran, and a
    # side effect is retried too (not left OutcomeUnknown under its key)
    b = LambdaBackend(REG, LambdaConfig())
    r = b._refused(Invocation(function="add"), "RequestTimeoutException", 408, "the body did not arrive")
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable
    r = b._refused(Invocation(function="add"), "", 408, "<html>408 Request Time-out</html>")  # nginx
    assert r.error.type == ErrorCode.NOT_STARTED and r.retryable
    assert b._refused(Invocation(function="add"), "", 418, "").error.type == ErrorCode.INVALID_ARGUMENTS


def test_replies_that_are_not_results():
    b = LambdaBackend(REG, LambdaConfig())
    inv = Invocation(function="add")
    # the function's runtime wrote it, the same at every call: final (test_lambda_not_json.py)
    assert b._reply(inv, b"not json", None).error.type == ErrorCode.RESULT_NOT_SERIALIZABLE
    assert b._reply(inv, b'{"score": 1', None).error.type == ErrorCode.TRANSPORT  # cut short: may pass
    plain = b._reply(inv, b'{"score": 1.0}', None)  # a plain Lambda function's bare value
    assert plain.ok and plain.value == {"score": 1.0}
    assert b._reply(inv, b"", None).value is None


def test_transport_choice(monkeypatch):
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    assert LambdaBackend(REG, LambdaConfig()).transport == "boto3"  # AWS
    assert LambdaBackend(REG, LambdaConfig(endpoint_url="http://x", token=TOKEN)).transport == "http"
    with pytest.raises(Exception, match="needs transport 'boto3'"):
        LambdaBackend(REG, LambdaConfig(transport="http"))


def test_config_by_name_and_dict():
    b = make_backend({"type": "lambda", "endpoint_url": "http://127.0.0.1:1", "function_prefix": "x-"}, REG)
    assert isinstance(b, LambdaBackend) and b.config.function_prefix == "x-"
    with pytest.raises(Exception, match="known types: inproc, local, lambda"):
        make_backend({"type": "lambada"}, REG)


def test_a_newer_handlers_result_with_an_unknown_field_is_still_its_result():
    """A Result carrying a field this client does not know (a newer handler or fabric serve)
    failed validation and was read as a plain function's value: a failure became ok=True
    with the whole error object as its value."""
    from fabric.backends.lambda_ import _as_result
    from fabric.protocol import Result

    sent = Result.failure(ErrorCode.USER_ERROR, "boom", function="f", request_id="r")
    data = {**sent.model_dump(mode="json"), "added_in_a_later_release": {"x": 1}}
    got = _as_result(data)
    assert got is not None and not got.ok and got.error.type == ErrorCode.USER_ERROR
    assert got.error.message == "boom"
    # so a client older than Result.started reads an answer that carries it
    late = Result.failure(ErrorCode.DEADLINE_EXCEEDED, "late", function="f", request_id="r", started=False)
    older = _as_result({**late.model_dump(mode="json"), "added_in_a_later_release": 1})
    assert older is not None and older.error.type == ErrorCode.DEADLINE_EXCEEDED and older.started is False
    # a user's value that only looks like a Result (no field of ours beside ok/value) stays a value
    assert _as_result({"ok": "yes", "value": 3, "mine": True}) is None


@pytest.mark.parametrize(
    ("etype", "message"),
    [
        (
            "Runtime.ImportModuleError",
            "Unable to import module 'functions.handler': No module named 'pydantic'",
        ),
        ("Runtime.HandlerNotFound", "Handler 'handler' missing on module 'functions.handler'"),
        ("Runtime.UserCodeSyntaxError", "Syntax error in module 'functions.handler': invalid syntax"),
        ("Runtime.InvalidEntrypoint", "RequestId: x Error: exec: no such file or directory"),
    ],
)
def test_a_broken_deployment_is_setup_failed_not_the_functions_answer(etype, message):
    """A package that cannot be imported (a zip built --no-deps without a layer, a wheel for
    the other architecture, a wrong handler) makes Lambda answer every call with its own error
    object. It was read as the function's UserError: final, kept under the idempotency key as
    the function's answer, and scored by RewardConfig.failure_score as if the trajectory had
    crashed the reward (a deployment fault trained into the policy as a zero). The handler
    reports its own start-up failures as SetupFailed; Lambda's are the same kind."""
    from fabric.errors import FINAL_ERRORS

    b = LambdaBackend(REG, LambdaConfig())
    body = json.dumps({"errorMessage": message, "errorType": etype, "requestId": "", "stackTrace": []})
    r = b._reply(Invocation(function="add"), body.encode(), "Unhandled")
    assert r.error.type == ErrorCode.SETUP_FAILED, r.error
    assert r.error.type not in FINAL_ERRORS and not r.retryable
    assert etype in r.error.message and message in r.error.message
    assert "fabric deploy" in r.error.message  # what to do


@pytest.mark.parametrize("region", ["us east 1", "eu_west_1", "-us-east-1"])
async def test_a_malformed_region_is_a_config_error_at_the_edge(region):
    """It was taken, and the first call raised botocore's InvalidRegionError out of
    client.call (a backend never raises for a call): said when the config is made, naming
    the key and what a region looks like."""
    from fabric.errors import ConfigError

    with pytest.raises(ConfigError, match=r"region: .*like us-east-1"):
        make_backend({"type": "lambda", "region": region}, REG)


def test_an_endpoint_of_ones_own_takes_a_region_name_aws_has_not():
    # fabric serve, LocalStack or MinIO may call their region "local": the AWS shape check
    # refused it, though nothing on that path needs an AWS region (botocore signs with it)
    from fabric.errors import ConfigError

    b = make_backend({"type": "lambda", "region": "local", "endpoint_url": "http://127.0.0.1:9"}, REG)
    assert b.config.region == "local"
    with pytest.raises(ConfigError, match=r"region: 'loc al' is not a region name"):
        make_backend({"type": "lambda", "region": "loc al", "endpoint_url": "http://127.0.0.1:9"}, REG)
    with pytest.raises(ConfigError, match=r"region: 'local' is not an AWS region"):
        make_backend({"type": "lambda", "region": "local"}, REG)  # AWS itself: its shape


def test_a_malformed_region_from_the_environment_is_a_config_error(monkeypatch):
    from fabric.errors import ConfigError

    monkeypatch.setenv("AWS_REGION", "us east 1")
    with pytest.raises(ConfigError, match=r"region: 'us east 1' is not an AWS region"):
        make_backend("lambda", REG)


class _Unreachable:
    """A boto3 Lambda client whose host does not resolve (the region's endpoint is made up)."""

    def __init__(self, region: str):
        self.region = region

    def invoke(self, **_):
        from botocore.exceptions import EndpointConnectionError

        url = f"https://lambda.{self.region}.amazonaws.com/2015-03-31/functions/x/invocations"
        raise EndpointConnectionError(endpoint_url=url, error=OSError("Name or service not known"))


def test_a_region_without_lambda_fails_fast_with_what_to_set(monkeypatch):
    """A well-formed region that AWS has not (us-east-9, a typo of a real one): its endpoint's
    host does not resolve, which read as a connection that was not made, NotStarted, retried
    to the call's attempts and deadline. The region is the fault, and it says so, final."""
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    b = LambdaBackend(REG, LambdaConfig(region="us-east-9", function_prefix="rl-fabric-"))
    b._client = _Unreachable("us-east-9")
    r = b._invoke_sync(Invocation(function="add"), b"{}")
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and not r.retryable, r.error
    assert "us-east-9" in r.error.message and "region" in r.error.message
    assert "$AWS_REGION" in r.error.message and "fabric deploy" in r.error.message
    # a region AWS has: a connection that was not made is still NotStarted (DNS or network down)
    b = LambdaBackend(REG, LambdaConfig(region="eu-west-1"))
    b._client = _Unreachable("eu-west-1")
    assert b._invoke_sync(Invocation(function="add"), b"{}").error.type == ErrorCode.NOT_STARTED


def test_a_function_not_found_on_aws_names_the_region_it_was_looked_for_in():
    # deployed to eu-west-1, called in us-east-1 (the default when $AWS_REGION is unset)
    b = LambdaBackend(REG, LambdaConfig(region="us-east-1", function_prefix="rl-fabric-"))
    message = "Function not found: arn:aws:lambda:us-east-1:123456789012:function:rl-fabric-add:live"
    r = b._refused(Invocation(function="add"), "ResourceNotFoundException", 404, message)
    assert r.error.type == ErrorCode.UNKNOWN_FUNCTION and not r.retryable
    assert "in us-east-1" in r.error.message and "$AWS_REGION" in r.error.message
    # an opt-in region not enabled for the account: Lambda refuses the credentials there
    b = LambdaBackend(REG, LambdaConfig(region="me-south-1"))
    r = b._refused(
        Invocation(function="add"), "UnrecognizedClientException", 403, "The security token is invalid"
    )
    assert r.error.type == ErrorCode.UNAUTHORIZED and "me-south-1" in r.error.message


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (401, ErrorCode.UNAUTHORIZED),
        (403, ErrorCode.UNAUTHORIZED),
        (404, ErrorCode.UNKNOWN_FUNCTION),
        (413, ErrorCode.PAYLOAD_TOO_LARGE),
    ],
)
def test_a_refusal_without_a_lambda_error_code_is_read_by_its_status(status, expected):
    """A proxy in front of fabric serve (nginx's client_max_body_size, an auth gateway) or an
    endpoint_url with a wrong path answers with a bare status, no x-amzn-ErrorType. Any 4xx
    was InvalidArguments: final and kept under the idempotency key as the function's own
    answer (a reward's failure_score scored it), for a refusal that is no fault of the payload."""
    from fabric.errors import FINAL_ERRORS

    b = LambdaBackend(REG, LambdaConfig(endpoint_url="http://127.0.0.1:9", token=TOKEN))
    # the http transport finds no code; botocore puts the status in its place
    for code_name in ("", str(status)):
        r = b._refused(Invocation(function="add"), code_name, status, "<html><body>refused</body></html>")
        assert r.error.type == expected and r.error.type not in FINAL_ERRORS, r.error
        assert str(status) in r.error.message
        if status == 404:
            assert "endpoint_url" in r.error.message


def test_the_default_prefix_follows_what_made_the_functions(monkeypatch):
    """A fabric serve (the token says so) serves names as registered unless given --prefix;
    a signed call goes to what `fabric deploy` made, rl-fabric-NAME unless given --prefix."""
    monkeypatch.delenv("RL_FABRIC_TOKEN", raising=False)
    assert LambdaConfig().function_prefix == "rl-fabric-"
    assert LambdaConfig(endpoint_url="http://127.0.0.1:1").function_prefix == "rl-fabric-"
    assert LambdaConfig(endpoint_url="http://127.0.0.1:1", token=TOKEN).function_prefix == ""
    assert LambdaConfig(function_prefix=None).function_prefix == "rl-fabric-"
    assert LambdaConfig(function_prefix="").function_prefix == ""
    monkeypatch.setenv("RL_FABRIC_TOKEN", TOKEN)  # read only for an endpoint_url
    assert LambdaConfig(endpoint_url="http://127.0.0.1:1").function_prefix == ""
    assert LambdaConfig().function_prefix == "rl-fabric-"


@pytest.mark.parametrize("transport", ["http", "boto3"])
async def test_an_envelope_over_lambdas_limit_is_refused_before_sending(transport, monkeypatch):
    """The client checks the payload against Lambda's 6 MB, but Lambda counts the request:
    the envelope around the payload (ids, key, deadline) is a few hundred bytes more. A
    payload just under the limit went out, all 6 MB of it, to be refused by Lambda (413)."""
    from aws_fakes import free_port

    from fabric.protocol import MAX_PAYLOAD_BYTES

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    port = free_port()  # nothing listens: a call that is sent fails NotStarted
    cfg = LambdaConfig(endpoint_url=f"http://127.0.0.1:{port}", token=TOKEN, transport=transport)
    text = "x" * (MAX_PAYLOAD_BYTES - 20)  # {"s":"..."}: 8 bytes of JSON around it
    async with LambdaBackend(REG, cfg) as b:
        r = await b.submit(Invocation(function="add", payload={"s": text}))
    assert r.error.type == ErrorCode.PAYLOAD_TOO_LARGE and not r.retryable, r.error
    assert f"{MAX_PAYLOAD_BYTES:,}" in r.error.message, r.error.message


@pytest.mark.parametrize(
    ("code_name", "status", "code"),
    [
        # the function's configuration: no call can run until it is redeployed (final, and not
        # the function's answer, kept under the key and scored by a reward's failure_score)
        ("EFSMountFailureException", 403, ErrorCode.SETUP_FAILED),
        ("SnapStartException", 400, ErrorCode.SETUP_FAILED),
        ("InvalidZipFileException", 502, ErrorCode.SETUP_FAILED),
        ("InvalidRuntimeException", 502, ErrorCode.SETUP_FAILED),
        ("KMSAccessDeniedException", 502, ErrorCode.SETUP_FAILED),
        ("KMSDisabledException", 502, ErrorCode.SETUP_FAILED),
        ("KMSInvalidStateException", 502, ErrorCode.SETUP_FAILED),
        ("KMSNotFoundException", 502, ErrorCode.SETUP_FAILED),
        ("EC2AccessDeniedException", 502, ErrorCode.SETUP_FAILED),
        ("InvalidSubnetIDException", 502, ErrorCode.SETUP_FAILED),
        ("InvalidSecurityGroupIDException", 502, ErrorCode.SETUP_FAILED),
        # an environment Lambda could not make ready: the function did not run, retry even a
        # side effect (a TransportError ended it OutcomeUnknown)
        ("ENILimitReachedException", 502, ErrorCode.NOT_STARTED),
        ("SubnetIPAddressLimitReachedException", 502, ErrorCode.NOT_STARTED),
        ("EFSMountConnectivityException", 408, ErrorCode.NOT_STARTED),
        ("EFSMountTimeoutException", 408, ErrorCode.NOT_STARTED),
        ("SnapStartNotReadyException", 409, ErrorCode.NOT_STARTED),
        ("SnapStartTimeoutException", 408, ErrorCode.NOT_STARTED),
        # the request as a whole (Lambda's other 413)
        ("SerializedRequestEntityTooLargeException", 413, ErrorCode.PAYLOAD_TOO_LARGE),
        # while it ran: it may have had effects
        ("EFSIOException", 410, ErrorCode.TRANSPORT),
    ],
)
def test_lambdas_refusals_for_the_functions_environment(code_name, status, code):
    """Lambda's Invoke errors that are neither the payload's nor the network's: a 4xx one
    was InvalidArguments, which the client keeps under the key as the function's answer and a
    reward's failure_score scores (an EFS mount that failed trained as a zero); a 502 one a
    TransportError, retried though no call can pass until the function is fixed, and a side
    effect's ended OutcomeUnknown though it never ran."""
    b = LambdaBackend(REG, LambdaConfig())
    r = b._refused(Invocation(function="add"), code_name, status, "refused")
    assert r.error.type == code and code_name in r.error.message, r.error
