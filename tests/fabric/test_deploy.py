"""``fabric deploy``: packaging, tfvars, the boto3 path end to end against a moto server (then
the deployed names called through the lambda backend pointed at ``fabric serve``), Modal."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
from pydantic import ValidationError
from sample_fns import REG
from typer.testing import CliRunner

from fabric.backends.base import LambdaConfig, LocalConfig, ModalConfig
from fabric.client import Client
from fabric.deploy import DeployError, plan_functions
from fabric.deploy.direct import DirectConfig, deploy_direct
from fabric.deploy.package import build_zip, image_context, requirements
from fabric.deploy.tfcheck import check_tfvars
from fabric.deploy.tfvars import TFVARS_FILE, tfvars, write_tfvars
from fabric.errors import ErrorCode
from fabric.protocol import Invocation
from fabric.serve import Gateway, ServeConfig, TenantConfig

#: the variable in which deploy --direct records the names it sets (docs/deploy.md)
MANAGED_ENV = "RL_FABRIC_MANAGED_ENV"

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "deploy-test-token-0123456789"


# -- plan


def test_plan_names_modules_and_limits():
    plan = plan_functions(REG, ["add", "sleepy"], prefix="rl-")
    assert [f.deployed_name for f in plan] == ["rl-add", "rl-sleepy"]
    assert plan[0].module == "sample_fns" and plan[0].warm == 1 and plan[0].reserved_concurrency == -1
    assert plan[1].timeout_s == 10
    assert plan_functions(REG, ["add"], warm=0)[0].warm == 0
    assert (
        plan_functions(REG, ["add"], reserved=True)[0].reserved_concurrency == REG.get("add").max_concurrency
    )


def test_plan_errors():
    with pytest.raises(DeployError, match=r"not registered: nope .*-m MODULE"):
        plan_functions(REG, ["add", "nope"])
    with pytest.raises(DeployError, match="at most 64 characters"):
        plan_functions(REG, ["add"], prefix="x" * 70)
    with pytest.raises(DeployError, match="nothing to deploy"):
        plan_functions(REG, [])


# -- package


def test_zip_holds_the_code_and_is_deterministic(tmp_path):
    plan = plan_functions(REG, ["add"])
    a = build_zip(plan, tmp_path / "a.zip", deps=False)
    b = build_zip(plan, tmp_path / "b.zip", deps=False)
    assert a.read_bytes() == b.read_bytes()  # an unchanged package keeps its hash
    names = zipfile.ZipFile(a).namelist()
    assert "fabric/protocol.py" in names and "functions/handler.py" in names
    assert "sample_fns.py" in names  # the module the deployed function lives in
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert not (tmp_path / "a.zip.partial").exists()


def test_a_user_package_goes_without_its_dotfiles(tmp_path, monkeypatch):
    """The package's whole tree was zipped: .env (secrets), .git, a .venv inside it. Hidden
    files and directories stay out, of the zip and of an image's build context."""
    from fabric.registry import Registry

    pkg = tmp_path / "src" / "dotted_rewards"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from fabric.registry import Registry\n"
        "REG = Registry()\n"
        "@REG.function\n"
        "def secretless(x: int) -> int:\n"
        "    return x\n"
    )
    (pkg / "sub" / "helpers.py").write_text("X = 1\n")
    (pkg / ".env").write_text("OPENAI_API_KEY=sk-secret\n")
    (pkg / "sub" / ".hidden.py").write_text("")
    for d in (".git", ".venv/lib/python3.11/site-packages/big", "sub/.cache"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "f.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    reg = Registry()
    reg.discover("dotted_rewards")
    plan = plan_functions(reg, ["secretless"])
    names = {n for n in zipfile.ZipFile(build_zip(plan, tmp_path / "f.zip", deps=False)).namelist()}
    mine = sorted(n for n in names if n.startswith("dotted_rewards/"))
    assert mine == ["dotted_rewards/__init__.py", "dotted_rewards/sub/helpers.py"], mine
    code = image_context(plan, tmp_path / "image") / "code" / "dotted_rewards"
    assert sorted(str(p.relative_to(code)) for p in code.rglob("*")) == [
        "__init__.py",
        "sub",
        "sub/helpers.py",
    ]


def test_requirements_leave_out_what_lambda_has():
    reqs = requirements()
    assert any(r.startswith("pydantic") for r in reqs) and any(
        r.startswith("aws-lambda-powertools") for r in reqs
    )
    assert not any(r.startswith(("boto3", "botocore", "torch", "ray")) for r in reqs)


def test_image_context(tmp_path):
    ctx = image_context(plan_functions(REG, ["add"]), tmp_path / "image")
    dockerfile = (ctx / "Dockerfile").read_text()
    assert "FROM public.ecr.aws/lambda/python:3.11" in dockerfile
    assert 'CMD ["functions.handler.handler"]' in dockerfile
    assert (ctx / "code" / "fabric" / "protocol.py").is_file() and (ctx / "code" / "sample_fns.py").is_file()
    assert "pydantic" in (ctx / "requirements.txt").read_text()


# -- tfvars


def test_tfvars_keys_are_declared_terraform_variables(tmp_path):
    values = tfvars(plan_functions(REG, ["add", "boom"]), region="eu-west-1", prefix="rl-", zip_path="/x.zip")
    assert check_tfvars(values, ROOT / "terraform") == []
    assert values["functions"]["add"] == {
        "modules": "sample_fns",
        "memory_mb": 512,
        "timeout_s": 30,
        "warm": 1,
        "reserved_concurrency": -1,
        "description": REG.get("add").description or "rl-fabric function add",
        "version": REG.get("add").version,
    }
    (tmp_path / "variables.tf").write_text('variable "region" {}\n')
    with pytest.raises(DeployError, match="name_prefix: not a declared variable; package: not a declared"):
        write_tfvars(values, tmp_path)
    assert check_tfvars(values, ROOT / "terraform") == []
    with pytest.raises(DeployError, match="exactly one of zip_path, image_uri"):
        tfvars([], region="r", prefix="p")


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


# -- CLI


def test_cli_direct_deploy(moto_url, tmp_path, monkeypatch):
    from fabric.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        app,
        [
            *("deploy", "--direct", "--no-deps", "--endpoint-url", moto_url, "--prefix", "cli-"),
            *("-m", "sample_fns", "-f", "add", "-f", "pid", "--out", str(tmp_path / "build")),
        ],
    )
    assert r.exit_code == 0, r.output
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert [d["deployed_name"] for d in done] == ["cli-add", "cli-pid"]


