"""envpool's image fetch, reviewed (17).

* A remote container's fetch (``envpool.server.fetch_image``: Kubernetes, Modal, Docker)
  streams the blob into a disk tier in its own work directory, a chunk at a time, and unpacks
  it from that file. It had an HTTP tier alone, so the whole image was read into memory
  there: a multi-GB image could take the container down (OOM). It leaves the unpacked bundle
  alone behind (the blob, spent, is removed); a failed fetch leaves nothing.
* The disk tier hashes a streamed blob's chunks in the thread that writes them, not on the
  event loop, where each 1 MiB chunk stalled every other session's I/O for a millisecond or two.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from image_cache_helpers import make_tree
from test_envpool_review17b import CHUNK, _forbid_whole_blobs, _serve

import envpool.images.tiers.disk as disk_mod
from envpool.images import Bundle, DigestMismatch, DiskTier, DiskTierConfig, ImageFetchError, build_bundle
from envpool.server import fetch_image


@pytest.fixture
def big(tmp_path: Path) -> Bundle:
    """A bundle of many chunks (random: gzip cannot shrink it under one)."""
    return build_bundle(make_tree(tmp_path / "src", payload=os.urandom(64 * 1024)))


@pytest.fixture
def container_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The container's temp dir, where its fetch makes its work directory."""
    tmp = tmp_path / "container-tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


async def test_a_remote_containers_fetch_streams_the_blob_to_disk(
    container_tmp: Path, big: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = _forbid_whole_blobs(monkeypatch)
    server = await _serve(big.data)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        # (its own loop, in a thread: this one serves the blob meanwhile)
        root = await asyncio.to_thread(fetch_image, big.digest, url)
    assert (root / "pkg" / "data" / "blob.bin").stat().st_size == 64 * 1024
    assert (root / "run.sh").is_file()
    assert len(written) > 1 and max(written) < big.size and sum(written) == big.size
    # its work directory holds the unpacked bundle alone: the blob it was streamed into is gone
    [work] = _names(container_tmp)
    assert root.parents[1] == container_tmp / work
    assert _names(container_tmp / work) == ["sha256"]
    assert [n for n in _names(root.parent) if not n.startswith(".")] == [root.name]


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("how", ["cut-off", "corrupt", "over-cap"])
async def test_a_remote_containers_failed_fetch_leaves_nothing(
    container_tmp: Path, big: Bundle, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    written = _forbid_whole_blobs(monkeypatch)
    body = big.data[:-1] + bytes([big.data[-1] ^ 1]) if how == "corrupt" else big.data
    server = await _serve(body, cut_at=big.size // 2 if how == "cut-off" else None)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    cap = big.size // 3 if how == "over-cap" else None
    async with server:
        with pytest.raises(ImageFetchError) as e:
            await asyncio.to_thread(fetch_image, big.digest, url, max_blob_bytes=cap)
    said = {"cut-off": "RemoteProtocolError", "corrupt": "hashing to", "over-cap": "max_blob_bytes"}[how]
    assert said in str(e.value)
    assert written  # (it streamed some of it to disk: then stopped)
    assert _names(container_tmp) == []


# -- hashing off the loop


class _Sha256Spy:
    """hashlib.sha256, noting the thread of each ``update``."""

    def __init__(self, threads: list[int]):
        self._h = hashlib.sha256()
        self._threads = threads

    def update(self, data: bytes) -> None:
        self._threads.append(threading.get_ident())
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


@pytest.fixture
def hashed_on(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The threads the disk tier hashed each chunk in."""
    threads: list[int] = []
    monkeypatch.setattr(disk_mod, "hashlib", SimpleNamespace(sha256=lambda: _Sha256Spy(threads)))
    return threads


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(data), CHUNK):
        yield data[i : i + CHUNK]


async def test_a_streamed_blob_is_hashed_off_the_event_loop(
    tmp_path: Path, big: Bundle, hashed_on: list[int]
) -> None:
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1")) as disk:
        with await disk.put_stream(big.digest, _chunks(big.data), source="test") as f:
            assert f.read() == big.data
        assert disk.path_of(big.digest).read_bytes() == big.data
    assert len(hashed_on) == -(-big.size // CHUNK)
    assert threading.get_ident() not in hashed_on


@pytest.mark.parametrize("how", ["corrupt", "over-cap"])
async def test_a_blob_hashed_off_the_loop_is_still_checked_and_capped(
    tmp_path: Path, big: Bundle, hashed_on: list[int], how: str
) -> None:
    cap = big.size - 1 if how == "over-cap" else 2**30
    body = big.data[:-1] + bytes([big.data[-1] ^ 1]) if how == "corrupt" else big.data
    async with DiskTier(DiskTierConfig(path=tmp_path / "l1", max_bytes=cap)) as disk:
        if how == "corrupt":
            with pytest.raises(DigestMismatch, match="hashing to"):
                await disk.put_stream(big.digest, _chunks(body), source="test")
        else:  # handed over, open, but not kept
            with await disk.put_stream(big.digest, _chunks(body), source="test") as f:
                assert f.read() == big.data
        assert big.digest not in disk
    assert _names(tmp_path / "l1" / "sha256") == []
    assert hashed_on and threading.get_ident() not in hashed_on
