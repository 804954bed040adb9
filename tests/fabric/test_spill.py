"""fabric.spill's reading side: what a pointer that cannot be resolved says (the handler's
end to end path is tests/functions/test_handler_spill.py)."""

from __future__ import annotations

import time

import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

from fabric.spill import SPILL_KEY, SpillError, fetch, pointer


class RefusingS3:
    """An S3 client whose get_object fails as S3 answers it."""

    def __init__(self, code: str, message: str, status: int):
        self.error = {
            "Error": {"Code": code, "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": status},
        }

    def get_object(self, **_: object) -> dict:
        raise ClientError(self.error, "GetObject")


def _pointer(**extra: object) -> dict:
    p = pointer("spill-bucket", "spill/t/r1.json", b'{"a": 1}')
    del p[SPILL_KEY]["spilled_at"]  # as an older client's pointer, unless given
    p[SPILL_KEY].update(extra)
    return p


def test_a_request_that_expired_says_so_not_no_permission():
    # a presigned URL or credentials past their lifetime: S3 answers 403 AccessDenied
    # "Request has expired", which read as a permission the role lacks
    with pytest.raises(SpillError) as e:
        fetch(RefusingS3("AccessDenied", "Request has expired", 403), _pointer())
    text = str(e.value)
    assert "expired" in text and "no permission" not in text
    assert "again" in text  # what to do: a new call spills the payload anew
    assert e.value.retryable


def test_an_object_gone_with_the_lifecycle_rule_reads_as_expired_not_no_permission():
    # the deployment's role may s3:GetObject spill/* and no more: without s3:ListBucket S3
    # answers a missing key 403 AccessDenied, not 404 NoSuchKey. A pointer spilled a day or
    # more ago (the lifecycle rule deletes spill/ after spill_expiration_days >= 1) is expired
    old = _pointer(spilled_at=time.time() - 8 * 86400)
    with pytest.raises(SpillError) as e:
        fetch(RefusingS3("AccessDenied", "Access Denied", 403), old)
    text = str(e.value)
    assert "expired" in text and "spill_expiration_days" in text and "no permission" not in text
    assert "8 days ago" in text
    assert e.value.retryable  # the client's retry spills the payload again


def test_a_fresh_pointer_refused_is_a_missing_permission():
    # spilled moments ago, so no lifecycle rule has deleted it: the role may not read it
    fresh = _pointer(spilled_at=time.time() - 5)
    with pytest.raises(SpillError) as e:
        fetch(RefusingS3("AccessDenied", "Access Denied", 403), fresh)
    text = str(e.value)
    assert "s3:GetObject" in text and "expired" not in text
    assert not e.value.retryable


def test_a_pointer_of_unknown_age_refused_names_both_causes():
    # spilled by an older client (no spilled_at): either cause, each with what to do
    with pytest.raises(SpillError) as e:
        fetch(RefusingS3("AccessDenied", "Access Denied", 403), _pointer())
    text = str(e.value)
    assert "expired" in text and "s3:GetObject" in text and "again" in text


def test_pointers_carry_when_they_were_spilled():
    t0 = time.time()
    p = pointer("b", "k", b"{}")[SPILL_KEY]
    assert t0 - 1 <= p["spilled_at"] <= time.time() + 1


def test_a_missing_object_spilled_days_ago_expired_and_one_spilled_now_was_never_there():
    # a reader that may list the bucket gets 404 NoSuchKey: final for a pointer to a key that
    # was never written, retryable (the next attempt spills anew) for one the rule deleted
    with pytest.raises(SpillError) as e:
        fetch(
            RefusingS3("NoSuchKey", "The specified key does not exist.", 404),
            _pointer(spilled_at=time.time() - 3 * 86400),
        )
    assert "expired" in str(e.value) and "again" in str(e.value) and e.value.retryable
    with pytest.raises(SpillError) as e:
        fetch(
            RefusingS3("NoSuchKey", "The specified key does not exist.", 404),
            _pointer(spilled_at=time.time()),
        )
    assert "not found" in str(e.value) and not e.value.retryable


class FailingS3:
    """An S3 client whose read fails in transport, as botocore raises it."""

    def __init__(self, error: Exception):
        self.error = error

    def get_object(self, **_: object) -> dict:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        ReadTimeoutError(endpoint_url="https://s3.amazonaws.com"),
        ConnectionClosedError(endpoint_url="https://s3.amazonaws.com"),
        EndpointConnectionError(endpoint_url="https://s3.amazonaws.com"),
    ],
)
def test_a_transport_failure_is_a_retryable_spill_error(error):
    # botocore's transport errors carry response=None: reading a code from it raised
    # AttributeError, which escaped the handler instead of answering a retryable failure
    with pytest.raises(SpillError) as e:
        fetch(FailingS3(error), _pointer(spilled_at=time.time()))
    assert e.value.retryable and not e.value.resend
    assert "cannot read the spilled payload" in str(e.value)
