"""Attacks on the code sandbox (see ``attack_box``): the jail (what a run can see and
touch), processes that try to outlive their run, runs that talk to or hurt each other, and
starving the sandbox of output, input or time."""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from attack_box import MARKS, after_each_attack, module_sandbox
from sandbox_probe import FAST, LIBC, MB, NEST, py

from functions.verifiers.errors import SandboxError
from functions.verifiers.program import SHM_MB
from functions.verifiers.sandbox import RunOutcome, _package_root
from functions.verifiers.verify import CodeTests, Verifier

pytestmark = MARKS

BASE_UID = 340_000  # and up to 341_023
# attack_box: this module's sandbox, and the checks after every attack
sandbox = pytest.fixture(module_sandbox, scope="module", name="sandbox")
sb = pytest.fixture(after_each_attack, name="sb")


# -- the jail ----------------------------------------------------------------------------------
def test_proc_shows_only_the_run_and_nothing_of_the_host(sb):
    project_file = os.path.join(_package_root(), "functions", "verifiers", "sandbox.py")
    code = (
        "import os\n"
        "print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "for path in ('/proc/1/root', '/proc/1/cwd', '/proc/1/fd', '/proc/1/environ', '/proc/1/mem'):\n"
        "    try:\n"
        "        os.listdir(path) if not path.endswith(('environ', 'mem')) else open(path, 'rb').read(1)\n"
        "        print('OPEN', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, e.errno)\n"
        f"print('project', os.path.exists({project_file!r}))\n"
        "print('sys', os.path.exists('/sys/kernel'), 'home', os.path.exists('/home'))\n"
        "print('dev', sorted(os.listdir('/dev')))\n"
    )
    out = py(sb, code)
    text = out.stdout.decode()
    assert out.status == "exited", out
    pids = ast.literal_eval(text.split("pids ")[1].split("\n")[0])
    assert set(pids) <= {1, 2}, pids  # PID 1 (the run's init) and the program itself, nothing else
    assert "OPEN" not in text, text
    assert "project False" in text and "sys False home False" in text
    assert "dev ['fd', 'null', 'random', 'shm', 'stderr', 'stdin', 'stdout', 'urandom', 'zero']" in text


def test_dev_shm_is_the_runs_own_and_bounded(sb):
    # a tmpfs of each run's own (multiprocessing's semaphores are files there): what one run
    # leaves in it no other run sees, and it holds at most SHM_MB (its pages are the run's
    # memory too, in the run's memory cgroup)
    left = py(sb, "import os\nopen('/dev/shm/rlfabric-left', 'w').write('x')\nprint(os.listdir('/dev/shm'))")
    assert left.stdout == b"['rlfabric-left']\n", left
    code = (
        "import os\n"
        "print(oct(os.stat('/dev/shm').st_mode & 0o7777), os.listdir('/dev/shm'))\n"
        "n = 0\n"
        "try:\n"
        f"    for i in range({SHM_MB} + 8):\n"
        "        with open(f'/dev/shm/{i}', 'wb') as f:\n"
        "            f.write(bytes(1 << 20))\n"  # 1 MiB a file: under the run's file size limit
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(e.errno, n)\n"
    )
    out = py(sb, code)
    lines = out.stdout.decode().splitlines()
    assert lines[0] == "0o1777 []", out
    errno_, n = map(int, lines[1].split())
    assert errno_ == 28 and n <= SHM_MB, out  # ENOSPC


def test_nested_namespaces_cannot_unmask_or_alter_the_jail(sb, tmp_path):
    marker = tmp_path / "host-marker"
    code = (
        LIBC + NEST + "print('nested', nest(0x00020000))\n"  # a mount namespace of its own, full caps in it
        "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n"
        "for target in (b'/usr', b'/etc', b'/', b'/proc', b'/sandbox'):\n"
        "    print('umount', target, libc.umount2(target, 2), err())\n"
        "for src, dst, fs, flags in ((b'none', b'/usr', None, 32 | 4096), (b'none', b'/', None, 32),\n"
        "                            (b'proc', b'/tmp', b'proc', 0), (b'sysfs', b'/tmp', b'sysfs', 0)):\n"
        "    print('mount', dst, fs, libc.mount(src, dst, fs, flags, None), err())\n"
        f"for path in ('/usr/rlfabric-pwned', '/etc/rlfabric-pwned', {str(marker)!r}):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('WROTE', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, e.errno)\n"
    )
    out = py(sb, code)
    text = out.stdout.decode()
    assert out.status == "exited", out
    for line in text.splitlines():
        if line.startswith(("umount", "mount")):
            assert line.split()[-2] == "-1", line  # every (un)mount refused
    assert "WROTE" not in text, text
    assert not Path("/usr/rlfabric-pwned").exists() and not Path("/etc/rlfabric-pwned").exists()
    assert not marker.exists()


