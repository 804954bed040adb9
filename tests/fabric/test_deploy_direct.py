"""``fabric deploy --direct``: the boto3 path end to end against a moto server, then the
deployed names called through the lambda backend pointed at ``fabric serve``; what moto lacks
(provisioned concurrency, a new role's wait, a too low concurrency limit) against botocore's
Stubber; redeploys keeping or removing what they should."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from sample_fns import REG

from fabric.backends.base import LambdaConfig, LocalConfig
from fabric.client import Client
from fabric.deploy import DeployError, plan_functions
from fabric.deploy.direct import DirectConfig, deploy_direct
from fabric.deploy.package import build_zip
from fabric.errors import ErrorCode
from fabric.serve import Gateway, ServeConfig, TenantConfig

#: the variable in which deploy --direct records the names it sets (docs/deploy.md)
MANAGED_ENV = "RL_FABRIC_MANAGED_ENV"

TOKEN = "deploy-test-token-0123456789"


# -- direct (boto3) against moto, then called through fabric serve


async def test_direct_deploy_then_invoke_through_fabric_serve(moto_url, tmp_path):
    import boto3

    plan = plan_functions(REG, ["add", "boom"], prefix="rl-")
    package = build_zip(plan, tmp_path / "fabric.zip", deps=False)
    cfg = DirectConfig(region="us-east-1", endpoint_url=moto_url, prefix="rl-")
    steps: list[str] = []
    first = deploy_direct(plan, package, cfg, on_step=steps.append)
    assert [d.deployed_name for d in first] == ["rl-add", "rl-boom"] and all(d.created for d in first)
    add = first[0]
    # moto does not implement provisioned concurrency: a warning, not a failure
    assert add.provisioned == 0 and "provisioned concurrency (1 warm) not set" in (add.warning or "")
    assert any(s.startswith("warning: rl-add") for s in steps)
    assert first[1].warning is None  # boom has warm=0: nothing to set

    lam = boto3.client("lambda", endpoint_url=moto_url, region_name="us-east-1")
    conf = lam.get_function(FunctionName="rl-add")["Configuration"]
    assert conf["Handler"] == "functions.handler.handler" and conf["Timeout"] == 30
    assert conf["Environment"]["Variables"] == {
        "RL_FABRIC_MODULES": "sample_fns",
        "RL_FABRIC_FUNCTIONS": "add",
    }
    assert lam.get_alias(FunctionName="rl-add", Name="live")["FunctionVersion"] == add.version

    again = deploy_direct(plan, package, cfg)  # idempotent: updates, publishes, moves the alias
    assert not again[0].created and again[0].version != add.version
    assert lam.get_alias(FunctionName="rl-add", Name="live")["FunctionVersion"] == again[0].version

    # the deployed names, called through the lambda backend pointed at fabric serve
    serve = ServeConfig(
        port=0,
        tenants={"job": TenantConfig(token=TOKEN)},
        function_prefix="rl-",
        backend=LocalConfig(max_workers=1),
        warm=False,
    )
    async with Gateway(serve, REG) as gw:
        for transport in ("boto3", "http"):
            backend = LambdaConfig(
                endpoint_url=gw.url, token=TOKEN, function_prefix="rl-", transport=transport
            )
            async with Client(backend=backend, registry=REG) as c:
                assert (await c.call("add", {"a": 20, "b": 22})).value == 42
                boom = await c.call("boom", {"x": 1})
                assert boom.error.type == ErrorCode.USER_ERROR


@pytest.mark.parametrize("refusal", ["ClientError", "DeployError"])
def test_a_deploy_that_fails_part_way_names_what_was_deployed_and_what_was_not(
    moto_url, tmp_path, monkeypatch, refusal
):
    """The second of three functions is refused: the error was that function's (botocore's
    words, or deploy's own), and which were deployed showed only in the progress lines. It
    names the functions deployed (live now, with their versions) and those not."""
    from botocore.exceptions import ClientError

    from fabric.deploy import direct

    real = direct._create_function

    def refusing(lam, say, **kwargs):
        if kwargs["FunctionName"] == "rl-boom":
            if refusal == "DeployError":
                raise DeployError("rl-boom: Lambda still cannot assume the role")
            error = {"Error": {"Code": "InvalidParameterValueException", "Message": "bad memory"}}
            raise ClientError(error, "CreateFunction")
        real(lam, say, **kwargs)

    monkeypatch.setattr(direct, "_create_function", refusing)
    plan = plan_functions(REG, ["add", "boom", "sleepy"], prefix="rl-", warm=0)
    package = build_zip(plan, tmp_path / "fabric.zip", deps=False)
    with pytest.raises(DeployError) as info:
        deploy_direct(plan, package, DirectConfig(region="us-east-1", endpoint_url=moto_url, prefix="rl-"))
    text = str(info.value)
    assert ("bad memory" if refusal == "ClientError" else "cannot assume the role") in text
    assert "deployed: rl-add (version 1)" in text
    assert "not deployed: rl-boom (this error), rl-sleepy" in text


def _created_up_to_its_alias(stub, arn: str) -> None:
    """What Lambda answers a new function's create, its wait, its version and its alias."""
    stub.add_response("create_function", {"FunctionName": "rl-add"})
    active = {"Configuration": {"State": "Active", "LastUpdateStatus": "Successful"}}
    stub.add_response("get_function", active)
    stub.add_response("publish_version", {"Version": "1"})
    stub.add_client_error("update_alias", "ResourceNotFoundException", http_status_code=404)
    stub.add_response("create_alias", {"AliasArn": arn + ":live"})


