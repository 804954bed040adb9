"""L2: a cluster-wide cache in an S3 bucket (or anything speaking S3: MinIO, moto).

boto3 is imported here only, when the tier starts. Its calls block, so they run in threads;
one client is shared (boto3 clients are thread-safe, sessions are not). botocore's own retries
are off: the cache retries with backoff and jitter, and two layers would multiply the waits.
A get reads at most ``max_blob_bytes`` of an object (``FetchingTierConfig``, as HTTP tiers do).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from typing import Any, BinaryIO, Literal

from pydantic import Field

from envpool.images.errors import ImageFetchError
from envpool.images.tiers.base import FetchingTierConfig, Tier, blob_too_big

_MISSING = frozenset({"NoSuchKey", "404", "NotFound"})
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "503"})
_MULTIPART_BYTES = 64 * 2**20
"""Blobs from this size on are stored in parts of it (a single put takes 5 GB at most)."""
_READ_CHUNK = 2**20
"""A blob's body is read this much at a time, counted against ``max_blob_bytes``."""


class S3TierConfig(FetchingTierConfig):
    type: Literal["s3"] = "s3"
    bucket: str
    prefix: str = "envpool/images/"
    """Blobs are stored at ``<prefix>sha256/<hex>``."""
    endpoint_url: str | None = None
    """For MinIO, moto or a VPC endpoint; None means AWS."""
    region: str = "us-east-1"
    max_pool_connections: int = Field(32, ge=1)
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(60.0, gt=0)


