"""Payloads over Lambda's 6 MB go through S3: the invocation carries a pointer instead.

The lambda backend (``LambdaConfig.spill_bucket``) uploads the payload's JSON to
``s3://BUCKET/spill/<tenant>/<request id>.json`` and sends ``{"__fabric_spill__": {bucket,
key, bytes, sha256}}`` as the payload; the Lambda handler fetches it, checks its size and
hash, and runs the function on it. The bucket's lifecycle rule (terraform's storage
module) deletes spilled payloads after a few days.
"""

from __future__ import annotations

import hashlib
from typing import Any

SPILL_KEY = "__fabric_spill__"
BUCKET_ENV = "RL_FABRIC_SPILL_BUCKET"


class SpillError(Exception):
    """A pointer that cannot be resolved: ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


def pointer(bucket: str, key: str, raw: bytes) -> dict[str, Any]:
    return {
        SPILL_KEY: {
            "bucket": bucket,
            "key": key,
            "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
        }
    }


def spill_key(prefix: str, tenant: str, request_id: str) -> str:
    return f"{prefix.rstrip('/')}/{tenant}/{request_id}.json"


def is_pointer(payload: Any) -> bool:
    return isinstance(payload, dict) and len(payload) == 1 and isinstance(payload.get(SPILL_KEY), dict)


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
        code = getattr(e, "response", {}).get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "NoSuchBucket", "404"):
            raise SpillError(
                f"spilled payload {where} not found (expired by the bucket's lifecycle rule?)",
                retryable=False,
            ) from None
        if code in ("AccessDenied", "403"):
            raise SpillError(f"no permission to read the spilled payload {where}", retryable=False) from None
        raise SpillError(f"cannot read the spilled payload {where}: {e}", retryable=True) from None
    if len(raw) != p.get("bytes") or hashlib.sha256(raw).hexdigest() != p.get("sha256"):
        raise SpillError(
            f"spilled payload {where} does not match its pointer (size or sha256)", retryable=False
        )
    return raw
