"""Run ``terraform init/plan/apply`` in the terraform directory, when terraform is on PATH."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from fabric.deploy.plan import DeployError, concurrency_limit_hint

PLAN_FILE = "fabric.tfplan"


def terraform_binary() -> str | None:
    return shutil.which("terraform")


def run_terraform(terraform_dir: Path, *, plan_only: bool, echo: Callable[[str], None]) -> None:
    binary = terraform_binary()
    if binary is None:
        raise DeployError("terraform is not on PATH: install it, or deploy with --direct (boto3)")
    steps = [
        ["init", "-input=false", "-no-color"],
        ["plan", "-input=false", "-no-color", f"-out={PLAN_FILE}"],
    ]
    if not plan_only:
        steps.append(["apply", "-input=false", "-no-color", PLAN_FILE])
    for args in steps:
        echo(f"$ terraform {' '.join(args)}")
        done = subprocess.run([binary, *args], cwd=terraform_dir, capture_output=True, text=True)
        for line in (done.stdout + done.stderr).splitlines():
            echo(line)
        if done.returncode != 0:
            hint = ""
            if args[0] == "init" and "registry.terraform.io" in done.stdout + done.stderr:
                hint = (
                    " (terraform init downloads the AWS provider from registry.terraform.io: it needs "
                    "that network, or a provider mirror in your terraform CLI config)"
                )
            limit = concurrency_limit_hint(done.stdout + done.stderr)
            if limit is not None:  # warm functions' provisioned concurrency on a new account
                hint = f": {limit}"
            raise DeployError(f"terraform {args[0]} failed with exit code {done.returncode}{hint}")
