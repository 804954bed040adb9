"""The security suite of the code sandbox: hostile programs are contained, the host is not
touched, and the sandbox keeps giving correct answers afterwards.

Each test runs a real program in the real sandbox (namespaces, rlimits, jail); the checks
look at the host from outside: processes left in the sandbox's uid range, mounts, files,
a listener on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from functions.verifiers import _linux
from functions.verifiers.errors import SandboxError
from functions.verifiers.init import image as init_image
from functions.verifiers.sandbox import Limits, Sandbox, SandboxConfig
from functions.verifiers.verify import CodeTests, Verifier

pytestmark = pytest.mark.skipif(_linux.supported() is not None, reason=str(_linux.supported()))

BASE_UID = 310_000
SECRET = "rlfabric-test-secret-7d1c2a"
FAST = Limits(cpu_s=1, wall_s=3, memory_mb=256, nproc=16, disk_mb=8, fsize_mb=4, stdout_bytes=64 << 10)
GOOD = "print(sum(map(int, input().split())))"


def _sandbox_pids(base: int = BASE_UID) -> list[int]:
    """Live processes of the host running as one of the sandbox's uids (there must be none
    left)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
        state = next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
        if base <= uid < base + 1024 and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="module")
def sandbox():
    os.environ["RLFABRIC_TEST_SECRET"] = SECRET  # in the worker's environment: must not reach a run
    try:
        with Sandbox(SandboxConfig(base_uid=BASE_UID, spares=2)) as sb:
            yield sb
    finally:
        del os.environ["RLFABRIC_TEST_SECRET"]


@pytest.fixture
def sb(sandbox):
    """After every hostile program: nothing of it survives, and a good program still works."""
    mounts_before = Path("/proc/self/mountinfo").read_text()
    yield sandbox
    deadline = time.monotonic() + 5
    leftover = [0]
    while leftover and time.monotonic() < deadline:  # a run's PID 1 may still be exiting
        # only warm spares (waiting for a run, unprivileged already) may remain
        leftover = [pid for pid in _sandbox_pids() if not _is_spare(pid)]
        time.sleep(0.02)
    assert leftover == [], f"processes of a finished run survived: {leftover}"
    assert Path("/proc/self/mountinfo").read_text() == mounts_before, "a run changed the host's mounts"
    out = sandbox.run_python(GOOD, stdin=b"20 22\n", limits=FAST)
    assert (out.status, out.stdout) == ("exited", b"42\n")


def _is_spare(pid: int) -> bool:
    # a warm spare's PID 1 is blocked reading its start message; it has run no user code
    try:
        return Path(f"/proc/{pid}/wchan").read_text() in ("pipe_read", "pipe_wait", "anon_pipe_read")
    except OSError:
        return True  # already gone


def py(sb: Sandbox, code: str, **kw):
    return sb.run_python(code, limits=kw.pop("limits", FAST), **kw)


def test_fork_bomb_is_contained(sb):
    t0 = time.monotonic()
    out = py(sb, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    assert out.status in ("timeout", "signaled", "cpu_limit")  # the run's CPU budget, usually
    assert time.monotonic() - t0 < FAST.wall_s + 2
    pid = os.fork()  # the host can still make processes
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_memory_bomb_hits_the_limit(sb):
    out = py(sb, "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n")
    assert out.status == "exited" and out.exit_code == 1
    assert b"MemoryError" in out.stderr
    assert out.maxrss_kb < FAST.memory_mb * 1024


def test_infinite_loop_dies_at_the_cpu_limit(sb):
    # a wall limit far past the CPU limit: on a loaded machine a spinning run gets a fraction of
    # a core, and with FAST's 3 s of wall it could be stopped by the wall clock first
    limits = FAST.model_copy(update={"wall_s": 15})
    out = py(sb, "while True:\n    pass\n", limits=limits)
    # the run's CPU budget (cgroup, polled) or the process's RLIMIT_CPU, whichever is first
    assert out.status == "cpu_limit" or (out.status == "signaled" and out.signal == 9), out
    assert 700 <= out.cpu_ms <= 1500  # read after the kill: short of the limit under load


def test_a_child_that_outlives_its_parent_is_killed(sb):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    out = py(sb, code)
    assert (out.status, out.stdout) == ("exited", b"parent done\n")
    # the sb fixture checks that no process of the run is left on the host


def test_no_network_not_even_loopback(sb):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    accepted = []
    acceptor = threading.Thread(target=lambda: accepted.append(_try_accept(listener)), daemon=True)
    acceptor.start()
    code = (
        "import socket\n"
        f"for host in ('127.0.0.1', 'localhost', '::1'):\n"
        "    try:\n"
        f"        socket.create_connection((host, {port}), timeout=1)\n"
        "        print('connected', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, e.errno)\n"
        "import os\n"
        "print(sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else 'no sysfs')\n"
    )
    out = py(sb, code)
    acceptor.join()
    listener.close()
    assert b"connected" not in out.stdout, out.stdout
    assert out.stdout.count(b"refused") == 3
    assert accepted == [None]


def _try_accept(listener: socket.socket):
    try:
        conn, _ = listener.accept()
        conn.close()
        return "accepted"
    except OSError:
        return None


def test_writing_outside_the_work_dir_fails_and_host_is_untouched(sb, tmp_path):
    targets = ["/etc/rlfabric-pwned", "/usr/rlfabric-pwned", "/rlfabric-pwned", str(tmp_path / "pwned")]
    code = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, e.errno)\n"
        "open('/tmp/inside', 'w').write('fine')\n"
        "print(open('/sandbox/inside').read())\n"
    )
    out = py(sb, code)
    assert b"wrote" not in out.stdout, out.stdout
    assert out.stdout.endswith(b"fine\n")
    for path in targets:
        assert not Path(path).exists()
    assert not Path("/tmp/inside").exists() or Path("/tmp/inside").read_text() != "fine"


