"""Attacks on the code sandbox (see ``attack_box``) that found holes, each fixed: a
supervisor stalled or made to leak (these get a sandbox of their own, ``own_sandbox``), and
limits that were per process, not per run (memory, cgroups, CPU); last, nothing leaks over
many hostile runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

import pytest
from attack_box import MARKS, after_each_attack, module_sandbox
from sandbox_probe import (
    FAST,
    GOOD,
    LIBC,
    MB,
    NEST,
    jail_dirs,
    lines,
    own_sandbox,
    py,
    settled_runs,
    stale_jail_dirs,
    wait_clean,
)

from functions.verifiers.cgroups import RunCgroups, SlotCgroups
from functions.verifiers.errors import SandboxError
from functions.verifiers.sandbox import Limits
from functions.verifiers.verify import CodeTests, Verifier

pytestmark = MARKS

BASE_UID = 370_000  # apart from the other attack modules (340_000, 360_000)
# attack_box: this module's sandbox, and the checks after every attack
sandbox = pytest.fixture(module_sandbox, scope="module", name="sandbox")
sb = pytest.fixture(after_each_attack, name="sb")


# -- holes: the supervisor can be stalled or made to leak -------------------------------------
def test_a_tracer_holding_the_programs_zombie_cannot_stall_the_wall_limit():
    code = LIBC + (
        "import time\n"
        "parent = os.getpid()\n"
        "libc.prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)\n"  # Yama: PR_SET_PTRACER_ANY
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.write(w, b'%d' % libc.ptrace(0x4206, parent, 0, 0))\n"  # PTRACE_SEIZE the program
        "    time.sleep(3600)\n"  # never wait()s for it
        "print('seized', os.read(r, 8), flush=True)\n"
        "os._exit(0)\n"
    )
    limits = FAST.model_copy(update={"wall_s": 1.0})
    with own_sandbox() as box:
        t0 = time.monotonic()
        out = py(box, code, limits=limits)  # today: SandboxError after wall_s + grace_s
        assert out.status in ("exited", "timeout"), out
        assert time.monotonic() - t0 < 3.5  # the wall limit (1 s), not wall_s + grace_s (6 s)
        assert wait_clean(box.config.base_uid, 2.0) == []


def test_a_clone_parent_sibling_does_not_leak_the_runs_uid_slot():
    code = LIBC + (
        "pid = libc.syscall(56, 0x8000 | 17, 0, 0, 0, 0)\n"  # clone(CLONE_PARENT | SIGCHLD): fork-like
        "if pid == 0:\n"
        "    os._exit(0)\n"
        "open('/sandbox/pinned', 'wb').write(b'x' * (4 << 20))\n"  # kept alive with the leak
        "print('sibling', pid > 0)\n"
    )
    with own_sandbox() as box:
        out = py(box, code)
        assert out.stdout == b"sibling True\n", out  # the verdict itself is right
        assert box._zygote is not None
        assert wait_clean(box.config.base_uid, 3.0) == []
        assert settled_runs(box._zygote.pid, 1) == 1


def test_collect_does_not_follow_symlinks_or_dotdot_as_root():
    if not Path("/etc/shadow").exists():
        pytest.skip("this host has no /etc/shadow to leak")
    plant = "import os\nos.symlink('/etc/shadow', '/sandbox/main')\nos.symlink('/etc/shadow', '/tmp/a.out')\n"
    with own_sandbox() as box:
        leaked = []
        for collect in (("main", "a.out"), ("../etc/shadow",)):
            try:
                out = box.run(
                    mode="python",
                    entry="solution.py",
                    files={"solution.py": plant.encode()},
                    limits=FAST,
                    collect=collect,
                )
            except ValueError:
                continue  # refusing a '../' name is a fine answer
            leaked += [name for name, blob in out.files.items() if blob]
        assert leaked == [], leaked


def test_collecting_a_fifo_does_not_hang_the_supervisor():
    with own_sandbox() as box:
        t0 = time.monotonic()
        out = box.run(
            mode="python",
            entry="solution.py",
            files={"solution.py": b"import os\nos.mkfifo('/sandbox/main')\n"},
            limits=FAST.model_copy(update={"wall_s": 1.0}),
            collect=("main",),
        )
        assert time.monotonic() - t0 < 3.5  # not a hang until wall_s + grace_s (6 s) or forever
        assert out.status == "exited" and not out.files.get("main")
        assert box._zygote is not None and settled_runs(box._zygote.pid, 1) == 1


def test_collect_never_returns_more_than_collect_bytes(sb):
    limits = FAST.model_copy(update={"collect_bytes": 1000})
    write = b"open('/sandbox/big', 'wb').write(b'x' * 5000)\n"
    try:
        out = sb.run(
            mode="python", entry="solution.py", files={"solution.py": write}, limits=limits, collect=("big",)
        )
    except ValueError:
        return
    assert len(out.files.get("big", b"")) <= 1000, len(out.files["big"])


# -- holes: limits that are per process, not per run -------------------------------------------
MEMORY = Limits(cpu_s=2, wall_s=3, memory_mb=64, nproc=16, disk_mb=8, fsize_mb=4, nofile=32)


#: RLIMIT_AS out of the way, so the run's memory cgroup is what stops it
UNCAPPED = MEMORY.model_copy(update={"address_space_mb": 1024})
#: six children, each touching 40 MB (resident, then) and holding it for 2 s; a child
#: refused its block exits at once, so only the ones holding theirs are counted
FORK_HOG = (
    "import os, time\n"
    "kids = []\n"
    "for i in range(6):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        try:\n"
    "            block = bytearray(40 << 20)\n"
    "            block[:: 4096] = b'x' * len(range(0, 40 << 20, 4096))\n"
    "        except MemoryError:\n"
    "            os._exit(1)\n"
    "        time.sleep(2)\n"
    "        os._exit(0)\n"
    "    kids.append(pid)\n"
    "time.sleep(1.0)\n"
    "alive = [pid for pid in kids if os.waitpid(pid, os.WNOHANG) == (0, 0)]\n"
    "print('resident', 40 * len(alive), flush=True)\n"
)


def test_forked_children_share_one_memory_limit(sb):
    """RLIMIT_AS is per process; the run's memory cgroup bounds all of them together: six
    children touching 40 MB each cannot all be resident under 64 MB (+8 MB of disk).

    Each child must be able to get its 40 MB but for the cgroup (RLIMIT_AS lifted), and
    only children that hold theirs count: the test used to count every live child as
    40 MB, and to leave RLIMIT_AS at 64 MB. A zygote that imports more (``subprocess``,
    ``pydantic``: 41 MB of address space where it had 22) then had every child refused
    its block by RLIMIT_AS, catch the MemoryError and sleep on: "240 MB resident under a
    72 MB budget" with nothing resident at all, while the cgroup was never reached."""
    out = py(sb, FORK_HOG, limits=UNCAPPED)
    held = max([int(line.split()[1]) for line in lines(out) if line.startswith("resident")] or [0])
    budget = UNCAPPED.memory_mb + UNCAPPED.disk_mb
    assert held <= budget, f"the run held {held} MB resident under a {budget} MB budget"
    assert out.oom_killed, "the run's memory cgroup stopped none of its children"


