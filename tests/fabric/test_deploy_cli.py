"""``fabric deploy`` from the command line: the direct path against a moto server (and the
client calling the region it deployed to), the terraform path's tfvars, provisioned
concurrency, missing credentials and bad input, each saying what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from sample_fns import REG
from typer.testing import CliRunner

from fabric.backends.base import LambdaConfig
from fabric.client import Client
from fabric.deploy import DeployError
from fabric.deploy.tfvars import TFVARS_FILE

# -- CLI


def terraform_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A terraform directory declaring the variables a deploy writes, and no terraform on
    PATH: the deploy writes its tfvars and package, then says terraform is missing."""
    tf = tmp_path / "terraform"
    tf.mkdir()
    for name in ("region", "name_prefix", "package", "functions", "tags"):
        (tf / f"{name}.tf").write_text(f'variable "{name}" {{}}\n')
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    return tf


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

    tf = terraform_dir(tmp_path, monkeypatch)
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


@pytest.mark.parametrize("image", [False, True], ids=["zip", "image"])
def test_a_terraform_dir_that_does_not_declare_the_variables_is_refused_before_packaging(
    tmp_path, monkeypatch, image
):
    """A --terraform-dir that is not the repository's terraform/ (another project's): the
    package (with pip, half a minute) or the image context was built and left in --out, then
    the deploy was refused for the variables."""
    from fabric.cli import app

    tf = tmp_path / "theirs"
    tf.mkdir()
    (tf / "variables.tf").write_text('variable "region" {}\n')
    out = tmp_path / "b"
    args = ["deploy", "--no-deps", "-f", "exact_match", "--terraform-dir", str(tf), "--out", str(out)]
    if image:
        args += ["--image", "123.dkr.ecr.eu-west-1.amazonaws.com/fabric:1"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    assert "does not declare what deploy writes: name_prefix: not a declared variable" in r.output
    assert "packaging" not in r.output and not out.exists()


def test_cli_lambda_deploy_provisions_no_concurrency_unless_asked(tmp_path, monkeypatch):
    """Every built-in has warm=1, and a deploy put provisioned concurrency on each: on a new
    AWS account (a concurrency limit of 10, of which Lambda keeps 10 unreserved) terraform
    apply failed with "decreases account's UnreservedConcurrentExecution below its minimum
    value of [10]". A Lambda deploy provisions none unless asked (--provisioned: each
    function's warm; --warm N: N for every function)."""
    from fabric.cli import app

    tf = terraform_dir(tmp_path, monkeypatch)
    base = ["deploy", "--no-deps", "-m", "sample_fns", "-f", "add", "--terraform-dir", str(tf)]
    base += ["--out", str(tmp_path / "b")]
    for extra, warm in (([], 0), (["--provisioned"], REG.get("add").warm), (["--warm", "2"], 2)):
        r = CliRunner().invoke(app, base + extra)
        assert r.exit_code == 0, r.output
        assert json.loads((tf / TFVARS_FILE).read_text())["functions"]["add"]["warm"] == warm, extra
    assert REG.get("add").warm == 1  # so the default's 0 is the deploy's, not the function's
    r = CliRunner().invoke(app, [*base, "--keep-warm"])  # (--provisioned, above, is its earlier name)
    assert r.exit_code == 0 and json.loads((tf / TFVARS_FILE).read_text())["functions"]["add"]["warm"] == 1
    r = CliRunner().invoke(app, [*base, "--keep-warm", "--warm", "2"])
    assert r.exit_code == 2 and "pass one" in " ".join(r.output.split()), r.output


def test_a_modal_deploy_keeps_no_container_warm_unless_asked(tmp_path, monkeypatch):
    """Modal's min_containers followed each function's warm: every built-in has warm=1, so a
    Modal deploy of them kept two containers per function running (min_containers 1 plus a
    buffer of 1), billed while idle, for as long as the app stayed deployed. As on Lambda, a
    deploy keeps none unless asked (--keep-warm: each function's warm; --warm N)."""
    import fabric.deploy.modal_ as modal_deploy
    from fabric.cli import app

    seen: list[dict] = []

    def fake_deploy(registry, plan, *, app_name="rl-fabric", secrets=(), pip=(), echo):
        seen.append({f.name: modal_deploy.modal_options(registry, f) for f in plan})

    monkeypatch.setattr(modal_deploy, "deploy_modal", fake_deploy)
    monkeypatch.chdir(tmp_path)
    args = ["deploy", "--backend", "modal", "--prune", "-m", "sample_fns", "-f", "add"]
    for extra in ([], ["--keep-warm"], ["--provisioned"], ["--warm", "3"]):
        r = CliRunner().invoke(app, args + extra)
        assert r.exit_code == 0, r.output
    kept = [(o["add"]["min_containers"], o["add"]["buffer_containers"]) for o in seen]
    assert kept == [(0, 0), (1, 1), (1, 1), (3, 1)]


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

    tf = terraform_dir(tmp_path, monkeypatch)
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


async def test_a_client_with_the_defaults_calls_the_names_a_deploy_with_the_defaults_made(
    moto_url, tmp_path, monkeypatch
):
    """`fabric deploy` names functions rl-fabric-NAME unless given --prefix, while
    LambdaConfig's function_prefix defaulted to "": a deploy with the defaults and then
    Client(backend="lambda") (or `fabric invoke --backend lambda`) called 'add' and every
    call was UnknownFunction. A client that signs its calls (AWS, or moto and LocalStack at
    an endpoint_url) now calls the names a deploy gives by default."""
    import boto3

    from fabric.cli import app
    from fabric.cli._app import remote_backend

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        app,
        [
            *("deploy", "--direct", "--no-deps", "--endpoint-url", moto_url),
            *("-m", "sample_fns", "-f", "add", "--out", str(tmp_path / "build")),
        ],
    )
    assert r.exit_code == 0, r.output
    deployed = json.loads(r.stdout.strip().splitlines()[-1])[0]["deployed_name"]
    for cfg in (
        LambdaConfig(endpoint_url=moto_url),
        LambdaConfig.model_validate({"endpoint_url": moto_url}),
        remote_backend("lambda", endpoint_url=moto_url, token=None, prefix=None, transport="auto"),
    ):
        assert isinstance(cfg, LambdaConfig)
        assert cfg.function_prefix + "add" == deployed, cfg
        boto3.client("lambda", endpoint_url=moto_url, region_name=cfg.region).get_function(
            FunctionName=cfg.function_prefix + "add"
        )
    assert LambdaConfig().function_prefix + "add" == deployed  # AWS itself
    # --prefix given, even empty, is taken as given
    cfg = remote_backend("lambda", endpoint_url=moto_url, token=None, prefix="", transport="auto")
    assert isinstance(cfg, LambdaConfig) and cfg.function_prefix == ""