def test_limits_hold_inside_a_nested_user_namespace(sb):
    # root (with every capability) in a user namespace of its own: still the run's rlimits
    code = (
        LIBC
        + NEST
        + (
            "import resource, time\n"
            "print('nested', nest(0))\n"
            "for res in (resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_CPU):\n"
            "    try:\n"
            "        resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
            "        print('RAISED', res)\n"
            "    except (OSError, ValueError):\n"
            "        pass\n"
            "n = 0\n"
            "try:\n"
            "    while n < 200:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(5)\n"
            "            os._exit(0)\n"
            "        n += 1\n"
            "except OSError:\n"
            "    pass\n"
            "print('forked', n)\n"
        )
    )
    out = py(sb, code)
    text = out.stdout.decode()
    assert "RAISED" not in text, text
    assert int(text.split("forked ")[1]) < FAST.nproc, text


def test_file_names_cannot_write_outside_the_work_dir(sb):
    # the names come from the verifier, but Sandbox.run takes any: nothing may land outside
    for name in ("../rlfabric-escape", "../../rlfabric-escape", "/rlfabric-escape", "../proc/rlfabric"):
        with contextlib.suppress(ValueError, SandboxError):
            sb.run(mode="python", entry="solution.py", files={"solution.py": b"", name: b"x"}, limits=FAST)
        assert not Path("/rlfabric-escape").exists()
        assert not Path("/rlfabric-escape").is_symlink()


def test_bad_file_names_are_a_clear_non_retryable_error(sb):
    with pytest.raises(ValueError):
        sb.run(mode="python", entry="solution.py", files={"solution.py": b"", "../x": b"x"}, limits=FAST)


# -- processes that try to outlive their run ---------------------------------------------------
SURVIVORS = {
    "setsid_double_fork": (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
    ),
    # a daemon thread: Python waits for a thread that is not one before it exits (the
    # program has not ended while it runs), and so does the runner
    "thread_and_exec_of_sleep": (
        "import os, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "os.posix_spawn('/bin/sleep', ['sleep', '60'], {})\n"
    ),
    "stopped_child": (
        "import os, signal, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60)\n"
        "os.kill(pid, signal.SIGSTOP)\n"
    ),
    "nested_pid_namespace": LIBC
    + NEST
    + (
        "import time\n"
        "nest(0x20000000 | 0x00020000)\n"
        "if os.fork() == 0:\n"  # PID 1 of a namespace of its own
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    time.sleep(60)\n"
    ),
    "ptrace_sibling_pair": LIBC
    + (
        "import time\n"
        "a = os.fork()\n"
        "if a == 0:\n"
        "    time.sleep(60)\n"
        "if os.fork() == 0:\n"
        "    libc.ptrace(0x4206, a, 0, 0)\n"  # PTRACE_SEIZE its sibling, then idle
        "    time.sleep(60)\n"
    ),
}


@pytest.mark.parametrize("code", SURVIVORS.values(), ids=SURVIVORS.keys())
def test_no_process_survives_its_run(sb, code):
    # a wall limit far above the program's own time, so that the bound below tells "ended
    # with the program" from "ended at the wall limit" on a loaded machine too
    t0 = time.monotonic()
    out = py(sb, code + "\nprint('parent done')\n", limits=FAST.model_copy(update={"wall_s": 20}))
    assert out.status == "exited" and out.stdout.endswith(b"parent done\n"), out
    assert time.monotonic() - t0 < 10  # the run ended with the program, not at its wall limit
    # the sb fixture checks that nothing of the run is left on the host


def test_a_child_printing_after_the_program_exits_is_not_heard(sb):
    verifier = Verifier(sb, FAST)
    code = "import os, time, sys\nif os.fork() == 0:\n    time.sleep(0.5)\n    print('ok', flush=True)\n"
    result = verifier.verify(code, CodeTests(cases=[{"stdin": "", "expected_stdout": "ok"}]))
    assert result.status == "Failed", result  # the late child was killed with the namespace


