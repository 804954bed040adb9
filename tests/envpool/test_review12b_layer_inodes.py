"""A container's layer in memory (``private_view``'s tmpfs, where the scratch's file system
takes no upper dir) is bounded by ``memory_layer_bytes`` in files as well as in bytes. A
tmpfs's ``size`` counts data pages only: its default ``nr_inodes`` is half the host's pages,
so a container creating empty files (or directories, or symlinks) held kernel memory the
bound never counted, millions of inodes on a large host, where on disk the file system's
blocks bound them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.envpool.test_image_private_view_on_overlayfs import _PRELUDE, _image_src, _mounts, _run

_FILL = (
    _PRELUDE
    + r"""
import shutil
root, src, bound, count = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
where = on_overlayfs(root)
bundle, scratch = where / "bundle", where / "scratch"
shutil.copytree(src, bundle)
scratch.mkdir()
view, how = isolation.private_view(bundle, scratch, memory_layer_bytes=bound)
out = {"how": how, "made": 0, "error": None}
for n in range(count):
    try:
        (view / f"empty-{n}").touch()
    except OSError as e:
        out["error"] = errno.errorcode[e.errno]
        break
    out["made"] = n + 1
print(json.dumps(out))
"""
)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the overlayfs under the runtime needs root here")
def test_the_layer_in_memory_bounds_the_files_a_container_makes_not_only_their_bytes(tmp_path: Path) -> None:
    root = tmp_path / "ns"
    root.mkdir()
    # 1 MiB: as many files as the pages the bound holds (256), not the host's millions
    seen = _run(_FILL, str(root), str(_image_src(tmp_path / "src")), str(2**20), "5000")
    assert seen["how"] == "overlay"
    assert seen["error"] == "ENOSPC", seen
    assert 0 < seen["made"] <= 2**20 // 4096
    assert str(tmp_path) not in _mounts()
