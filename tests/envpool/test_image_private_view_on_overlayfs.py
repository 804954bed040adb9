"""A container's private view of its image where the container directories' file system is
itself overlayfs: inside Docker, /tmp and the root are, the most common place the process
runtime runs. The kernel takes no overlayfs as an overlay's upper dir ("filesystem ... not
supported as upperdir"), so every container got the bundle read-only there and an
environment that writes in its working directory (an output file, a sqlite db) failed with
EROFS where it works on a plain host.

Each test runs in a child process with a mount namespace of its own, where it mounts the
overlayfs the runtime's root sits on (its upper on a tmpfs, so that this works wherever the
tests' temp dir is): every mount the test makes goes with that namespace when the child
exits, failed or not, and none is ever in the test runner's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

_ENV = '''
import json
import os
import sqlite3

import envpool


class Writer(envpool.Env):
    """'write' leaves an output file, a sqlite db and a changed bundle file in its working
    directory (the image, as it sees it); every step says what it sees there."""

    example_actions = ("look",)

    def reset(self, *, seed=None, options=None):
        return "ready", {}

    def step(self, action):
        if action == "write":
            with open("out.txt", "w") as f:
                f.write("output")
            with open("data.txt", "a") as f:
                f.write(" changed")
            db = sqlite3.connect("runs.db")
            db.execute("create table runs (n integer)")
            db.execute("insert into runs values (7)")
            db.commit()
            db.close()
        seen = {"out": os.path.exists("out.txt"), "data": open("data.txt").read()}
        if os.path.exists("runs.db"):
            seen["runs"] = sqlite3.connect("runs.db").execute("select n from runs").fetchall()
        return envpool.StepResult(obs=envpool.Observation(text=json.dumps(seen)))
'''

_PRELUDE = r"""
import ctypes, errno, json, os, sys
from pathlib import Path
import envpool.isolation as isolation

libc = ctypes.CDLL(None, use_errno=True)

def own_namespace():
    # a mount namespace of this process's own: every mount made in it goes with the process
    if libc.unshare(isolation.CLONE_NEWNS) != 0:
        print(json.dumps({"skip": "no mount namespace here: " + os.strerror(ctypes.get_errno())}))
        sys.exit(0)
    isolation._mount(libc, None, "/", None, isolation._MS_REC | isolation._MS_PRIVATE)

def mounted(fstype, target, options):
    target.mkdir()
    try:
        isolation._mount(libc, fstype, str(target), fstype, 0, options)
    except OSError as e:
        if e.errno in (errno.ENODEV, errno.EPERM):  # no such file system, or no right to it
            print(json.dumps({"skip": f"no {fstype} can be mounted here: {e.strerror}"}))
            sys.exit(0)
        raise
    return target

def on_overlayfs(root):
    # an overlayfs at root/merged, as Docker's /tmp: its upper on a tmpfs (an upper dir on
    # the tests' temp dir would be refused where that is overlayfs itself)
    own_namespace()
    base = mounted("tmpfs", root / "base", "size=64m")
    for d in ("lower", "upper", "work"):
        (base / d).mkdir()
    options = f"lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work"
    return mounted("overlay", root / "merged", options)

def layer_mount(pid, scratch):
    # the container's layer as its own mount namespace has it: (fstype, options) or None
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == str(scratch / ".image-layer"):
                fstype, _, options = line.split(" - ", 1)[1].split()[:3]
                return [fstype, options]
    return None
"""

_POOL = (
    _PRELUDE
    + r"""
import asyncio
from envpool import EnvPool
from envpool.images import DiskTier, DiskTierConfig, TieredCache, build_bundle
from envpool.images.unpacked import tree_bytes

root, src, zygote = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "zygote"
merged = on_overlayfs(root)

def listing(d):
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))