def test_secrets_of_the_worker_are_invisible(sb):
    code = (
        "import os, glob\n"
        "print(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as e:\n"
        "        print(path, 'denied')\n"
        "print(os.listdir('/proc'))\n"
        "for path in ('/etc/shadow', '/root/.bash_history', '/proc/1/root/etc/shadow'):\n"
        "    try:\n"
        "        print(path, open(path).read()[:50])\n"
        "    except OSError as e:\n"
        "        print(path, 'denied', e.errno)\n"
    )
    out = py(sb, code)
    assert out.status == "exited"
    assert SECRET.encode() not in out.stdout
    assert b"AWS_" not in out.stdout and b"TOKEN" not in out.stdout
    assert b"root:" not in out.stdout


def test_runs_cannot_read_each_others_files(sb):
    writer = (
        "import time\n"
        "open('/sandbox/secret.txt', 'w').write('run-a-secret')\n"
        "open('/tmp/secret2.txt', 'w').write('run-a-secret')\n"
        "print('written', flush=True)\n"
        "time.sleep(1.0)\n"
    )
    reader = (
        "import os, glob\n"
        "print(os.listdir('/sandbox'), os.listdir('/tmp'))\n"
        "for path in glob.glob('/proc/*/root/sandbox/*'):\n"
        "    print(path, open(path).read())\n"
    )
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("a", py(sb, writer)))
    t.start()
    time.sleep(0.3)  # the writer's files exist now
    results["b"] = py(sb, reader)
    t.join()
    results["c"] = py(sb, reader)  # and after it finished
    assert results["a"].stdout == b"written\n"
    for key in "bc":
        assert b"run-a-secret" not in results[key].stdout
        assert b"secret" not in results[key].stdout, results[key].stdout


def test_gigabytes_of_stdout_are_cut_at_the_cap(sb):
    # cut at the cap, not at a limit: the wall (and the CPU, spent on the writes) is far
    # above the bound, so that a loaded machine cannot turn one into the other
    roomy = FAST.model_copy(update={"wall_s": 20, "cpu_s": 10})
    t0 = time.monotonic()
    out = py(sb, "import sys\nblock = 'x' * 65536\nwhile True:\n    sys.stdout.write(block)\n", limits=roomy)
    assert out.status == "output_limit", out
    assert len(out.stdout) == FAST.stdout_bytes
    assert time.monotonic() - t0 < 10


def test_killing_the_parent_or_everything_hurts_no_one_else(sb):
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print('kill', target, 'failed', e.errno)\n"
        "print('still here')\n"
    )
    zygote = sb._zygote
    out = py(sb, code)
    assert out.status in ("exited", "signaled")
    assert zygote is sb._zygote and zygote.poll() is None  # the zygote lives on
    os.kill(os.getpid(), 0)  # and so does this process


