import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from echo_bundle import DirImages, write_bundle
from image_cache_helpers import make_tree

from envpool.images import Bundle, build_bundle


@pytest.fixture
def images(tmp_path):
    """The echo bundle in a directory, served as an image resolver."""
    return DirImages(write_bundle(tmp_path / "bundle"))


@pytest.fixture
def host_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The host's temp dir for the test (ask for it before the fake API or Modal): empty
    again at its end. A pod's or sandbox's /tmp is its own; the fakes' once unpacked their
    fetched images into the host's and left an envpool-image-* dir there per test."""
    host = tmp_path / "host-tmp"
    host.mkdir()
    monkeypatch.setenv("TMPDIR", str(host))
    monkeypatch.setattr(tempfile, "tempdir", str(host))
    yield host
    assert sorted(p.name for p in host.iterdir()) == []


# the image cache's test modules' (test_image_*.py): a bundle of image_cache_helpers.make_tree
@pytest.fixture
def bundle(tmp_path: Path) -> Bundle:
    return build_bundle(make_tree(tmp_path / "src"))


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An S3 bucket "images" on moto, in-process (the image tiers' S3 tests)."""
    moto = pytest.importorskip("moto")
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with moto.mock_aws():
        import boto3

        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="images")
        yield "images"
