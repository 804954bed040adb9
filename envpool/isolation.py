"""What a container's server applies to itself before it serves: its own network namespace
(``isolate_network``; in a user namespace of its own where it is not root), a private view
of its image's bundle as its working directory (``private_view``: an overlay, its writable
layer on disk or in a bounded tmpfs; else the bundle read-only), death with its parent and
resource limits; and the removal of a container's directory with what its view left there
(``remove_scratch``). Linux only, through libc; each step that the kernel refuses leaves the
container with less isolation, which the server reports (``isolation``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import resource
import shutil
import signal
from pathlib import Path
from typing import Any

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 0x1, 0x2, 0x4, 0x20
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_MNT_DETACH = 0x2


def isolate_network() -> str:
    """Enter a fresh network namespace: no interfaces but a down loopback. Without the
    privilege to (not root), in a user namespace of its own as well, where its uid and gid
    map to themselves (``_map_own_ids``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) == 0:
        return "netns"
    uid, gid = os.geteuid(), os.getegid()  # (in the user namespace, unmapped, both read 65534)
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
        _map_own_ids(uid, gid)
        return "userns+netns"
    return "none"


def _map_own_ids(uid: int, gid: int) -> None:
    """Map the uid and gid this process has outside its new user namespace to themselves
    inside, the one mapping the kernel lets a user of no privilege write (``setgroups``
    denied first, as it requires for the gid). Unmapped, the overlay of ``private_view``
    could not be mounted (the bundle was read-only to a non-root runtime's containers), the
    container read its own uid, gid and files' owners as the overflow id (65534), and a user
    namespace it made (a sandbox's) could map no id. What the map changes for it: it sees
    the ids it runs as on the host, as without the namespace; the capabilities it holds in
    the namespace (it held them unmapped too, and an ``exec`` drops them) now reach inodes
    of its own uid, so it may do to its own files what their owner may anyway (chmod them);
    no other uid is mapped, so it can take none, and nothing changes outside the namespace.
    ``setgroups`` stays denied in it and in the user namespaces it makes (its supplementary
    groups, which read as 65534 there, still grant what they did). A map refused (an LSM,
    a kernel that allows none): unmapped, as before, the view read-only."""
    for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError:
            return


def _mount(
    libc: Any, source: str | None, target: str, fstype: str | None, flags: int, data: str = ""
) -> None:
    def c(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    if libc.mount(c(source), c(target), c(fstype), flags, c(data) if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), target)


MEMORY_LAYER_BYTES = 1024**3
"""The default bound of a container's layer where it is a tmpfs (``private_view``): 1 GiB,
``limits.fsize_bytes``'s default, so that a file as large as a container may write on disk
fits in memory too."""