# -- runs talking to each other or hurting each other -----------------------------------------
def test_concurrent_runs_share_no_channel(sb):
    first = (
        LIBC + "import socket, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "s.bind(b'\\0rlfabric-attack')\n"
        "s.listen(1)\n"
        "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "u.bind(('127.0.0.1', 47913))\n"
        "shm = libc.shmget(0x5EED, 4096, 0o1666)\n"
        "libc.msgget(0x5EED, 0o1666)\n"
        "libc.semget(0x5EED, 1, 0o1666)\n"
        "ring = libc.syscall(250, 1, b'rlfabric-shared')\n"  # KEYCTL_JOIN_SESSION_KEYRING by name
        "libc.syscall(248, b'user', b'msg', b'run-a-secret', 12, -3)\n"
        "open('/tmp/run-a', 'w').write('run-a-secret')\n"
        "time.sleep(1.2)\n"
        "print('a done')\n"
    )
    second = (
        LIBC + "import socket, glob\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "try:\n"
        "    s.connect(b'\\0rlfabric-attack')\n"
        "    print('LEAK abstract socket')\n"
        "except OSError:\n"
        "    pass\n"
        "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n"
        "    u.sendto(b'x', ('127.0.0.1', 47913))\n"
        "    print('LEAK udp')\n"
        "except OSError:\n"
        "    pass\n"
        "for name, call in (('shm', lambda: libc.shmget(0x5EED, 0, 0)),\n"
        "                   ('msg', lambda: libc.msgget(0x5EED, 0)),\n"
        "                   ('sem', lambda: libc.semget(0x5EED, 0, 0))):\n"
        "    if call() >= 0:\n"
        "        print('LEAK sysv', name)\n"
        "ring = libc.syscall(250, 1, b'rlfabric-shared')\n"
        "if libc.syscall(250, 10, ring, b'user', b'msg', 0) >= 0:\n"  # KEYCTL_SEARCH
        "    print('LEAK keyring')\n"
        "print('files', glob.glob('/tmp/*') + glob.glob('/sandbox/*') + glob.glob('/proc/*/root/tmp/*'))\n"
        "print('b done')\n"
    )
    results: dict[str, RunOutcome] = {}
    t = threading.Thread(target=lambda: results.setdefault("a", py(sb, first)))
    t.start()
    time.sleep(0.5)  # the first run holds every channel open now
    results["b"] = py(sb, second)
    t.join()
    assert results["a"].stdout == b"a done\n", results["a"]
    b_out = results["b"].stdout.decode()
    assert "LEAK" not in b_out and "run-a" not in b_out, b_out
    assert b_out.endswith("b done\n")