def _memory_cgroup(pid: int) -> Path:
    """Where ``pid``'s memory cgroup is, on the host (cgroup v1)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if "memory" in names.split(","):
            return Path("/sys/fs/cgroup/memory", path.lstrip("/"))
    pytest.skip("no cgroup v1 memory controller here")


def test_a_run_outside_its_memory_cgroup_is_refused_not_run_unbounded():
    """The memory limit is written into the uid slot's cgroup by the supervisor, while the
    program joined it by itself, earlier, in the zygote's fork: nothing checked the two
    meet. A program that is not in the cgroup that has its limit (moved out here, as a
    failed or misdirected attach would leave it) ran with no memory limit at all but
    RLIMIT_AS per process: six children held 240 MB under a 72 MB budget. The run must
    refuse to start, saying why."""
    with own_sandbox(spares=1) as box:
        if "memory" not in box.cgroups:
            pytest.skip("no writable cgroup v1 memory controller here")
        assert box._zygote is not None
        ours = _memory_cgroup(box._zygote.pid) / f"rlfabric-{box._zygote.pid}"
        deadline = time.monotonic() + 10
        while True:  # until the spare's program has joined its slot's cgroup
            waiting = [p for d in ours.glob("s*") for p in (d / "cgroup.procs").read_text().split()]
            if waiting or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert waiting, "the spare's program never joined its slot's memory cgroup"
        for pid in waiting:  # out of the slot's cgroup, into the (unlimited) zygote's
            # (the program's throwaway group leader may be listed and gone: program._join_own_group)
            with contextlib.suppress(ProcessLookupError):
                (ours / "cgroup.procs").write_text(pid)
        try:
            out = py(box, FORK_HOG, limits=UNCAPPED)
        except SandboxError as e:
            assert "memory limit is not in force" in str(e), e
            assert "not in its memory cgroup" in str(e), e
        else:
            held = max([int(line.split()[1]) for line in lines(out) if line.startswith("resident")] or [0])
            budget = UNCAPPED.memory_mb + UNCAPPED.disk_mb
            pytest.fail(f"it ran, outside its memory cgroup, and held {held} MB under a {budget} MB budget")
        # the next spare is in its cgroup: runs are judged as before
        assert py(box, GOOD, stdin=b"1 2\n").stdout == b"3\n"


def test_a_slot_without_its_memory_cgroup_is_not_a_slot_without_a_limit(tmp_path):
    """Where the zygote made a memory cgroup, a run's slot that cannot open it (gone, or
    closed with its sandbox) must say so, not hand back a slot with no memory limit (or
    none at all, which means "rlimits alone"): both used to run the program unbounded."""
    gone = SlotCgroups({"memory": str(tmp_path / "gone")})
    slot = gone.slot(0)
    assert slot is not None
    assert slot.check(os.getpid(), 64 * MB) == "its memory cgroup could not be opened"
    run = RunCgroups()
    try:
        if "memory" not in run.paths:
            pytest.skip("no writable cgroup v1 memory controller here")
        closed = SlotCgroups(run.paths)
        closed.close()
        with pytest.raises(OSError, match="closed"):
            closed.slot(0)
    finally:
        run.remove()


def test_a_stale_cgroup_of_a_dead_process_with_our_pid_does_not_turn_the_cgroups_off():
    """The zygote's cgroups are named after its pid; a zygote killed before it could remove
    them (SIGKILL, or runs still dying at its shutdown) leaves them behind, and pids come
    round again (pid_max is often 32768). A zygote with the same pid found its name taken
    and quietly fell back to rlimits alone: no memory limit for the whole run."""
    memory = _memory_cgroup(os.getpid())
    if not os.access(memory, os.W_OK):
        pytest.skip("no writable cgroup v1 memory controller here")
    probe = RunCgroups()  # where a zygote of this process would put its cgroups
    try:
        if "memory" not in probe.paths:
            pytest.skip("no writable cgroup v1 memory controller here")
        stale = dict(probe.paths)
    finally:
        assert probe.remove()
    found = None
    try:
        for path in stale.values():  # as a dead process with our pid left them, with a slot
            os.makedirs(os.path.join(path, "s3"))
        found = RunCgroups()
        assert set(found.paths) == set(stale), (
            f"cgroups {sorted(found.paths)} where {sorted(stale)} were free"
        )
        assert found.procs(3)  # the stale slot is usable
    finally:
        if found is not None:
            found.remove()
        for path in stale.values():
            for left in (os.path.join(path, "s3"), path):
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(left)


def test_memfd_memory_counts_against_the_limit(sb):
    """memfd (shmem) pages are not address space, but they are charged to the run's cgroup."""
    code = (
        "import os\n"
        "held = 0\n"
        "for i in range(25):\n"
        "    fd = os.memfd_create(f'm{i}')\n"
        "    for _ in range(4):\n"
        "        os.write(fd, b'x' * (1 << 20))\n"
        "    held += 4\n"
        "    print('held', held, flush=True)\n"
    )
    out = py(sb, code, limits=MEMORY)
    held = max([int(line.split()[1]) for line in lines(out) if line.startswith("held")] or [0])
    budget = MEMORY.memory_mb + MEMORY.disk_mb
    assert held <= budget, f"the run held {held} MB of memfd under a {budget} MB budget"
    assert out.oom_killed