@pytest.mark.parametrize("aws_region", [None, ""])
async def test_the_client_calls_the_region_the_cli_deployed_to(moto_url, tmp_path, monkeypatch, aws_region):
    """With the region in AWS_DEFAULT_REGION (what `aws configure` users and most CI set),
    `fabric deploy` deployed there, but LambdaConfig read only AWS_REGION and called
    us-east-1: every call was UnknownFunction "run `fabric deploy`?" for a function that was
    deployed. An empty AWS_REGION made the region "" and the first call raised botocore's
    ValueError "Invalid endpoint: https://lambda..amazonaws.com" out of client.call."""
    from fabric.cli import app

    if aws_region is None:
        monkeypatch.delenv("AWS_REGION", raising=False)
    else:
        monkeypatch.setenv("AWS_REGION", aws_region)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        app,
        [
            *("deploy", "--direct", "--no-deps", "--endpoint-url", moto_url, "--prefix", "reg-"),
            *("-m", "sample_fns", "-f", "add", "--out", str(tmp_path / "build")),
        ],
    )
    assert r.exit_code == 0, r.output
    assert ":eu-west-1:" in json.loads(r.stdout.strip().splitlines()[-1])[0]["alias_arn"]
    import boto3

    cfg = LambdaConfig(endpoint_url=moto_url, function_prefix="reg-")
    # the region the client calls holds the function (moto's invoke echoes the envelope
    # without looking the function up, so ask its control plane)
    assert cfg.region == "eu-west-1"
    boto3.client("lambda", endpoint_url=moto_url, region_name=cfg.region).get_function(FunctionName="reg-add")
    async with Client(backend=cfg, registry=REG) as c:
        got = await c.call("add", {"a": 1})
    assert got.ok and got.value["function"] == "add", got.error


