"""The capabilities of a ``code-repair-v1`` test run's module where it runs as the env
process's own uid (``run_uid_base=None``: root on the root route, the user namespace's owner
on the user-namespace route). It kept every capability of its namespace: it ptrace-attached to
the namespace's init (still in the env server's process group) and made it kill that group,
the env server with it; it unmounted the run's own ``/proc`` and saw the container's again;
and it joined the env server's network namespace by ``setns`` and reached its localhost. The
runner now drops them all before the module is imported (none left, none to gain by exec), as
a uid of the run's own (a root server's ``run_uid_base``) always did."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
from code_repair_helpers import (
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    edit_action,
    kernel_allows,
    run_env_script,
)

from envpool.envs.code_repair_user import DEFAULT_RUN_UID_BASE

# setpriv takes CAP_SYS_ADMIN from root: the server may not make namespaces itself, and the run
# takes a user namespace of its own, which maps root alone (run_uid_base=None)
_NO_SYS_ADMIN = ["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"]

_ROUTES = {
    # root makes the namespaces itself; the module runs as root
    "root": ([], None, True),
    # root without CAP_SYS_ADMIN: a user namespace of the run's own, whose root the module is
    "user_namespace": (_NO_SYS_ADMIN, None, True),
    # root without a PID namespace (the fallback): the module runs as root all the same
    "root_no_namespace": ([], None, False),
    # root with a uid of the run's own (the default): setresuid dropped them all already
    "root_run_uid": ([], DEFAULT_RUN_UID_BASE, True),
}


def _route_skip(route: str) -> str | None:
    """Why ``route`` cannot be taken here, or None."""
    if os.geteuid() != 0:
        return "each route is a root server's (the module runs as root, or as root of a user namespace)"
    if route == "user_namespace":
        if shutil.which("setpriv") is None:
            return "drops CAP_SYS_ADMIN from root (setpriv)"
        if not kernel_allows(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS):
            return "the kernel refuses a user namespace with PID and mount namespaces here"
    elif route != "root_no_namespace" and not kernel_allows(CLONE_NEWPID | CLONE_NEWNS):
        return "the kernel refuses a PID namespace with a mount namespace here"
    return None


def _run_env(
    tmp_path: Path, route: str, attack: str, runner_edit: tuple[tuple[str, str], ...] = ()
) -> tuple[int, str]:
    """The env's exit status and output, on ``route``."""
    why = _route_skip(route)
    if why is not None:
        pytest.skip(why)
    prefix, uid_base, pid_namespace = _ROUTES[route]
    return run_env_script(
        tmp_path,
        attack,
        prefix=prefix,
        uid_base=uid_base,
        pid_namespace=pid_namespace,
        runner_edit=runner_edit,
    )


