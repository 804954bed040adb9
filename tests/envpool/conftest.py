import pytest
from echo_bundle import DirImages, write_bundle


@pytest.fixture
def images(tmp_path):
    """The echo bundle in a directory, served as an image resolver."""
    return DirImages(write_bundle(tmp_path / "bundle"))