def test_cli_terraform_path_writes_tfvars(tmp_path, monkeypatch):
    from fabric.cli import app

    tf = tmp_path / "terraform"
    tf.mkdir()
    for name in ("region", "name_prefix", "package", "functions", "tags"):
        (tf / f"{name}.tf").write_text(f'variable "{name}" {{}}\n')
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no terraform on PATH
    r = CliRunner().invoke(
        app,
        [
            "deploy",
            "--no-deps",
            "-m",
            "sample_fns",
            "-f",
            "add",
            "--terraform-dir",
            str(tf),
            "--out",
            str(tmp_path / "b"),
        ],
    )
    assert r.exit_code == 0, r.output
    values = json.loads((tf / TFVARS_FILE).read_text())
    assert values["functions"]["add"]["modules"] == "sample_fns"
    assert Path(values["package"]["zip_path"]).is_file()
    assert "terraform is not on PATH" in r.output


def test_cli_lambda_deploy_provisions_no_concurrency_unless_asked(tmp_path, monkeypatch):
    """Every built-in has warm=1, and a deploy put provisioned concurrency on each: on a new
    AWS account (a concurrency limit of 10, of which Lambda keeps 10 unreserved) terraform
    apply failed with "decreases account's UnreservedConcurrentExecution below its minimum
    value of [10]". A Lambda deploy provisions none unless asked (--provisioned: each
    function's warm; --warm N: N for every function)."""
    from fabric.cli import app

    tf = tmp_path / "terraform"
    tf.mkdir()
    for name in ("region", "name_prefix", "package", "functions", "tags"):
        (tf / f"{name}.tf").write_text(f'variable "{name}" {{}}\n')
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no terraform on PATH
    base = ["deploy", "--no-deps", "-m", "sample_fns", "-f", "add", "--terraform-dir", str(tf)]
    base += ["--out", str(tmp_path / "b")]
    for extra, warm in (([], 0), (["--provisioned"], REG.get("add").warm), (["--warm", "2"], 2)):
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        assert json.loads((tf / TFVARS_FILE).read_text())["functions"]["add"]["warm"] == warm, extra
    assert REG.get("add").warm == 1  # so the default's 0 is the deploy's, not the function's
    r = CliRunner().invoke(app, ["deploy", "--backend", "modal", "--provisioned", "-m", "sample_fns"])
    assert r.exit_code == 2 and "--provisioned" in r.output  # Modal's warm pool is min_containers


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


def test_a_terraform_apply_refused_for_the_concurrency_limit_says_what_to_do(tmp_path, monkeypatch):
    from fabric.deploy.terraform import run_terraform

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "terraform"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = apply ]; then\n'
        "  echo 'Error: putting Lambda Provisioned Concurrency Config (rl-fabric-add,live): "
        "InvalidParameterValueException: Specified ConcurrentExecutions for function decreases "
        "account'\\''s UnreservedConcurrentExecution below its minimum value of [10].' >&2\n"
        "  exit 1\n"
        "fi\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    with pytest.raises(DeployError) as e:
        run_terraform(tmp_path, plan_only=False, echo=lambda _: None)
    assert "apply failed" in str(e.value) and "Service Quotas" in str(e.value) and "--warm 0" in str(e.value)


