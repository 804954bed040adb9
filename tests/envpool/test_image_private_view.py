"""An image is immutable to its containers: what one container writes in its working
directory (the image's bundle, as it sees it) or changes of the bundle's files is never seen
by the next container of the image, nor does it change the unpacked bundle the cache shares,
its digest or the bytes it counts for it. The process runtime gives each container a private
view of the bundle (``envpool.isolation.private_view``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envpool import EnvPool
from envpool.images import DiskTier, DiskTierConfig, TieredCache, build_bundle
from envpool.images.fake_origin import FakeOrigin
from envpool.images.unpacked import MARKER, tree_bytes

_SCRIBBLER = '''
import json
import os

import envpool

import scribble_helper  # an import from the bundle: its bytecode would go to its __pycache__


class Scribbler(envpool.Env):
    """'scribble' writes a file into its working directory (the bundle) and changes one of
    the bundle's own files; every step says what it sees there."""

    example_actions = ("look",)

    def reset(self, *, seed=None, options=None):
        return "ready", {}

    def step(self, action):
        if action == "scribble":
            with open("left.txt", "w") as f:
                f.write("from an earlier episode")
            with open("data.txt", "a") as f:
                f.write(" changed")
            os.makedirs("made/here")
        seen = {
            "left": os.path.exists("left.txt"),
            "made": os.path.exists("made"),
            "data": open("data.txt").read(),  # a relative path to the bundle's file
            "helper": scribble_helper.VALUE,
        }
        return envpool.StepResult(obs=envpool.Observation(text=json.dumps(seen)))