class S3Tier(Tier):
    kind = "s3"

    def __init__(self, config: S3TierConfig):
        super().__init__(config.name or config.type)
        self.config = config
        self._client: Any = None

    def key_of(self, digest: str) -> str:
        return f"{self.config.prefix}sha256/{digest.removeprefix('sha256:')}"

    async def _start(self) -> None:
        self._client = await asyncio.to_thread(self._make_client)

    def _make_client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:  # pragma: no cover - depends on the install
            raise ImageFetchError(
                "the s3 tier needs boto3: pip install 'rl-fabric[aws]'", tier=self.name, retryable=False
            ) from None
        c = self.config
        return boto3.session.Session().client(
            "s3",
            region_name=c.region,
            endpoint_url=c.endpoint_url,
            config=Config(
                retries={"total_max_attempts": 1},
                max_pool_connections=c.max_pool_connections,
                connect_timeout=c.connect_timeout_s,
                read_timeout=c.read_timeout_s,
            ),
        )

    async def _close(self) -> None:
        if self._client is not None:
            await asyncio.to_thread(self._client.close)

    async def _get(self, digest: str) -> bytes | None:
        async with self._stream(digest) as chunks:
            return None if chunks is None else b"".join([c async for c in chunks])

    @contextlib.asynccontextmanager
    async def _stream(self, digest: str) -> AsyncIterator[AsyncIterator[bytes] | None]:
        key = self.key_of(digest)
        call = asyncio.ensure_future(
            asyncio.to_thread(self._client.get_object, Bucket=self.config.bucket, Key=key)
        )
        try:
            resp = await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(_close_body)  # (its thread goes on: the body it opens is closed)
            raise
        except Exception as e:
            if _error_code(e) in _MISSING:
                yield None
                return
            raise self._translate(e) from e
        body = resp["Body"]
        try:
            yield self._body(body, resp.get("ContentLength"), digest, key)
        finally:
            await asyncio.to_thread(body.close)  # (a refused body is not drained: its connection is dropped)

    async def _body(self, body: Any, length: int | None, digest: str, key: str) -> AsyncIterator[bytes]:
        """The object's body a chunk at a time (each read in a thread), up to
        ``max_blob_bytes`` and no further."""
        cap = self.config.max_blob_bytes
        where = f"s3://{self.config.bucket}/{key}"
        if length is not None and length > cap:
            raise blob_too_big(self.name, cap, digest, where, f"its ContentLength says {length:,} bytes")
        size = 0
        while True:
            try:
                chunk: bytes = await asyncio.to_thread(body.read, _READ_CHUNK)
            except Exception as e:  # a timeout or a body cut short mid-read
                raise self._translate(e) from e
            if not chunk:
                return
            size += len(chunk)
            if size > cap:  # (a body longer than its ContentLength said, or one without it)
                raise blob_too_big(self.name, cap, digest, where, f"its body ran past {cap:,} bytes")
            yield chunk

    async def _put(self, digest: str, data: bytes) -> None:
        try:
            await asyncio.to_thread(self._put_sync, digest, data)
        except Exception as e:
            raise self._translate(e) from e

    def _put_sync(self, digest: str, data: bytes) -> None:
        if len(data) < _MULTIPART_BYTES:
            self._client.put_object(Bucket=self.config.bucket, Key=self.key_of(digest), Body=data)
            return
        self._upload(digest, io.BytesIO(data))

    async def _put_file(self, digest: str, f: BinaryIO) -> None:
        # from the file, in parts as they are read: never the whole blob in memory
        try:
            await asyncio.to_thread(self._upload, digest, f)
        except Exception as e:
            raise self._translate(e) from e

    def _upload(self, digest: str, f: BinaryIO) -> None:
        # one put_object takes 5 GB at most: a big bundle goes in parts (boto3's transfer)
        from boto3.s3.transfer import TransferConfig

        self._client.upload_fileobj(
            f,
            self.config.bucket,
            self.key_of(digest),
            Config=TransferConfig(
                multipart_threshold=_MULTIPART_BYTES,
                multipart_chunksize=_MULTIPART_BYTES,
                max_concurrency=min(10, self.config.max_pool_connections),
            ),
        )

    async def _delete(self, digest: str) -> None:
        try:
            await asyncio.to_thread(
                self._client.delete_object, Bucket=self.config.bucket, Key=self.key_of(digest)
            )
        except Exception as e:
            raise self._translate(e) from e

    def _translate(self, e: Exception) -> ImageFetchError:
        """The one place botocore's errors become ours."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, ParamValidationError

        if isinstance(e, S3UploadFailedError) and isinstance(e.__context__, Exception):
            e = e.__context__  # boto3's transfer raises it over botocore's own error, as a string
        bucket = self.config.bucket
        if isinstance(e, ParamValidationError):  # refused before it was sent: nothing to retry
            return ImageFetchError(
                f"botocore refused the request: {e}; check S3TierConfig.bucket ({bucket!r}) and prefix",
                tier=self.name,
                retryable=False,
            )
        if isinstance(e, NoCredentialsError):
            return ImageFetchError(
                "no AWS credentials: set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
                tier=self.name,
                retryable=False,
            )
        if isinstance(e, ClientError):
            code = _error_code(e)
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code == "NoSuchBucket":
                return ImageFetchError(
                    f"bucket {bucket!r} does not exist: create it or fix S3TierConfig.bucket",
                    tier=self.name,
                    retryable=False,
                )
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return ImageFetchError(
                    f"access to s3://{bucket}/{self.config.prefix} denied ({code}): check the "
                    "credentials and the bucket policy",
                    tier=self.name,
                    retryable=False,
                )
            retryable = code in _THROTTLED or status >= 500 or status == 429
            return ImageFetchError(f"S3 {code} (HTTP {status})", tier=self.name, retryable=retryable)
        if isinstance(e, BotoCoreError):  # connection refused, timeouts, truncated bodies
            return ImageFetchError(f"S3 transport error: {e}", tier=self.name)
        return ImageFetchError(f"unexpected {type(e).__name__}: {e}", tier=self.name, retryable=False)


def _close_body(call: asyncio.Future[Any]) -> None:
    if not call.cancelled() and call.exception() is None:
        call.result()["Body"].close()


def _error_code(e: Exception) -> str:
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return ""
    return str(response.get("Error", {}).get("Code", ""))