def private_view(
    bundle: Path, scratch: Path, *, memory_layer_bytes: int = MEMORY_LAYER_BYTES
) -> tuple[Path, str]:
    """The bundle as this container sees it, and how: ``(view, "overlay" | "read-only" |
    "shared")`` (an overlay's layer on disk or in memory: ``image_layer``). The unpacked
    bundle is the image cache's, one per node, shared by every container of the image in
    every pool on it: what a container wrote there (its modules' ``__pycache__``, an
    environment's output files, code a policy wrote and ran) every later container of the
    image saw, a state that leaks from episode to episode (one episode can
    leave a file the next one reads, and be rewarded through it), and bytes the cache's
    budget never counted. Docker gives each container a copy-on-write layer; this is ours.

    In a mount namespace of its own (root; not root, in the user namespace of its network's
    isolation, where its own uid is mapped, ``isolate_network``, on a kernel that mounts
    overlayfs in a user namespace, 5.11 up) the container mounts an overlay at
    ``<scratch>/image``: the bundle read-only below, a layer of its own above
    (``<scratch>/.image-layer/upper``), where its writes go and stay. Where the scratch's file
    system takes no upper dir (overlayfs itself: /tmp and the root in a Docker container,
    where the kernel refuses an overlay's upper on overlayfs; NFS), the layer is a tmpfs
    mounted at ``<scratch>/.image-layer`` in the container's namespace, of
    ``memory_layer_bytes`` at most (a write past it fails with ENOSPC): its writes are in
    memory, charged to the memory cgroup its processes are in, and gone with the container, as
    the disk layer is. ``memory_layer_bytes=0``: no layer in memory, read-only there. Where
    the kernel or the filesystems refuse an overlay all the same, the bundle bound there
    read-only: a write fails with EROFS, loudly, for root too. The mounts exist in the
    container's namespace only, which ends with its last process: nothing is left mounted on
    the host, nothing needs unmounting, and the layer goes with the container's directory (or
    its namespace). The cost is a few system calls at its start (no copy), and in a zygote's
    fork as well.

    Limits: with no mount namespace to be had (an unprivileged user without user namespaces,
    or with ``network_namespace`` off: its container makes no user namespace for the view
    alone) the view is the bundle itself, ``"shared"``, as before, and only the bytecode
    caches are kept out of it (``sys.dont_write_bytecode``); the runtime says so on the
    container. The layer's bytes are the container's directory's (or its tmpfs's), not counted
    by the image cache's budget (``limits.fsize_bytes`` bounds each file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return bundle, "shared"
    try:
        # first, or a mount under a shared peer group propagates to the host's namespace
        _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    except OSError:
        return bundle, "shared"
    view, layer = scratch / "image", scratch / ".image-layer"
    try:
        for d in (view, layer):
            d.mkdir()
    except OSError:  # (a user namespace that maps no uid of ours may refuse it)
        return bundle, "shared"
    err = _overlay(libc, bundle, layer, view)
    if err == 0:
        return view, "overlay"
    # no upper dir on the scratch's file system: one in memory. Not where the kernel has no
    # overlayfs, or lets this namespace mount none: a tmpfs would change neither
    if memory_layer_bytes > 0 and err not in (errno.ENODEV, errno.EPERM):
        try:
            # nr_inodes too: size counts data pages only, and the default (half the host's
            # pages) let empty files, directories and links hold kernel memory past the bound;
            # one inode a page, as a small file on disk takes a block
            inodes = max(memory_layer_bytes // 4096, 64)
            options = f"size={memory_layer_bytes},nr_inodes={inodes},mode=0700"
            _mount(libc, "tmpfs", str(layer), "tmpfs", _MS_NOSUID | _MS_NODEV, options)
        except OSError:
            pass  # no tmpfs either: the read-only view below
        else:
            if _overlay(libc, bundle, layer, view) == 0:
                return view, "overlay"
            libc.umount2(os.fsencode(layer), _MNT_DETACH)  # (nothing in it: no memory held)
    try:
        _mount(libc, str(bundle), str(view), None, _MS_BIND | _MS_REC)
        _mount(libc, None, str(view), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    except OSError:
        return bundle, "shared"  # (a bind left writable is no view to give it: unused)
    return view, "read-only"


def image_layer(scratch: Path) -> str:
    """Where the writes of the overlay ``private_view`` mounted in ``scratch`` go: ``"memory"``
    where its layer is the tmpfs (the scratch's file system took no upper dir), or the
    directory in ``scratch`` on a file system held in memory itself (a runtime's root in a
    /tmp that is a tmpfs, as on many hosts); ``"disk"`` where it is that directory on any
    other. Read from the mounts, as the kernel has them in this namespace, not from which
    branch ``private_view`` took: the tmpfs is a mount point, and a tmpfs's type is its own."""
    layer = scratch / ".image-layer"
    return "memory" if os.path.ismount(layer) or _fs_type(layer) in _IN_MEMORY else "disk"


#: ``statfs(2)``'s ``f_type`` of the file systems whose files are held in memory: tmpfs, ramfs.
_IN_MEMORY = frozenset({0x01021994, 0x858458F6})


def _fs_type(path: Path) -> int | None:
    """The ``f_type`` ``statfs(2)`` says of the file system that holds ``path`` (the first
    field of its struct, a C long; the magic numbers are 32 bits), or None where it says none."""
    buf = ctypes.create_string_buffer(256)  # (struct statfs: 120 bytes on 64-bit Linux)
    if ctypes.CDLL(None, use_errno=True).statfs(os.fsencode(path), buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def remove_scratch(path: str | Path) -> None:
    """Remove a container's directory (or a runtime's root of them), what its view left
    there included: the kernel makes an overlay's ``work/work`` with mode 0, which root
    removes regardless but a runtime of no privilege (whose containers mount the overlay in
    their user namespace) could neither list nor empty, so its containers' directories were
    left behind. Errors are ignored, as ``shutil.rmtree(..., ignore_errors=True)``'s."""
    try:
        shutil.rmtree(path)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass  # a directory it may not enter: opened up below, then removed again
    # top-down: each directory is opened up before the walk goes into it; a link is not
    # followed (what a container left could point anywhere its uid owns)
    for root, dirs, _ in os.walk(path):
        for d in dirs:
            with contextlib.suppress(OSError):
                fd = os.open(os.path.join(root, d), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_PATH)
                try:
                    os.chmod(f"/proc/self/fd/{fd}", 0o700)
                finally:
                    os.close(fd)
    shutil.rmtree(path, ignore_errors=True)


def _overlay(libc: Any, bundle: Path, layer: Path, view: Path) -> int:
    """Mount the overlay of ``bundle`` at ``view``, its upper and work dirs in ``layer``:
    0, or the errno that refused it."""
    upper, work = layer / "upper", layer / "work"
    try:
        for d in (upper, work):
            d.mkdir()
    except OSError as e:
        return e.errno or errno.EIO
    # the directories by descriptor: a path with a ',' or a ':' (a user's unpack_dir) would
    # break the overlay's option string
    fds = [os.open(d, os.O_PATH | os.O_DIRECTORY) for d in (bundle, upper, work)]
    try:
        lower, up, wk = (f"/proc/self/fd/{fd}" for fd in fds)
        options = f"lowerdir={lower},upperdir={up},workdir={wk}"
        _mount(libc, "overlay", str(view), "overlay", _MS_NOSUID | _MS_NODEV, options)
        return 0
    except OSError as e:  # no overlay here (the kernel, or an upper dir on overlayfs)
        return e.errno or errno.EIO
    finally:
        for fd in fds:
            os.close(fd)


def die_with_parent(parent_pid: int) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def apply_limits(limits: dict[str, int]) -> None:
    names = {
        "as_bytes": resource.RLIMIT_AS,
        "nofile": resource.RLIMIT_NOFILE,
        "fsize_bytes": resource.RLIMIT_FSIZE,
        "cpu_s": resource.RLIMIT_CPU,
    }
    for key, value in limits.items():
        if value:
            resource.setrlimit(names[key], (value, value))