@pytest.mark.parametrize("image", [None, "123456789012.dkr.ecr.us-east-1.amazonaws.com/rl-fabric:1"])
def test_cli_terraform_path_keeps_the_architecture(tmp_path, monkeypatch, image):
    """--image with --architecture arm64 wrote x86_64 to the tfvars (an arm64 image on an
    x86_64 function fails at its first call); the zip path passed it on."""
    from fabric.cli import app

    tf = tmp_path / "terraform"
    tf.mkdir()
    for name in ("region", "name_prefix", "package", "functions", "tags"):
        (tf / f"{name}.tf").write_text(f'variable "{name}" {{}}\n')
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no terraform on PATH
    args = ["deploy", "--no-deps", "-m", "sample_fns", "-f", "add", "--architecture", "arm64"]
    args += ["--terraform-dir", str(tf), "--out", str(tmp_path / "b")]
    r = CliRunner().invoke(app, args + (["--image", image] if image else []))
    assert r.exit_code == 0, r.output
    package = json.loads((tf / TFVARS_FILE).read_text())["package"]
    assert package["architecture"] == "arm64" and package["type"] == ("image" if image else "zip")


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """No AWS variables, empty credentials and config files, no instance metadata."""
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, name in (("AWS_SHARED_CREDENTIALS_FILE", "credentials"), ("AWS_CONFIG_FILE", "config")):
        (tmp_path / name).write_text("")
        monkeypatch.setenv(k, str(tmp_path / name))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # an EC2 runner's role is credentials
    import boto3

    # boto3.client() reuses one default session, with the credentials an earlier test found
    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)


def test_cli_direct_deploy_without_credentials_says_what_to_do_before_packaging(
    no_aws_credentials, tmp_path, monkeypatch
):
    """It packaged (28 s with dependencies), then failed with "deploy failed: Unable to
    locate credentials"."""
    from fabric.cli import app

    monkeypatch.chdir(tmp_path)
    args = ["deploy", "--direct", "--no-deps", "-f", "exact_match", "--out", str(tmp_path / "b")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "no AWS credentials found" in text and "aws configure" in text, text
    assert "AWS_PROFILE" in text and "AWS_ACCESS_KEY_ID" in text and "--endpoint-url" in text
    assert "packaging" not in text and not (tmp_path / "b").exists()
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2 and "no-such-profile" in r.output and "aws configure" in r.output, r.output
    assert not (tmp_path / "b").exists()


def test_cli_direct_deploy_to_an_endpoint_without_credentials_says_what_to_do(
    no_aws_credentials, tmp_path, monkeypatch
):
    from fabric.cli import app

    monkeypatch.chdir(tmp_path)
    args = ["deploy", "--direct", "--no-deps", "-f", "exact_match", "--out", str(tmp_path / "b")]
    r = CliRunner().invoke(app, [*args, "--endpoint-url", "http://127.0.0.1:9"])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "no AWS credentials found" in text and "AWS_ACCESS_KEY_ID" in text, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "azure"], "--backend must be lambda or modal"),
        (["--architecture", "sparc"], "--architecture must be x86_64 or arm64"),
        (["-m", "sample_fns", "-f", "nope"], "not registered: nope"),
        (["-m", "sample_fns", "-f", "add", "--direct", "--image", "x"], "--direct deploys zip packages"),
        (
            ["-m", "sample_fns", "-f", "add", "--no-deps", "--terraform-dir", "/nonexistent"],
            "no terraform directory",
        ),
        (["-m", "sample_fns", "-f", "add", "--warm", "-1"], "Invalid value for '--warm'"),
        (["-m", "sample_fns", "-f", "add", "--no-deps", "--out", "a-file"], "--out 'a-file' is a file"),
        # a traceback of botocore's InvalidRegionError (--direct), or a tfvars file terraform
        # refuses later: said at once, with what a region looks like
        (["-m", "sample_fns", "-f", "add", "--direct", "--region", "us east 1"], "--region 'us east 1'"),
        (["-m", "sample_fns", "-f", "add", "--no-deps", "--region", "eu_west_1"], "like us-east-1"),
    ],
)
def test_cli_deploy_bad_input(tmp_path, monkeypatch, args, message):
    from fabric.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("")
    r = CliRunner().invoke(app, ["deploy", *args])
    assert r.exit_code == 2 and message in r.output, r.output
    # said before packaging: no package is left behind
    assert "packaging" not in r.output and not (tmp_path / "build").exists()


