"""``fabric deploy --direct``: the Lambda control plane through boto3, without terraform.

Per function: create it (or update its code and configuration), wait until it is ready,
publish a version, point the ``live`` alias at it, set reserved concurrency, and put
provisioned concurrency (the warm pool) on the alias. Every step is idempotent, so a
deploy that stopped half way is finished by running it again. A redeploy converges on what
it asks for: without ``--reserved`` the reserved cap an earlier deploy set is deleted, and
with ``--warm 0`` the alias's provisioned concurrency is deleted (it is billed while it
exists, used or not).

A role this deploy creates takes some seconds to reach Lambda (IAM is eventually
consistent): creating a function is tried again while Lambda cannot assume it yet.

Each function's log group ``/aws/lambda/<name>`` is created (or found) with the retention
terraform gives it: Lambda creates the group at a function's first log line with none, and
its logs are then kept, and billed, for good.

Provisioned concurrency and the log group's retention fail soft: a warning names the function
and the reason, and the function works without a warm pool (moto, for one, does not implement
the calls) or keeps its logs for good.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from fabric.deploy.package import MAX_DIRECT_ZIP_BYTES
from fabric.deploy.plan import ALIAS, HANDLER, DeployedFunction, DeployError, concurrency_limit_hint

_TRUST = {
    "Version": "2012-10-17",
    "Statement": [
        {"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}
    ],
}
#: What the functions may do: write their own logs (the handler needs nothing else unless
#: idempotency or the SQS path is on; grant those with --role-arn or terraform).
_LOGS = {
    "Version": "2012-10-17",
    "Statement": [
        {
            "Effect": "Allow",
            "Action": ["logs:CreateLogGroup", "logs:CreateLogStream", "logs:PutLogEvents"],
            "Resource": "arn:aws:logs:*:*:log-group:/aws/lambda/{prefix}*",
        }
    ],
}


#: How long a first deploy waits for a role it just created to reach Lambda (IAM is
#: eventually consistent: usually under 10 s), and the waits between tries.
ROLE_PROPAGATION_S = 60.0
_ROLE_RETRY_WAITS = (1.0, 2.0, 4.0, 8.0)
#: The variable in which a deploy records the names of ``DirectConfig.environment`` it set,
#: comma-separated: the next deploy removes those it no longer sets, and only those.
MANAGED_ENV = "RL_FABRIC_MANAGED_ENV"
#: Lambda's refusal of a role it cannot assume (yet): the message is the only mark.
_ROLE_NOT_ASSUMABLE = "cannot be assumed by Lambda"
#: The retentions CloudWatch Logs accepts, in days (terraform/modules/functions checks the same).
LOG_RETENTIONS = (
    0, 1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096, 1827, 2192, 2557,
    2922, 3288, 3653,
)  # fmt: skip


class DirectConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    region: str
    endpoint_url: str | None = None
    """An AWS-compatible endpoint (moto, LocalStack); ``None`` is AWS."""
    role_arn: str | None = None
    """The functions' execution role; ``None`` creates ``<prefix>lambda``, allowed to write
    the functions' logs and nothing else."""
    prefix: str = "rl-fabric-"
    runtime: str = "python3.11"
    architecture: str = "x86_64"
    environment: dict[str, str] = {}
    """Extra variables for every function (e.g. ``RL_FABRIC_IDEMPOTENCY_TABLE``). Their names
    are recorded on the function (``RL_FABRIC_MANAGED_ENV``): one dropped from here is
    removed by the next deploy, while variables set on the function by hand are kept."""
    log_retention_days: int = 14
    """Retention of each function's log group, as terraform's ``log_retention_days`` (whose
    default this is); 0 keeps the logs for good."""

    @field_validator("log_retention_days")
    @classmethod
    def _a_retention(cls, days: int) -> int:
        if days not in LOG_RETENTIONS:
            raise ValueError(f"log_retention_days must be one CloudWatch Logs accepts: {LOG_RETENTIONS}")
        return days

    @field_validator("environment")
    @classmethod
    def _not_the_record(cls, environment: dict[str, str]) -> dict[str, str]:
        if MANAGED_ENV in environment:
            raise ValueError(f"{MANAGED_ENV} is deploy's record of the variables it sets; leave it out")
        return environment


class Deployed(BaseModel):
    name: str
    deployed_name: str
    version: str
    alias_arn: str
    created: bool
    provisioned: int
    warning: str | None = None


#: What to do when boto3 finds no credentials
_GET_CREDENTIALS = (
    "run `aws configure`, or set AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; "
    "to try it without an account, pass --endpoint-url of a moto server (`moto_server`; any key "
    "values do)"
)


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise DeployError("--direct needs boto3: pip install 'rl-fabric[aws]'") from None
    return boto3


