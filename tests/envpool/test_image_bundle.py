"""Image bundles: a build is deterministic and round-trips, refuses a symlink out of its
root; image references and digests are checked; an unpack refuses path attacks, escapes
through symlink chains, garbage and bombs."""

from __future__ import annotations

import gzip
import os
import stat
import tarfile
from pathlib import Path

import pytest
from image_cache_helpers import make_tree, member, tar_gz

from envpool.errors import InfraError
from envpool.images import (
    Bundle,
    DigestMismatch,
    ImageRef,
    InvalidImageRef,
    UnsafeBundle,
    build_bundle,
    digest_of,
    unpack,
    verify,
)

# -- bundles


def test_bundle_is_deterministic(tmp_path: Path) -> None:
    a = build_bundle(make_tree(tmp_path / "a"))
    b_root = make_tree(tmp_path / "b")
    os.utime(b_root / "run.sh", (1, 1))  # other mtimes, same content
    b = build_bundle(b_root)
    assert a.digest == b.digest == digest_of(a.data)
    (b_root / "run.sh").write_text("#!/bin/sh\necho changed\n")
    assert build_bundle(b_root).digest != a.digest


def test_bundle_round_trip(tmp_path: Path, bundle: Bundle) -> None:
    unpack(bundle.data, tmp_path / "out")
    out = tmp_path / "out"
    assert (out / "pkg" / "__init__.py").read_text() == "VALUE = 42\n"
    assert (out / "pkg" / "data" / "blob.bin").read_bytes() == b"x" * 1000
    assert os.access(out / "run.sh", os.X_OK)
    assert (out / "empty").is_dir()
    assert (out / "link.py").is_symlink() and (out / "link.py").read_text() == "VALUE = 42\n"


def test_build_refuses_symlink_out_of_the_root(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "src")
    os.symlink("../../etc/passwd", root / "pkg" / "evil")
    with pytest.raises(UnsafeBundle, match="outside"):
        build_bundle(root)


def test_build_refuses_symlink_out_of_the_root_through_another_symlink(tmp_path: Path) -> None:
    # each link looks inside on its own: `up` is here/.., and `here` is the root itself
    root = make_tree(tmp_path / "src")
    os.symlink(".", root / "here")
    os.symlink("here/..", root / "up")
    assert (root / "up").resolve() == tmp_path
    with pytest.raises(UnsafeBundle, match="outside"):
        build_bundle(root)


def test_image_ref_and_digest_checks(bundle: Bundle) -> None:
    ref = ImageRef.parse(f"envs/frozenlake@{bundle.digest}")
    assert (ref.name, ref.digest) == ("envs/frozenlake", bundle.digest)
    assert str(ref) == f"envs/frozenlake@{bundle.digest}"
    assert ImageRef.parse(bundle.digest).name == ""
    for bad in ["envs/x", "envs/x@sha256:abc", f"x@{bundle.digest.upper()}", "a b@" + bundle.digest, ""]:
        with pytest.raises(InvalidImageRef, match="expected 'name@sha256"):
            ImageRef.parse(bad)
    verify(bundle.data, bundle.digest)
    with pytest.raises(DigestMismatch, match="expected " + bundle.digest) as e:
        verify(bundle.data + b"!", bundle.digest, source="mirror")
    assert e.value.retryable and isinstance(e.value, InfraError)


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([(member("/etc/cron.d/x"), b"boom")], "absolute"),
        ([(member("../outside.txt"), b"boom")], r"'\.\.'"),
        ([(member("a/../../outside.txt"), b"boom")], r"'\.\.'"),
        ([(member("ln", type=tarfile.SYMTYPE, linkname="/etc/passwd"), None)], "absolute path"),
        ([(member("a/ln", type=tarfile.SYMTYPE, linkname="../../etc"), None)], "outside"),
        ([(member("hard", type=tarfile.LNKTYPE, linkname="../../etc/passwd"), None)], "outside"),
        ([(member("dev", type=tarfile.CHRTYPE), None)], "device"),
        ([(member("blk", type=tarfile.BLKTYPE), None)], "device"),
        ([(member("fifo", type=tarfile.FIFOTYPE), None)], "fifo"),
    ],
    ids=["abs", "dotdot", "dotdot2", "abs-symlink", "symlink-out", "hardlink-out", "chr", "blk", "fifo"],
)
def test_unpack_refuses_path_attacks(tmp_path: Path, members: list, message: str) -> None:
    (tmp_path / "jail").mkdir()
    with pytest.raises(UnsafeBundle, match=message):
        unpack(tar_gz(*members), tmp_path / "jail" / "dest")
    assert list(tmp_path.rglob("*")) == [tmp_path / "jail"]  # refused before anything was written


