"""Image bundles: a directory packed as a deterministic tar.gz, named by the sha256 of its bytes.

Deterministic means the same directory gives the same digest on any machine: entries sorted,
mtimes zero, owners zero, modes normalised to 0644/0755, and no timestamp or file name in the
gzip header. Unpacking trusts nothing in the archive: absolute paths, ``..``, links that leave
the root and device files are refused before anything is written, and Python's ``data``
extraction filter checks again against the real paths on disk.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import posixpath
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from envpool.images.errors import DigestMismatch, InvalidImageRef, UnsafeBundle

_DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
_MALFORMED_ERRNOS = frozenset(
    {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EMLINK}
)
"""Errors of an unpack that are the archive's (members that clash, a name past the file
system's limits, more hard links to one file than it takes): the same on every try."""
_REF_RE = re.compile(r"(?:(?P<name>[^\s@]+)@)?(?P<digest>sha256:[0-9a-f]{64})")


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def parse_digest(digest: str) -> str:
    """Return ``digest`` if it is ``sha256:<64 lowercase hex>``; raise ``InvalidImageRef`` if not."""
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise InvalidImageRef(f"bad digest {digest!r}: expected 'sha256:' and 64 lowercase hex digits")
    return digest


def verify(data: bytes | BinaryIO, digest: str, *, source: str = "") -> None:
    """Raise ``DigestMismatch`` unless ``data`` (bytes, or a file read from its start a
    part at a time) hashes to ``digest``."""
    if isinstance(data, bytes | bytearray | memoryview):
        actual = digest_of(bytes(data))
    else:
        data.seek(0)
        h = hashlib.sha256()
        while chunk := data.read(2**20):
            h.update(chunk)
        actual = "sha256:" + h.hexdigest()
    if actual != digest:
        raise DigestMismatch(digest, actual, tier=source)


@dataclass(frozen=True)
class ImageRef:
    """``name@sha256:<hex>``. Only the digest identifies the image; the name is for people."""

    name: str
    digest: str

    @classmethod
    def parse(cls, ref: str) -> ImageRef:
        m = _REF_RE.fullmatch(ref) if isinstance(ref, str) else None
        if m is None:
            raise InvalidImageRef(
                f"bad image reference {ref!r}: expected 'name@sha256:<64 hex>' or 'sha256:<64 hex>' "
                "(build one with envpool.images.build_bundle)"
            )
        return cls(name=m["name"] or "", digest=m["digest"])

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.name else self.digest


@dataclass(frozen=True)
class Bundle:
    digest: str
    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    def ref(self, name: str) -> ImageRef:
        return ImageRef(name=name, digest=self.digest)


def build_bundle(src: str | os.PathLike[str], *, compresslevel: int = 6) -> Bundle:
    """Pack the directory ``src`` into a bundle. Symlinks are kept if they stay inside ``src``."""
    root = Path(src)
    if not root.is_dir():
        raise UnsafeBundle(f"cannot bundle {root}: not a directory")
    rels = _walk_sorted(root)
    # a link may leave the root through another link (`up -> here/..`, `here -> .`): each
    # looks inside alone; refused here, as unpack would refuse the bundle on every node
    links = []
    for rel in rels:
        if (root / rel).is_symlink():
            info = tarfile.TarInfo(rel)
            info.type, info.linkname = tarfile.SYMTYPE, os.readlink(root / rel)
            links.append(info)
    _check_links_on_disk(links)
    buf = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of anything machine- or time-specific
    with (
        gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=compresslevel) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for rel in rels:
            _add(tar, root, rel)
    data = buf.getvalue()
    return Bundle(digest=digest_of(data), data=data)


UNPACKED_MARKER = ".envpool-unpacked"
"""The image cache's mark of a whole unpacked bundle, at its root (``envpool.images.unpacked``):
never bundled, so an unpacked bundle bundled again keeps its digest."""


