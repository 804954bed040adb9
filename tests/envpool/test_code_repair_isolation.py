"""What a ``code-repair-v1`` test run is cut off from, beyond its PID namespace: the network
(a network namespace of its own, whose loopback is down: no localhost service, the env
server's own TCP port included, is reachable from the policy's module) and the container's
processes (a ``/proc`` of the run's PID namespace: the module lists only the run's own
processes and reads no other command line). Where the kernel refuses either, a run still runs,
as before, and says so: the step's ``info["isolation"]`` names each part it got or not, and the
env warns once."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
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
)

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair, code_repair_runner

FIX = ("    return a - b", "    return a + b")


def _either_route_allows(flags: int) -> bool:
    """Whether a run can have ``flags``: as this process is, or in a user namespace of its own
    (the runner's two routes)."""
    return kernel_allows(flags) or kernel_allows(flags | CLONE_NEWUSER)


@contextlib.contextmanager
def _env(tmp_path: Path, **kwargs: Any) -> Iterator[Any]:
    """An env on the mathutils task, fixed, whose work dirs are under ``tmp_path/work``."""
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make("code-repair-v1", workdir_root=str(work), test_timeout_s=20, **kwargs)
    try:
        env.reset(options={"task": "mathutils"})
        env.step(edit_action("mathutils.py", *FIX))
        yield env
    finally:
        env.close()


_FULL = dict.fromkeys(code_repair_runner.ISOLATION, True)


def _full_isolation_here() -> bool:
    """Whether a run on the root route gets every part of its isolation here (root: the
    namespaces, the mounts, and the module's uid of its own, which holds no capability)."""
    return os.geteuid() == 0 and kernel_allows(CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET)


@contextlib.contextmanager
def _reported(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, bool] | None]]:
    """The isolation each run of the env reported (``RunOutput.isolation``), in order."""
    seen: list[dict[str, bool] | None] = []

    def run_checks(*args: Any, **kwargs: Any) -> code_repair_runner.RunOutput:
        out = code_repair_runner.run_checks(*args, **kwargs)
        seen.append(out.isolation)
        return out

    monkeypatch.setattr(code_repair, "run_checks", run_checks)
    yield seen


def _run_with(env: Any, code: str) -> Any:
    """One test run whose module runs ``code`` at import."""
    assert env.step(edit_action("mathutils.py", "def add", code + "def add")).info["valid"]
    return env.step("run_tests")


_CONNECT = """
import socket as _socket
try:
    _socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
    print("CONNECTED")
except OSError as _e:
    print("CONNECT FAILED", type(_e).__name__, _e.errno)
"""


@pytest.mark.skipif(
    not _either_route_allows(CLONE_NEWPID | CLONE_NEWNET),
    reason="the kernel refuses a network namespace (with a PID namespace) here, even in a user namespace",
)
def test_a_module_cannot_reach_a_localhost_listener(tmp_path):
    # the run shared the container's network: a module connected to the env server's own TCP
    # port (a container with a network of its own serves on host:port) and to whatever else
    # the container reaches. In a network namespace of its own loopback is down
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        with _env(tmp_path) as env:
            res = _run_with(env, _CONNECT.format(port=port))
        text = res.obs.text
        assert "CONNECTED" not in text, text
        # ENETUNREACH (no route: loopback is down), or ECONNREFUSED where it is up
        found = re.search(r"CONNECT FAILED (\w+) (\d+)", text)
        assert found and int(found[2]) in (101, 111), text
        assert res.info["all_passed"], text  # the run itself runs as before
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing reached it
            listener.accept()


_LIST_PROC = """
import os as _os
print("PIDS", sorted(int(_n) for _n in _os.listdir("/proc") if _n.isdigit()))
for _pid in ({pids}):
    try:
        open(f"/proc/{{_pid}}/cmdline", "rb").read()
        print("READ CMDLINE", _pid)
    except OSError as _e:
        print("CMDLINE REFUSED", _pid, type(_e).__name__)
"""


@pytest.mark.skipif(
    not _either_route_allows(CLONE_NEWPID | CLONE_NEWNS),
    reason="the kernel refuses a PID namespace with a mount namespace here, even in a user namespace",
)
def test_a_module_sees_only_its_runs_processes_in_proc(tmp_path):
    # /proc was the container's: a module listed every process of the server's PID namespace
    # and read their command lines (the server's, a sibling's). A proc of the run's PID
    # namespace lists only the run's: its init (1) and runner (2)
    with subprocess.Popen(["sleep", "60"]) as sleeper:
        try:
            pids = (os.getpid(), os.getppid(), sleeper.pid)
            with _env(tmp_path) as env:
                res = _run_with(env, _LIST_PROC.format(pids=", ".join(map(str, pids))))
        finally:
            sleeper.kill()
    text = res.obs.text
    found = re.search(r"PIDS \[([\d, ]*)\]", text)
    assert found, text
    listed = [int(p) for p in found[1].split(",") if p.strip()]
    assert listed == [1, 2], text
    assert "READ CMDLINE" not in text, text
    for pid in pids:
        assert f"CMDLINE REFUSED {pid} FileNotFoundError" in text, text
    assert res.info["all_passed"], text


@pytest.mark.skipif(
    not _full_isolation_here(), reason="a run gets its full isolation as root with namespaces"
)
def test_a_run_reports_its_full_isolation(tmp_path, monkeypatch, caplog):
    # the runner's report, before the module ran: every part True on the root route here. The
    # step's info carries it only where a part is missing, and nothing is logged
    with _reported(monkeypatch) as seen, _env(tmp_path) as env, caplog.at_level(logging.WARNING):
        res = env.step("run_tests")
    assert seen == [_FULL], seen
    assert "isolation" not in res.info and res.info["all_passed"], res.info
    assert not [r for r in caplog.records if "isolation" in r.getMessage()], caplog.text