def test_unpack_refuses_escape_through_a_symlink_chain(tmp_path: Path) -> None:
    # each link looks harmless on its own; only the real path on disk shows the escape
    data = tar_gz(
        (member("here", type=tarfile.SYMTYPE, linkname="."), None),
        (member("up", type=tarfile.SYMTYPE, linkname="here/.."), None),
        (member("up/escaped.txt"), b"boom"),
    )
    with pytest.raises(UnsafeBundle):
        unpack(data, tmp_path / "jail" / "dest")
    assert not (tmp_path / "jail" / "escaped.txt").exists()


def _deep_link_escape() -> bytes:
    """Every link lexically inside the root; on disk, ``a/.../p/e`` is the root's parent.
    Short links ``a``..``p`` reach a directory 16 long names deep, so the real path of the
    link ``l...l`` there is over PATH_MAX: ``os.path.realpath`` (the ``data`` filter's check,
    before Python 3.11.13) gives up resolving it and takes it for a directory, while the
    kernel, walking the short member names, follows every link (CVE-2025-4517)."""
    comp, steps = "d" * 240, "abcdefghijklmnop"
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    deep = ""
    for s in steps:
        members.append((member(deep + comp, type=tarfile.DIRTYPE), None))
        members.append((member(deep + s, type=tarfile.SYMTYPE, linkname=comp), None))
        deep += comp + "/"
    short = "/".join(steps)
    long_link = f"{short}/{'l' * 254}"
    members.append((member(long_link, type=tarfile.SYMTYPE, linkname="../" * len(steps)), None))
    members.append((member(f"{short}/e", type=tarfile.SYMTYPE, linkname=f"{'l' * 254}/.."), None))
    members.append((member(f"{short}/e/escaped.txt"), b"boom"))
    return tar_gz(*members)


def test_unpack_refuses_a_link_escape_that_realpath_cannot_see(tmp_path: Path) -> None:
    (tmp_path / "jail").mkdir()
    with pytest.raises(UnsafeBundle, match="symlink"):
        unpack(_deep_link_escape(), tmp_path / "jail" / "dest")
    assert not (tmp_path / "jail" / "escaped.txt").exists()
    assert list(tmp_path.rglob("*")) == [tmp_path / "jail"]  # refused before anything was written


@pytest.mark.parametrize(
    ("members", "message"),
    [
        (
            [
                (member("sub", type=tarfile.DIRTYPE), None),
                (member("sub/here", type=tarfile.SYMTYPE, linkname=".."), None),
                (member("up", type=tarfile.SYMTYPE, linkname="sub/here/.."), None),
            ],
            "outside",
        ),
        (
            [
                (member("s", type=tarfile.SYMTYPE, linkname="."), None),
                (member("s/f"), b"boom"),
            ],
            "under the symlink",
        ),
        (
            [
                (member("loop", type=tarfile.SYMTYPE, linkname="loop/x"), None),
            ],
            "loop",
        ),
        (
            [
                (member("x", type=tarfile.SYMTYPE, linkname="."), None),
                (member("x"), b"boom"),
            ],
            "same name",
        ),
    ],
    ids=["through-link", "under-link", "loop", "link-then-file"],
)
def test_unpack_resolves_links_through_the_bundles_own_links(
    tmp_path: Path, members: list, message: str
) -> None:
    (tmp_path / "jail").mkdir()
    with pytest.raises(UnsafeBundle, match=message):
        unpack(tar_gz(*members), tmp_path / "jail" / "dest")
    assert list(tmp_path.rglob("*")) == [tmp_path / "jail"]


def test_unpack_refuses_a_hard_link_to_a_symlink(tmp_path: Path) -> None:
    # the symlink is inside from its own directory, and dangling there: tarfile, finding no
    # file to link to, copies the symlink to the hard link's place, where the same target
    # climbs out of the root (here to the host's /etc/passwd, read as the image's manifest)
    deep = "a/b/c/d/e/f/g/h/i/j/k/l/m/n/o/p"
    data = tar_gz(
        (member(deep, type=tarfile.DIRTYPE), None),
        (member(f"{deep}/s", type=tarfile.SYMTYPE, linkname="../" * 16 + "etc/passwd"), None),
        (member("envpool.json", type=tarfile.LNKTYPE, linkname=f"{deep}/s"), None),
    )
    (tmp_path / "jail").mkdir()
    with pytest.raises(UnsafeBundle, match="hard-links to the symlink"):
        unpack(data, tmp_path / "jail" / "dest")
    assert list(tmp_path.rglob("*")) == [tmp_path / "jail"]


