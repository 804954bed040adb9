"""``fabric deploy --direct`` from review 17b of the AWS deploy: the functions' log groups
get the retention terraform gives them (see test_deploy_direct.py for the rest)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from sample_fns import REG

from fabric.deploy import plan_functions
from fabric.deploy.direct import DirectConfig, deploy_direct
from fabric.deploy.package import build_zip


def _retention(logs, name: str) -> int | None:
    groups = logs.describe_log_groups(logGroupNamePrefix=name)["logGroups"]
    [group] = [g for g in groups if g["logGroupName"] == name]
    return group.get("retentionInDays")


def test_a_direct_deploy_gives_the_log_groups_terraforms_retention(moto_url, tmp_path):
    """Lambda creates a function's log group /aws/lambda/<name> at its first log line, with
    no retention: logs kept (and billed) forever, where terraform creates the group with
    log_retention_days (14). The direct deploy creates it with that retention; a redeploy,
    over a group that exists (or one Lambda made without a retention), does not fail and
    puts the retention on it."""
    import boto3

    plan = plan_functions(REG, ["add", "boom"], prefix="rl-", warm=0)
    package = build_zip(plan, tmp_path / "fabric.zip", deps=False)
    cfg = DirectConfig(region="us-east-1", endpoint_url=moto_url, prefix="rl-")
    logs = boto3.client("logs", endpoint_url=moto_url, region_name="us-east-1")
    logs.create_log_group(logGroupName="/aws/lambda/rl-boom")  # as Lambda makes it: no retention
    first = deploy_direct(plan, package, cfg)
    assert all(d.warning is None for d in first)
    assert _retention(logs, "/aws/lambda/rl-add") == 14
    assert _retention(logs, "/aws/lambda/rl-boom") == 14
    deploy_direct(plan, package, cfg.model_copy(update={"log_retention_days": 30}))
    assert _retention(logs, "/aws/lambda/rl-add") == 30


def test_a_retention_cloudwatch_refuses_is_refused_before_any_call():
    with pytest.raises(ValidationError, match="log_retention_days must be one CloudWatch Logs accepts"):
        DirectConfig(region="us-east-1", log_retention_days=10)


def test_a_deployer_who_may_not_manage_log_groups_gets_a_warning(moto_url, tmp_path, monkeypatch):
    """Credentials that may deploy functions but not manage logs deployed before: the
    function is deployed, with a warning that says its logs are kept forever."""
    from botocore.exceptions import ClientError

    from fabric.deploy import direct

    def refused(*_a, **_k):
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}}, "CreateLogGroup")

    monkeypatch.setattr(direct, "_log_group", refused, raising=False)
    plan = plan_functions(REG, ["add"], prefix="rl-", warm=0)
    package = build_zip(plan, tmp_path / "fabric.zip", deps=False)
    steps: list[str] = []
    [done] = deploy_direct(
        plan, package, DirectConfig(region="us-east-1", endpoint_url=moto_url, prefix="rl-"), steps.append
    )
    assert done.version == "1"
    assert "log group /aws/lambda/rl-add" in (done.warning or "") and "AccessDeniedException" in done.warning
    assert any(s.startswith("warning: rl-add: log group") for s in steps), steps
