"""Attacks on the code sandbox: hostile programs run for real, containment checked from outside.

Every test is one attack, and passes when it is contained (the review that wrote them
found 16 holes; each is fixed and its test passes). A hole found later belongs here as an
``xfail(strict=True, reason="HOLE: ...")`` test until it is fixed. Runs use uids from
340 000 up, apart from the other sandbox suites.

Attacks that leave something behind on purpose (a stuck run, a leaked uid slot)
get a sandbox of their own, closed (and checked clean) at the end of the test; closing the
sandbox ends whatever a hole left, and orphaned run PID 1s (see test_sandbox_lifecycle.py)
are killed by pid, so the suite leaves nothing running. The programs call x86_64 syscall
numbers directly (clone, keyctl, add_key, userfaultfd).
"""

from __future__ import annotations

import ast
import contextlib
import os
import platform
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
from sandbox_probe import (
    FAST,
    GOOD,
    LIBC,
    MB,
    NEST,
    jail_dirs,
    kill_orphaned_inits,
    lines,
    live_in_range,
    own_sandbox,
    py,
    settled_runs,
    stale_jail_dirs,
    wait_clean,
    wait_no_live,
)

from functions.verifiers import _linux
from functions.verifiers.cgroups import RunCgroups, SlotCgroups
from functions.verifiers.errors import SandboxError
from functions.verifiers.sandbox import Limits, RunOutcome, Sandbox, SandboxConfig, _package_root
from functions.verifiers.verify import CodeTests, Verifier

# node, and a fresh gcc binary, can take seconds of wall to start on a loaded 2-core machine:
# an attack test must fail the program on its attack, not on the clock
ROOMY = FAST.model_copy(update={"wall_s": 20, "cpu_s": 5})

pytestmark = [
    pytest.mark.skipif(_linux.supported() is not None, reason=str(_linux.supported())),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the attacks use x86_64 syscall numbers"),
]

BASE_UID = 340_000


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(base_uid=BASE_UID, spares=2, grace_s=2.0)) as sb:
        yield sb
    kill_orphaned_inits(BASE_UID)
    assert wait_clean(BASE_UID) == []
    assert live_in_range(BASE_UID) == [] or wait_no_live(BASE_UID)


