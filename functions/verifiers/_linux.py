"""The few Linux syscalls the sandbox needs that Python 3.11's ``os`` lacks (via ctypes).

Each wrapper raises ``OSError`` with the real errno so a failed step says which one and why.
"""

from __future__ import annotations

import ctypes
import os
import platform

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38

# pivot_root has no libc wrapper; its number differs per architecture
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(platform.machine(), -1)
_SYS_CAPSET = {"x86_64": 126, "aarch64": 91}.get(platform.machine(), -1)
# the new mount API (Linux 5.2): the same numbers on every architecture
_SYS_FSCONFIG = 431
_SYS_FSPICK = 433
_FSPICK_CLOEXEC = 1
_FSPICK_EMPTY_PATH = 8
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_RECONFIGURE = 7


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(
            source.encode(),
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {target}",
    )


def umount(target: str, flags: int = 0) -> None:
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl {option}")


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), "sethostname")


def reconfigure(mount_fd: int, key: str, value: str) -> None:
    """Set one option of the filesystem mounted at ``mount_fd`` (its root, even ``O_PATH``).

    Unlike ``mount(MS_REMOUNT)`` this works from outside the mount's namespace, so the
    supervisor can resize a run's tmpfs without entering it."""
    fs = _libc.syscall(_SYS_FSPICK, mount_fd, b"", _FSPICK_EMPTY_PATH | _FSPICK_CLOEXEC)
    if fs < 0:
        _check(fs, "fspick")
    try:
        _check(
            _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_SET_STRING, key.encode(), value.encode(), 0),
            "fsconfig",
        )
        _check(
            _libc.syscall(_SYS_FSCONFIG, fs, _FSCONFIG_CMD_RECONFIGURE, None, None, 0), "fsconfig reconfigure"
        )
    finally:
        os.close(fs)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_all_capabilities() -> None:
    """Empty the effective, permitted and inheritable sets (capset v3, two 32-bit words)."""
    header = _CapHeader(0x20080522, 0)
    data = (_CapData * 2)()
    _check(_libc.syscall(_SYS_CAPSET, ctypes.byref(header), ctypes.byref(data)), "capset")


def sched_getcpu() -> int:
    """The core this thread is running on (as of the call: the kernel may move it)."""
    cpu = _libc.sched_getcpu()
    if cpu < 0:
        _check(cpu, "sched_getcpu")
    return int(cpu)


def pidfd_pid(pidfd: int) -> int:
    """The pid (in our PID namespace) of the process ``pidfd`` refers to; -1 once it has
    been reaped (``/proc/self/fdinfo`` says so since Linux 5.4)."""
    with open(f"/proc/self/fdinfo/{pidfd}") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "Pid":
                return int(value)
    raise OSError(f"/proc/self/fdinfo/{pidfd} names no process (not a pidfd?)")


def supported() -> str | None:
    """``None`` when this machine can run the sandbox, else the reason it cannot."""
    if platform.system() != "Linux":
        return "the code sandbox needs Linux namespaces"
    if _SYS_PIVOT_ROOT < 0:
        return f"unsupported architecture {platform.machine()}"
    if os.geteuid() != 0:
        # it creates namespaces and mounts, then drops every run to an unprivileged uid
        return "the code sandbox must be started as root (in a container: run the worker as root)"
    return None