def test_a_terraform_deploy_that_would_destroy_deployed_functions_is_refused(tmp_path, monkeypatch):
    """fabric.auto.tfvars.json is terraform's whole list of functions: a deploy of one more
    function (`-f new`), or one that forgot `-m my_rewards`, or one under another --prefix,
    wrote a list without the others, and `terraform apply` destroyed them (and their alias,
    under a training job calling them). Refused, naming them, unless --prune says so."""
    from fabric.cli import app

    tf = terraform_dir(tmp_path, monkeypatch)
    base = [
        "deploy",
        "--no-deps",
        "-m",
        "sample_fns",
        "--terraform-dir",
        str(tf),
        "--out",
        str(tmp_path / "b"),
    ]

    def deploy(*extra: str):
        return CliRunner().invoke(app, [*base, *extra])

    def deployed() -> list[str]:
        values = json.loads((tf / TFVARS_FILE).read_text())
        return [values["name_prefix"] + n for n in sorted(values["functions"])]

    assert deploy("-f", "add", "-f", "pid").exit_code == 0
    assert deployed() == ["rl-fabric-add", "rl-fabric-pid"]
    assert deploy("-f", "add", "-f", "pid", "-f", "boom").exit_code == 0  # adding one is fine
    r = deploy("-f", "add")
    text = " ".join(r.output.split())
    assert r.exit_code == 2, r.output
    assert "rl-fabric-boom, rl-fabric-pid" in text and "--prune" in text, text
    assert deployed() == ["rl-fabric-add", "rl-fabric-boom", "rl-fabric-pid"]  # left as it was
    r = deploy("-f", "add", "-f", "pid", "-f", "boom", "--prefix", "team-")  # a rename destroys too
    assert r.exit_code == 2 and "rl-fabric-add" in " ".join(r.output.split()), r.output
    r = deploy("-f", "add", "--prune")
    assert r.exit_code == 0, r.output
    assert deployed() == ["rl-fabric-add"]