# -- Modal


def test_modal_app_definitions_and_local_run():
    from fabric.deploy.modal_ import build_app, modal_options

    plan = plan_functions(REG, ["add", "async_sleepy"], prefix="rl-")
    opts = modal_options(REG, plan[0])
    assert opts == {
        "name": "rl-add",
        "min_containers": 1,
        "buffer_containers": 1,
        "max_containers": 64,
        "scaledown_window": 60,
        "timeout": 30,
        "retries": 0,
        "cpu": 1.0,
        "memory": 512,
    }
    assert (
        modal_options(REG, plan[1])["min_containers"] == 0
        and modal_options(REG, plan[1])["buffer_containers"] == 0
    )
    app, functions = build_app(REG, plan)
    assert app.name == "rl-fabric" and set(functions) == {"add", "async_sleepy"}
    out = functions["add"].local(Invocation(function="add", payload={"a": 2, "b": 3}).model_dump(mode="json"))
    assert out["ok"] and out["value"] == 5 and out["worker"] == "modal:add"
    out = functions["async_sleepy"].local(
        Invocation(function="async_sleepy", payload={"seconds": 0}).model_dump(mode="json")
    )
    assert out["ok"]
    wrong = functions["add"].local(Invocation(function="boom", payload={}).model_dump(mode="json"))
    assert wrong["error"]["type"] == "UnknownFunction"
    bad = functions["add"].local({"function": "add", "payload": {"a": "x"}})
    assert bad["error"]["type"] == "InvalidArguments"


