"""Cache tiers, fastest first: ``disk`` (L1), ``s3`` or ``peer`` (L2), ``mirror`` (L3),
``origin`` (L4). ``make_tier`` builds one from its typed config; SDKs load lazily."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from envpool.images.tiers.base import Tier, TierConfigBase, TierMetrics
from envpool.images.tiers.disk import DiskTier, DiskTierConfig
from envpool.images.tiers.http import (
    HttpTier,
    HttpTierConfig,
    MirrorTierConfig,
    OriginTierConfig,
    PeerTierConfig,
)
from envpool.images.tiers.s3 import S3Tier, S3TierConfig

TierConfig = Annotated[
    DiskTierConfig | S3TierConfig | PeerTierConfig | MirrorTierConfig | OriginTierConfig,
    Field(discriminator="type"),
]
_adapter: TypeAdapter[Any] = TypeAdapter(TierConfig)


def make_tier(config: TierConfigBase | dict[str, Any]) -> Tier:
    """A tier from its config (object or dict with a ``type``)."""
    cfg = config if isinstance(config, TierConfigBase) else _adapter.validate_python(config)
    if isinstance(cfg, DiskTierConfig):
        return DiskTier(cfg)
    if isinstance(cfg, S3TierConfig):
        return S3Tier(cfg)
    if isinstance(cfg, PeerTierConfig | MirrorTierConfig | OriginTierConfig):
        return HttpTier(cfg)
    raise TypeError(f"no tier for config {type(cfg).__name__}")


__all__ = [
    "DiskTier",
    "DiskTierConfig",
    "HttpTier",
    "HttpTierConfig",
    "MirrorTierConfig",
    "OriginTierConfig",
    "PeerTierConfig",
    "S3Tier",
    "S3TierConfig",
    "Tier",
    "TierConfig",
    "TierConfigBase",
    "TierMetrics",
    "make_tier",
]