def test_ignoring_sigterm_does_not_outlive_the_wall_limit(sb):
    code = (
        "import signal, time\n"
        "for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
        "    signal.signal(sig, signal.SIG_IGN)\n"
        "time.sleep(30)\n"
    )
    t0 = time.monotonic()
    out = py(sb, code)
    assert out.status == "timeout"
    # the wall limit, not the program's 30 s (the slack: a loaded machine)
    assert FAST.wall_s <= time.monotonic() - t0 < FAST.wall_s + 5


def test_filling_the_disk_stops_at_the_run_quota(sb):
    code = (
        "import os\n"
        "written = 0\n"
        "for i in range(10_000):\n"
        "    try:\n"
        "        with open(f'/sandbox/f{i}', 'wb') as f:\n"
        "            f.write(b'x' * (1 << 20))\n"
        "        written += 1\n"
        "    except OSError as e:\n"
        "        print('stopped', e.errno, written)\n"
        "        break\n"
    )
    out = py(sb, code)
    assert out.stdout.startswith(b"stopped 28"), out  # ENOSPC
    assert int(out.stdout.split()[-1]) <= FAST.disk_mb


def test_one_file_past_the_size_limit_is_killed(sb):
    # Python ignores SIGXFSZ, so the write fails with EFBIG; a C program gets the signal
    out = py(sb, "f = open('/sandbox/big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))\n")
    assert out.exit_code == 1 and b"File too large" in out.stderr, out


def test_no_privilege_inside(sb):
    code = (
        "import os, ctypes\n"
        "print(os.getuid(), os.geteuid())\n"
        "for step in ('setuid', 'mount', 'chroot'):\n"
        "    try:\n"
        "        if step == 'setuid': os.setuid(0)\n"
        "        elif step == 'chroot': os.chroot('/tmp')\n"
        "        else:\n"
        "            libc = ctypes.CDLL(None, use_errno=True)\n"
        "            if libc.mount(b'none', b'/usr', None, 32 | 4096, None) != 0:\n"
        "                raise OSError(ctypes.get_errno(), 'mount')\n"
        "        print(step, 'succeeded')\n"
        "    except OSError as e:\n"
        "        print(step, 'denied', e.errno)\n"
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
    )
    out = py(sb, code)
    assert b"succeeded" not in out.stdout, out.stdout
    assert out.stdout.splitlines()[-1] == b"0000000000000000"
    assert not out.stdout.startswith(b"0 ")


def test_the_verifier_still_judges_correctly_after_the_suite(sandbox):
    verifier = Verifier(sandbox, FAST)
    tests = CodeTests(
        cases=[{"stdin": "1 2\n", "expected_stdout": "3"}, {"stdin": "5 5\n", "expected_stdout": "10"}]
    )
    result = verifier.verify(GOOD, tests)
    assert (result.status, result.passed) == ("Finished", 2)
    wrong = verifier.verify("print(0)", tests)
    assert (wrong.status, wrong.passed) == ("Failed", 0)


def test_closing_the_sandbox_removes_its_cgroups():
    with Sandbox(SandboxConfig(base_uid=BASE_UID + 2048, spares=2)) as box:
        if not box.cgroups:
            pytest.skip("no writable cgroup v1 controllers here: the sandbox runs on rlimits alone")
        assert set(box.cgroups) == {"memory", "cpuacct"}
        assert box.run_python(GOOD, stdin=b"1 2\n", limits=FAST).stdout == b"3\n"
        assert box._zygote is not None
        zygote = box._zygote.pid
    left = [str(p) for p in Path("/sys/fs/cgroup").glob(f"**/rlfabric-{zygote}")]
    assert left == []


NETNS = "import os\nprint(os.readlink('/proc/self/ns/net'))\n"


def test_a_slots_network_namespace_carries_nothing_to_its_next_run():
    """Runs of one uid slot share its network namespace one after another: nothing a run
    makes there (an abstract socket, a listener) outlives it, and it cannot bring lo up."""
    with Sandbox(SandboxConfig(base_uid=BASE_UID + 4096, spares=1)) as box:
        first = NETNS + (
            "import socket\n"
            "s = socket.socket(socket.AF_UNIX); s.bind('\\0rlfabric-left-behind'); s.listen(1)\n"
            "print(socket.gethostname())\n"
        )
        netns, host = box.run_python(first, limits=FAST).stdout.split()
        assert host == b"sandbox"
        second = NETNS + (
            "import socket\n"
            "c = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            "    c.connect('\\0rlfabric-left-behind'); print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "import fcntl, struct\n"
            "try:\n"
            "    fcntl.ioctl(c.fileno(), 0x8914, struct.pack('16sH', b'lo', 1))\n"  # SIOCSIFFLAGS up
            "    print('lo up')\n"
            "except OSError as e:\n"
            "    print('lo stays down', e.errno)\n"
        )
        same_slot = 0
        for _ in range(6):  # spare slots alternate: some of these land in the first run's
            ns, out = box.run_python(second, limits=FAST).stdout.split(b"\n", 1)
            same_slot += ns == netns
            assert out.startswith(b"refused") and b"lo stays down" in out, out
        assert same_slot, "no run reused the first run's slot namespaces"


