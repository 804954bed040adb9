"""What a deploy creates: one Lambda/Modal function per registered function."""

from __future__ import annotations

import math
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from fabric.config_messages import hint
from fabric.errors import FabricError
from fabric.registry import Registry
from fabric.spec import FunctionSpec

HANDLER = "functions.handler.handler"
SQS_HANDLER = "functions.handler.sqs_handler"
ALIAS = "live"


class DeployError(FabricError):
    """A deploy that cannot go on (bad options, a failed packaging or cloud step)."""


#: What a Lambda function name (and terraform's ``name_prefix``) may hold. ASCII only: ``\w``
#: would take any letter.
_PREFIX = re.compile(r"[A-Za-z0-9_-]*")
#: Lambda's refusal of provisioned or reserved concurrency the account's limit cannot spare.
_CONCURRENCY_LIMIT = "UnreservedConcurrentExecution"


def concurrency_limit_hint(text: str) -> str | None:
    """What to do when ``text`` (an AWS error, terraform's output) is Lambda refusing
    provisioned or reserved concurrency for the account's concurrency limit; else ``None``.
    A new account's limit is 10 and Lambda keeps 10 unreserved, so it refuses any."""
    if _CONCURRENCY_LIMIT not in text:
        return None
    return (
        "this account's Lambda concurrency limit cannot spare it (new accounts start at 10, and Lambda "
        "keeps 10 unreserved, so it refuses any provisioned or reserved concurrency; `aws lambda "
        "get-account-settings` shows the limit): ask for more 'Concurrent executions' in Service Quotas "
        "(AWS Lambda), and meanwhile deploy with --warm 0 (the default) and without --reserved"
    )


class DeployedFunction(BaseModel):
    """One registered function as a cloud function."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    """The fabric name (what callers use)."""
    deployed_name: str
    """``prefix + name``: the Lambda/Modal function."""
    module: str
    """What the handler discovers (``RL_FABRIC_MODULES``): the entry's module, or the
    basename of a ``file.py`` entry (packaged at the root)."""
    source_file: str | None = None
    """A ``file.py`` entry's path, to package."""
    memory_mb: int
    timeout_s: int
    warm: int
    reserved_concurrency: int
    description: str
    version: str
    gpu: int = 0
    cpu: float = 1.0
    max_attempts: int = 3
    """Its ``retry.max_attempts``: the SQS worker leaves a retryable record on the queue for
    that many receives, which the input queue's redrive has to allow."""


def _module_of(spec: FunctionSpec) -> tuple[str, str | None]:
    mod = spec.entry.partition(":")[0]
    if mod.endswith(".py"):
        return Path(mod).name, mod
    return mod, None


def plan_functions(
    registry: Registry,
    names: list[str] | None = None,
    *,
    prefix: str = "",
    warm: int | None = None,
    reserved: bool = False,
) -> list[DeployedFunction]:
    """The functions to deploy (all registered ones unless ``names``), in name order.

    ``warm`` overrides every function's provisioned concurrency (0 turns the warm pools
    off: provisioned concurrency is billed while idle). ``reserved`` caps each function at
    its ``max_concurrency`` with reserved concurrency (which also takes that much out of
    the account's pool, so it is off unless asked)."""
    if not _PREFIX.fullmatch(prefix):
        # said before the packaging: terraform's validation or Lambda refused it after
        raise DeployError(
            f"--prefix {prefix!r}: a Lambda function name takes letters, digits, '-' and '_' only"
        )
    chosen = sorted(names if names is not None else registry.names())
    unknown = [n for n in chosen if n not in registry]
    if unknown:
        known = registry.names()
        raise DeployError(
            f"not registered: {', '.join(n + hint(n, known) for n in unknown)} "
            f"(known: {', '.join(known) or 'none'}); "
            "a function of your own registers when its module is loaded: -m MODULE (module, "
            "module:attr or file.py) or $FABRIC_MODULES"
        )
    if not chosen:
        raise DeployError("nothing to deploy: no functions registered (pass -m MODULE)")
    out = []
    for name in chosen:
        spec = registry.get(name)
        if warm is not None and warm > spec.max_concurrency:
            # said before the packaging, as the decorator says it of its own warm: Lambda
            # refuses provisioned above reserved concurrency (--reserved caps at
            # max_concurrency; terraform's validation said so after the packaging), and
            # without the cap a warm pool larger than the function's own bound is billed idle
            raise DeployError(
                f"{name}: --warm {warm} is more than its max_concurrency={spec.max_concurrency} (Lambda's "
                "reserved concurrency with --reserved, Modal's max_containers; neither takes more warm "
                "instances): pass a smaller --warm, or --keep-warm for each function's own warm"
            )
        module, source = _module_of(spec)
        out.append(
            DeployedFunction(
                name=name,
                deployed_name=prefix + name,
                module=module,
                source_file=source,
                memory_mb=spec.memory_mb,
                timeout_s=max(1, math.ceil(spec.timeout_s)),
                warm=spec.warm if warm is None else warm,
                reserved_concurrency=spec.max_concurrency if reserved else -1,
                description=(spec.description or f"rl-fabric {spec.kind} {name}")[:256],
                version=spec.version,
                gpu=spec.resources.gpu,
                cpu=spec.resources.cpu,
                max_attempts=spec.retry.max_attempts,
            )
        )
    too_long = [f.deployed_name for f in out if len(f.deployed_name) > 64]
    if too_long:
        raise DeployError(
            f"Lambda names are at most 64 characters: {', '.join(too_long)}; use a shorter --prefix"
        )
    return out