async def main():
    bundle = build_bundle(src)
    tiers = [DiskTier(DiskTierConfig(path=merged / "l1"))]
    async with TieredCache(tiers, unpack_dir=merged / "unpacked") as images:
        image = await images.publish(bundle, name="writer")
        unpacked = await images.get(image)
        before = listing(unpacked)
        runtime = {"heartbeat_s": 0.1, "zygote": zygote, "root": str(merged / "rt")}
        runtime.update(json.loads(sys.argv[4]))
        cfg = {"min_warm": 0, "max_episodes": 1, "runtime": runtime}
        out = {}
        async with EnvPool(cfg, images=images) as p:
            async with p.session("writer-v0", image=image) as s:
                out["view"] = s.container.image_view
                out["image_layer"] = s.container.image_layer
                await s.reset()
                try:
                    out["first"] = json.loads((await s.step("write")).obs.text)
                except Exception as e:  # (the read-only view's EROFS)
                    out["first"] = f"{type(e).__name__}: {e}"
                scratch = Path(s.container.endpoint).parent
                out["layer"] = layer_mount(s.container.pid, scratch)
                # its writes in its layer as its own namespace has it, none in the directory
                # under it that the host's namespace (ours) sees
                ns_upper = Path(f"/proc/{s.container.pid}/root{scratch}/.image-layer/upper")
                out["in_layer"] = sorted(p.name for p in ns_upper.iterdir())
                out["under_it"] = listing(scratch / ".image-layer")
            async with p.session("writer-v0", image=image) as s:
                await s.reset()
                out["second"] = json.loads((await s.step("look")).obs.text)
        out["cache_unchanged"] = listing(unpacked) == before
        out["cache_digest"] = build_bundle(unpacked).digest == bundle.digest
        out["cache_counted"] = tree_bytes(unpacked) == images.metrics()["unpacked"]["bytes"]
        out["rt_left"] = listing(merged / "rt") if (merged / "rt").exists() else []
    print(json.dumps(out))

asyncio.run(main())
"""
)


def _image_src(root: Path) -> Path:
    root.mkdir()
    (root / "writer_env.py").write_text(_ENV)
    (root / "data.txt").write_text("original")
    entries = [{"id": "writer-v0", "entry_point": "writer_env:Writer"}]
    (root / "envpool.json").write_text(json.dumps({"register": entries}))
    return root


def _mounts() -> str:
    with open("/proc/self/mountinfo") as f:
        return f.read()


def _run(script: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=90
    )
    assert out.returncode == 0, out.stderr
    seen: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if "skip" in seen:
        pytest.skip(seen["skip"])
    return seen


needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="mounting the overlayfs the runtime's root sits on needs root here"
)


@needs_root
@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "fresh-interpreter"])
def test_on_overlayfs_a_container_still_gets_a_writable_private_layer(tmp_path, zygote):
    root = tmp_path / "ns"
    root.mkdir()
    runtime = json.dumps({"memory_layer_bytes": 4 * 2**20})
    seen = _run(_POOL, str(root), str(_image_src(tmp_path / "src")), "zygote" if zygote else "fresh", runtime)
    # a private overlay, not the read-only bundle: its writes work and it reads them back
    assert seen["view"] == "overlay"
    # and it says that its layer is in memory: what it writes there takes RAM, not disk
    assert seen["image_layer"] == "memory"
    assert seen["first"] == {"out": True, "data": "original changed", "runs": [[7]]}
    # its layer is a tmpfs of the configured size in the container's own mount namespace
    fstype, options = seen["layer"]
    assert fstype == "tmpfs" and "size=4096k" in options.split(","), seen["layer"]
    assert {"out.txt", "data.txt", "runs.db"} <= set(seen["in_layer"])
    assert seen["under_it"] == ["upper", "work"]  # (the upper the overlayfs refused, empty)
    # the next container of the image sees the image, the cache's copy is as published
    assert seen["second"] == {"out": False, "data": "original"}
    assert seen["cache_unchanged"] and seen["cache_digest"] and seen["cache_counted"]
    assert seen["rt_left"] == []
    assert str(tmp_path) not in _mounts()


_VIEW = (
    _PRELUDE
    + r"""
import shutil
root, src, fs, bound = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
if fs == "overlayfs":
    where = on_overlayfs(root)
else:  # a file system that takes an overlay's upper dir, as the host's ext4 or xfs do
    own_namespace()
    where = mounted("tmpfs", root / "plain", "size=16m")
bundle, scratch = where / "bundle", where / "scratch"
shutil.copytree(src, bundle)
scratch.mkdir()
view, how = isolation.private_view(bundle, scratch, memory_layer_bytes=bound)
out = {"how": how, "layer": layer_mount(os.getpid(), scratch), "read": (view / "data.txt").read_text()}
if how == "overlay":
    out["image_layer"] = isolation.image_layer(scratch)
for name, size in (("small", 1000), ("large", 2 * 2**20)):
    try:
        with open(view / name, "wb") as f:
            f.write(b"x" * size)
        out[name] = "written"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