def test_slot_namespaces_are_made_once_per_slot_not_per_run():
    """Making a network namespace per run cost more CPU than a short run itself (and once
    happened silently, in the forked child where the cache died with it)."""
    with Sandbox(SandboxConfig(base_uid=BASE_UID + 5120, spares=1)) as box:
        seen = {box.run_python(NETNS, limits=FAST).stdout for _ in range(10)}
    # one run in flight and one spare at a time: a handful of slots, not one per run
    assert len(seen) <= 4, seen


def _waiting_for_sigusr1(base: int) -> dict[int, int]:
    """The host's view of the sandbox processes (uids ``base`` to ``base + 1023``) that catch
    SIGUSR1, as the runs of the uid-slot test do once they wait for it: pid -> uid. (Not
    SigBlk: a process in sigtimedwait shows the signals it waits for unblocked.)"""
    found = {}
    for pid in _sandbox_pids(base):
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        except (OSError, ValueError):
            continue
        if int(status["SigCgt"], 16) & 1 << (signal.SIGUSR1 - 1):
            found[pid] = int(status["Uid"].split()[0])
    return found


def test_uid_slots_come_back_only_after_their_supervisor_is_done():
    """A slot is reused once its program, its init and its supervisor are all done with it
    (the supervisor holds the run's tmpfs until it has collected the files): the uids of
    many runs one after another stay a handful, and concurrent runs never share one."""
    code = "import os, time\nprint(os.getuid())\ntime.sleep(0.05)\n"
    base = BASE_UID + 6144
    with Sandbox(SandboxConfig(base_uid=base, spares=1)) as box:
        one_by_one = {box.run_python(code, limits=FAST).stdout for _ in range(15)}
        assert len(one_by_one) <= 4, one_by_one
        # 4 runs that hold their uids at once, seen so from the host: each waits for SIGUSR1
        # and is let go only once all 4 wait (a thread pool alone does not make them overlap:
        # on a loaded machine a batch's runs started one after another, and a slot given back
        # was then rightly reused). Blocked before its handler shows: a signal sent as soon as
        # the host sees the handler is pending, never lost before the wait
        held = (
            "import os, signal\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
            "signal.signal(signal.SIGUSR1, lambda *_: None)\n"
            "print(os.getuid())\n"
            "signal.sigtimedwait({signal.SIGUSR1}, 60)\n"
        )
        slow = Limits(cpu_s=1, wall_s=120, memory_mb=256, nproc=16, disk_mb=8, fsize_mb=4)
        for _ in range(3):
            with ThreadPoolExecutor(4) as pool:
                runs = [pool.submit(box.run_python, held, limits=slow) for _ in range(4)]
                deadline = time.monotonic() + 60  # bounds a failure only
                waiting = _waiting_for_sigusr1(base)
                while len(waiting) < 4 and time.monotonic() < deadline and not any(r.done() for r in runs):
                    time.sleep(0.02)
                    waiting = _waiting_for_sigusr1(base)
                for pid in waiting:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
                outs = [r.result().stdout for r in runs]
            assert len(waiting) == 4, (waiting, outs)
            assert len(set(waiting.values())) == 4, waiting
            assert sorted(int(o) for o in outs) == sorted(waiting.values()), (outs, waiting)


def test_a_fork_of_the_worker_does_not_keep_a_run_alive():
    """The worker may fork (the math reward does, for sympy) while it holds warm sandboxes:
    the fork holds copies of their descriptors, the pipe that ends a run's namespace when
    closed included. A run must still end when its program does, background children and
    all, not at its wall limit."""
    leaver = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\nprint('done')\n"
    with Sandbox(SandboxConfig(base_uid=BASE_UID + 7168, spares=2)) as box:
        box.run_python("print(1)", limits=FAST)  # the spares are made and queued here
        time.sleep(0.2)
        child = os.fork()
        if child == 0:  # a stand-in for the math reward's sympy child (killed below)
            time.sleep(30)
            os._exit(0)
        try:
            t0 = time.monotonic()
            out = box.run_python(leaver, limits=Limits(cpu_s=2, wall_s=20))
            took = time.monotonic() - t0
        finally:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    assert (out.status, out.stdout) == ("exited", b"done\n"), out
    assert took < 10, took  # ended with the program, not with the fork (30 s) or the wall (20 s)


