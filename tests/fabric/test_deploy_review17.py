"""Review 17 of the AWS deploy: what `fabric deploy --backend lambda` plans and writes for
terraform before anything is packaged or applied."""

from __future__ import annotations

from pathlib import Path

import pytest

from fabric.deploy import DeployError, plan_functions
from fabric.deploy.tfcheck import check_tfvars
from fabric.deploy.tfvars import tfvars
from fabric.registry import Registry

TERRAFORM_DIR = Path(__file__).resolve().parents[2] / "terraform"


def _registry() -> Registry:
    reg = Registry()

    @reg.function(warm=0, max_concurrency=4, retry={"max_attempts": 7})
    def capped(x: int) -> int:
        return x

    @reg.function(warm=0)
    def plain(x: int) -> int:
        return x

    return reg


def test_warm_above_max_concurrency_is_refused_before_packaging():
    """`--warm N` sets every function's provisioned concurrency. Above a function's
    max_concurrency it is either refused by Lambda (provisioned above the reserved cap
    `--reserved` sets: terraform's validation, after the packaging) or keeps more warm
    instances than the function may ever run at once (billed while idle). The Modal deploy
    refused it; the Lambda one went on to package and run terraform."""
    reg = _registry()
    for reserved in (False, True):
        with pytest.raises(DeployError, match=r"capped: --warm 5 is more than its max_concurrency=4"):
            plan_functions(reg, ["capped"], warm=5, reserved=reserved)
    assert plan_functions(reg, ["capped"], warm=4, reserved=True)[0].warm == 4


def test_tfvars_carry_each_functions_max_attempts():
    """The SQS worker leaves a retryable record on the queue until its function's
    retry.max_attempts receives; the input queue's redrive (maxReceiveCount) has to allow
    that many, so terraform needs each function's max_attempts."""
    values = tfvars(plan_functions(_registry()), region="eu-west-1", prefix="rl-", zip_path="/x.zip")
    assert values["functions"]["capped"]["max_attempts"] == 7
    assert values["functions"]["plain"]["max_attempts"] == 3
    assert check_tfvars(values, TERRAFORM_DIR) == []