def test_signals_reach_no_other_run_nor_the_sandbox(sb):
    victim = "import time\ntime.sleep(1.0)\nprint('survived')\n"
    killer = (
        "import os, signal\n"
        "if os.fork() == 0:\n"  # in its own group, so kill(-1) does not end the report
        "    os.setsid()\n"
        "    for sig in (signal.SIGSTOP, signal.SIGKILL):\n"
        "        for pid in [p for p in (-1, *range(1, 4096)) if p != os.getpid()]:\n"
        "            try:\n"
        "                os.kill(pid, sig)\n"
        "            except OSError:\n"
        "                pass\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )
    zygote = sb._zygote
    results: dict[str, RunOutcome] = {}
    t = threading.Thread(target=lambda: results.setdefault("victim", py(sb, victim)))
    t.start()
    time.sleep(0.3)
    # PID 1 of the killer's namespace is its init: neither SIGSTOP nor SIGKILL from
    # inside reaches it, so the killer's own run is reported (its child killed the program)
    out = py(sb, killer)
    assert (out.status, out.signal) == ("signaled", signal.SIGKILL), out
    t.join()
    assert results["victim"].stdout == b"survived\n"
    assert sb._zygote is zygote and zygote is not None and zygote.poll() is None


def test_keyrings_are_the_runs_own_and_do_not_persist(sb):
    code = (
        LIBC + "buf = ctypes.create_string_buffer(256)\n"
        "for spec in (-3, -4, -5):\n"  # session, user, user-session keyrings
        "    ring = libc.syscall(250, 0, spec, 1)\n"  # KEYCTL_GET_KEYRING_ID (create)
        "    libc.syscall(250, 6, ring, buf, 256)\n"  # KEYCTL_DESCRIBE
        "    print('ring', buf.value.decode())\n"
        "found = libc.syscall(250, 10, -4, b'user', b'rlfabric-persist', 0)\n"
        "print('found', found >= 0)\n"
        "libc.syscall(248, b'user', b'rlfabric-persist', b'x', 1, -4)\n"
    )
    for _ in range(3):  # the next run (often the same uid slot) must not find the key
        out = py(sb, code)
        text = out.stdout.decode()
        assert "found False" in text, text
        for line in text.splitlines():
            if line.startswith("ring"):
                owner = int(line.split(";")[1])
                assert BASE_UID <= owner < BASE_UID + 1024, line  # never the worker's (root's)


# -- starving the sandbox ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("code", "stdin", "check"),
    [
        (  # non-UTF-8, NUL bytes and no final newline: byte-exact
            "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 3)",
            b"",
            lambda o: o.status == "exited" and o.stdout == bytes(range(256)) * 3,
        ),
        (  # one giant line with no newline: cut at the cap, the run killed
            "import sys\nsys.stdout.write('x' * (200 << 10))",
            b"",
            lambda o: o.status == "output_limit" and len(o.stdout) == FAST.stdout_bytes,
        ),
        (  # a flood of stderr: read to the end the CPU limit makes, its middle cut and marked
            "import os\nos.write(2, b'first\\n')\nwhile True:\n    os.write(2, b'e' * 65536)",
            b"",
            lambda o: (
                o.status in ("cpu_limit", "signaled", "timeout")
                and o.stderr_total > 4 * FAST.stderr_bytes
                and o.stderr.startswith(b"first\n")
                and o.stderr.endswith(b"e" * (FAST.stderr_bytes // 2))
                and b"\n[... %d bytes of stderr cut]\n" % (o.stderr_total - FAST.stderr_bytes) in o.stderr
            ),
        ),
        (  # 8 MB of stdin it never reads
            "print('ignored')",
            b"y" * (8 * MB),
            lambda o: o.status == "exited" and o.stdout == b"ignored\n",
        ),
        (  # 8 MB of stdin read in full
            "import sys\nprint(len(sys.stdin.buffer.read()))",
            b"y" * (8 * MB),
            lambda o: o.stdout == b"%d\n" % (8 * MB),
        ),
        (  # stdout and stderr closed, then a long quiet exit
            "import os\nos.close(1)\nos.close(2)\nos._exit(7)",
            b"",
            lambda o: o.status == "exited" and o.exit_code == 7,
        ),
        (  # thousands of inodes
            "import os\n"
            "for i in range(10_000):\n"
            "    try:\n"
            "        open(f'/sandbox/{i}', 'w').close()\n"
            "    except OSError as e:\n"
            "        print(e.errno, i)\n"
            "        break\n",
            b"",
            lambda o: o.stdout.split()[0] == b"28" and int(o.stdout.split()[1]) <= 4096,
        ),
    ],
    ids=["binary", "giant_line", "stderr_flood", "unread_stdin", "read_stdin", "closed_pipes", "inodes"],
)
def test_output_and_input_edge_cases(sb, code, stdin, check):
    out = py(sb, code, stdin=stdin)
    assert check(out), out


def test_the_wall_limit_holds_and_is_accounted(sb):
    code = (
        "import os, signal, time\n"
        "for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
        "    signal.signal(sig, signal.SIG_IGN)\n"
        "os.fork()\n"
        "time.sleep(60)\n"
    )
    limits = FAST.model_copy(update={"wall_s": 1.0})
    t0 = time.monotonic()
    out = py(sb, code, limits=limits)
    took = time.monotonic() - t0
    assert out.status == "timeout", out
    # killed at the wall limit, not at the client's give-up (wall_s + grace_s = 6 s) nor at the
    # program's own end (60 s); the slack above 1 s is for a loaded machine (three test workers)
    assert 1000 <= out.wall_ms < 5500, out.wall_ms
    assert took < 5.5, took


def test_a_userfaultfd_stall_still_dies_at_the_wall_limit(sb):
    code = LIBC + (
        "import mmap\n"
        "fd = libc.syscall(323, os.O_CLOEXEC | 1)\n"  # userfaultfd(UFFD_USER_MODE_ONLY)
        "if fd < 0:\n"
        "    print('no uffd')\n"
        "    raise SystemExit(0)\n"
        "api = (ctypes.c_uint64 * 3)(0xAA, 0, 0)\n"
        "libc.ioctl(fd, 0xC018AA3F, api)\n"  # UFFDIO_API
        "m = mmap.mmap(-1, 4096)\n"
        "addr = ctypes.addressof(ctypes.c_char.from_buffer(m))\n"
        "reg = (ctypes.c_uint64 * 4)(addr, 4096, 1, 0)\n"
        "libc.ioctl(fd, 0xC020AA00, reg)\n"  # UFFDIO_REGISTER (missing pages)
        "print('faulting', flush=True)\n"
        "m[0]\n"  # nobody serves the fault
    )
    limits = FAST.model_copy(update={"wall_s": 1.0})
    t0 = time.monotonic()
    out = py(sb, code, limits=limits)
    assert out.status == "timeout" or out.stdout == b"no uffd\n", out
    assert time.monotonic() - t0 < 3.5  # the wall limit (1 s), not wall_s + grace_s (6 s)