def test_modal_functions_leave_retries_to_the_client(monkeypatch):
    """Modal retried a lost or timed-out container max_attempts - 1 times, side effects
    included (a call that may have run, run again), and the client retried each of those
    again: up to 3 x 3 runs. Modal retries nothing now; the client applies the retry policy
    with its idempotency and side-effect rules."""
    import modal

    from fabric.deploy.modal_ import build_app, modal_options

    plan = plan_functions(REG, ["add", "append_line"], prefix="rl-")
    assert REG.get("append_line").side_effects and REG.get("add").retry.max_attempts > 1
    assert [modal_options(REG, fn)["retries"] for fn in plan] == [0, 0]
    seen = []
    real = modal.App.function

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("retries"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(modal.App, "function", recording)
    build_app(REG, plan)
    assert seen == [0, 0]


def test_modal_functions_get_the_secrets_named_at_deploy(monkeypatch):
    """`fabric deploy --backend modal` gave its functions no way to receive variables (a
    judge's model and API key): every such function failed its setup on Modal. Each Modal
    secret named with --modal-secret is attached to every function (its keys become their
    environment); the option is Modal's only."""
    import modal

    from fabric.cli import app
    from fabric.deploy.modal_ import build_app

    plan = plan_functions(REG, ["add", "boom"], prefix="rl-")
    seen = []
    real = modal.App.function

    def recording(self, *args, **kwargs):
        seen.append(sorted(s.name for s in kwargs.get("secrets", [])))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(modal.App, "function", recording)
    build_app(REG, plan, secrets=["judge-keys", "hf"])
    assert seen == [["hf", "judge-keys"], ["hf", "judge-keys"]]
    seen.clear()
    build_app(REG, plan)
    assert seen == [[], []]
    r = CliRunner().invoke(app, ["deploy", "--modal-secret", "judge-keys", "-m", "sample_fns", "-f", "add"])
    assert r.exit_code == 2 and "--modal-secret" in r.output and "modal" in r.output


@pytest.fixture
def echo_port():
    """A line echo server on 127.0.0.1, in a thread (the Modal runtime's calls are blocking)."""
    import socketserver
    import threading

    class Echo(socketserver.StreamRequestHandler):
        def handle(self):
            for line in self.rfile:
                self.wfile.write(line)

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()
            thread.join(5)


def test_modal_runtime_keeps_one_event_loop_per_container(echo_port):
    """Each async call ran under its own asyncio.run, which closes its loop: a connection or
    client made on the first call (or in a setup hook) was bound to a closed loop on the
    second, which failed with UserError "Event loop is closed". One loop serves the
    container's calls, as in the Lambda handler."""
    from fabric.deploy import modal_runtime

    def call(text):
        inv = Invocation(function="echo_pooled", payload={"port": echo_port, "text": text})
        return modal_runtime.run("echo_pooled", "sample_fns", inv.model_dump(mode="json"))

    try:
        outs = [call(t) for t in ("a", "b", "c", "")]
        assert [(o["ok"], o["value"]) for o in outs] == [(True, "a"), (True, "b"), (True, "c"), (True, "")], [
            o["error"] for o in outs
        ]
    finally:
        modal_runtime.reset()


def test_modal_runtime_honours_the_invocations_deadline(tmp_path):
    """A call that reached its container after its deadline (queued behind a cold start, a
    burst past max_containers) still ran: a side effect happened after the client had given
    the call up. And an async call ran for the function's whole timeout_s past the deadline.
    The Lambda handler and the local workers refuse a late call (DeadlineExceeded) and bound
    an async one by the deadline; the Modal runtime now does too."""
    import time

    from fabric.deploy import modal_runtime

    path = tmp_path / "effects.txt"
    late = Invocation(
        function="append_line", payload={"path": str(path), "line": "x"}, deadline=time.time() - 1
    )
    try:
        out = modal_runtime.run("append_line", "sample_fns", late.model_dump(mode="json"))
        assert out["error"]["type"] == ErrorCode.DEADLINE_EXCEEDED, out
        assert not path.exists()  # the effect never happened
        soon = Invocation(function="async_sleepy", payload={"seconds": 5}, deadline=time.time() + 0.3)
        t0 = time.monotonic()
        out = modal_runtime.run("async_sleepy", "sample_fns", soon.model_dump(mode="json"))
        assert time.monotonic() - t0 < 3 and not out["ok"], out  # not the function's 30 s timeout
        # a call with no deadline (a keyed execution's, as the backend sends it) runs
        out = modal_runtime.run(
            "append_line", "sample_fns", late.model_copy(update={"deadline": None}).model_dump(mode="json")
        )
        assert out["ok"] and path.read_text() == "x\n", out
    finally:
        modal_runtime.reset()


@pytest.fixture
def no_modal_token(monkeypatch, tmp_path):
    monkeypatch.delenv("MODAL_TOKEN_ID", raising=False)
    monkeypatch.delenv("MODAL_TOKEN_SECRET", raising=False)
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(tmp_path / "modal.toml"))
    monkeypatch.setenv("HOME", str(tmp_path))