out["bundle"] = sorted(p.name for p in bundle.iterdir())
print(json.dumps(out))
"""
)


def _view(tmp_path: Path, fs: str, bound: int) -> dict[str, Any]:
    root = tmp_path / "ns"
    root.mkdir()
    return _run(_VIEW, str(root), str(_image_src(tmp_path / "src")), fs, str(bound))


@needs_root
def test_the_layer_in_memory_is_bounded_by_memory_layer_bytes(tmp_path):
    seen = _view(tmp_path, "overlayfs", 2**20)
    assert seen["how"] == "overlay"
    assert seen["layer"][0] == "tmpfs" and "size=1024k" in seen["layer"][1].split(",")
    # a write within the bound is the container's; one past it fails, loudly
    assert (seen["read"], seen["small"], seen["large"]) == ("original", "written", "ENOSPC")
    assert seen["bundle"] == ["data.txt", "envpool.json", "writer_env.py"]
    assert str(tmp_path) not in _mounts()


@needs_root
def test_memory_layer_bytes_0_keeps_the_image_read_only_on_overlayfs(tmp_path):
    seen = _view(tmp_path, "overlayfs", 0)
    assert seen["how"] == "read-only" and seen["layer"] is None
    assert (seen["read"], seen["small"], seen["large"]) == ("original", "EROFS", "EROFS")
    assert seen["bundle"] == ["data.txt", "envpool.json", "writer_env.py"]


@needs_root
def test_where_the_scratch_takes_an_upper_dir_the_layer_is_on_it_not_in_memory(tmp_path):
    # memory only where it is needed: on a file system that takes the upper dir the layer
    # is there (bounded by the disk and limits.fsize_bytes, not by memory_layer_bytes)
    seen = _view(tmp_path, "plain", 2**20)
    assert seen["how"] == "overlay" and seen["layer"] is None
    assert (seen["small"], seen["large"]) == ("written", "written")
    assert seen["bundle"] == ["data.txt", "envpool.json", "writer_env.py"]


@needs_root
def test_a_layer_on_a_scratch_in_memory_says_so(tmp_path):
    # a runtime's root on a tmpfs, as /tmp is on many distributions (Fedora, Arch, Debian
    # 13): the overlay's upper dir is on it, no tmpfs of the container's own is mounted, and
    # its writes take RAM all the same. Read as "no mount at .image-layer", it said "disk"
    seen = _view(tmp_path, "plain", 2**20)
    assert seen["how"] == "overlay" and seen["layer"] is None
    assert seen["image_layer"] == "memory"


_UNPRIVILEGED = r"""
import ctypes, errno, json, os, sys
from pathlib import Path
import envpool.isolation as isolation

bundle, scratch, uid = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
# a user of no privilege, as the runtime's owner may be: this interpreter (its modules
# imported above) is under a directory of root's, so root starts it and drops to the uid
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE: a uid dropped from root's leaves /proc/self root's
level = isolation.isolate_network()  # as server.run: first, before the view
if level != "userns+netns":
    print(json.dumps({"skip": f"no user namespace for an unprivileged user here ({level})"}))
    sys.exit(0)
view, how = isolation.private_view(bundle, scratch)
out = {"how": how, "uid": os.getuid(), "gid": os.getgid(), "owner": (view / "data.txt").stat().st_uid}
try:
    with open(view / "out.txt", "w") as f:
        f.write("output")
    with open(view / "data.txt", "a") as f:
        f.write(" changed")
    out["read"] = [(view / "out.txt").read_text(), (view / "data.txt").read_text()]
except OSError as e:
    out["read"] = errno.errorcode[e.errno]
print(json.dumps(out))
"""


@pytest.fixture
def open_dir():
    # (pytest's tmp_path is under a directory of root's alone: no other user reaches it)
    d = Path(tempfile.mkdtemp(prefix="envpool-test-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


@needs_root  # (to start the child that drops to a user of no privilege)
def test_an_unprivileged_user_with_user_namespaces_gets_a_writable_private_layer(open_dir):
    if tuple(int(n) for n in re.findall(r"[0-9]+", os.uname().release)[:2]) < (5, 11):
        pytest.skip("the kernel mounts no overlayfs in a user namespace before 5.11")
    uid = 54321  # no user's: a runtime's owner of no privilege
    bundle, scratch = _image_src(open_dir / "bundle"), open_dir / "scratch"
    scratch.mkdir()
    for p in (bundle, *bundle.iterdir(), scratch):
        os.chown(p, uid, uid)
    seen = _run(_UNPRIVILEGED, str(bundle), str(scratch), str(uid))
    # an overlay, not the read-only bundle (its uid unmapped in the network isolation's
    # user namespace, it could mount none); and it sees its own ids, not the overflow id
    assert seen["how"] == "overlay"
    assert seen["read"] == ["output", "original changed"]
    assert (seen["uid"], seen["gid"], seen["owner"]) == (uid, uid, uid)
    assert (bundle / "data.txt").read_text() == "original"
    assert not (bundle / "out.txt").exists()
    assert str(open_dir) not in _mounts()
