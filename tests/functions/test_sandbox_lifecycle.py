"""The sandbox's lifecycle: closing it, its client or zygote dying, and a race made
deterministic with ptrace. Each test has a sandbox of its own (``own_sandbox`` ranges) and
checks from outside that nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from sandbox_probe import (
    OWN_BASES,
    PTRACE_DETACH,
    PTRACE_O_TRACEFORK,
    PTRACE_SEIZE,
    WALL,
    is_zygote_family,
    jail_dirs,
    kill_orphaned_inits,
    live_in_range,
    orphaned_inits,
    own_sandbox,
    ptrace,
    py,
    settled_runs,
    stale_jail_dirs,
    stop_at_program_fork,
    wait_no_live,
)

from functions.verifiers import _linux
from functions.verifiers.errors import SandboxError
from functions.verifiers.sandbox import Limits, RunOutcome, Sandbox, SandboxConfig, _package_root

pytestmark = [
    pytest.mark.skipif(_linux.supported() is not None, reason=str(_linux.supported())),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the attacks use x86_64 syscall numbers"),
]


def test_close_leaves_nothing_running():
    base = next(OWN_BASES)
    box = Sandbox(SandboxConfig(base_uid=base, spares=2))
    box.start()
    outcome: list[object] = []

    def long_run():
        try:
            outcome.append(py(box, "import os, time\nos.fork()\ntime.sleep(30)", Limits(cpu_s=30, wall_s=30)))
        except SandboxError as e:
            outcome.append(e)

    t = threading.Thread(target=long_run)
    t.start()
    time.sleep(0.4)
    assert len(live_in_range(base)) >= 3  # two program processes and a spare
    zygote = box._zygote
    assert zygote is not None
    box.close()
    t.join(5)
    assert isinstance(outcome[0], SandboxError)
    assert zygote.poll() is not None
    kill_orphaned_inits(base)
    assert wait_no_live(base, 3.0), live_in_range(base)


CLIENT = """
import sys, time
from functions.verifiers.sandbox import Limits, Sandbox, SandboxConfig
box = Sandbox(SandboxConfig(base_uid=int(sys.argv[1]), spares=2))
box.start()
print(box._zygote.pid, flush=True)
box.run_python("import os, time\\nif os.fork() == 0:\\n    os.setsid()\\ntime.sleep(60)",
               limits=Limits(cpu_s=60, wall_s=60))
