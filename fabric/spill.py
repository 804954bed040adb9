"""Payloads over Lambda's 6 MB go through S3: the invocation carries a pointer instead.

The lambda backend (``LambdaConfig.spill_bucket``) uploads the payload's JSON to
``s3://BUCKET/spill/<tenant>/<request id>.json`` and sends ``{"__fabric_spill__": {bucket,
key, bytes, sha256, spilled_at}}`` as the payload; the Lambda handler fetches it, checks its
size and hash, and runs the function on it. The bucket's lifecycle rule (terraform's storage
module) deletes spilled payloads after ``spill_expiration_days`` (at least 1).

The deployment's role may ``s3:GetObject`` on ``spill/*`` and nothing else, so S3 answers a
read of an object that is gone with 403 AccessDenied, as for one the role may not read (it
says 404 only to a reader that may list the bucket). ``spilled_at`` tells them apart: a
payload spilled under a day ago cannot have expired.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from fabric.errors import pickled_whole

SPILL_KEY = "__fabric_spill__"
BUCKET_ENV = "RL_FABRIC_SPILL_BUCKET"
#: The lifecycle rule's shortest expiry (``spill_expiration_days`` >= 1): S3 deletes an object
#: no sooner than this after it was written.
_MIN_EXPIRY_S = 86400.0
#: What a call whose spilled payload expired should do.
_SEND_AGAIN = (
    "send the call again: the client uploads the payload anew with each call (and each retry); if "
    "calls wait longer than that (an SQS backlog), raise terraform's spill_expiration_days"
)


class SpillError(Exception):
    """A pointer that cannot be resolved: ``retryable`` says whether trying again may help;
    ``resend`` that only a new call does (the payload expired: the caller uploads it anew),
    not another read of the same pointer (an SQS record delivered again)."""

    def __init__(self, message: str, *, retryable: bool, resend: bool = False):
        super().__init__(message)
        self.retryable = retryable
        self.resend = resend

    def __reduce__(self) -> tuple[Any, ...]:
        return pickled_whole(self)  # ``retryable`` is required: type(*args) cannot rebuild it


def pointer(bucket: str, key: str, raw: bytes) -> dict[str, Any]:
    return {
        SPILL_KEY: {
            "bucket": bucket,
            "key": key,
            "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
            # when: a read refused later tells an expired object from a missing permission
            "spilled_at": round(time.time(), 3),
        }
    }


def spill_key(prefix: str, tenant: str, request_id: str) -> str:
    return f"{prefix.rstrip('/')}/{tenant}/{request_id}.json"


def is_pointer(payload: Any) -> bool:
    return isinstance(payload, dict) and len(payload) == 1 and isinstance(payload.get(SPILL_KEY), dict)


def aws_error(e: BaseException) -> dict[str, Any]:
    """The ``Error`` part (``Code``, ``Message``) of a botocore error's answer, or ``{}``. A
    ClientError's ``response`` is the service's answer; botocore's transport errors (a read
    timeout, a connection closed) carry ``response=None``, and reading a code from that
    raised AttributeError where the caller meant to answer a retryable failure."""
    response = getattr(e, "response", None)
    error = response.get("Error") if isinstance(response, dict) else None
    return error if isinstance(error, dict) else {}


def fetch(s3: Any, payload: dict[str, Any], *, only_bucket: str | None = None) -> bytes:
    """The spilled payload's bytes, checked against the pointer. With ``only_bucket`` (the
    deployment's spill bucket, ``$RL_FABRIC_SPILL_BUCKET``), a pointer elsewhere is refused:
    a caller must not make the function read whatever else its role can."""
    p = payload[SPILL_KEY]
    bucket, key = p.get("bucket"), p.get("key")
    if not isinstance(bucket, str) or not isinstance(key, str):
        raise SpillError(f"a spill pointer needs a bucket and a key, got {p!r}", retryable=False)
    if only_bucket is not None and bucket != only_bucket:
        raise SpillError(
            f"spilled payloads are read from s3://{only_bucket} only, not {bucket!r}", retryable=False
        )
    where = f"s3://{bucket}/{key}"
    try:
        raw: bytes = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as e:
        error = aws_error(e)
        code = error.get("Code", "")
        age = time.time() - p["spilled_at"] if isinstance(p.get("spilled_at"), int | float) else None
        if code in ("NoSuchKey", "NoSuchBucket", "404"):
            if age is not None and age >= _MIN_EXPIRY_S:
                raise SpillError(
                    f"{_expired(where)}, spilled {_ago(age)}; {_SEND_AGAIN}", retryable=True, resend=True
                ) from None
            raise SpillError(
                f"spilled payload {where} not found (expired by the bucket's lifecycle rule?)",
                retryable=False,
            ) from None
        if code in ("AccessDenied", "403"):
            message = str(error.get("Message", ""))
            raise _refused(where, message, age) from None
        raise SpillError(f"cannot read the spilled payload {where}: {e}", retryable=True) from None
    if len(raw) != p.get("bytes") or hashlib.sha256(raw).hexdigest() != p.get("sha256"):
        raise SpillError(
            f"spilled payload {where} does not match its pointer (size or sha256)", retryable=False
        )
    return raw


def _expired(where: str) -> str:
    return (
        f"spilled payload {where} is gone: it expired (the bucket's lifecycle rule deletes spill/ after "
        "spill_expiration_days)"
    )


def _refused(where: str, message: str, age: float | None) -> SpillError:
    """What a 403 on a spilled payload means: a request that expired (a presigned URL, a
    credential), an object the lifecycle rule deleted (a 403 to a reader that may not list
    the bucket), or a role without ``s3:GetObject`` there, told apart by the pointer's age
    (``None``: an older client's pointer, without ``spilled_at``). An expired payload is
    retryable: the client's next attempt spills it again."""
    if "expired" in message.lower():
        return SpillError(
            f"the request to read the spilled payload {where} expired ({message}); {_SEND_AGAIN}",
            retryable=True,
            resend=True,
        )
    missing = (
        "S3 answers 403 AccessDenied, not 404, for a missing object to a reader that may not list the bucket"
    )
    denied = (
        f"the function's role may not read {where} (403 AccessDenied): grant it s3:GetObject on the "
        "bucket's spill/* (terraform's functions module does), or point LambdaConfig.spill_bucket at "
        "the deployment's bucket"
    )
    if age is None:
        return SpillError(
            f"cannot read the spilled payload {where}: 403 AccessDenied. Most likely it expired (the "
            f"bucket's lifecycle rule deleted it; {missing}): {_SEND_AGAIN}. "
            f"If fresh calls fail too, {denied}",
            retryable=True,
            resend=True,
        )
    if age >= _MIN_EXPIRY_S:
        return SpillError(
            f"{_expired(where)} ({missing}), spilled {_ago(age)}; {_SEND_AGAIN}", retryable=True, resend=True
        )
    return SpillError(
        f"{denied}; it was spilled {_ago(age)}, too recently for the lifecycle rule to have deleted it",
        retryable=False,
    )


def _ago(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.0f} days ago"
    if seconds >= 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{max(seconds, 0):.0f} s ago"