def test_a_nested_user_namespace_cannot_mount_an_unbounded_tmpfs(sb):
    code = (
        LIBC
        + NEST
        + (
            "if not nest(0x00020000) or libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) != 0:\n"
            "    print('refused')\n"
            "    raise SystemExit(0)\n"
            "written = 0\n"
            "for i in range(100):\n"
            "    try:\n"
            "        open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 20))\n"
            "    except OSError:\n"
            "        break\n"
            "    written += 1\n"
            "print('written', written, flush=True)\n"
        )
    )
    out = py(sb, code, limits=MEMORY)
    written = max([int(line.split()[1]) for line in lines(out) if line.startswith("written")] or [0])
    assert written <= MEMORY.disk_mb + MEMORY.memory_mb, f"{written} MB in a tmpfs of its own"


def test_a_run_gets_no_capability_in_a_nested_namespace(sb):
    code = (
        LIBC
        + NEST
        + (
            "import fcntl, socket, struct\n"
            "if not nest(0x40000000):\n"  # a user and a network namespace of its own
            "    print('refused')\n"
            "    raise SystemExit(0)\n"
            "print('CapEff', open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "try:\n"
            "    fcntl.ioctl(u, 0x8914, struct.pack('16sH14s', b'lo', 0x9, b''))\n"  # SIOCSIFFLAGS up
            "    print('NET_ADMIN')\n"
            "except OSError:\n"
            "    pass\n"
        )
    )
    out = py(sb, code)
    assert out.stdout == b"refused\n", out.stdout


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_javascript_buffers_respect_the_memory_limit(sb):
    verifier = Verifier(sb, Limits(cpu_s=3, wall_s=5, memory_mb=64))
    code = "const b = [];\nfor (let i = 0; i < 6; i++) b.push(Buffer.alloc(100 * 2 ** 20, 1));\n"
    code += "console.log(600);\n"
    result = verifier.verify(code, CodeTests(cases=[{"stdin": "", "expected_stdout": "600"}]), "js")
    assert result.status != "Finished", result