@pytest.fixture
def sb(sandbox):
    """After every attack: nothing of it survives, the host's mounts are unchanged, the
    zygote has its spares back, and a good program is still judged right."""
    mounts_before = Path("/proc/self/mountinfo").read_text()
    yield sandbox
    assert wait_clean(BASE_UID) == [], "processes of a finished run survived"
    assert Path("/proc/self/mountinfo").read_text() == mounts_before, "a run changed the host's mounts"
    assert sandbox._zygote is not None
    assert settled_runs(sandbox._zygote.pid, 2) == 2, "a run's namespace is stuck (uid slot leaked)"
    out = sandbox.run_python(GOOD, stdin=b"20 22\n", limits=FAST)
    assert (out.status, out.stdout) == ("exited", b"42\n")


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
    assert "dev ['null', 'random', 'urandom', 'zero']" in text


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
    "thread_and_exec_of_sleep": (
        "import os, threading, time\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=False).start()\n"
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
        (  # a flood of stderr
            "import os\nwhile True:\n    os.write(2, b'e' * 65536)",
            b"",
            lambda o: o.status == "output_limit" and len(o.stderr) == FAST.stderr_bytes,
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
    # program's own end (60 s); the slack above 1 s is for a loaded machine
    assert 1000 <= out.wall_ms < 3500, out.wall_ms
    assert took < 3.5, took


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


# -- verdicts ----------------------------------------------------------------------------------
def test_verdicts_that_cannot_be_forged(sb):
    verifier = Verifier(sb, FAST)
    secret = "rlfabric-expected-4f2a9c"
    one = CodeTests(cases=[{"stdin": "", "expected_stdout": secret}])
    # the right output, then a crash: not a pass
    printed_then_failed = verifier.verify(f"print({secret!r})\nraise SystemExit(3)", one)
    assert printed_then_failed.status == "RuntimeError"
    killed = verifier.verify(f"import os\nprint({secret!r}, flush=True)\nos.kill(os.getpid(), 9)", one)
    assert killed.status == "RuntimeError"
    # the expected output is nowhere the program can look
    hunt = (
        "import os\n"
        "hits = []\n"
        "def look(path):\n"
        "    try:\n"
        "        if b'rlfabric-expected' in open(path, 'rb').read(1 << 20):\n"
        "            hits.append(path)\n"
        "    except OSError:\n"
        "        pass\n"
        "for root in ('/sandbox', '/tmp', '/proc/self', '/proc/1'):\n"
        "    for d, dirs, files in os.walk(root):\n"
        "        if root in ('/sandbox', '/tmp'):  # not the read-only shared dirs (a venv in /tmp)\n"
        "            dirs[:] = [x for x in dirs if os.access(os.path.join(d, x), os.W_OK)]\n"
        "        for f in files:\n"
        "            look(os.path.join(d, f))\n"
        "print(os.environ, hits)\n"
    )
    found = verifier.verify(hunt, one)
    assert found.status == "Failed" and "rlfabric-expected" not in found.cases[0].stdout


EARLY_EXITS = {
    "sys_exit": "import sys\nsys.exit(0)\n",
    "os_exit": "import os\nos._exit(0)\n",
    "raise_systemexit": "raise SystemExit\n",
    "patched_traceback": (
        "import os, traceback\ntraceback.print_exception = lambda *a, **k: os._exit(0)\n"
    ),  # a failing assert then exits 0 from the sandbox's own handler
}


@pytest.mark.parametrize("tail", EARLY_EXITS.values(), ids=EARLY_EXITS.keys())
def test_exiting_early_does_not_pass_assert_style_tests(sb, tail):
    verifier = Verifier(sb, FAST)
    result = verifier.verify(
        "def add(a, b):\n    return 0\n" + tail, CodeTests(test_code="assert add(2, 3) == 5")
    )
    assert result.status != "Finished", result


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_exiting_early_does_not_pass_javascript_asserts(sb):
    verifier = Verifier(sb, ROOMY)
    code = "function add(a, b) { return 0; }\nprocess.exit(0);\n"
    tests = CodeTests(test_code="require('assert').strictEqual(add(2, 3), 5);")
    assert verifier.verify(code, tests, "javascript").status != "Finished"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_exiting_early_does_not_pass_c_asserts(sb):
    verifier = Verifier(sb, ROOMY)
    code = (
        "#include <stdlib.h>\nint add(int a, int b) { return 0; }\n"
        "__attribute__((constructor)) static void early(void) { exit(0); }\n"
    )
    tests = CodeTests(test_code="#include <assert.h>\nint main(void) { assert(add(2, 3) == 5); return 0; }")
    assert verifier.verify(code, tests, "c").status != "Finished"


# A program that reads fd 3 itself, before its tests run, used to take the marker, print it
# and exit 0: a pass without one assert (any proof made in the tests' process can be forged
# by the code it runs: docs/code-verifier.md). The tests of every language now run in a
# process of their own: fd 3 carries their requests, and what the program prints or how it
# exits proves nothing to them.
FD3_FORGERIES = {
    "c": (
        "gcc",
        "#include <unistd.h>\nint add(int a, int b) { return 0; }\n"
        "__attribute__((constructor)) static void forge(void) {\n"
        "    char m[81]; int n = read(3, m, 80);\n"
        '    if (n > 0) { write(1, "\\n", 1); write(1, m, n); }\n'
        "    _exit(0);\n}\n",
        "#include <assert.h>\nint main(void) { assert(add(2, 3) == 5); return 0; }",
    ),
    "cpp": (
        "g++",
        "#include <unistd.h>\nint add(int a, int b) { return 0; }\n"
        "__attribute__((constructor)) static void forge(void) {\n"
        "    char m[81]; int n = read(3, m, 80);\n"
        '    if (n > 0) { write(1, "\\n", 1); write(1, m, n); }\n'
        "    _exit(0);\n}\n",
        "#include <cassert>\nint main() { assert(add(2, 3) == 5); return 0; }",
    ),
    "javascript": (
        "node",
        "function add(a, b) { return 0; }\n"
        "const fs = require('fs'), b = Buffer.alloc(80), n = fs.readSync(3, b, 0, 80, null);\n"
        "process.stdout.write('\\n' + b.toString('latin1', 0, n));\nprocess.exit(0);\n",
        "require('assert').strictEqual(add(2, 3), 5);",
    ),
}


def _forge_by_reading_fd_3(sb, lang, limits=ROOMY):
    tool, code, test_code = FD3_FORGERIES[lang]
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed")
    verifier = Verifier(sb, limits)
    return verifier.verify(code, CodeTests(test_code=test_code), lang)


@pytest.mark.parametrize("lang", ["c", "cpp"])
def test_reading_fd_3_does_not_pass_c_or_cpp_asserts(sb, lang):
    result = _forge_by_reading_fd_3(sb, lang)
    assert result.status != "Finished", result.cases[0]
    honest = FD3_FORGERIES[lang][1].split("__attribute__")[0].replace("return 0;", "return a + b;")
    tests = CodeTests(test_code=FD3_FORGERIES[lang][2])
    assert Verifier(sb, ROOMY).verify(honest, tests, lang).status == "Finished"


@pytest.mark.parametrize("lang", ["c", "cpp"])
def test_the_in_process_c_harness_is_still_forgeable_when_asked_for(sb, lang):
    # c_asserts="in_process" keeps the old harness for tests that need more than calls of
    # functions; it is documented as forgeable, and this pins that it is
    _tool, code, test_code = FD3_FORGERIES[lang]
    tests = CodeTests(test_code=test_code, c_asserts="in_process")
    assert Verifier(sb, ROOMY).verify(code, tests, lang).status == "Finished"


def test_reading_fd_3_does_not_pass_javascript_asserts(sb):
    # its fd 3 carries its tests' requests, which it reads before they are sent: it blocks
    # until the wall limit, and printing or exiting proves nothing to the tests' process
    result = _forge_by_reading_fd_3(sb, "javascript", ROOMY.model_copy(update={"wall_s": 8}))
    assert result.status == "TimeLimitExceeded", result.cases[0]


# The marker of assert-style tests (C, C++, JavaScript) sits on the program's fd 3 until its
# harness reads it after the tests: it is in no frame, source, binary, argv or environment
# of the run. Python's tests run in a sandbox of their own and need no marker: the old ways
# to steal one find nothing, and printing proves nothing.
PY_READS_MARKER = {
    "runner_frame": (
        "import sys\nm = sys._getframe(1).f_locals.get('marker')"
        " or sys._getframe(2).f_locals['run']['marker']\n"
    ),
    "start_message": "import sys\nm = sys._getframe(2).f_locals['run']['marker']\n",
    "environment": (
        "import os\nm = [v for v in os.environ.values() if v.startswith('rlfabric-tests-done-')][0]\n"
    ),
    "source": "m = [w for w in open(__file__).read().split() if w.startswith('rlfabric-tests-done-')][0]\n",
}


@pytest.mark.parametrize("steal", PY_READS_MARKER.values(), ids=PY_READS_MARKER.keys())
def test_python_asserts_cannot_be_passed_by_reading_the_marker(sb, steal):
    verifier = Verifier(sb, FAST)
    code = (
        "def add(a, b):\n    return 0\n"
        + steal
        + "import os\nos.write(1, ('\\n' + m + '\\n').encode())\nos._exit(0)\n"
    )
    result = verifier.verify(code, CodeTests(test_code="assert add(2, 3) == 5\nassert add(1, 1) == 2"))
    assert result.status != "Finished", result.cases[0]


ALWAYS_EQUAL = {  # a wrong add() and what it is asserted to equal
    "python_eq": ("class Any:\n    def __eq__(self, other):\n        return True\n", "Any()", "5"),
    "int_subclass": ("class I(int):\n    __eq__ = int.__ge__\n", "I(10**9)", "5"),
    "inside_a_list": (
        "class Any:\n    __eq__ = lambda self, other: True\n    __hash__ = lambda self: 5\n",
        "[Any()]",
        "[5]",
    ),
    "inside_a_set": (
        "class Any:\n    __eq__ = lambda self, other: True\n    __hash__ = lambda self: 5\n",
        "{Any()}",
        "{5}",
    ),
    "metaclass_lies": (
        "class Meta(type):\n    __dict__ = property(lambda cls: {})\n"
        "class Any(metaclass=Meta):\n    def __eq__(self, other):\n        return True\n",
        "Any()",
        "5",
    ),
}


@pytest.mark.parametrize(("cls", "answer", "expected"), ALWAYS_EQUAL.values(), ids=ALWAYS_EQUAL.keys())
def test_python_asserts_cannot_be_passed_by_an_always_equal_answer(sb, cls, answer, expected):
    verifier = Verifier(sb, FAST)
    code = f"{cls}\ndef add(a, b):\n    return {answer}\n"
    for test in (f"assert add(2, 3) == {expected}", f"assert {expected} == add(2, 3)"):
        # in the program's own process the lie works...
        plain = sb.run_python(code + test.replace("assert ", "print(") + ")\n", limits=FAST)
        assert plain.stdout.strip() == b"True", "the hack works on a plain =="
        # ...but the tests run in a process of their own, which decides == itself
        result = verifier.verify(code, CodeTests(test_code=test))
        assert result.status == "Failed", result.cases[0]


def test_python_asserts_still_pass_honest_programs(sb):
    verifier = Verifier(sb, FAST)
    code = (
        "import collections\nclass P:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __eq__(self, other):\n        return isinstance(other, P) and other.x == self.x\n"
        "Pair = collections.namedtuple('Pair', 'a b')\n"
        "def half(n):\n    return n / 2\n"
    )
    tests = (
        "assert half(10) == 5\nassert P(1) == P(1)\nassert Pair(1, 2) == (1, 2)\n"
        "assert {'k': [half(2)]} == {'k': [1]}\n"
        "class T:\n    def check(self):\n        assert half(4) == 2, 'msg'\n"
        "T().check()\nassert (half(2) == 1) == True"
    )
    result = verifier.verify(code, CodeTests(test_code=tests))
    assert result.status == "Finished", result.cases[0]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_javascript_asserts_cannot_be_passed_by_reading_the_marker(sb):
    verifier = Verifier(sb, ROOMY)
    code = (
        "function add(a, b) { return 0; }\n"
        "const src = require('fs').readFileSync(__filename, 'utf8')"
        " + JSON.stringify(process.env) + process.argv;\n"
        "const m = src.match(/rlfabric-tests-done-[0-9a-f]{16}/);\n"
        "process.stdout.write('\\n' + (m ? m[0] : 'none') + '\\n'); process.exit(0);\n"
    )
    tests = CodeTests(test_code="require('assert').strictEqual(add(2, 3), 5);")
    result = verifier.verify(code, tests, "javascript")
    assert result.status != "Finished", result.cases[0]
    honest = verifier.verify("function add(a, b) { return a + b; }", tests, "javascript")
    assert honest.status == "Finished", honest.cases[0]


C_READS_MARKER = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
int add(int a, int b) { volatile int wrong = 0; return wrong; }
static char image[1 << 21];
__attribute__((constructor)) static void early(void) {
    char prefix[21];
    strcpy(prefix, "rlfabric"); strcat(prefix, "-tests-done-");
    FILE *f = fopen("/proc/self/exe", "rb");
    size_t n = f ? fread(image, 1, sizeof image, f) : 0;
    for (size_t i = 0; i + 36 <= n; i++)
        if (memcmp(image + i, prefix, 20) == 0) {
            char line[38]; line[0] = '\n'; memcpy(line + 1, image + i, 36); line[37] = '\n';
            write(1, line, sizeof line); _exit(0);
        }
    _exit(0);
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_c_asserts_cannot_be_passed_by_reading_the_marker(sb):
    verifier = Verifier(sb, ROOMY)
    tests = CodeTests(test_code="#include <assert.h>\nint main(void) { assert(add(2, 3) == 5); return 0; }")
    result = verifier.verify(C_READS_MARKER, tests, "c")
    assert result.status != "Finished", result.cases[0]
    honest = verifier.verify("int add(int a, int b) { return a + b; }", tests, "c")
    assert honest.status == "Finished", honest.cases[0]


def test_a_program_cannot_fake_a_retryable_sandbox_error(sb):
    verifier = Verifier(sb, FAST)
    code = "import os\nos.write(2, b'rl-fabric sandbox setup failed: not me\\n')\nos._exit(125)\n"
    result = verifier.verify(code, CodeTests(cases=[{"stdin": "", "expected_stdout": "1"}]))
    assert not result.retryable and result.status == "RuntimeError", result


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
