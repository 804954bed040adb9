"""Tiers reached over HTTP: a peer node (L2), a registry mirror (L3), the origin (L4).

All three answer ``GET {url}/blobs/sha256:<hex>`` with the blob, or 404. They are read-only
to the cache. httpx's transport errors (refused, reset, timeout, a body cut short), a body
that does not decode (a garbled compressed reply) and 5xx/429 answers are retryable; any
other status is a configuration problem and is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import httpx
from pydantic import Field, field_validator

from envpool.images.errors import ImageFetchError
from envpool.images.tiers.base import DEFAULT_MAX_BLOB_BYTES as DEFAULT_MAX_BLOB_BYTES  # (envpool.server's)
from envpool.images.tiers.base import FetchingTierConfig, Tier, blob_too_big


class HttpTierConfig(FetchingTierConfig):
    url: str
    """Base URL; blobs are fetched from ``{url}/blobs/sha256:<hex>``."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        # refused here: httpx fails such a URL on every request with an error the cache
        # takes for a transport fault, retried with backoff on every get
        try:
            url = httpx.URL(v)
        except httpx.InvalidURL as e:
            raise ValueError(f"url {v!r} is not a valid URL: {e}") from None
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"url {v!r} must be http:// or https:// with a host, e.g. http://mirror:5000")
        return v

    timeout_s: float = Field(120.0, gt=0)
    """Read timeout: the longest silence tolerated mid-download."""
    connect_timeout_s: float = Field(5.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)
    """Sent with every request (e.g. ``Authorization`` for a private registry)."""
    max_connections: int = Field(64, ge=1)


class PeerTierConfig(HttpTierConfig):
    """Another node of the cluster serving its L1 blobs."""

    type: Literal["peer"] = "peer"


class MirrorTierConfig(HttpTierConfig):
    """A registry mirror near the cluster."""

    type: Literal["mirror"] = "mirror"


class OriginTierConfig(HttpTierConfig):
    """Where images are published: the source of truth."""

    type: Literal["origin"] = "origin"


class HttpTier(Tier):
    kind = "http"
    writable = False

    def __init__(self, config: PeerTierConfig | MirrorTierConfig | OriginTierConfig):
        super().__init__(config.name or config.type)
        self.config = config
        self._client: httpx.AsyncClient | None = None

    async def _start(self) -> None:
        c = self.config
        self._client = httpx.AsyncClient(
            base_url=c.url.rstrip("/"),
            headers=c.headers,
            timeout=httpx.Timeout(c.timeout_s, connect=c.connect_timeout_s),
            limits=httpx.Limits(max_connections=c.max_connections),
        )

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _get(self, digest: str) -> bytes | None:
        async with self._stream(digest) as chunks:
            return None if chunks is None else b"".join([c async for c in chunks])

    @contextlib.asynccontextmanager
    async def _stream(self, digest: str) -> AsyncIterator[AsyncIterator[bytes] | None]:
        assert self._client is not None
        with self._translated(digest):
            async with self._client.stream("GET", f"/blobs/{digest}") as resp:
                if resp.status_code == 404:
                    yield None
                    return
                if resp.status_code != 200:
                    raise _status_error(resp, self.name)
                yield self._body(resp, digest)

    @contextlib.contextmanager
    def _translated(self, digest: str) -> Iterator[None]:
        """httpx's faults as ours: the one place they are translated."""
        try:
            yield
        except httpx.TransportError as e:
            raise ImageFetchError(f"{type(e).__name__} fetching {digest}: {e}", tier=self.name) from e
        except httpx.DecodingError as e:
            # not a TransportError in httpx, but a fault on the way all the same (a proxy that
            # mangled a compressed reply, a body cut inside its compression): retried
            raise ImageFetchError(
                f"the reply fetching {digest} could not be decoded (its body does not match its "
                f"Content-Encoding): {e}",
                tier=self.name,
            ) from e

    async def _body(self, resp: httpx.Response, digest: str) -> AsyncIterator[bytes]:
        """The reply's body a chunk at a time, up to ``max_blob_bytes`` and no further."""
        cap = self.config.max_blob_bytes
        length = resp.headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            raise self._too_big(resp, digest, f"its Content-Length says {int(length):,} bytes")
        size = 0
        with self._translated(digest):  # (a body cut short: raised as it is read, by whoever reads)
            async for chunk in resp.aiter_bytes():  # (after its Content-Encoding: counted as decoded)
                size += len(chunk)
                if size > cap:
                    raise self._too_big(resp, digest, f"its body ran past {cap:,} bytes")
                yield chunk

    def _too_big(self, resp: httpx.Response, digest: str, why: str) -> ImageFetchError:
        return blob_too_big(self.name, self.config.max_blob_bytes, digest, resp.request.url, why)


def _status_error(resp: httpx.Response, tier: str) -> ImageFetchError:
    status = resp.status_code
    where: Any = resp.request.url
    if status in (401, 403):
        return ImageFetchError(
            f"HTTP {status} from {where}: check the credentials in the tier's headers",
            tier=tier,
            retryable=False,
        )
    retryable = status >= 500 or status in (408, 429)
    return ImageFetchError(f"HTTP {status} from {where}", tier=tier, retryable=retryable)
