"""What the image cache's test modules (test_image_*.py) share: a source tree to bundle,
a two-tier cache (L1 disk over an HTTP origin) with fast retries, a bounded poll, and
hand-made tarballs. The ``bundle`` fixture (of ``make_tree``) is in conftest.py."""

from __future__ import annotations

import asyncio
import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

from envpool.images import (
    DiskTier,
    DiskTierConfig,
    HttpTier,
    OriginTierConfig,
    RetryPolicy,
    TieredCache,
)

FAST_RETRY = RetryPolicy(attempts=4, backoff_s=0.001, max_backoff_s=0.01)


def make_tree(root: Path, *, payload: bytes = b"x" * 1000) -> Path:
    (root / "pkg" / "data").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("VALUE = 42\n")
    (root / "pkg" / "data" / "blob.bin").write_bytes(payload)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    os.symlink("pkg/__init__.py", root / "link.py")
    return root


def cache_with(
    tmp_path: Path, origin_url: str, *, node: str = "a", retry: RetryPolicy = FAST_RETRY
) -> TieredCache:
    return TieredCache(
        [
            DiskTier(DiskTierConfig(path=tmp_path / node / "l1", max_bytes=10 * 2**20)),
            HttpTier(OriginTierConfig(url=origin_url)),
        ],
        unpack_dir=tmp_path / node / "unpacked",
        retry=retry,
    )


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


def tar_gz(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def member(name: str, *, type: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = type
    info.linkname = linkname
    info.mode = 0o644
    return info
