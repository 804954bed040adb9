"""Errors of the image cache.

    ImageError                  (an EnvPoolError)
    ├── InvalidImageRef         not ``name@sha256:<64 hex>`` or ``sha256:<64 hex>``
    ├── ImageNotFound           no tier has the blob: a wrong reference, never retried
    ├── UnsafeBundle            a path escaping the root, a device file, an outside link
    └── ImageFetchError         a tier failed (transport fault, 5xx); also an InfraError
        └── DigestMismatch      bytes that do not hash to their digest (corrupted download)

``ImageFetchError.retryable`` is False for faults a retry cannot fix (a 403, a missing
bucket); the cache retries the rest with backoff and full jitter.
"""

from __future__ import annotations

from envpool.errors import EnvPoolError, InfraError


class ImageError(EnvPoolError):
    """Base class of the image cache's errors."""


class InvalidImageRef(ImageError, ValueError):
    """Not ``name@sha256:<64 hex>`` or ``sha256:<64 hex>``."""


class ImageNotFound(ImageError):
    def __init__(self, digest: str, tiers: list[str]):
        self.digest = digest
        self.tiers = tiers
        super().__init__(
            f"image {digest} is in none of the tiers ({', '.join(tiers) or 'none configured'}); "
            "check the reference, or publish the bundle to the origin (envpool.images.build_bundle)"
        )


class UnsafeBundle(ImageError):
    """A bundle path escaping its root, a device file or an outside link."""


class ImageFetchError(InfraError, ImageError):
    def __init__(self, message: str, *, tier: str = "", retryable: bool = True):
        self.tier = tier
        self.retryable = retryable
        super().__init__(f"{tier}: {message}" if tier else message)


class DigestMismatch(ImageFetchError):
    def __init__(self, expected: str, actual: str, *, tier: str = ""):
        self.expected = expected
        self.actual = actual
        # retryable: a flipped bit in transit is the common cause; a mirror holding the
        # wrong bytes keeps failing and surfaces once the attempts are spent
        super().__init__(
            f"got bytes hashing to {actual}, expected {expected} (corrupted download, or the "
            "source holds the wrong blob for this digest)",
            tier=tier,
        )
