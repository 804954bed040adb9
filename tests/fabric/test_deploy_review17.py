"""Review 17 of the AWS deploy: what `fabric deploy --backend lambda` plans and writes for
terraform before anything is packaged or applied."""

from __future__ import annotations

import pytest

from fabric.deploy import DeployError, plan_functions
from fabric.registry import Registry


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