def _runs(returncode: int, text: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two runs' info and text, the env alive after them (it closed its env)."""
    assert returncode == 0 and "ENV ALIVE" in text.splitlines(), (returncode, text)
    first, second = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
    assert second["info"]["all_passed"], second["text"]  # the next run in the same env
    return first, second


_CAPS = """
import subprocess as _sp
_status = dict(_l.split(":", 1) for _l in open("/proc/self/status") if _l.startswith(("Cap", "NoNewPrivs")))
print("CAPS", " ".join(f"{_k}={_v.strip()}" for _k, _v in sorted(_status.items())))
# what an exec gives back: root's execve fills its sets from the bounding set
_exec = _sp.run(["/bin/sh", "-c", "grep CapEff /proc/self/status"], capture_output=True, text=True).stdout
print("EXEC", _exec.split())
"""


@pytest.mark.parametrize("route", sorted(_ROUTES))
def test_the_module_holds_no_capability(tmp_path, route):
    first, _ = _runs(*_run_env(tmp_path, route, _CAPS))
    text = first["text"]
    found = re.search(r"^CAPS (.*)$", text, re.MULTILINE)
    assert found, text
    caps = dict(kv.split("=") for kv in found[1].split())
    for name in ("CapEff", "CapPrm", "CapInh", "CapAmb"):
        assert int(caps[name], 16) == 0, text
    if _ROUTES[route][1] is None:  # as the server's own uid: no exec may give them back either
        assert int(caps["CapBnd"], 16) == 0, text
    # on every route no exec gives privileges: a set-uid program in the container (su, mount,
    # passwd) runs as its caller, never as its owner (root)
    assert caps["NoNewPrivs"] == "1", text
    assert "EXEC ['CapEff:', '0000000000000000']" in text, text
    assert first["info"]["all_passed"], text  # the run itself runs as before


# the module stops the init (pid 1 of the run's PID namespace, in the env server's process
# group: a container's kill reaches it there) at its wait and makes it call kill(0, SIGKILL),
# which killed the env server with its whole group (x86_64's registers; elsewhere the attach
# alone is the hole)
_PTRACE_INIT = """
import ctypes as _c, os as _os, platform as _platform
def _attack():
    libc = _c.CDLL(None, use_errno=True)
    libc.ptrace.restype = _c.c_long
    libc.ptrace.argtypes = [_c.c_long, _c.c_long, _c.c_void_p, _c.c_void_p]
    if libc.ptrace(16, 1, None, None) != 0:  # PTRACE_ATTACH
        print("ATTACH REFUSED", _c.get_errno())
        return
    print("ATTACHED", _os.waitpid(1, 0x40000000))  # __WALL
    if _platform.machine() != "x86_64":
        libc.ptrace(17, 1, None, None)  # PTRACE_DETACH
        return
    class _Regs(_c.Structure):
        _fields_ = [(n, _c.c_ulonglong) for n in (
            "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp ss "
            "fs_base gs_base ds es fs gs").split()]
    regs = _Regs()
    libc.ptrace(12, 1, None, _c.byref(regs))  # PTRACE_GETREGS
    if libc.ptrace(1, 1, _c.c_void_p(regs.rip - 2), None) & 0xFFFF == 0x050F:  # after a syscall
        regs.rip -= 2  # that syscall again, as kill(0, SIGKILL)
        regs.rax, regs.rdi, regs.rsi, regs.orig_rax = 62, 0, 9, 2**64 - 1
        libc.ptrace(13, 1, None, _c.byref(regs))  # PTRACE_SETREGS
        print("INJECTED", flush=True)
    libc.ptrace(17, 1, None, None)
    import time
    time.sleep(2)
_attack()
"""


@pytest.mark.parametrize("route", ["root", "user_namespace"])
def test_the_module_cannot_ptrace_the_init(tmp_path, route):
    first, _ = _runs(*_run_env(tmp_path, route, _PTRACE_INIT))
    text = first["text"]
    assert "ATTACH REFUSED 1" in text, text  # EPERM
    assert first["info"]["all_passed"], text


# the module unmounts the run's /proc (its mount namespace's, whose mounts it then could
# change) and lists what is below it
_UMOUNT_PROC = """
import ctypes as _c, os as _os
_libc = _c.CDLL(None, use_errno=True)
print("UMOUNT", _libc.umount2(b"/proc", 2), _c.get_errno())  # MNT_DETACH
print("PIDS", sorted(int(_n) for _n in _os.listdir("/proc") if _n.isdigit()))
"""


@pytest.mark.skipif(not kernel_allows(CLONE_NEWPID | CLONE_NEWNS), reason="no PID and mount namespaces here")
@pytest.mark.parametrize("route", ["root", "user_namespace"])
def test_the_module_cannot_unmount_its_proc(tmp_path, route):
    first, _ = _runs(*_run_env(tmp_path, route, _UMOUNT_PROC))
    text = first["text"]
    assert "UMOUNT -1 1" in text, text  # EPERM
    assert "PIDS [1, 2]" in text, text  # the run's processes alone, never the container's
    assert first["info"]["all_passed"], text


# the module joins the network namespace of a process outside the run (this test's: the env
# server's is the same) and connects to a listener on its loopback
_SETNS = """
import ctypes as _c, os as _os, socket as _socket
_libc = _c.CDLL(None, use_errno=True)
try:
    _fd = _os.open("/proc/{pid}/ns/net", _os.O_RDONLY)
    print("SETNS", _libc.setns(_fd, 0x40000000), _c.get_errno())  # CLONE_NEWNET
except OSError as _e:
    print("OPEN NS", type(_e).__name__)
try:
    _socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
    print("CONNECTED")
except OSError as _e:
    print("CONNECT FAILED", _e.errno)
"""


@pytest.mark.skipif(
    not kernel_allows(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET),
    reason="no PID, mount and network namespaces here",
)
def test_the_module_cannot_join_the_servers_network_namespace(tmp_path):
    # the run's own /proc refused (as where a container masks /proc), so that the module sees
    # the container's processes and their namespaces without unmounting anything first (the
    # test above): only the capability stops setns. The root route alone: in a user namespace
    # of its own the module never held a capability over the server's network namespace
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        attack = _SETNS.format(pid=os.getpid(), port=listener.getsockname()[1])
        proc_refused = (('b"proc", b"/proc", b"proc"', 'b"proc", b"/proc", b"no-such-fs"'),)
        first, _ = _runs(*_run_env(tmp_path, "root", attack, proc_refused))
        text = first["text"]
        # its link refused (a process with capabilities: the module may not trace it), or setns
        # (EPERM: CAP_SYS_ADMIN)
        assert "OPEN NS PermissionError" in text or "SETNS -1 1" in text, text
        assert "CONNECTED" not in text and re.search(r"CONNECT FAILED (101|111)", text), text
        assert first["info"]["all_passed"], text
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing reached it
            listener.accept()


# what a uid 0 without capabilities may still write in a fresh /proc (the file's owner): a
# sysctl (the host's core_pattern, the container's hostname), the sysrq trigger. Opened for
# writing only, never written
_PROC_WRITES = """
import os as _os
for _path in ("/proc/sys/kernel/core_pattern", "/proc/sys/kernel/hostname", "/proc/sysrq-trigger"):
    try:
        _os.close(_os.open(_path, _os.O_WRONLY))
        print("OPENED FOR WRITING", _path)
    except OSError as _e:
        print("REFUSED", _path, _e.errno)
"""


@pytest.mark.skipif(not kernel_allows(CLONE_NEWPID | CLONE_NEWNS), reason="no PID and mount namespaces here")
@pytest.mark.parametrize("route", ["root", "user_namespace"])
def test_the_runs_proc_is_read_only_where_uid_0_writes_without_capabilities(tmp_path, route):
    # the run's own /proc, a fresh proc, had a writable /proc/sys where a container's is
    # read-only (Docker's): a module run as uid 0 (the server's own, on either route), though
    # without capabilities, could set the host's core_pattern (a program the kernel runs as
    # root on a crash). Read-only there, as Docker makes them: sys, sysrq-trigger, irq, bus, fs
    first, _ = _runs(*_run_env(tmp_path, route, _PROC_WRITES))
    text = first["text"]
    assert "OPENED FOR WRITING" not in text, text
    assert "REFUSED /proc/sys/kernel/core_pattern 30" in text, text  # EROFS
    assert first["info"]["all_passed"] and "isolation" not in first["info"], first


def test_a_module_whose_capabilities_cannot_be_dropped_is_never_run(tmp_path, monkeypatch):
    # the runner refuses (caps_error) rather than import the module with them: the env says why
    import envpool
    from envpool.envs import code_repair_runner
    from envpool.errors import EnvUsageError

    runner = code_repair_runner.RUNNER
    assert "def drop_caps():\n" in runner
    refused = "def drop_caps():\n    raise OSError('refused for this test')\n"
    monkeypatch.setattr(code_repair_runner, "RUNNER", runner.replace("def drop_caps():\n", refused))
    marker = tmp_path / "imported"
    env = envpool.make("code-repair-v1", workdir_root=str(tmp_path), run_uid_base=None)
    try:
        env.reset(options={"task": "mathutils"})
        planted = f"open({str(marker)!r}, 'w').close()\n"
        assert env.step(edit_action("mathutils.py", "def add", planted + "def add")).info["valid"]
        with pytest.raises(
            EnvUsageError, match=r"could not be stripped of its capabilities \(refused for this test\)"
        ):
            env.step("run_tests")
    finally:
        env.close()
    assert not marker.exists()  # the module was never imported