def test_provisioned_concurrency_call_on_the_alias():
    # the call moto lacks, against botocore's Stubber: parameters checked against the API model
    import boto3
    from botocore.stub import Stubber

    from fabric.deploy.direct import _one

    lam = boto3.client("lambda", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fn = plan_functions(REG, ["add"], prefix="rl-", warm=3)[0]
    arn = "arn:aws:lambda:us-east-1:123456789012:function:rl-add"
    with Stubber(lam) as stub:
        stub.add_client_error("get_function", "ResourceNotFoundException", http_status_code=404)
        _created_up_to_its_alias(stub, arn)
        stub.add_response(
            "put_provisioned_concurrency_config",
            {"RequestedProvisionedConcurrentExecutions": 3, "Status": "IN_PROGRESS"},
            {"FunctionName": "rl-add", "Qualifier": "live", "ProvisionedConcurrentExecutions": 3},
        )
        done = _one(
            lam, fn, b"zip", "arn:aws:iam::123456789012:role/r", DirectConfig(region="us-east-1"), print
        )
        stub.assert_no_pending_responses()
    assert done.provisioned == 3 and done.warning is None and done.alias_arn.endswith(":live")


def test_a_redeploy_without_reserved_removes_the_cap(moto_url, tmp_path):
    """A deploy with --reserved capped the function; a later one without it left the cap
    (nothing deleted it), so the function stayed limited."""
    import boto3

    lam = boto3.client("lambda", endpoint_url=moto_url, region_name="us-east-1")
    cfg = DirectConfig(region="us-east-1", endpoint_url=moto_url, prefix="rl-")
    package = build_zip(plan_functions(REG, ["boom"], prefix="rl-"), tmp_path / "f.zip", deps=False)
    deploy_direct(plan_functions(REG, ["boom"], prefix="rl-", reserved=True), package, cfg)
    cap = REG.get("boom").max_concurrency
    assert lam.get_function_concurrency(FunctionName="rl-boom").get("ReservedConcurrentExecutions") == cap
    deploy_direct(plan_functions(REG, ["boom"], prefix="rl-", reserved=False), package, cfg)
    assert "ReservedConcurrentExecutions" not in lam.get_function_concurrency(FunctionName="rl-boom")


def test_a_redeploy_keeps_the_variables_set_on_the_function(moto_url, tmp_path):
    """`fabric deploy --direct` gives a function no variables of the user's, so they are set
    on the function itself (the console, `aws lambda update-function-configuration`: a
    judge's model and API key). A redeploy replaced the function's whole environment with
    deploy's own variables, wiping them silently, and the judge failed every call after it.
    It keeps the variables it does not set; its own are as it sets them."""
    import boto3

    lam = boto3.client("lambda", endpoint_url=moto_url, region_name="us-east-1")
    cfg = DirectConfig(region="us-east-1", endpoint_url=moto_url, prefix="rl-")
    plan = plan_functions(REG, ["boom"], prefix="rl-")
    package = build_zip(plan, tmp_path / "f.zip", deps=False)
    deploy_direct(plan, package, cfg)
    own = {"RL_FABRIC_MODULES": "sample_fns", "RL_FABRIC_FUNCTIONS": "boom"}
    user = {"OPENAI_API_KEY": "sk-1", "RL_FABRIC_JUDGE_MODEL": "m1"}
    lam.update_function_configuration(
        FunctionName="rl-boom", Environment={"Variables": {**own, **user, "RL_FABRIC_FUNCTIONS": "changed"}}
    )
    deploy_direct(plan, package, cfg)
    conf = lam.get_function(FunctionName="rl-boom")["Configuration"]
    assert conf["Environment"]["Variables"] == {**own, **user}


def test_a_variable_dropped_from_the_config_leaves_the_function(moto_url, tmp_path):
    """DirectConfig.environment: a variable a deploy set and a later deploy no longer sets
    stayed on the function for good, since an update keeps the variables it finds (those set
    by hand). Deploy records the names it sets (RL_FABRIC_MANAGED_ENV) and removes those it
    set before and sets no more; a variable set by hand is kept."""
    import boto3

    lam = boto3.client("lambda", endpoint_url=moto_url, region_name="us-east-1")
    plan = plan_functions(REG, ["boom"], prefix="rl-")
    package = build_zip(plan, tmp_path / "f.zip", deps=False)

    def deploy(**environment: str) -> dict[str, str]:
        cfg = DirectConfig(region="us-east-1", endpoint_url=moto_url, prefix="rl-", environment=environment)
        deploy_direct(plan, package, cfg)
        return lam.get_function(FunctionName="rl-boom")["Configuration"]["Environment"]["Variables"]

    own = {"RL_FABRIC_MODULES": "sample_fns", "RL_FABRIC_FUNCTIONS": "boom"}
    env = deploy(RL_FABRIC_IDEMPOTENCY_TABLE="t1", JUDGE_MODEL="m1")
    set_first = {"RL_FABRIC_IDEMPOTENCY_TABLE": "t1", "JUDGE_MODEL": "m1"}
    assert {**own, **set_first}.items() <= env.items(), env
    by_hand = {**env, "OPENAI_API_KEY": "sk-1"}
    lam.update_function_configuration(FunctionName="rl-boom", Environment={"Variables": by_hand})
    env = deploy(RL_FABRIC_IDEMPOTENCY_TABLE="t2")
    assert "JUDGE_MODEL" not in env, f"a variable dropped from the config stayed: {env}"
    assert env == {
        **own,
        "RL_FABRIC_IDEMPOTENCY_TABLE": "t2",
        "OPENAI_API_KEY": "sk-1",
        MANAGED_ENV: "RL_FABRIC_IDEMPOTENCY_TABLE",
    }, env
    # none left: the record goes too, and what was set by hand stays
    assert deploy() == {**own, "OPENAI_API_KEY": "sk-1"}


def test_the_managed_names_variable_is_deploys_own():
    with pytest.raises(ValidationError, match=MANAGED_ENV):
        DirectConfig(region="us-east-1", environment={MANAGED_ENV: "X"})


def test_a_first_deploy_waits_for_its_new_role(monkeypatch):
    """IAM is eventually consistent: for some seconds after `fabric deploy --direct` creates
    <prefix>lambda, Lambda refuses the function with InvalidParameterValueException "The
    role defined for the function cannot be assumed by Lambda." The first deploy of every
    prefix failed with "deploy failed: ..." (moto has no such delay: botocore's Stubber
    plays AWS's answer). It is retried while the role propagates; any other refusal is not."""
    import boto3
    from botocore.exceptions import ClientError
    from botocore.stub import Stubber

    from fabric.deploy import direct
    from fabric.deploy.direct import _one

    slept: list[float] = []
    monkeypatch.setattr(direct.time, "sleep", slept.append)
    not_yet = "The role defined for the function cannot be assumed by Lambda."
    lam = boto3.client("lambda", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fn = plan_functions(REG, ["add"], prefix="rl-", warm=0)[0]
    arn = "arn:aws:lambda:us-east-1:123456789012:function:rl-add"
    role = "arn:aws:iam::123456789012:role/rl-lambda"
    steps: list[str] = []
    with Stubber(lam) as stub:
        stub.add_client_error("get_function", "ResourceNotFoundException", http_status_code=404)
        for _ in range(2):
            stub.add_client_error("create_function", "InvalidParameterValueException", not_yet)
        _created_up_to_its_alias(stub, arn)
        done = _one(lam, fn, b"zip", role, DirectConfig(region="us-east-1"), steps.append)
        stub.assert_no_pending_responses()
    assert done.created and done.version == "1" and len(slept) == 2
    assert any("waiting for the role" in s for s in steps), steps
    # another invalid parameter is the deploy's own mistake: not retried
    with Stubber(lam) as stub:
        stub.add_client_error("get_function", "ResourceNotFoundException", http_status_code=404)
        stub.add_client_error("create_function", "InvalidParameterValueException", "Unsupported runtime")
        with pytest.raises(ClientError, match="Unsupported runtime"):
            _one(lam, fn, b"zip", role, DirectConfig(region="us-east-1"), steps.append)
    assert len(slept) == 2
    # a role that never becomes usable: a DeployError that says what to check
    monkeypatch.setattr(direct, "ROLE_PROPAGATION_S", 3.0)
    with Stubber(lam) as stub:
        stub.add_client_error("get_function", "ResourceNotFoundException", http_status_code=404)
        for _ in range(3):
            stub.add_client_error("create_function", "InvalidParameterValueException", not_yet)
        with pytest.raises(DeployError, match=r"trust policy allows lambda\.amazonaws\.com"):
            _one(lam, fn, b"zip", role, DirectConfig(region="us-east-1"), steps.append)
    assert slept[2:] == [1.0, 2.0]


def _redeploy_stubbed(stub, name: str) -> None:
    """The calls of redeploying an existing function, up to its concurrency settings."""
    ready = {"Configuration": {"State": "Active", "LastUpdateStatus": "Successful"}}
    arn = f"arn:aws:lambda:us-east-1:123456789012:function:{name}"
    stub.add_response("get_function", {"Configuration": {"FunctionName": name}})
    stub.add_response("update_function_code", {"FunctionName": name})
    stub.add_response("get_function", ready)
    stub.add_response("update_function_configuration", {"FunctionName": name})
    stub.add_response("get_function", ready)
    stub.add_response("publish_version", {"Version": "2"})
    stub.add_response("update_alias", {"AliasArn": arn + ":live"})
    stub.add_response("delete_function_concurrency", {}, {"FunctionName": name})


def test_a_redeploy_with_warm_0_removes_provisioned_concurrency():
    """`fabric deploy --direct --warm 0` left the alias's provisioned concurrency in place
    (billed, used or not). moto lacks the call: botocore's Stubber checks it against the API
    model. A function that has none (ResourceNotFoundException) is no warning."""
    import boto3
    from botocore.stub import Stubber

    from fabric.deploy.direct import _one

    lam = boto3.client("lambda", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fn = plan_functions(REG, ["add"], prefix="rl-", warm=0)[0]
    role = "arn:aws:iam::123456789012:role/r"
    steps: list[str] = []
    with Stubber(lam) as stub:
        _redeploy_stubbed(stub, "rl-add")
        stub.add_response(
            "delete_provisioned_concurrency_config", {}, {"FunctionName": "rl-add", "Qualifier": "live"}
        )
        done = _one(lam, fn, b"zip", role, DirectConfig(region="us-east-1"), steps.append)
        stub.assert_no_pending_responses()
    assert done.provisioned == 0 and done.warning is None and not done.created
    assert "rl-add: provisioned concurrency removed" in steps
    with Stubber(lam) as stub:
        _redeploy_stubbed(stub, "rl-add")
        stub.add_client_error(
            "delete_provisioned_concurrency_config", "ResourceNotFoundException", http_status_code=404
        )
        done = _one(lam, fn, b"zip", role, DirectConfig(region="us-east-1"), steps.append)
        stub.assert_no_pending_responses()
    assert done.warning is None
    with Stubber(lam) as stub:  # any other refusal: a warning that says it is still billed
        _redeploy_stubbed(stub, "rl-add")
        stub.add_client_error("delete_provisioned_concurrency_config", "AccessDeniedException", "no")
        done = _one(lam, fn, b"zip", role, DirectConfig(region="us-east-1"), steps.append)
    assert "not removed: AccessDeniedException" in (done.warning or "") and "billed" in done.warning


def test_oversize_zip_is_refused_before_any_call(tmp_path):
    big = tmp_path / "big.zip"
    with big.open("wb") as f:
        f.truncate(51 * 1024 * 1024)
    with pytest.raises(DeployError, match="over Lambda's 50 MiB direct upload"):
        deploy_direct(plan_functions(REG, ["add"]), big, DirectConfig(region="us-east-1"))


def test_a_concurrency_limit_too_low_for_provisioned_concurrency_says_what_to_do():
    import boto3
    from botocore.stub import Stubber

    from fabric.deploy.direct import _one

    lam = boto3.client("lambda", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fn = plan_functions(REG, ["add"], prefix="rl-", warm=1)[0]
    arn = "arn:aws:lambda:us-east-1:123456789012:function:rl-add"
    refused = (
        "Specified ConcurrentExecutions for function decreases account's UnreservedConcurrentExecution "
        "below its minimum value of [10]."
    )
    with Stubber(lam) as stub:
        stub.add_client_error("get_function", "ResourceNotFoundException", http_status_code=404)
        _created_up_to_its_alias(stub, arn)
        stub.add_client_error("put_provisioned_concurrency_config", "InvalidParameterValueException", refused)
        done = _one(
            lam, fn, b"zip", "arn:aws:iam::123456789012:role/r", DirectConfig(region="us-east-1"), print
        )
    assert done.provisioned == 0 and done.warning is not None
    assert "Service Quotas" in done.warning and "--warm 0" in done.warning


def _redeploy_over(left: dict, waited: dict):
    """A direct redeploy of ``add`` over a function an earlier deploy left ``left``, whose
    wait for that change reads ``waited``, against botocore's Stubber (moto has no Pending
    or InProgress state to leave a function in); every call it makes must be one of these."""
    import boto3
    from botocore.stub import Stubber

    from fabric.deploy.direct import _one

    lam = boto3.client("lambda", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fn = plan_functions(REG, ["add"], prefix="rl-", warm=0)[0]
    ready = {"Configuration": {"State": "Active", "LastUpdateStatus": "Successful"}}
    with Stubber(lam) as stub:
        stub.add_response("get_function", {"Configuration": {"FunctionName": "rl-add", **left}})
        stub.add_response("get_function", {"Configuration": waited})  # the wait for that change
        stub.add_response("update_function_code", {"FunctionName": "rl-add"})
        stub.add_response("get_function", ready)
        stub.add_response("update_function_configuration", {"FunctionName": "rl-add"})
        stub.add_response("get_function", ready)
        stub.add_response("publish_version", {"Version": "2"})
        stub.add_response(
            "update_alias", {"AliasArn": "arn:aws:lambda:us-east-1:123456789012:function:rl-add:live"}
        )
        stub.add_response("delete_function_concurrency", {}, {"FunctionName": "rl-add"})
        stub.add_client_error(
            "delete_provisioned_concurrency_config", "ResourceNotFoundException", http_status_code=404
        )
        done = _one(
            lam, fn, b"zip", "arn:aws:iam::123456789012:role/r", DirectConfig(region="us-east-1"), print
        )
        stub.assert_no_pending_responses()
    return done


@pytest.mark.parametrize(
    "left", [{"State": "Pending"}, {"State": "Active", "LastUpdateStatus": "InProgress"}], ids=str
)
def test_a_redeploy_after_one_that_stopped_mid_update_waits_for_it(left):
    """A deploy stopped (or whose wait ran out) while Lambda was still creating or updating
    the function left it Pending or InProgress: the next deploy, which is to finish it,
    called update_function_code at once and Lambda refused it (ResourceConflictException:
    an update is in progress). It waits for the function to be ready first."""
    done = _redeploy_over(left, {"State": "Active", "LastUpdateStatus": "Successful"})
    assert done.version == "2" and not done.created


@pytest.mark.parametrize(
    "left, ended",
    [
        ({"State": "Pending"}, {"State": "Failed"}),
        (
            {"State": "Active", "LastUpdateStatus": "InProgress"},
            {"State": "Active", "LastUpdateStatus": "Failed"},
        ),
    ],
    ids=["create", "update"],
)
def test_a_redeploy_after_one_whose_change_then_failed_replaces_it(left, ended):
    """The earlier deploy's create or update, still in progress, then failed (a bad setting):
    the wait for it met botocore's terminal failure state and this deploy, the one that is
    to replace that change, raised WaiterError. A failed change holds nothing up."""
    done = _redeploy_over(left, ended)
    assert done.version == "2" and not done.created


def test_a_redeploy_that_updates_the_code_but_not_the_configuration_says_so():
    """The code went up, then the configuration update was refused (or its wait ran out):
    the error was botocore's alone ("deploy failed: ... UpdateFunctionConfiguration ..."),
    without the function's name, or that its code is new and its settings old. It says so,
    and that the 'live' alias still serves the earlier version until a deploy finishes."""
    import boto3
    from botocore.stub import Stubber

    from fabric.deploy.direct import _one

    lam = boto3.client("lambda", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fn = plan_functions(REG, ["add"], prefix="rl-", warm=0)[0]
    ready = {"Configuration": {"State": "Active", "LastUpdateStatus": "Successful"}}
    with Stubber(lam) as stub:
        stub.add_response("get_function", {"Configuration": {"FunctionName": "rl-add", "State": "Active"}})
        stub.add_response("update_function_code", {"FunctionName": "rl-add"})
        stub.add_response("get_function", ready)
        stub.add_client_error(
            "update_function_configuration", "InvalidParameterValueException", "Environment too large"
        )
        with pytest.raises(DeployError) as info:
            _one(lam, fn, b"zip", "arn:aws:iam::123456789012:role/r", DirectConfig(region="us-east-1"), print)
    text = str(info.value)
    assert "rl-add" in text and "code is updated" in text and "Environment too large" in text
    assert "'live'" in text and "deploy again" in text


def test_a_redeploy_whose_code_update_fails_does_not_say_the_code_is_updated():
    """Lambda took the new code, then its update failed (LastUpdateStatus Failed: a zip
    that does not unpack, a layer gone): the function keeps its earlier code. The error said
    "its code is updated but not its configuration", which sends one looking at the settings."""
    import boto3
    from botocore.stub import Stubber

    from fabric.deploy.direct import _one

    lam = boto3.client("lambda", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x")
    fn = plan_functions(REG, ["add"], prefix="rl-", warm=0)[0]
    failed = {
        "Configuration": {
            "State": "Active",
            "LastUpdateStatus": "Failed",
            "LastUpdateStatusReason": "Unzipped size must be smaller than 262144000 bytes",
        }
    }
    with Stubber(lam) as stub:
        stub.add_response("get_function", {"Configuration": {"FunctionName": "rl-add", "State": "Active"}})
        stub.add_response("update_function_code", {"FunctionName": "rl-add"})
        stub.add_response("get_function", failed)
        with pytest.raises(DeployError) as info:
            _one(lam, fn, b"zip", "arn:aws:iam::123456789012:role/r", DirectConfig(region="us-east-1"), print)
    text = str(info.value)
    assert "rl-add" in text and "code is updated" not in text
    assert "code update failed" in text and "'live'" in text