def test_a_last_deploy_s_list_that_cannot_be_read_is_refused_not_taken_for_none(tmp_path, monkeypatch):
    """A fabric.auto.tfvars.json cut short (a deploy stopped mid-write) or broken by hand was
    taken for "no earlier deploy": the guard above was off, and terraform destroyed what its
    state still held. Refused, saying how to go on; --prune still deploys."""
    from fabric.cli import app

    tf = terraform_dir(tmp_path, monkeypatch)
    base = [
        "deploy",
        "--no-deps",
        "-m",
        "sample_fns",
        "--terraform-dir",
        str(tf),
        "--out",
        str(tmp_path / "b"),
    ]
    for broken in ('{"name_prefix": "rl-fabric-", "functions": {"add": {', '{"something": "else"}'):
        (tf / TFVARS_FILE).write_text(broken)
        r = CliRunner().invoke(app, [*base, "-f", "add"])
        text = " ".join(r.output.split())
        assert r.exit_code == 2, r.output
        assert "cannot read which functions the last deploy made" in text and "--prune" in text, text
        assert (tf / TFVARS_FILE).read_text() == broken  # left for the user to restore
    r = CliRunner().invoke(app, [*base, "-f", "add", "--prune"])
    assert r.exit_code == 0, r.output
    assert sorted(json.loads((tf / TFVARS_FILE).read_text())["functions"]) == ["add"]
    assert [p.name for p in tf.iterdir() if p.name.endswith(".tmp")] == []  # written whole, by a rename


def test_deploy_pip_reaches_every_package_and_refuses_no_deps(tmp_path, monkeypatch):
    """--pip: the functions' own dependencies (test_deploy_package.py has the package's side)."""
    import fabric.deploy.modal_ as modal_deploy
    from fabric.cli import app

    seen: dict = {}
    monkeypatch.setattr(modal_deploy, "deploy_modal", lambda *a, pip=(), **kw: seen.update(pip=list(pip)))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        app, ["deploy", "--backend", "modal", "--prune", "-m", "sample_fns", "-f", "add", "--pip", "numpy"]
    )
    assert r.exit_code == 0 and seen == {"pip": ["numpy"]}, r.output
    tf = tmp_path / "terraform"
    tf.mkdir()
    r = CliRunner().invoke(
        app,
        [
            "deploy",
            "--no-deps",
            "--pip",
            "numpy",
            "-m",
            "sample_fns",
            "-f",
            "add",
            "--terraform-dir",
            str(tf),
        ],
    )
    assert r.exit_code == 2 and "--no-deps" in r.output and not (tmp_path / "build").exists(), r.output
    (tf / "variables.tf").write_text(
        "".join(f'variable "{n}" {{}}\n' for n in ("region", "name_prefix", "package", "functions"))
    )
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))  # no terraform on PATH
    r = CliRunner().invoke(
        app,
        [
            *(
                "deploy",
                "--pip",
                "numpy>=1.26",
                "--image",
                "example.com/r:1",
                "-m",
                "sample_fns",
                "-f",
                "add",
            ),
            *("--terraform-dir", str(tf), "--out", str(tmp_path / "b")),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "numpy>=1.26" in (tmp_path / "b" / "image" / "requirements.txt").read_text().splitlines()