def test_unpack_refuses_a_hard_link_to_a_directory(tmp_path: Path) -> None:
    # a directory cannot be hard-linked: tarfile falls back to extracting the directory's
    # own member, unfiltered, at the link's place, with the owner it names (a host user's
    # uid: a directory of theirs in the image every container of the node runs from)
    real = member("real", type=tarfile.DIRTYPE)
    real.uid = real.gid = 1234
    data = tar_gz((real, None), (member("pkg", type=tarfile.LNKTYPE, linkname="real"), None))
    (tmp_path / "jail").mkdir()
    with pytest.raises(UnsafeBundle, match="hard-links to the directory"):
        unpack(data, tmp_path / "jail" / "dest")
    assert list(tmp_path.rglob("*")) == [tmp_path / "jail"]


def test_what_a_hard_link_falls_back_to_keeps_no_owner_or_mode_of_the_archives(tmp_path: Path) -> None:
    # `f/.` names the member f, but no path on disk: tarfile, finding nothing to link to,
    # extracts f's own member there, past the data filter, with the owner and mode it names
    f = member("f")
    f.mode, f.uid, f.gid = 0o6777, 1234, 1234
    data = tar_gz((f, b"#!/bin/sh\n"), (member("h", type=tarfile.LNKTYPE, linkname="f/."), None))
    unpack(data, tmp_path / "dest")
    for name in ("f", "h"):
        st = (tmp_path / "dest" / name).lstat()
        assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid()), name  # not a host user's
        assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH), name


def test_unpack_keeps_links_through_links_that_stay_inside(tmp_path: Path) -> None:
    data = tar_gz(
        (member("lib", type=tarfile.DIRTYPE), None),
        (member("lib/mod.py"), b"X = 1\n"),
        (member("current", type=tarfile.SYMTYPE, linkname="lib"), None),
        (member("sub", type=tarfile.DIRTYPE), None),
        (member("sub/mod.py", type=tarfile.SYMTYPE, linkname="../current/mod.py"), None),
    )
    unpack(data, tmp_path / "dest")
    assert (tmp_path / "dest" / "sub" / "mod.py").read_text() == "X = 1\n"


def test_the_unpack_limit_counts_entries_not_only_their_bytes(tmp_path: Path) -> None:
    # 5,000 empty directories: 0 bytes of content, 20 MB of disk (a block each) from a few
    # kB of gzip; the limit took only the members' sizes, so a bomb of entries went through
    data = tar_gz(*((member(f"d{i}", type=tarfile.DIRTYPE), None) for i in range(5000)))
    assert len(data) < 100_000
    with pytest.raises(UnsafeBundle, match="over the 1000000-byte limit"):
        unpack(data, tmp_path / "dest", max_bytes=1_000_000)
    assert not (tmp_path / "dest").exists()
    unpack(data, tmp_path / "ok", max_bytes=50_000_000)  # a limit the entries fit


def test_unpack_refuses_garbage_and_bombs(tmp_path: Path, bundle: Bundle) -> None:
    with pytest.raises(UnsafeBundle, match=r"not a tar\.gz"):
        unpack(b"definitely not gzip", tmp_path / "x")
    with pytest.raises(UnsafeBundle, match="over the 100-byte limit"):
        unpack(bundle.data, tmp_path / "y", max_bytes=100)


def test_a_bomb_of_entries_is_refused_at_the_limit_not_after_reading_them_all(tmp_path: Path) -> None:
    # every header was read (and kept) before the limit was checked: a few MB of gzip holding
    # millions of empty entries took minutes of a core and GBs of memory to refuse. The
    # archive here ends cut short far past the limit: a read to its end says "truncated"
    whole = tar_gz(
        *((member(f"d{i}", type=tarfile.DIRTYPE), None) for i in range(5000)),
        (member("last.bin"), b"x" * 100_000),
    )
    raw = gzip.decompress(whole)
    cut = gzip.compress(raw[: raw.rindex(b"x" * 1000) - 50_000])  # in the last member's bytes
    with pytest.raises(UnsafeBundle, match="truncated"):
        unpack(cut, tmp_path / "all")  # (no limit: read to its end)
    with pytest.raises(UnsafeBundle, match="over the 1000000-byte limit"):
        unpack(cut, tmp_path / "dest", max_bytes=1_000_000)
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("name", ["a" * 300, "/".join(["d" * 200] * 30)], ids=["a-name", "a-path"])
def test_a_member_named_past_the_file_systems_limits_is_a_malformed_bundle(tmp_path: Path, name: str) -> None:
    # the archive's fault, the same on every try: it surfaced as a bare OSError, which a
    # session takes for a fault of the machine and retries with a fresh container
    with pytest.raises(UnsafeBundle, match="File name too long"):
        unpack(tar_gz((member(name), b"x")), tmp_path / "dest")