'''


def _image_src(root: Path) -> Path:
    root.mkdir()
    (root / "scribble_env.py").write_text(_SCRIBBLER)
    (root / "scribble_helper.py").write_text("VALUE = 42\n")
    (root / "data.txt").write_text("original")
    entries = [{"id": "scribble-v0", "entry_point": "scribble_env:Scribbler"}]
    (root / "envpool.json").write_text(json.dumps({"register": entries}))
    return root


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _cache(tmp_path: Path) -> TieredCache:
    """The image cache the tests publish the scribbling image to: one disk tier."""
    return TieredCache([DiskTier(DiskTierConfig(path=tmp_path / "l1"))], unpack_dir=tmp_path / "unpacked")


def _layer_fstype(pid: int | None, scratch: Path) -> str | None:
    """The file system that holds a container's ``.image-layer`` in its mount namespace: the
    one at the longest mount point above it (a tmpfs at it, else its root's file system)."""
    layer, best, fstype = str(scratch / ".image-layer"), "", None
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if (layer == point or layer.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, fstype = point, line.split(" - ", 1)[1].split()[0]  # (the last one is on top)
    return fstype


def _mounts() -> str:
    with open("/proc/self/mountinfo") as f:
        return f.read()


@pytest.mark.parametrize("zygote", [True, False], ids=["zygote", "fresh-interpreter"])
async def test_what_a_container_writes_in_its_image_no_later_container_sees(tmp_path, zygote):
    bundle = build_bundle(_image_src(tmp_path / "src"))
    async with _cache(tmp_path) as images:
        image = await images.publish(bundle, name="scribble")
        unpacked = await images.get(image)
        before = _listing(unpacked)
        counted = images.metrics()["unpacked"]["bytes"]
        cfg = {
            "min_warm": 0,
            "max_episodes": 1,  # each session's episode on a fresh container
            "runtime": {"heartbeat_s": 0.1, "zygote": zygote, "root": str(tmp_path / "rt")},
        }
        async with EnvPool(cfg, images=images) as p:
            async with p.session("scribble-v0", image=image) as s:
                if s.container.image_view != "overlay":
                    # (read-only: its write fails, as the test below shows; shared: the
                    # directory is every container's, and the runtime warns of it)
                    pytest.skip(f"no overlay here (the image is {s.container.image_view!r})")
                # it says where its layer is, as its own mount namespace has it: a tmpfs at
                # .image-layer (a root on overlayfs), or the directory on the root's file
                # system, in memory itself where that is a tmpfs (/tmp on many hosts)
                fstype = _layer_fstype(s.container.pid, Path(s.container.endpoint).parent)
                in_memory = fstype in ("tmpfs", "ramfs")
                assert s.container.image_layer == ("memory" if in_memory else "disk"), fstype
                await s.reset()
                first = json.loads((await s.step("scribble")).obs.text)
                first_id = s.container.id
            async with p.session("scribble-v0", image=image) as s:
                await s.reset()
                second = json.loads((await s.step("look")).obs.text)
                assert s.container.id != first_id
        # the first container wrote into a layer of its own, and read its writes back there
        assert first == {"left": True, "made": True, "data": "original changed", "helper": 42}
        # the second one's view of the image is the image's
        assert second == {"left": False, "made": False, "data": "original", "helper": 42}
        # and the cache's copy is as it was unpacked: no file more (no __pycache__ either),
        # the same bytes counted, the same digest
        assert _listing(unpacked) == before
        assert (unpacked / "data.txt").read_text() == "original"
        assert tree_bytes(unpacked) == counted == images.metrics()["unpacked"]["bytes"]
        assert build_bundle(unpacked).digest == bundle.digest
    # nothing of the containers' views is left mounted (they lived in the containers' own
    # mount namespaces, gone with them), nor their directories
    assert str(tmp_path) not in _mounts()
    assert not (tmp_path / "rt").exists() or list((tmp_path / "rt").iterdir()) == []


async def test_a_container_is_told_its_image_view(tmp_path):
    # root (this pool's runtime) gets a private writable layer; elsewhere a container says
    # what it got, never silently less
    src = _image_src(tmp_path / "src")
    async with TieredCache(
        [DiskTier(DiskTierConfig(path=tmp_path / "l1"))], unpack_dir=tmp_path / "unpacked"
    ) as images:
        image = await images.publish(build_bundle(src), name="scribble")
        cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1}}
        async with EnvPool(cfg, images=images) as p, p.session("scribble-v0", image=image) as s:
            assert s.container.image_view in ("overlay", "read-only", "shared")
            # where its writes go: a layer only an overlay has
            expected = ("disk", "memory") if s.container.image_view == "overlay" else (None,)
            assert s.container.image_layer in expected
            if os.geteuid() == 0:
                assert s.container.image_view == "overlay"


_NO_OVERLAY = r"""
import json, os, sys
from pathlib import Path
import envpool.isolation as isolation

mount = isolation._mount

def no_overlay(libc, source, target, fstype, flags, data=""):
    if fstype == "overlay":  # as a kernel without overlayfs, or an upper fs it refuses
        raise OSError(err, os.strerror(err), target)
    mount(libc, source, target, fstype, flags, data)

isolation._mount = no_overlay
bundle, scratch, err = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
view, how = isolation.private_view(bundle, scratch)
out = {"how": how, "view": str(view), "read": (view / "data.txt").read_text()}
with open("/proc/self/mountinfo") as f:  # (the view's, in this process's namespace)
    out["mounted"] = sorted(line.split()[4] for line in f if str(scratch) in line)
try:
    with open(view / "left.txt", "w") as f:
        f.write("x")
    out["write"] = "written"
except OSError as e:
    out["write"] = os.strerror(e.errno)
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace of its own needs root here")
@pytest.mark.parametrize(
    "err",
    # no overlayfs in the kernel (no layer in memory is tried); or a refusal a layer in
    # memory would answer, yet the overlay on it is refused too (its tmpfs is unmounted)
    [errno.ENODEV, errno.EINVAL],
    ids=["no-overlayfs", "refused-on-tmpfs-too"],
)
def test_where_no_overlay_can_be_had_the_image_is_read_only_and_a_write_says_so(tmp_path, err):
    bundle, scratch = _image_src(tmp_path / "bundle"), tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _NO_OVERLAY, str(bundle), str(scratch), str(err)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    seen = json.loads(out.stdout)
    # root ignores file modes: only a read-only mount refuses its write
    assert seen == {
        "how": "read-only",
        "view": str(scratch / "image"),
        "read": "original",
        "write": "Read-only file system",
        "mounted": [str(scratch / "image")],
    }
    assert not (bundle / "left.txt").exists()
    assert str(tmp_path) not in _mounts()  # (the child's namespace went with it)


async def test_the_images_modules_are_compiled_once_by_the_cache_not_by_each_container(tmp_path, monkeypatch):
    # a container's bytecode goes to its own layer, gone with it: each one compiled the
    # image's modules afresh (tens of ms for a large module, against a zygote fork's few).
    # The cache compiles them once, as it unpacks; the bytes count, the digest does not
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)  # the containers would write it
    bundle = build_bundle(_image_src(tmp_path / "src"))
    async with _cache(tmp_path) as images:
        image = await images.publish(bundle, name="scribble")
        unpacked = await images.get(image)
        compiled = sorted(p.name.split(".")[0] for p in (unpacked / "__pycache__").glob("*.pyc"))
        assert compiled == ["scribble_env", "scribble_helper"]
        assert tree_bytes(unpacked) == images.metrics()["unpacked"]["bytes"]
        assert build_bundle(unpacked).digest == bundle.digest
        cfg = {"min_warm": 0, "runtime": {"heartbeat_s": 0.1, "root": str(tmp_path / "rt")}}
        async with EnvPool(cfg, images=images) as p, p.session("scribble-v0", image=image) as s:
            if s.container.image_view != "overlay":
                pytest.skip(f"no overlay here (the image is {s.container.image_view!r})")
            await s.reset()
            await s.step("look")
            # its layer as its own mount namespace has it (where that is a tmpfs, on a runtime
            # root on overlayfs, the directory the runner sees under it is empty)
            scratch = Path(s.container.endpoint).parent
            layer = f"/proc/{s.container.pid}/root{scratch}/.image-layer/upper"
            assert os.listdir(layer) == []  # nothing compiled again


async def test_the_caches_bytecode_stays_within_max_unpacked_bytes(tmp_path):
    # bytecode can be hundreds of times its source (a constant folded from "x" * n: 28 kB of
    # such lines compile to some 8 MB): compiled past the bundle's limit, a bundle that
    # unpacked well within max_unpacked_bytes took many times it on the disk. Over the limit,
    # what the compile wrote goes (the containers compile what they import, in their layers)
    src = tmp_path / "src"
    src.mkdir()
    (src / "folded.py").write_text("".join(f'a = "{i:05d}" * 819\n' for i in range(2000)))
    (src / "small.py").write_text("VALUE = 42\n")
    bundle = build_bundle(src)
    limit = 2**20
    async with TieredCache(
        [DiskTier(DiskTierConfig(path=tmp_path / "l1"))],
        unpack_dir=tmp_path / "unpacked",
        max_unpacked_bytes=limit,
    ) as images:
        image = await images.publish(bundle, name="folded")
        unpacked = await images.get(image)
        assert tree_bytes(unpacked) <= limit
        assert tree_bytes(unpacked) == images.metrics()["unpacked"]["bytes"]
        assert sorted(p.name for p in unpacked.iterdir()) == [MARKER, "folded.py", "small.py"]
        assert build_bundle(unpacked).digest == bundle.digest


def test_a_remote_containers_fetch_compiles_nothing(tmp_path):
    # a remote container (kubernetes, modal) fetches its bundle into a directory of its own,
    # for itself alone: compiling every module there is all cost (the modules it imports are
    # compiled as it imports them, once either way), paid at each container's start, before
    # it reports ready within start_timeout_s
    import envpool.server as server

    src = tmp_path / "src"
    src.mkdir()
    (src / "mod.py").write_text("VALUE = 42\n")
    bundle = build_bundle(src)
    with FakeOrigin({bundle.digest: bundle.data}) as origin:
        path = server.fetch_image(bundle.digest, origin.url)
    try:
        assert (path / "mod.py").is_file()
        assert not (path / "__pycache__").exists()
    finally:
        shutil.rmtree(path.parents[1], ignore_errors=True)  # the fetch's own directory
