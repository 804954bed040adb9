"""Content-addressed environment images and the tiered cache that fetches them.

An image is a bundle: a deterministic tar.gz of a directory, named ``name@sha256:<hex>`` by
the digest of its bytes. ``TieredCache`` finds it in the nearest tier (node disk, S3 or a peer,
a registry mirror, the origin), verifies it, and unpacks it once per node.
"""

from envpool.images.bundle import (
    Bundle,
    ImageRef,
    build_bundle,
    digest_of,
    parse_digest,
    unpack,
    verify,
)
from envpool.images.cache import CacheConfig, RetryPolicy, TieredCache
from envpool.images.errors import (
    DigestMismatch,
    ImageError,
    ImageFetchError,
    ImageNotFound,
    InvalidImageRef,
    UnsafeBundle,
)
from envpool.images.tiers import (
    DiskTier,
    DiskTierConfig,
    HttpTier,
    MirrorTierConfig,
    OriginTierConfig,
    PeerTierConfig,
    S3Tier,
    S3TierConfig,
    Tier,
    TierConfig,
    make_tier,
)

__all__ = [
    "Bundle",
    "CacheConfig",
    "DigestMismatch",
    "DiskTier",
    "DiskTierConfig",
    "HttpTier",
    "ImageError",
    "ImageFetchError",
    "ImageNotFound",
    "ImageRef",
    "InvalidImageRef",
    "MirrorTierConfig",
    "OriginTierConfig",
    "PeerTierConfig",
    "RetryPolicy",
    "S3Tier",
    "S3TierConfig",
    "Tier",
    "TierConfig",
    "TieredCache",
    "UnsafeBundle",
    "build_bundle",
    "digest_of",
    "make_tier",
    "parse_digest",
    "unpack",
    "verify",
]