"""


def test_a_killed_client_leaves_nothing_running():
    base = next(OWN_BASES)
    env = {**os.environ, "PYTHONPATH": _package_root()}
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, str(base)], stdout=subprocess.PIPE, env=env, cwd=_package_root()
    )
    try:
        assert client.stdout is not None
        zygote = int(client.stdout.readline())
        deadline = time.monotonic() + 5
        while len(live_in_range(base)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(live_in_range(base)) >= 3  # the run (two processes) and a spare
    finally:
        client.kill()
        client.wait()
        kill_orphaned_inits(base)
    assert wait_no_live(base, 3.0), live_in_range(base)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and is_zygote_family(str(zygote)):
        time.sleep(0.05)
    assert not is_zygote_family(str(zygote)), "the zygote outlived its client"


RUN_ONCE = """
import sys
from functions.verifiers.sandbox import Sandbox, SandboxConfig
box = Sandbox(SandboxConfig(base_uid=int(sys.argv[1]), spares=2))
box.start()
assert box.run_python("print(1)").stdout == b"1\\n"
print(box._zygote.pid, flush=True)
sys.stdin.read()
"""


def test_a_killed_process_group_of_the_client_leaves_the_zygote_its_cleanup():
    """The local pool kills a worker's whole process group (to end what its function forked).
    The zygote leads a session of its own, so that kill does not reach it: it sees its
    client gone, ends the runs and removes its cgroups (the worker's group once held it too,
    and each close of a pool that ran the code verifier left the cgroup dirs behind)."""
    base = next(OWN_BASES)
    env = {**os.environ, "PYTHONPATH": _package_root()}
    client = subprocess.Popen(
        [sys.executable, "-c", RUN_ONCE, str(base)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=_package_root(),
        start_new_session=True,
    )
    try:
        assert client.stdout is not None
        zygote = int(client.stdout.readline())
    finally:
        os.killpg(client.pid, signal.SIGKILL)
        client.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (is_zygote_family(str(zygote)) or _cgroups_of(zygote)):
        time.sleep(0.02)
    kill_orphaned_inits(base)
    assert not is_zygote_family(str(zygote)), "the zygote outlived its client"
    assert _cgroups_of(zygote) == []
    assert wait_no_live(base, 3.0), live_in_range(base)


def _cgroups_of(zygote: int) -> list[str]:
    roots = [Path("/sys/fs/cgroup", ctl) for ctl in ("cpuacct", "memory")]
    return [str(p) for root in roots for p in root.glob(f"**/rlfabric-{zygote}")]


def test_start_and_close_leave_no_jail_dirs_or_mounts():
    before = jail_dirs()
    mounts = Path("/proc/self/mountinfo").read_text()
    for _ in range(3):
        with own_sandbox() as box:
            assert py(box, "print(5)").stdout == b"5\n"
    assert stale_jail_dirs(before) == []
    assert Path("/proc/self/mountinfo").read_text() == mounts


def test_a_client_gone_with_spares_unread_ends_the_zygote_cleanly():
    """A client killed (not closed) with a spare unread in its queue makes the zygote's next
    read fail with ECONNRESET rather than return EOF: gone all the same, so the zygote still
    ends its runs and removes its cgroups, and prints no traceback."""
    base = next(OWN_BASES)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cmd = [sys.executable, "-m", "functions.verifiers.zygote", str(base), "1", "1"]  # one spare
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": _package_root()}
    zygote = subprocess.Popen(
        cmd, stdin=theirs.fileno(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd="/"
    )
    theirs.close()
    try:
        ours.settimeout(30)
        hello = json.loads(ours.recv(65536))
        assert hello["ready"], hello
        # the spare arrived, stays unread, and the zygote made all it will: it waits to read
        assert ours.recv(4096, socket.MSG_PEEK)
        ours.close()
        _, err = zygote.communicate(timeout=10)
    finally:
        ours.close()
        if zygote.poll() is None:
            zygote.kill()
            zygote.wait()
        kill_orphaned_inits(base)
    assert (zygote.returncode, err.decode()) == (0, "")
    assert [p for p in hello["cgroups"].values() if os.path.exists(p)] == []
    assert wait_no_live(base, 3.0), live_in_range(base)


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtualenv to reach through a link")
@pytest.mark.parametrize(
    # a plain path; one each run's /tmp hides; one under /dev, which the jail makes itself
    "under",
    [
        "/var/tmp",
        "/tmp",
        pytest.param(
            "/dev/shm", marks=pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
        ),
    ],
)
def test_a_virtualenv_reached_through_a_symlink_is_importable_in_runs(under):
    """A venv reached through a link (`.venv -> /opt/venvs/x`) keeps the link's path in
    sys.prefix and sys.path; the jail had only the resolved one, so a run could import
    nothing of the venv's (a program's `import numpy` scored 0, libclang was "missing").
    Under /dev the jail's set-up crashed: its bind made the jail's /dev, which the set-up
    then made again for the devices (FileExistsError)."""
    made = tempfile.mkdtemp(prefix="rlfabric-test-venvlink-", dir=under)
    try:
        link = os.path.join(made, "venv")
        os.symlink(os.path.realpath(sys.prefix), link)
        with own_sandbox(python=os.path.join(link, "bin", "python")) as box:
            out = py(box, "import sys, pydantic\nprint(sys.prefix)")
        assert (out.status, out.stdout.decode().strip()) == ("exited", link), out
    finally:
        shutil.rmtree(made)


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a virtualenv to reach through a link")
def test_a_shared_directory_whose_path_has_a_space_is_read_only_in_runs():
    """/proc/self/mountinfo writes a space in a mount point as ``\\040``: the jail looked for
    the bind of a venv at "/var/tmp/x/my venv" under its plain name, found none, and left
    it as bound: writable (and suid, dev) in every run."""
    made = tempfile.mkdtemp(prefix="rlfabric-test-venv space-", dir="/var/tmp")
    try:
        link = os.path.join(made, "my venv")
        os.symlink(os.path.realpath(sys.prefix), link)
        with own_sandbox(python=os.path.join(link, "bin", "python")) as box:
            out = py(
                box, "import os, sys\nprint(sys.prefix, bool(os.statvfs(sys.prefix).f_flag & os.ST_RDONLY))"
            )
        assert (out.status, out.stdout.decode().strip()) == ("exited", f"{link} True"), out
    finally:
        shutil.rmtree(made)


_ENTER_WITH_LINKED_SYSTEM_DIR = """
import json, os, sys
from functions.verifiers import jail
plain, link = sys.argv[1:3]
host_bin_is_link = os.path.islink("/bin")
jail.SYSTEM_DIRS = (*jail.SYSTEM_DIRS, plain, link)  # plain first: its bind makes the link's parent
jail.enter()
print(json.dumps({
    "listed": sorted(os.listdir(link)) if os.path.isdir(link) else None,
    "bin_kept_as_it_is": os.path.islink("/bin") == host_bin_is_link and os.path.exists("/bin/sh"),
}))
"""


def test_a_system_dir_that_links_outside_the_system_dirs_shows_its_files_in_the_jail():
    """A system dir that is a link (``/opt -> /data/opt``) was copied into the jail as that
    link, which resolves only where its target is shared too (``/bin -> usr/bin``): one to
    anywhere else pointed at nothing, and the runs saw no such directory."""
    made = tempfile.mkdtemp(prefix="rlfabric-test-syslink-", dir="/var/tmp")
    try:
        os.makedirs(f"{made}/plain")
        os.makedirs(f"{made}/elsewhere")
        Path(made, "elsewhere", "tool.txt").write_text("here\n")
        os.symlink(f"{made}/elsewhere", f"{made}/link")  # neither it nor its target a system dir
        done = subprocess.run(
            [sys.executable, "-c", _ENTER_WITH_LINKED_SYSTEM_DIR, f"{made}/plain", f"{made}/link"],
            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": _package_root()},
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        shutil.rmtree(made)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"listed": ["tool.txt"], "bin_kept_as_it_is": True}


# -- a race made deterministic: PR_SET_PDEATHSIG is set after fork ---------------------------
def test_a_zygote_dying_right_after_forking_the_program_leaves_no_orphan(monkeypatch):
    """Freeze a fresh program at birth (ptrace), before it arms PR_SET_PDEATHSIG, and kill
    its parent, the zygote: nothing signals the program then, but the run's namespace
    outlives the zygote only as long as its supervisor holds the init's pipe, so closing
    the sandbox ends the frozen program with the namespace."""
    base = next(OWN_BASES)
    box = Sandbox(SandboxConfig(base_uid=base, spares=1))
    box.start()
    frozen = None
    try:
        assert box._zygote is not None
        zygote = box._zygote.pid
        for _ in range(3):  # every slot the runs below use has its namespaces already
            assert py(box, "print(1)").stdout == b"1\n"
        settled_runs(zygote, 1)
        # this process is the zygote's parent and now its tracer too: the client's liveness
        # check (Popen.poll, a waitpid) would reap the zygote's ptrace stops, read one as the
        # zygote's death and restart it, leaving the traced one stopped and unseen (1 run in
        # ~15 hung here). While traced, the run takes the spare without that check.
        monkeypatch.setattr(box, "start", lambda: None)
        ptrace(PTRACE_SEIZE, zygote, PTRACE_O_TRACEFORK)
        # a run makes the zygote make a replacement spare (and forward the run's status,
        # which it can only do while we let it run)
        runs: list[RunOutcome] = []
        t = threading.Thread(target=lambda: runs.append(py(box, "print(1)")))
        t.start()
        frozen = stop_at_program_fork(zygote)
        ptrace(PTRACE_DETACH, zygote)
        monkeypatch.undo()
        t.join(10)
        assert runs and runs[0].stdout == b"1\n"
        deadline = time.monotonic() + 3
        while box._spares.empty() and time.monotonic() < deadline:  # the spare reaches us
            time.sleep(0.01)
        assert not box._spares.empty()
        os.kill(zygote, signal.SIGKILL)
        time.sleep(0.1)
        assert os.waitpid(frozen, WALL | os.WNOHANG) == (0, 0), "no signal reaches the frozen program"
        box.close()  # the spare's pipe to its init closes: the namespace ends
        deadline = time.monotonic() + 3
        ended, status = 0, 0
        while not ended and time.monotonic() < deadline:
            ended, status = os.waitpid(frozen, WALL | os.WNOHANG)  # its tracer sees it end
            time.sleep(0.02)
        assert ended, "the frozen program outlived its sandbox"
        frozen = None
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        deadline = time.monotonic() + 3
        while orphaned_inits(base) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert orphaned_inits(base) == []
    finally:
        if frozen is not None:
            with contextlib.suppress(OSError):
                os.kill(frozen, signal.SIGKILL)
                ptrace(PTRACE_DETACH, frozen)
        box.close()
        kill_orphaned_inits(base)
        assert wait_no_live(base)


def _inheritable_fds() -> set[tuple[int, str]]:
    import fcntl

    found = set()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        with contextlib.suppress(OSError):
            if fd > 2 and not fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC:
                found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return found


def test_the_descriptors_of_spares_and_runs_are_close_on_exec():
    # socket.recv_fds hands over inheritable descriptors: a process the worker started (a
    # forked sympy child, a subprocess with close_fds=False) kept a run's pipes open, so a
    # pair's tests never saw their program's channel close
    before = _inheritable_fds()
    box = Sandbox(SandboxConfig(base_uid=next(OWN_BASES), spares=2))
    box.start()
    try:
        assert py(box, "print(1)").stdout == b"1\n"
        time.sleep(0.2)  # the next spares have arrived
        assert _inheritable_fds() - before == set()
    finally:
        box.close()


def _zygote_without_cgroups(tmp_path: Path) -> str:
    """An interpreter for the zygote that starts it in a mount namespace of its own with the
    cgroup v1 hierarchies unmounted: a host where none can be made (cgroup v2 alone)."""
    wrapper = tmp_path / "python-without-cgroups"
    wrapper.write_text(
        "#!/bin/sh\n"
        'if [ "$1" != --inside ]; then exec unshare -m --propagation private "$0" --inside "$@"; fi\n'
        "shift\n"
        'awk \'{ for (i = 7; i < NF; i++) if ($i == "-" && $(i + 1) == "cgroup") print $5 }\' '
        '/proc/self/mountinfo | while read -r d; do umount -l "$d"; done\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_sandbox_without_its_cgroups_says_what_its_limits_no_longer_bound(tmp_path, caplog):
    # where no cgroup could be made, cpu_s and memory_mb bound each process, not the run, and
    # only an empty Sandbox.cgroups said so: a run's three children each spent most of a
    # 1 s CPU limit, or each held most of a 128 MB one, and the run passed
    caplog.set_level(logging.WARNING, logger="functions.verifiers")
    with own_sandbox(python=_zygote_without_cgroups(tmp_path)) as box:
        assert box.cgroups == []
        assert py(box, "print(5)").stdout == b"5\n"
    warned = [r.getMessage() for r in caplog.records if r.name == "functions.verifiers"]
    assert len(warned) == 1, warned
    assert "memory, cpuacct" in warned[0]
    assert "memory_mb bounds each process" in warned[0] and "cpu_s bounds each process" in warned[0]


def test_a_sandbox_with_its_cgroups_or_told_to_go_without_says_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="functions.verifiers")
    for cgroups in (True, False):
        with own_sandbox(cgroups=cgroups) as box:
            assert py(box, "print(5)").stdout == b"5\n"
    assert [r for r in caplog.records if r.name == "functions.verifiers"] == []
