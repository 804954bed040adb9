"""``fabric deploy``: AWS Lambda (terraform or boto3) or a Modal app."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from fabric.backends.base import DEPLOY_PREFIX
from fabric.cli._app import (
    ModalAppOpt,
    ModulesOpt,
    app,
    err,
    fail,
    load_registry,
    out,
)
from fabric.errors import FabricError


@app.command(
    help="Deploy the registered functions: AWS Lambda (terraform or boto3) with a `live` alias "
    "(provisioned concurrency with --keep-warm or --warm N), or a Modal app.",
    epilog="Example: fabric deploy -m my_rewards.py --plan-only (terraform's plan; without "
    "--plan-only it applies)",
)
def deploy(
    backend: Annotated[
        str, typer.Option(help="lambda (terraform, or boto3 with --direct) or modal.")
    ] = "lambda",
    direct: Annotated[bool, typer.Option(help="Deploy with boto3 instead of terraform.")] = False,
    plan_only: Annotated[bool, typer.Option(help="terraform: init and plan, no apply.")] = False,
    prefix: Annotated[str, typer.Option(help="Deployed names are PREFIX + function name.")] = DEPLOY_PREFIX,
    region: Annotated[
        str | None, typer.Option(help="AWS region (default $AWS_REGION, $AWS_DEFAULT_REGION or us-east-1).")
    ] = None,
    endpoint_url: Annotated[
        str | None, typer.Option(help="--direct against an AWS-compatible endpoint (moto, LocalStack).")
    ] = None,
    role_arn: Annotated[
        str | None, typer.Option(help="--direct: execution role (default: create PREFIXlambda).")
    ] = None,
    functions: Annotated[
        list[str] | None, typer.Option("--function", "-f", help="Deploy only these (repeatable).")
    ] = None,
    warm: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Warm instances of every function: Lambda provisioned concurrency, Modal min_containers "
            "(default: none, see --keep-warm).",
        ),
    ] = None,
    keep_warm: Annotated[
        bool,
        typer.Option(
            help="Give each function its warm instances (its decorator's warm): Lambda provisioned "
            "concurrency, Modal min_containers. Off by default: they are billed while idle, and a new AWS "
            "account's concurrency limit (10) refuses any provisioned concurrency.",
        ),
    ] = False,
    provisioned: Annotated[
        bool, typer.Option("--provisioned", hidden=True, help="--keep-warm's earlier name.")
    ] = False,
    reserved: Annotated[bool, typer.Option(help="Cap each function at its max_concurrency.")] = False,
    prune: Annotated[
        bool,
        typer.Option(
            help="Let a deploy remove functions an earlier one made that this one does not name: "
            "terraform destroys them, and a Modal app is deployed whole (refused otherwise: terraform "
            "names them; Modal refuses -f without it)."
        ),
    ] = False,
    terraform_dir: Annotated[str, typer.Option(help="Where fabric.auto.tfvars.json goes.")] = "terraform",
    out_dir: Annotated[str, typer.Option("--out", help="Where the package is built.")] = "build",
    deps: Annotated[
        bool, typer.Option("--deps/--no-deps", help="Put the dependencies in the zip (or use a layer).")
    ] = True,
    pip: Annotated[
        list[str] | None,
        typer.Option(
            "--pip",
            help="A dependency of your functions (a pip requirement, e.g. 'numpy>=1.26'), installed beside "
            "rl-fabric's in the zip, the --image context or the Modal image (repeatable).",
        ),
    ] = None,
    image: Annotated[
        str | None,
        typer.Option(help="Deploy this container image URI; its build context is written to OUT/image."),
    ] = None,
    architecture: Annotated[str, typer.Option(help="x86_64 or arm64.")] = "x86_64",
    modal_secrets: Annotated[
        list[str] | None,
        typer.Option(
            "--modal-secret",
            help="modal: attach this Modal secret (`modal secret create NAME KEY=VALUE ...`) to every "
            "function; its keys become their environment (repeatable).",
        ),
    ] = None,
    modal_app: ModalAppOpt = None,
    modules: ModulesOpt = None,
) -> None:
    from pathlib import Path

    from fabric.backends.base import default_region, region_problem
    from fabric.deploy import DeployError, plan_functions

    if backend not in ("lambda", "modal"):
        fail(f"--backend must be lambda or modal, got {backend!r}")
    if architecture not in ("x86_64", "arm64"):
        fail(f"--architecture must be x86_64 or arm64, got {architecture!r}")
    if Path(out_dir).exists() and not Path(out_dir).is_dir():  # a traceback of mkdir's
        fail(f"--out {out_dir!r} is a file: the package goes into a directory; pick another --out")
    if modal_secrets and backend != "modal":
        fail(
            "--modal-secret is for --backend modal: with terraform, set function_settings and "
            "function_environment (docs/deploy.md); with --direct, set the variables on the function"
        )
    if prune and backend == "lambda" and direct:
        fail("--prune is for a terraform deploy or a Modal one: --direct removes nothing")
    if backend == "modal" and functions and not prune:
        # Modal deploys an app with the functions its definition holds: the app's others
        # (an earlier deploy's, without -f) stop, under their callers. Nothing here can list
        # the deployed app offline, so a deploy of some of them is asked to say it means it
        fail(
            f"-f deploys only {', '.join(functions)}, and a Modal app is deployed whole: the app's other "
            "functions would be removed. Deploy them all (drop -f), or pass --prune if that is what you "
            "mean (with --modal-app APP to make them an app of their own)"
        )
    if pip and not deps and image is None and backend == "lambda":
        fail(
            "--pip installs into the package, which --no-deps leaves without dependencies: drop --no-deps, "
            "or put them in your Lambda layer"
        )
    if modal_app is not None and backend != "modal":
        fail(f"--modal-app is for --backend modal, not {backend}")
    keep_warm = keep_warm or provisioned
    if keep_warm and warm is not None:
        fail("--keep-warm gives each function its own warm, --warm N every function N: pass one")
    if warm is None and not keep_warm:
        # no warm instances unless asked: both clouds bill them while idle (every built-in has
        # warm=1: a Modal deploy of them kept two containers each running for good), and a new
        # AWS account's concurrency limit refuses provisioned concurrency outright (terraform
        # apply failed on every warm function)
        warm = 0
    if backend == "lambda":
        given = region is not None
        region = region or default_region()
        problem = region_problem(region)
        if problem is not None:
            where = "--region" if given else "the region from $AWS_REGION / $AWS_DEFAULT_REGION"
            fail(f"{where} {problem}")
    try:
        reg = load_registry(modules)
        plan = plan_functions(reg, functions, prefix=prefix, warm=warm, reserved=reserved)
        if backend == "lambda" and not direct and not Path(terraform_dir).is_dir():
            # said before packaging (pip can take half a minute), which left a package behind
            fail(
                f"no terraform directory at {terraform_dir!r} (--terraform-dir): the repository's terraform/"
            )
        if backend == "lambda" and not direct and not prune:
            from fabric.deploy.tfvars import refuse_dropping

            refuse_dropping(plan, Path(terraform_dir))  # before packaging, which takes a while
        if backend == "modal":
            from fabric.deploy.modal_ import APP_NAME, deploy_modal

            deploy_modal(
                reg,
                plan,
                app_name=modal_app or APP_NAME,
                secrets=modal_secrets or (),
                pip=pip or (),
                echo=lambda m: err.print(escape(m), soft_wrap=True),
            )
            return
        _deploy_lambda(
            plan,
            direct=direct,
            plan_only=plan_only,
            prefix=prefix,
            region=region or default_region(),  # set above
            endpoint_url=endpoint_url,
            role_arn=role_arn,
            terraform_dir=Path(terraform_dir),
            out=Path(out_dir),
            deps=deps,
            image=image,
            architecture=architecture,
            pip=pip or (),
        )
    except (DeployError, FabricError) as e:
        fail(str(e))


def _deploy_lambda(plan: Any, **o: Any) -> None:
    from fabric.deploy import DeployError
    from fabric.deploy.package import build_zip, image_context
    from fabric.deploy.terraform import run_terraform, terraform_binary
    from fabric.deploy.tfvars import check_declared, tfvars, write_tfvars

    say = lambda m: err.print(escape(m), soft_wrap=True)  # noqa: E731
    if not o["direct"]:
        # a --terraform-dir that does not take what deploy writes (another project's) was said
        # after the packaging (pip: half a minute), which it left in --out
        source = {"image_uri": o["image"]} if o["image"] is not None else {"zip_path": "(the package)"}
        early = tfvars(plan, region=o["region"], prefix=o["prefix"], architecture=o["architecture"], **source)
        check_declared(early, o["terraform_dir"])
    if o["image"] is not None:
        if o["direct"]:
            raise DeployError("--direct deploys zip packages; deploy an --image with terraform")
        ctx = image_context(plan, o["out"] / "image", architecture=o["architecture"], pip=o["pip"])
        say(f"image build context: {ctx} (build and push it as {o['image']})")
        values = tfvars(
            plan, region=o["region"], prefix=o["prefix"], image_uri=o["image"], architecture=o["architecture"]
        )
    else:
        if o["direct"] and o["endpoint_url"] is None:
            from fabric.deploy.direct import check_credentials

            check_credentials(o["region"])  # before packaging, which takes a while
        say(f"packaging {len(plan)} functions" + (" with dependencies (pip)" if o["deps"] else ""))
        zip_path = build_zip(
            plan, o["out"] / "fabric-lambda.zip", deps=o["deps"], architecture=o["architecture"], pip=o["pip"]
        )
        say(f"package: {zip_path} ({zip_path.stat().st_size / 2**20:.1f} MiB)")
        if o["direct"]:
            from fabric.deploy.direct import DirectConfig, deploy_direct

            cfg = DirectConfig(
                region=o["region"],
                endpoint_url=o["endpoint_url"],
                role_arn=o["role_arn"],
                prefix=o["prefix"],
                architecture=o["architecture"],
            )
            done = deploy_direct(plan, zip_path, cfg, on_step=say)
            table = Table("function", "deployed as", "version", "warm", "alias ARN", title="deployed")
            for d in done:
                table.add_row(d.name, d.deployed_name, d.version, str(d.provisioned), d.alias_arn)
            out.print(table)
            print(json.dumps([d.model_dump() for d in done]))
            return
        values = tfvars(
            plan,
            region=o["region"],
            prefix=o["prefix"],
            zip_path=str(zip_path.resolve()),
            architecture=o["architecture"],
        )
    path = write_tfvars(values, o["terraform_dir"])
    say(f"wrote {path}")
    if terraform_binary() is None:
        last = "terraform plan" if o["plan_only"] else "terraform plan && terraform apply"
        say(f"terraform is not on PATH; run: cd {o['terraform_dir']} && terraform init && {last}")
        return
    run_terraform(o["terraform_dir"], plan_only=o["plan_only"], echo=say)
