"""The read-only root every sandboxed run sees, built once by the zygote.

The zygote enters its own mount namespace, assembles a small tree on a tmpfs (the system
directories, the Python installation and ``/dev/{null,zero,random,urandom}`` bind-mounted
read-only, ``/dev/{fd,stdin,stdout,stderr}`` linked into ``/proc/self/fd``, ``/sys/devices/system/cpu``
saying how many cores runs see, empty ``/sandbox``, ``/tmp``, ``/dev/shm`` and ``/proc``
mount points) and ``pivot_root``s into it.
Every run then copies that namespace (a dozen mounts, so the copy is cheap) and only adds
its own size-limited tmpfs at ``/sandbox`` (also seen as ``/tmp``) and at ``/dev/shm``.
Nothing else of the host is visible: not ``/root``, not the project checkout, not other
runs' files.

Stdlib only: this module runs inside the zygote, which stays small so forks stay cheap.
"""

from __future__ import annotations

import os
import sys
import tempfile

from functions.verifiers import _linux as lx

#: Directories shared read-only with every run (when they exist on this machine).
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/opt")
DEVICES = ("null", "zero", "random", "urandom")
STREAM_LINKS = (
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
)
#: Mount points every run covers with its own tmpfs.
PER_RUN = ("/sandbox", "/tmp", "/dev/shm")
HIDDEN = "/.rlfabric"
#: (hidden path, real path) of shared directories that live under a per-run mount point.
RELOCATED: list[tuple[str, str]] = []
RO_FLAGS = lx.MS_BIND | lx.MS_REMOUNT | lx.MS_RDONLY | lx.MS_NOSUID | lx.MS_NODEV


def _python_dirs() -> list[str]:
    # each both resolved and as sys names it: a virtualenv reached through a link (`.venv ->
    # /opt/venvs/x`) keeps the link's path in sys.prefix and on sys.path, where runs look
    prefixes = (sys.base_prefix, sys.prefix, sys.exec_prefix)
    dirs = {f(p) for p in prefixes for f in (os.path.realpath, os.path.abspath)}
    return sorted(d for d in dirs if not any(d == s or d.startswith(s + "/") for s in SYSTEM_DIRS))


def _links_into_system_dirs(path: str) -> bool:
    """Whether ``path`` is a link to within another of the system dirs, so that the jail's
    copy of the link resolves there as it does here. One to anywhere else (``/opt ->
    /data/opt``) pointed at nothing in the jail: it is bound as its target instead."""
    if not os.path.islink(path):
        return False
    target = os.path.normpath(os.path.join(os.path.dirname(path), os.readlink(path)))
    return any(
        target == d or target.startswith(d + "/") for d in SYSTEM_DIRS if d != path and os.path.exists(d)
    )


def _bind_ro(src: str, dst: str, flags: int = RO_FLAGS) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()  # a file bind needs a file to mount over
    lx.mount(src, dst, None, lx.MS_BIND | lx.MS_REC)
    # the bind itself ignores MS_RDONLY; it takes a remount, and submounts need their own
    for target in _mounts_under(dst):
        lx.mount("none", target, None, flags)


