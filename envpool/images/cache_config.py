"""The settings of a ``TieredCache`` (``envpool.images.cache``): its tiers, where bundles
unpack, how a fetch is retried (``RetryPolicy``), and the bounds on unpacked bytes."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from envpool.images.tiers import TierConfig


class RetryPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")

    attempts: int = Field(4, ge=1)
    """Walks of the tiers per fetch, the first included."""
    backoff_s: float = Field(0.2, ge=0)
    """Scale of the exponential backoff; each wait is uniform in [0, backoff_s * 2**n]."""
    max_backoff_s: float = Field(10.0, ge=0)
    deadline_s: float | None = Field(600.0, gt=0)
    """No new attempt starts after this long (None: attempts alone bound it)."""


DEFAULT_UNPACKED_BUDGET = 20 * 2**30
DEFAULT_MAX_UNPACKED_BYTES = 8 * 2**30
"""The default bound of one bundle's unpacked size: four times the default bound of a blob
an HTTP tier downloads (``max_blob_bytes``), a generous ratio for gzip of code and data,
and well under the default ``unpacked_budget_bytes``."""


class CacheConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tiers: list[TierConfig] = Field(min_length=1)
    """Fastest first, e.g. disk, s3, mirror, origin. The last one is the source of truth."""
    unpack_dir: Path
    """Unpacked bundles live at ``<unpack_dir>/sha256/<hex>``, one copy per node."""
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    max_concurrent_fetches: int = Field(8, ge=1)
    """Downloads of distinct images at once (a big prefetch must not starve a reset)."""
    max_unpacked_bytes: int | None = Field(DEFAULT_MAX_UNPACKED_BYTES, gt=0)
    """Refuse bundles that unpack to more than this (8 GiB by default; None: no limit): a
    decompression bomb of a few MB that would fill the disk is refused as its headers are
    read, before anything is written (``UnsafeBundle``, naming this key). Each member
    counts its bytes in whole 4 KiB blocks, one at least (an empty file or directory too)."""
    unpacked_budget_bytes: int | None = Field(DEFAULT_UNPACKED_BUDGET, gt=0)
    """Disk the unpacked bundles of ``unpack_dir`` may take (20 GiB by default; None: no
    limit). Past it, the least recently used bundles are deleted after each unpack, never
    one pinned by a live container (``acquire``: here or in another process sharing the
    directory), so it may be exceeded while everything left is in use; what was over is
    evicted as soon as this process releases a pin, or within a second of another process
    releasing its pin. Enforced per process."""