def check_credentials(region: str) -> None:
    """Fail before packaging (pip can take half a minute) when boto3 would find no
    credentials to sign the deploy with, instead of after it."""
    boto3 = _boto3()
    from botocore.exceptions import BotoCoreError

    try:
        found = boto3.session.Session(region_name=region).get_credentials()
    except BotoCoreError as e:  # a profile that is not in the config, a broken config file
        raise DeployError(f"AWS credentials: {e}; {_GET_CREDENTIALS}") from None
    if found is None:
        raise DeployError(f"no AWS credentials found: {_GET_CREDENTIALS}")


def _clients(cfg: DirectConfig) -> tuple[Any, Any, Any]:
    boto3 = _boto3()
    kw = {"region_name": cfg.region, "endpoint_url": cfg.endpoint_url}
    return boto3.client("lambda", **kw), boto3.client("iam", **kw), boto3.client("logs", **kw)


def ensure_role(iam: Any, cfg: DirectConfig) -> str:
    if cfg.role_arn:
        return cfg.role_arn
    name = f"{cfg.prefix}lambda"
    try:
        return str(iam.get_role(RoleName=name)["Role"]["Arn"])
    except iam.exceptions.NoSuchEntityException:
        pass  # the first deploy with this prefix: create the role below
    arn = str(iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(_TRUST))["Role"]["Arn"])
    policy = json.dumps(_LOGS).replace("{prefix}", cfg.prefix)
    iam.put_role_policy(RoleName=name, PolicyName="logs", PolicyDocument=policy)
    return arn


def deploy_direct(
    functions: list[DeployedFunction],
    zip_path: Path,
    cfg: DirectConfig,
    on_step: Callable[[str], None] | None = None,
) -> list[Deployed]:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    code = zip_path.read_bytes()
    if len(code) > MAX_DIRECT_ZIP_BYTES:
        raise DeployError(
            f"{zip_path} is {len(code) / 2**20:.1f} MiB, over Lambda's 50 MiB direct upload; deploy with "
            "terraform (which uploads through S3) or --no-deps with a layer"
        )
    say = on_step or (lambda _m: None)
    lam, iam, logs = _clients(cfg)
    out: list[Deployed] = []
    failing: str | None = None
    try:
        role = ensure_role(iam, cfg)
        for fn in functions:
            failing = fn.deployed_name
            say(f"{fn.deployed_name}: deploying")
            unkept = _log_group_warning(logs, fn.deployed_name, cfg, say)
            done = _one(lam, fn, code, role, cfg, say)
            if unkept is not None:
                done.warning = f"{done.warning}; {unkept}" if done.warning else unkept
            out.append(done)
        return out
    except NoCredentialsError:  # with --endpoint-url, which skips check_credentials
        raise DeployError(
            "no AWS credentials found: boto3 signs its requests to --endpoint-url too; set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (any values do for moto)"
        ) from None
    except (ClientError, BotoCoreError) as e:
        hint = concurrency_limit_hint(str(e))  # --reserved on an account with a low limit
        raise DeployError(
            f"deploy failed: {e}" + (f"; {hint}" if hint else "") + _so_far(functions, out, failing)
        ) from None
    except DeployError as e:
        raise DeployError(f"{e}{_so_far(functions, out, failing)}") from None


def _log_group(logs: Any, group: str, days: int) -> None:
    """Create ``group`` with a retention of ``days`` (0: none), or put that retention on it
    where it exists: Lambda made it without one, or an earlier deploy with another."""
    try:
        logs.create_log_group(logGroupName=group)
    except logs.exceptions.ResourceAlreadyExistsException:
        pass  # a redeploy, or the function has logged already
    if days:
        logs.put_retention_policy(logGroupName=group, retentionInDays=days)
    else:
        try:
            logs.delete_retention_policy(logGroupName=group)
        except logs.exceptions.ResourceNotFoundException:
            pass


def _log_group_warning(logs: Any, name: str, cfg: DirectConfig, say: Callable[[str], None]) -> str | None:
    """``_log_group`` for function ``name``, before the function exists so that Lambda does
    not make the group without a retention; a refusal (credentials that may deploy functions
    but not manage logs, which deployed before) is a warning, not a failure."""
    from botocore.exceptions import ClientError

    group = f"/aws/lambda/{name}"
    try:
        _log_group(logs, group, cfg.log_retention_days)
    except ClientError as e:
        warning = (
            f"{name}: log group {group} not given a retention of {cfg.log_retention_days} days: "
            f"{_reason(e)}; the function works, and its logs are kept until one is set"
        )
        say(f"warning: {warning}")
        return warning
    return None