def _walk_sorted(root: Path) -> list[str]:
    """The bundle's paths, sorted, without Python's bytecode caches (an import in the
    directory writes them: the digest would depend on whether anything ran there) or the
    image cache's marker."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")  # os.walk descends in this order
        base = os.path.relpath(dirpath, root)
        if base == ".":
            filenames = [f for f in filenames if f != UNPACKED_MARKER]
        for name in dirnames + [f for f in filenames if not f.endswith(".pyc")]:
            out.append(name if base == "." else posixpath.join(Path(base).as_posix(), name))
    return sorted(out)


def _add(tar: tarfile.TarFile, root: Path, rel: str) -> None:
    path = root / rel
    st = path.lstat()
    info = tarfile.TarInfo(rel)
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if stat.S_ISDIR(st.st_mode):
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
    elif stat.S_ISREG(st.st_mode):
        info.mode = 0o755 if st.st_mode & 0o111 else 0o644
        info.size = st.st_size
        with path.open("rb") as f:
            tar.addfile(info, f)
    elif stat.S_ISLNK(st.st_mode):
        info.type, info.mode = tarfile.SYMTYPE, 0o777
        info.linkname = os.readlink(path)
        _check_link(rel, info.linkname, symlink=True)
        tar.addfile(info)
    else:
        raise UnsafeBundle(f"cannot bundle {path}: not a file, directory or symlink")


def _check_name(name: str) -> None:
    if not name or name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":"):
        raise UnsafeBundle(f"bundle member {name!r} has an absolute or non-POSIX path")
    if ".." in name.split("/"):
        raise UnsafeBundle(f"bundle member {name!r} contains '..'")


def _check_link(name: str, target: str, *, symlink: bool) -> None:
    if not target or target.startswith("/"):
        raise UnsafeBundle(f"bundle member {name!r} links to the absolute path {target!r}")
    # a symlink resolves against its own directory, a hard link against the archive root
    joined = posixpath.join(posixpath.dirname(name), target) if symlink else target
    norm = posixpath.normpath(joined)
    if norm == ".." or norm.startswith("../"):
        raise UnsafeBundle(f"bundle member {name!r} links outside the bundle ({target!r})")


_BLOCK_BYTES = 4096
"""What the unpack limit charges per started block of a member (a filesystem's usual block)."""

_MAX_LINK_HOPS = 40
"""Symlinks one lookup may follow (the kernel's own limit): more is a loop."""


def _check_links_on_disk(members: list[tarfile.TarInfo]) -> None:
    """Check the links as the kernel will follow them once on disk, not lexically: a link
    may lead through the bundle's other links (``a -> d/d/d``, then ``a/../..``). The
    ``data`` filter's own check, ``os.path.realpath``, stops resolving past PATH_MAX and
    takes what is left for plain directories (CVE-2025-4517: fixed in Python 3.11.13), so
    deep links could lead a later member out of the root; this check reads the archive only.

    Sound because no member is written through a link: none lies under one, and a link's
    name is no other member's (``tarfile`` would write that member through the link, or
    make the link's name a directory first). So on disk each link's name is, at any moment,
    that link or nothing, and following the archive's links is following the disk's. Nor
    is a link copied elsewhere: no hard link names a symlink."""
    links: dict[str, str] = {}
    for m in members:
        if m.issym():
            name = posixpath.normpath(m.name)
            if name == "." or name in links:
                raise UnsafeBundle(f"bundle member {m.name!r} is a symlink over the root or another symlink")
            links[name] = m.linkname
    for m in members:
        name = posixpath.normpath(m.name)
        if not m.issym() and name in links:
            raise UnsafeBundle(f"bundle member {m.name!r} has the same name as a symlink of the bundle")
        if m.islnk() and posixpath.normpath(m.linkname) in links:
            # where the symlink is dangling (or a directory), tarfile copies it to the hard
            # link's place, where its relative target resolves from another directory
            raise UnsafeBundle(f"bundle member {m.name!r} hard-links to the symlink {m.linkname!r}")
        parts = name.split("/")
        for i in range(1, len(parts)):
            under = "/".join(parts[:i])
            if under in links:
                raise UnsafeBundle(f"bundle member {m.name!r} lies under the symlink {under!r}")
    for name, target in links.items():
        _resolve_inside(name, target, links)


def _resolve_inside(name: str, target: str, links: dict[str, str]) -> None:
    """Follow the symlink ``name -> target`` through the bundle's ``links`` (to its end:
    what a later lookup through it reaches); ``UnsafeBundle`` if it leaves the root."""
    if not target or target.startswith("/"):
        raise UnsafeBundle(f"bundle member {name!r} links to the absolute path {target!r}")
    here = name.split("/")[:-1]  # a symlink resolves against its own directory
    todo = target.split("/")
    hops = 0
    while todo:
        part = todo.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if not here:
                raise UnsafeBundle(
                    f"bundle member {name!r} links outside the bundle ({target!r}) through its symlinks"
                )
            here.pop()
            continue
        link = links.get("/".join([*here, part]))
        if link is None:
            here.append(part)
            continue
        hops += 1
        if hops > _MAX_LINK_HOPS:
            raise UnsafeBundle(f"bundle member {name!r} links to {target!r}: a symlink loop")
        if link.startswith("/"):
            raise UnsafeBundle(
                f"bundle member {name!r} links to the absolute path {link!r} through its symlinks"
            )
        todo[:0] = link.split("/")


def _check_member(m: tarfile.TarInfo, seen: dict[str, tarfile.TarInfo]) -> None:
    """What one member may be, by itself and against the ``seen`` ones before it."""
    _check_name(m.name)
    if m.issym() or m.islnk():
        _check_link(m.name, m.linkname, symlink=m.issym())
    elif not (m.isreg() or m.isdir()):
        raise UnsafeBundle(f"bundle member {m.name!r} is a device, fifo or other special file")
    if m.islnk():
        target = seen.get(posixpath.normpath(m.linkname))
        if target is None:
            # tarfile links to an earlier member only; else a bare KeyError mid-extraction
            raise UnsafeBundle(
                f"bundle member {m.name!r} hard-links to {m.linkname!r}, which is no earlier member"
            )
        if target.isdir():
            # no directory can be: tarfile extracts the directory's own member there
            # instead, past the data filter (with the owner and mode it names)
            raise UnsafeBundle(f"bundle member {m.name!r} hard-links to the directory {m.linkname!r}")


def unpack(data: bytes | BinaryIO, dest: str | os.PathLike[str], *, max_bytes: int | None = None) -> None:
    """Unpack a bundle (its bytes, or a file of them: read from its start, never whole)
    into the (new or empty) directory ``dest``; ``UnsafeBundle`` on any member that could
    write outside it, and before anything is written."""
    if isinstance(data, bytes | bytearray | memoryview):
        data = io.BytesIO(data)
    else:
        data.seek(0)
    try:
        tar = tarfile.open(fileobj=data, mode="r:gz")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise UnsafeBundle(f"not a tar.gz bundle: {e}") from None
    with tar:
        members: list[tarfile.TarInfo] = []
        total = 0
        seen: dict[str, tarfile.TarInfo] = {}
        try:
            # one header at a time, each counted as it is read: a bomb of millions of empty
            # entries (a few MB of gzip) is refused at the limit, not after all were parsed
            for m in tar:
                _check_member(m, seen)
                seen[posixpath.normpath(m.name)] = m
                members.append(m)
                # on disk: its bytes in whole blocks, one at least (a directory's, an inode's
                # worth): by content alone, a bomb of empty entries counted nothing
                total += max(1, -(-m.size // _BLOCK_BYTES)) * _BLOCK_BYTES
                if max_bytes is not None and total > max_bytes:
                    raise UnsafeBundle(
                        f"bundle unpacks to more than {max_bytes} bytes of disk (its first "
                        f"{len(members)} entries take about {total}), over the {max_bytes}-byte limit "
                        "(the image cache's max_unpacked_bytes: raise it for an image this big)"
                    )
        except (tarfile.TarError, OSError, EOFError) as e:
            raise UnsafeBundle(f"truncated or corrupt bundle: {e}") from None
        _check_links_on_disk(members)
        if not hasattr(tarfile, "data_filter"):  # pragma: no cover - Python 3.11.0-3.11.3
            raise UnsafeBundle("unpacking bundles safely needs Python >= 3.11.4 (tarfile filters)")
        for m in members:
            # tarfile's fallbacks extract a member past the filter (a hard link it cannot make
            # gets its target's own member): nothing in one may be the archive's to choose
            m.uid, m.gid, m.uname, m.gname = os.geteuid(), os.getegid(), "", ""
            m.mode &= 0o755
        Path(dest).mkdir(parents=True, exist_ok=True)
        try:
            # the "data" filter re-checks against real paths (a member written through an
            # earlier symlink) and drops setuid bits and ownership
            tar.extractall(dest, members=members, filter="data")
        except tarfile.FilterError as e:
            raise UnsafeBundle(f"refused bundle member: {e}") from None
        except (tarfile.TarError, KeyError) as e:
            raise UnsafeBundle(f"malformed bundle: {e}") from None
        except OSError as e:
            # members that clash (a file under a file, a file over a directory, a link loop),
            # or a name too long: the archive's fault, not a fault of the disk to retry
            if e.errno not in _MALFORMED_ERRNOS:
                raise
            why = {errno.ENAMETOOLONG: "a name too long", errno.EMLINK: "too many links"}
            raise UnsafeBundle(f"malformed bundle: {why.get(e.errno, 'its members clash')}: {e}") from None
    # the data filter drops a directory's mode, so tarfile makes each with the umask (as it
    # does the parents a bundle does not list): 0755, as build_bundle made them, whatever
    # umask an operator set (077 closed the bundle to a container of another user)
    for parent, dirnames, _ in os.walk(dest):
        for name in dirnames:
            path = os.path.join(parent, name)
            if not os.path.islink(path):  # (a link to a directory: not walked, its target is)
                os.chmod(path, 0o755)