_FAKE_REPORT = """
import os as _os
_os.write(int(__import__("sys").argv[3]), bytes([0xFF]))  # a report of full isolation, too late
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a part missing where the env process is not root")
def test_a_module_cannot_write_the_isolation_report(tmp_path, monkeypatch):
    # the report is the first byte on the done pipe, written by the runner before the module is
    # imported: a module that writes one there only sends a done byte (its results cut short),
    # and the report stays the runner's. Here with the network namespace refused (the test
    # below), so that the runner's own report is not the one the module fakes
    refused = code_repair_runner.RUNNER.replace("libc.unshare(0x40000000)", "libc.unshare(0x1)")
    monkeypatch.setattr(code_repair_runner, "RUNNER", refused)
    with _reported(monkeypatch) as seen, _env(tmp_path) as env:
        res = _run_with(env, _FAKE_REPORT)
    assert seen and seen[0] is not None and not seen[0]["net_ns"], seen
    assert res.info["isolation"]["net_ns"] is False, res.info


# the user-namespace route, taken where the server may not make namespaces itself (no
# CAP_SYS_ADMIN) and runs the module as its own user: this test's root without the capability,
# its run_uid_base None (a user namespace maps only the server's ids, and root's uid base is
# outside it)
_USER_ROUTE = """
import json, envpool, envpool.envs
env = envpool.make("code-repair-v1", workdir_root={work!r}, run_uid_base=None, test_timeout_s=20)
env.reset(options={{"task": "mathutils"}})
code = {code!r}
edit = "edit mathutils.py\\n<<<<<<< SEARCH\\ndef add\\n=======\\n" + code + "def add\\n>>>>>>> REPLACE"
assert env.step(edit).info["valid"]
fix = "edit mathutils.py\\n<<<<<<< SEARCH\\n    return a - b\\n=======\\n    return a + b\\n>>>>>>> REPLACE"
assert env.step(fix).info["valid"]
from envpool.envs import code_repair, code_repair_runner
def run_checks(*args, **kwargs):
    out = code_repair_runner.run_checks(*args, **kwargs)
    print("ISOLATION", json.dumps(out.isolation))
    return out
code_repair.run_checks = run_checks
print(env.step("run_tests").obs.text)
env.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops CAP_SYS_ADMIN from root (setpriv)")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.skipif(
    not kernel_allows(CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWNET),
    reason="the kernel refuses a user namespace with PID, mount and network namespaces here",
)
def test_the_user_namespace_route_cuts_the_network_and_proc_too(tmp_path):
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener,
        subprocess.Popen(["sleep", "60"]) as sleeper,
    ):
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(4)
            code = (
                _CONNECT.format(port=listener.getsockname()[1])
                + _LIST_PROC.format(pids=f"{os.getpid()}, {sleeper.pid}")
                + 'print("UID MAP", open("/proc/self/uid_map").read().split())\n'
            )
            script = _USER_ROUTE.format(work=str(tmp_path), code=code)
            out = subprocess.run(
                [
                    "setpriv",
                    "--bounding-set",
                    "-sys_admin",
                    "--inh-caps",
                    "-sys_admin",
                    sys.executable,
                    "-c",
                    script,
                ],
                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                capture_output=True,
                text=True,
                timeout=60,
            )
        finally:
            sleeper.kill()
        text = out.stdout + out.stderr
        assert "UID MAP ['0', '0', '1']" in text, text  # a user namespace that maps root alone
        assert "CONNECTED" not in text and re.search(r"CONNECT FAILED \w+ (101|111)", text), text
        assert "PIDS [1, 2]" in text and "READ CMDLINE" not in text, text
        assert "Tests: 3 passed, 0 failed" in text, text
        # every part reported (a container that masks /proc would refuse its own: own_proc false)
        assert f"ISOLATION {json.dumps(_FULL)}" in text, text
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize(
    "old, new, part",
    [
        # an unknown clone flag: EINVAL, as from a kernel or seccomp profile that refuses netns
        ("libc.unshare(0x40000000)", "libc.unshare(0x1)", "net_ns"),
        # a file system type the kernel does not know: ENODEV (as from a container that masks
        # paths under /proc, on the user-namespace route)
        ('b"proc", b"/proc", b"proc"', 'b"proc", b"/proc", b"no-such-fs"', "own_proc"),
        # its read-only parts refused (a bind of a type the kernel does not know): the fresh
        # proc unmounted again, never left writable
        (
            "libc.mount(path, path, None, 0x1000, None)",
            'libc.mount(path, path, b"no-such-fs", 0, None)',
            "own_proc",
        ),
    ],
    ids=["netns_refused", "proc_refused", "proc_read_only_refused"],
)
def test_a_run_runs_where_its_netns_or_proc_is_refused(tmp_path, monkeypatch, caplog, old, new, part):
    # what the kernel refuses is left as it was: the run runs, and passes; and says what it
    # lacked, in each run's info and in one warning per env
    assert old in code_repair_runner.RUNNER
    monkeypatch.setattr(code_repair_runner, "RUNNER", code_repair_runner.RUNNER.replace(old, new))
    with _env(tmp_path) as env, caplog.at_level(logging.WARNING, logger=code_repair.__name__):
        first = env.step("run_tests")
        second = env.step("run_tests")
    for res in (first, second):
        assert res.info["all_passed"], res.obs.text
        assert res.info["isolation"][part] is False, res.info
        if _full_isolation_here():  # that part alone
            assert res.info["isolation"] == {**_FULL, part: False}, res.info
    warnings = [r.getMessage() for r in caplog.records if r.name == code_repair.__name__]
    assert len(warnings) == 1 and part in warnings[0], warnings