async def test_modal_backend_without_a_token_fails_at_once(no_modal_token):
    import time

    from fabric.backends.modal_ import ModalBackend

    async with ModalBackend(REG, ModalConfig()) as b:
        t0 = time.monotonic()
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.UNAUTHORIZED and not r.retryable
    assert "modal token new" in r.error.message and time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    ("name", "code"),
    [
        ("ResourceExhaustedError", ErrorCode.THROTTLED),  # Modal's rate limit: nothing ran
        ("PermissionDeniedError", ErrorCode.UNAUTHORIZED),
        ("InvalidError", ErrorCode.SETUP_FAILED),  # the deployment's, not the function's answer
        ("RequestSizeError", ErrorCode.PAYLOAD_TOO_LARGE),
        ("AuthError", ErrorCode.UNAUTHORIZED),
        ("NotFoundError", ErrorCode.UNKNOWN_FUNCTION),
        ("FunctionTimeoutError", ErrorCode.TIMEOUT),
        ("ConnectionError", ErrorCode.TRANSPORT),
        ("InternalFailure", ErrorCode.TRANSPORT),
        ("ServiceError", ErrorCode.TRANSPORT),
    ],
)
async def test_modal_errors_are_translated(name, code):
    """Everything but AuthError, NotFoundError and the timeout was a retryable TransportError:
    a rate limit was not retried for a side effect (TransportError may have run), and a
    refused permission, an invalid or too large request were retried to no end."""
    import modal.exception

    from fabric.backends.modal_ import ModalBackend
    from fabric.errors import RETRYABLE

    class Raising:
        """A deployed function whose ``.remote.aio`` raises what Modal's client raised."""

        @property
        def remote(self):
            return self

        async def aio(self, envelope):
            raise getattr(modal.exception, name)("refused")

    class FakeModal(ModalBackend):
        def _function(self, name):  # the lookup hook: no Modal account here
            return Raising()

    async with FakeModal(REG, ModalConfig()) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == code and r.retryable == (code in RETRYABLE), r.error
    assert name in r.error.message and r.worker == "modal"


async def test_a_modal_container_that_cannot_import_the_runtime_is_setup_failed():
    """The container's entry imports fabric's runtime; an image without it (or without one of
    its dependencies) raises ImportError there, which Modal re-raises here. It was a retryable
    TransportError: every call was retried to its attempts, and a side effect's ended
    OutcomeUnknown, though the function never ran and never will until the app is redeployed."""
    from fabric.backends.modal_ import ModalBackend
    from fabric.errors import FINAL_ERRORS

    class Raising:
        @property
        def remote(self):
            return self

        async def aio(self, envelope):
            raise ModuleNotFoundError("No module named 'pydantic'", name="pydantic")

    class FakeModal(ModalBackend):
        def _function(self, name):
            return Raising()

    async with FakeModal(REG, ModalConfig()) as b:
        r = await b.invoke(Invocation(function="add", payload={"a": 1}))
    assert r.error.type == ErrorCode.SETUP_FAILED and not r.retryable, r.error
    assert r.error.type not in FINAL_ERRORS  # not the function's answer, kept under a key
    assert "No module named 'pydantic'" in r.error.message
    assert "fabric deploy --backend modal" in r.error.message  # what to do


def test_modal_deploy_without_a_token_is_a_clear_error(no_modal_token, tmp_path, monkeypatch):
    from fabric.cli import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["deploy", "--backend", "modal", "-m", "sample_fns", "-f", "add"])
    assert r.exit_code == 2 and "modal token new" in r.output, r.output


def test_deploy_docs_say_how_modal_errors_are_translated():
    """docs/deploy.md's list of Modal's errors and the fabric codes they become is the
    backend's table: it still said InvalidError is InvalidArguments after the backend made it
    SetupFailed (a user reading it would expect such a failure kept under the key and
    scored by failure_score)."""
    import re

    from fabric.backends.modal_ import _ERRORS

    text = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    start = text.index("Modal's errors become fabric's")
    paragraph = text[start : text.index("Offline,", start)]
    codes = {str(c) for c in ErrorCode}
    for name, code in _ERRORS:
        after = paragraph[paragraph.index(f"`{name}`") + len(name) + 2 :]
        said = next(t for t in re.findall(r"`([A-Za-z]+)`", after) if t in codes)
        assert said == str(code), f"docs/deploy.md says {name} is {said}; the backend makes it {code}"


def test_deploy_docs_commands_exist():
    # the deploy guide's commands use options the CLI has
    text = (ROOT / "docs" / "deploy.md").read_text()
    from fabric.cli import app

    help_text = CliRunner().invoke(app, ["deploy", "--help"], terminal_width=200).output
    for opt in (
        "--direct",
        "--plan-only",
        "--prefix",
        "--endpoint-url",
        "--no-deps",
        "--image",
        "--warm",
        "--provisioned",
    ):
        assert opt in text and opt in help_text, opt