def test_forked_children_share_one_cpu_budget(sb):
    code = (
        "import os, time\n"
        "kids = []\n"
        "for i in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        t = time.process_time()\n"
        "        while time.process_time() - t < 0.6:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "total = sum(sum(os.wait4(pid, 0)[2][:2]) for pid in kids)\n"
        "print('cpu', round(total, 2))\n"
    )
    limits = FAST.model_copy(update={"cpu_s": 1.0, "wall_s": 4.0})
    out = py(sb, code, limits=limits)
    used = max([float(line.split()[1]) for line in lines(out) if line.startswith("cpu")] or [0.0])
    assert used <= limits.cpu_s * 1.2, f"the run used {used} CPU s under a {limits.cpu_s} s budget"


def test_nothing_leaks_over_many_hostile_runs(sb):
    zygote = sb._zygote
    assert zygote is not None
    programs = [
        "print(1)",
        "import os\nos._exit(3)",
        "while True:\n    pass",
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        "import os\nfor i in range(8):\n    os.pipe()\nos.fork()\nos.memfd_create('x')",
        "raise SystemExit('boom')",
        "import os, socket\nsocket.socketpair()\nos.mkfifo('/tmp/f')\nos.symlink('/etc', '/tmp/l')",
    ]
    quick = FAST.model_copy(update={"cpu_s": 0.3, "wall_s": 1.0})
    py(sb, "print(0)", limits=quick)
    settled_runs(zygote.pid, 2)

    def zygote_fds() -> list[str]:
        fds = Path(f"/proc/{zygote.pid}/fd")
        links = []
        for fd in os.listdir(fds):
            # the zygote's own short-lived fds (a cgroup file it reads) may close under us
            with contextlib.suppress(FileNotFoundError):
                links.append(os.readlink(fds / fd))
        return links

    def snapshot():
        return (
            # the zygote keeps each uid slot's network and UTS namespaces, once per slot
            len([link for link in zygote_fds() if not link.startswith(("net:", "uts:"))]),
            Path("/proc/self/mountinfo").read_text(),
        )

    def settled_snapshot():
        # a short-lived fd of the zygote (a cgroup file it reads, a spare in the making) must
        # not land in "before" either: take it when two reads a moment apart agree
        last, deadline = snapshot(), time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.05)
            now = snapshot()
            if now == last:
                return now
            last = now
        return last

    def own_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    # one round first: this client keeps a channel per uid slot it has used, and their number
    # moves between runs (30-40 fds here); a leak grows with every one of the 21 runs below
    peak = own_fds()
    for code in programs:
        py(sb, code, limits=quick)
        peak = max(peak, own_fds())
    settled_runs(zygote.pid, 2)
    dirs = jail_dirs()
    before = settled_snapshot()
    for _ in range(3):
        for code in programs:
            py(sb, code, limits=quick)
    assert settled_runs(zygote.pid, 2) == 2  # every uid slot came back
    # a leak stays; a transient fd (mid-read when we look) is gone a moment later
    deadline = time.monotonic() + 5
    while snapshot() != before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert snapshot() == before
    assert own_fds() <= peak
    assert stale_jail_dirs(dirs) == []
    kept = [link for link in zygote_fds() if link.startswith(("net:", "uts:"))]
    assert len(kept) <= 2 * 8, kept  # a few slots at a time here, not one per run (21)