def _mounts_under(path: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        targets = [_unescape(line.split()[4]) for line in f]
    return [t for t in targets if t == path or t.startswith(path + "/")]


def _unescape(field: str) -> str:
    """A mountinfo path as it is: the kernel writes a space, tab, newline and backslash in it
    as ``\\ooo`` (octal); matched as written, a bind at "/x/my venv" was never found, so
    never remounted read-only."""
    # (a backslash of the path is itself written \134: each one starts an escape)
    head, *rest = field.split("\\")
    return head + "".join(chr(int(p[:3], 8)) + p[3:] for p in rest)


def restore_relocated() -> None:
    """In a run's mount namespace, after its tmpfs covers ``PER_RUN``: bind the
    shared directories that lived there back, read-only (their parents are root's)."""
    for hidden, real in RELOCATED:
        os.makedirs(real, exist_ok=True)
        lx.mount(hidden, real, None, lx.MS_BIND | lx.MS_REC)
        lx.mount("none", real, None, RO_FLAGS)


#: Precompiled headers for the C++ compiles (``native_pch``): built on the host, read-only in
#: every run; the same path on both sides.
PCH_DIR = "/var/cache/rlfabric-pch"


def prepare_pch_dir() -> tuple[str, ...]:
    """``(PCH_DIR,)``, made if missing; ``()`` where it is not root's alone (another user
    could write what the compiles read), which keeps it out of the jail."""
    try:
        os.makedirs(PCH_DIR, mode=0o755, exist_ok=True)
        st = os.stat(PCH_DIR)
    except OSError:
        return ()
    return () if st.st_uid != os.getuid() or st.st_mode & 0o022 else (PCH_DIR,)


#: Cores a run sees by default (``SandboxConfig.cpus``): with the host's, on a 64-core worker,
#: ``multiprocessing.Pool()``, ``ProcessPoolExecutor()`` and ``ThreadPoolExecutor()`` sized
#: themselves past the run's ``nproc`` (32) and died, and a right program scored 0. More
#: workers buy nothing anyway: the run's CPU limit counts all its processes together.
CPUS = 2
#: What glibc reads for ``sysconf(_SC_NPROCESSORS_ONLN)`` (Python's ``os.cpu_count()``) and
#: ``_SC_NPROCESSORS_CONF``; without them it falls back to ``/proc/stat``, the host's.
CPU_FILES = ("online", "possible", "present")


def _write_cpus(root: str, cpus: int) -> None:
    """``/sys/devices/system/cpu/{online,...}`` saying ``0-<cpus - 1>``: all of ``/sys`` a
    run sees. (``sched_getaffinity``, which ``nproc`` reads, says as many because each run
    pins itself to that many cores: ``program._pin``.)"""
    os.makedirs(root + "/sys/devices/system/cpu")
    text = f"0-{cpus - 1}\n" if cpus > 1 else "0\n"
    for name in CPU_FILES:
        with open(f"{root}/sys/devices/system/cpu/{name}", "w") as f:
            f.write(text)


#: Where the runs' init is, in the jail, when there is one for this machine (``init.py``).
INIT = "/.rlfabric-init"


def enter(extra_ro: tuple[str, ...] = (), init: bytes | None = None, cpus: int = CPUS) -> str:
    """Build the jail and make it this process's root (with ``init`` as ``INIT``). Returns
    the list of what is shared."""
    lx.unshare(lx.CLONE_NEWNS)
    lx.mount("none", "/", None, lx.MS_REC | lx.MS_PRIVATE)  # nothing propagates back to the host
    root = tempfile.mkdtemp(prefix="rlfabric-jail-")
    lx.mount("tmpfs", root, "tmpfs", lx.MS_NOSUID | lx.MS_NODEV, "size=1m,mode=755")
    shared = []
    for src in (*SYSTEM_DIRS, *_python_dirs(), *extra_ro):
        if not os.path.exists(src):
            continue
        if any(src == d or src.startswith(d + "/") for d in PER_RUN):
            # a virtualenv in /tmp (a CI checkout) or /dev/shm: each run's own tmpfs there
            # would hide it, so it waits at a hidden path and each run binds it back
            hidden = f"{HIDDEN}/{len(RELOCATED)}"
            _bind_ro(os.path.realpath(src), root + hidden)
            RELOCATED.append((hidden, src))
        elif src in SYSTEM_DIRS and _links_into_system_dirs(src):  # /bin -> usr/bin (merged /usr)
            # (a venv's link is bound below: its parent dirs exist only once a bind makes them)
            os.symlink(os.readlink(src), root + src)
        else:
            _bind_ro(os.path.realpath(src), root + src)
        shared.append(src)
    # there already when a shared dir lives under /dev (a venv in /dev/shm): its bind made it
    os.makedirs(root + "/dev", exist_ok=True)
    for dev in DEVICES:
        # read-only still lets a program write to /dev/null: that goes to the driver
        _bind_ro("/dev/" + dev, f"{root}/dev/{dev}", RO_FLAGS & ~lx.MS_NODEV)
    # as on a host (the run's /proc is its own, so they name the run's descriptors): a
    # program that read "/dev/stdin" died of FileNotFoundError
    for name, target in STREAM_LINKS:
        os.symlink(target, f"{root}/dev/{name}")
    for name in ("sandbox", "tmp", "dev/shm", "proc"):
        os.makedirs(f"{root}/{name}", exist_ok=True)
    _write_cpus(root, cpus)
    if init is not None:  # root's, and read-only with the rest once the root is remounted
        fd = os.open(root + INIT, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o555)
        try:
            os.write(fd, init)
        finally:
            os.close(fd)
    os.makedirs(root + "/.old")
    lx.pivot_root(root, root + "/.old")
    os.chdir("/")
    os.rmdir("/.old" + root)  # the host-side mount point; the tmpfs now lives on as our root
    lx.umount("/.old", lx.MNT_DETACH)
    os.rmdir("/.old")
    lx.mount("none", "/", None, lx.MS_REMOUNT | lx.MS_RDONLY | lx.MS_NOSUID | lx.MS_NODEV)
    return ",".join(shared)