def _so_far(functions: list[DeployedFunction], done: list[Deployed], failing: str | None) -> str:
    """Which functions a deploy that stopped part way deployed and which it did not: the
    finished ones were named in its progress lines only, and the error in one function's
    (or botocore's) words."""
    finished = {d.deployed_name for d in done}
    rest = [
        f.deployed_name + (" (this error)" if f.deployed_name == failing else "")
        for f in functions
        if f.deployed_name not in finished
    ]
    live = ", ".join(f"{d.deployed_name} (version {d.version})" for d in done) or "none"
    return f"\ndeployed: {live}; not deployed: {', '.join(rest)}; deploying again finishes it"


def _variables(fn: DeployedFunction, cfg: DirectConfig) -> dict[str, str]:
    variables = {"RL_FABRIC_MODULES": fn.module, "RL_FABRIC_FUNCTIONS": fn.name, **cfg.environment}
    if cfg.environment:  # none: no record (a function deployed without any looks as before)
        variables[MANAGED_ENV] = ",".join(sorted(cfg.environment))
    return variables


def _updated(found: dict[str, str], own: dict[str, str]) -> dict[str, str]:
    """The variables of a function that has ``found``, deployed now with ``own``: the
    names the last deploy recorded and this one does not set are dropped, the rest kept."""
    dropped = {n for n in found.get(MANAGED_ENV, "").split(",") if n} - own.keys()
    kept = {n: v for n, v in found.items() if n not in dropped and n != MANAGED_ENV}
    return {**kept, **own}


def _one(
    lam: Any, fn: DeployedFunction, code: bytes, role: str, cfg: DirectConfig, say: Callable[[str], None]
) -> Deployed:
    from botocore.exceptions import BotoCoreError, ClientError, WaiterError

    name = fn.deployed_name
    settings: dict[str, Any] = {
        "Role": role,
        "Handler": HANDLER,
        "Runtime": cfg.runtime,
        "Timeout": fn.timeout_s,
        "MemorySize": fn.memory_mb,
        "Description": fn.description,
        "Environment": {"Variables": _variables(fn, cfg)},
    }
    try:
        current = lam.get_function(FunctionName=name)["Configuration"]
        created = False
    except lam.exceptions.ResourceNotFoundException:
        created = True
    else:
        # variables set on the function itself (a judge's model and API key: deploy has no
        # way to give them) are kept, where an update replaced the whole environment and
        # wiped them; those an earlier deploy set from cfg.environment and this one does
        # not are removed, or they stayed on the function for good. Its own win
        found = (current.get("Environment") or {}).get("Variables") or {}
        settings["Environment"] = {"Variables": _updated(found, settings["Environment"]["Variables"])}
    if created:
        _create_function(
            lam,
            say,
            FunctionName=name,
            Code={"ZipFile": code},
            Architectures=[cfg.architecture],
            Publish=False,
            **settings,
        )
        lam.get_waiter("function_active_v2").wait(FunctionName=name)
    else:
        # a deploy stopped (or whose wait ran out) mid-create or mid-update left it Pending or
        # InProgress: Lambda refuses another update until that one is done (this deploy, which
        # is to finish it, failed with ResourceConflictException)
        pending = "function_active_v2" if current.get("State") == "Pending" else None
        if pending is None and current.get("LastUpdateStatus") == "InProgress":
            pending = "function_updated_v2"
        if pending is not None:
            try:
                lam.get_waiter(pending).wait(FunctionName=name)
            except WaiterError as e:
                # that change failed (botocore's terminal state): nothing is in progress, and
                # this deploy is the one to replace it (raising here refused it)
                ended = (e.last_response or {}).get("Configuration") or {}
                if "Failed" not in (ended.get("State"), ended.get("LastUpdateStatus")):
                    raise
        lam.update_function_code(FunctionName=name, ZipFile=code, Architectures=[cfg.architecture])
        try:
            lam.get_waiter("function_updated_v2").wait(FunctionName=name)
        except WaiterError as e:
            # the code update itself failed, or is not done: "its code is updated" said
            # neither (a failed one leaves the function its earlier code)
            ended = (e.last_response or {}).get("Configuration") or {}
            if ended.get("LastUpdateStatus") == "Failed":
                what = f"its code update failed: {ended.get('LastUpdateStatusReason') or e}"
            else:
                what = f"its code update did not finish: {e}"
            raise DeployError(
                f"{name}: {what}; the {ALIAS!r} alias still serves its earlier version: deploy again"
            ) from None
        try:
            lam.update_function_configuration(FunctionName=name, **settings)
            lam.get_waiter("function_updated_v2").wait(FunctionName=name)
        except (ClientError, BotoCoreError) as e:
            # half updated: botocore's words alone named neither the function nor that its
            # code is new and its settings old
            hint = concurrency_limit_hint(str(e))
            raise DeployError(
                f"{name}: its code is updated but not its configuration: {e}"
                + (f"; {hint}" if hint else "")
                + f"; the {ALIAS!r} alias still serves its earlier version: deploy again to finish"
            ) from None
    version = str(lam.publish_version(FunctionName=name, Description=f"fabric {fn.version}")["Version"])
    try:
        alias = lam.update_alias(FunctionName=name, Name=ALIAS, FunctionVersion=version)
    except lam.exceptions.ResourceNotFoundException:
        alias = lam.create_alias(FunctionName=name, Name=ALIAS, FunctionVersion=version)
    if fn.reserved_concurrency >= 0:
        lam.put_function_concurrency(FunctionName=name, ReservedConcurrentExecutions=fn.reserved_concurrency)
    elif not created:
        # a cap an earlier deploy set (--reserved) would stay, and keep limiting the function
        lam.delete_function_concurrency(FunctionName=name)
    provisioned, warning = 0, None
    if fn.warm > 0:
        try:
            lam.put_provisioned_concurrency_config(
                FunctionName=name, Qualifier=ALIAS, ProvisionedConcurrentExecutions=fn.warm
            )
            provisioned = fn.warm
        except ClientError as e:
            hint = concurrency_limit_hint(str(e))
            warning = (
                f"{name}: provisioned concurrency ({fn.warm} warm) not set: {_reason(e)}; "
                "the function works, with cold starts" + (f"; {hint}" if hint else "")
            )
    elif not created:
        # --warm 0: a warm pool an earlier deploy put on the alias would stay, and be billed
        try:
            lam.delete_provisioned_concurrency_config(FunctionName=name, Qualifier=ALIAS)
            say(f"{name}: provisioned concurrency removed")
        except lam.exceptions.ResourceNotFoundException:
            pass  # there was none
        except ClientError as e:
            warning = (
                f"{name}: provisioned concurrency on {ALIAS!r} not removed: {_reason(e)}; it is billed "
                "while it exists: delete it with `aws lambda delete-provisioned-concurrency-config`"
            )
    if warning is not None:
        say(f"warning: {warning}")
    say(f"{name}: version {version}, alias {ALIAS}" + (f", {provisioned} warm" if provisioned else ""))
    return Deployed(
        name=fn.name,
        deployed_name=name,
        version=version,
        alias_arn=str(alias["AliasArn"]),
        created=created,
        provisioned=provisioned,
        warning=warning,
    )