def test_warm_spares_die_with_their_zygote():
    """A spare's program has already become the run's uid, which clears the parent-death
    signal: it re-arms it, so spares of a zygote that died do not live on (a new zygote hands
    out the same uids)."""
    base = BASE_UID + 8192
    with Sandbox(SandboxConfig(base_uid=base, spares=2)) as box:
        box.run_python("print(1)", limits=FAST)
        deadline = time.monotonic() + 10  # a wait, not a bound: spares start slowly when loaded
        while len(_sandbox_pids(base)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(_sandbox_pids(base)) == 2  # two warm spares, unprivileged already
        assert box._zygote is not None
        os.kill(box._zygote.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _sandbox_pids(base) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _sandbox_pids(base) == []
        # and the sandbox recovers: the next run starts a new zygote
        out = box.run_python("print(2)", limits=FAST)
        assert out.stdout == b"2\n"


def test_runs_waiting_on_a_dead_zygote_all_move_to_the_next():
    """When the zygote dies, every run waiting for one of its spares moves on to the
    restarted zygote (not just the first to notice)."""
    with Sandbox(SandboxConfig(base_uid=BASE_UID + 9216, spares=1, start_timeout_s=20)) as box:
        box.run_python("print(1)", limits=FAST)
        time.sleep(0.2)  # its replacement spare is queued
        assert box._zygote is not None
        first = box._zygote.pid
        os.kill(first, signal.SIGSTOP)  # makes no more spares: the runs below wait for one
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(box.run_python, f"print({i})", limits=FAST) for i in range(4)]
            time.sleep(0.5)
            os.kill(first, signal.SIGKILL)
            outs = []
            for i, f in enumerate(futures):
                try:
                    outs.append(f.result().stdout)
                except SandboxError:  # the one run that got the queued spare: its zygote died
                    outs.append(b"lost %d" % i)
        took = time.monotonic() - t0
        lost = [o for o in outs if o.startswith(b"lost")]
        assert len(lost) <= 1 and sorted(set(outs) - set(lost)) == [
            b"%d\n" % i for i in range(4) if b"lost %d" % i not in lost
        ], outs
        assert box._zygote is not None and box._zygote.pid != first
    assert took < 10, took  # not the 20 s a run left waiting on the dead zygote sits out


def test_the_init_reads_until_eof_then_exits(tmp_path):
    """The runs' PID 1 (a hand-assembled static program where there is one for this
    machine): it lives while its pipe is open, whatever comes down it, and exits at EOF."""
    image = init_image()
    if image is None:
        pytest.skip(f"no static init for {platform.machine()}: the sandbox uses cat")
    path = tmp_path / "init"
    path.write_bytes(image)
    path.chmod(0o755)
    r, w = os.pipe()
    proc = subprocess.Popen([str(path)], stdin=r)
    os.close(r)
    try:
        os.write(w, b"anything\n" * 1000)
        time.sleep(0.2)
        assert proc.poll() is None
        # SIGCHLD ignored: the kernel reaps the orphans it inherits (they held the run's nproc)
        ignored = Path(f"/proc/{proc.pid}/status").read_text().split("SigIgn:")[1].split()[0]
        assert int(ignored, 16) & (1 << (signal.SIGCHLD - 1)), ignored
    finally:
        os.close(w)
    assert proc.wait(timeout=5) == 0
    # and it is what the sandbox runs as every run's PID 1
    with Sandbox(SandboxConfig(base_uid=BASE_UID + 10240, spares=1)) as box:
        box.run_python("print(1)", limits=FAST)
        assert box._zygote is not None
        inits = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if f"PPid:\t{box._zygote.pid}\n" in (entry / "status").read_text():
                        if (entry / "cmdline").read_bytes().startswith(b"rlfabric-init-"):
                            inits.append(os.readlink(entry / "exe"))
        assert inits and all(exe.endswith(".rlfabric-init") for exe in inits), inits
