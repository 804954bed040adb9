"""What a non-root container's overlay leaves in its directory can be removed by the
runtime's owner. The kernel makes the overlay's ``work/work`` with mode 0: root removes it
regardless, but a runtime of no privilege (whose containers get the overlay since their uid
is mapped in their user namespace) could neither list nor empty it, and the container's
directory was left behind at every stop (``shutil.rmtree(..., ignore_errors=True)``)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.envpool.test_image_private_view_on_overlayfs import _image_src, _mounts, _run

_DROP = r"""
import ctypes, json, os, shutil, sys
from pathlib import Path
import envpool.isolation as isolation

bundle, scratch, uid, what = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE
if what == "container":
    level = isolation.isolate_network()
    if level != "userns+netns":
        print(json.dumps({"skip": f"no user namespace for an unprivileged user here ({level})"}))
        sys.exit(0)
    view, how = isolation.private_view(bundle, scratch)
    (view / "out.txt").write_text("output")
    print(json.dumps({"how": how}))
else:  # the runtime's removal of a stopped container's directory, as its owner
    # the runtime's removal of a stopped container's directory
    isolation.remove_scratch(scratch)
    print(json.dumps({"left": sorted(str(p) for p in scratch.rglob("*")) if scratch.exists() else None}))
"""


@pytest.fixture
def open_dir():
    d = Path(tempfile.mkdtemp(prefix="envpool-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="starting a child that drops to a user of no privilege needs root"
)
def test_a_non_root_containers_layer_is_removed_with_its_directory(open_dir: Path) -> None:
    if tuple(int(n) for n in re.findall(r"[0-9]+", os.uname().release)[:2]) < (5, 11):
        pytest.skip("the kernel mounts no overlayfs in a user namespace before 5.11")
    uid = 54321
    bundle, scratch = _image_src(open_dir / "bundle"), open_dir / "scratch"
    scratch.mkdir()
    for p in (open_dir, bundle, *bundle.iterdir(), scratch):  # (the runtime's root is its owner's)
        os.chown(p, uid, uid)
    assert _run(_DROP, str(bundle), str(scratch), str(uid), "container") == {"how": "overlay"}
    assert _run(_DROP, str(bundle), str(scratch), str(uid), "owner") == {"left": None}
    assert str(open_dir) not in _mounts()