def _create_function(lam: Any, say: Callable[[str], None], **kwargs: Any) -> None:
    """``create_function``, tried again while Lambda cannot assume the role yet: a role made
    by this deploy (``ensure_role``) takes some seconds to reach Lambda, and the first deploy
    of a prefix failed on it. Any other refusal raises at once."""
    from botocore.exceptions import ClientError

    waited = 0.0
    for attempt in itertools.count():
        try:
            lam.create_function(**kwargs)
            return
        except ClientError as e:
            err = e.response.get("Error", {})
            if err.get("Code") != "InvalidParameterValueException" or _ROLE_NOT_ASSUMABLE not in str(
                err.get("Message", "")
            ):
                raise
            if waited >= ROLE_PROPAGATION_S:
                raise DeployError(
                    f"{kwargs['FunctionName']}: Lambda still cannot assume the role {kwargs['Role']} after "
                    f"{waited:.0f} s: check that its trust policy allows lambda.amazonaws.com "
                    "(sts:AssumeRole), or pass another with --role-arn"
                ) from None
            wait = _ROLE_RETRY_WAITS[min(attempt, len(_ROLE_RETRY_WAITS) - 1)]
            name = kwargs["FunctionName"]
            say(f"{name}: waiting for the role to reach Lambda (IAM propagation), {wait:.0f} s")
            time.sleep(wait)
            waited += wait


def _reason(e: Any) -> str:
    """``Code: message`` of a ``ClientError``; an endpoint without the API (moto) answers
    with an HTML page: its words are kept."""
    err = e.response.get("Error", {})
    text = " ".join(re.sub(r"<[^>]+>", " ", str(err.get("Message") or "")).split())[:160]
    return f"{err.get('Code')}: {text}"
