"""The code verifier: verdicts, languages, bad input, sandbox failures, and the fabric path."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from fabric.backends.base import LocalConfig
from fabric.client import Client
from fabric.errors import ErrorCode
from fabric.registry import Registry
from functions.verifiers import _linux
from functions.verifiers.code import code_verify, extract_code
from functions.verifiers.errors import SandboxError
from functions.verifiers.sandbox import Limits, Sandbox, SandboxConfig
from functions.verifiers.supervisor import _Drain, cut_marker, kept_stderr
from functions.verifiers.verify import CaseResult, CodeTests, Verifier, VerifyResult

pytestmark = pytest.mark.skipif(_linux.supported() is not None, reason=str(_linux.supported()))

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=256)
# an interpreter or compiled binary started from scratch (node, a fresh exec) can take seconds
# of wall on a loaded 2-core machine: the tests that check a language works give it room,
# the tests that check a limit use LIMITS
ROOMY = LIMITS.model_copy(update={"cpu_s": 5, "wall_s": 20})
ADD_CASES = [{"stdin": "1 2\n", "expected_stdout": "3\n"}, {"stdin": "20 22\n", "expected_stdout": "42"}]


def needs(binary: str):
    return pytest.mark.skipif(shutil.which(binary) is None, reason=f"{binary} is not installed")


@pytest.fixture(scope="module")
def verifier():
    # 322_000: test_sandbox_security.py uses 310_000 up to 321_263, and may run at the same time
    with Sandbox(SandboxConfig(base_uid=322_000, spares=2)) as sb:
        yield Verifier(sb, LIMITS)


def cases(*pairs: tuple[str, str]) -> CodeTests:
    return CodeTests(cases=[{"stdin": i, "expected_stdout": o} for i, o in pairs])


@pytest.mark.parametrize(
    ("code", "status", "message"),
    [
        ("a, b = map(int, input().split())\nprint(a + b)", "Finished", ""),
        ("a, b = map(int, input().split())\nprint(a - b)", "Failed", "wrong output"),
        ("while True:\n    pass", "TimeLimitExceeded", "CPU seconds"),
        ("import time\ntime.sleep(10)", "TimeLimitExceeded", "wall limit"),
        ("x = bytearray(10**10)", "MemoryLimitExceeded", "256 MB"),
        ("raise KeyError('boom')", "RuntimeError", "exited with code 1"),
        ("import sys\nsys.exit(4)", "RuntimeError", "exited with code 4"),
        ("print(1", "RuntimeError", "exited with code 1"),
        ("import os\nos.kill(os.getpid(), 11)", "RuntimeError", "SIGSEGV"),
        ("while True:\n    print('y' * 1000)", "RuntimeError", "stdout cap"),
    ],
)
def test_each_verdict(verifier, code, status, message):
    # a verdict that must come from the CPU limit gets a wall limit far past it: on a loaded
    # machine a spinning run gets a fraction of a core and could reach 3 s of wall first
    limits = LIMITS.model_copy(update={"wall_s": 15}) if message == "CPU seconds" else None
    result = verifier.verify(code, cases(("1 2", "3")), limits=limits)
    case = result.cases[0]
    assert (result.status, case.status) == (status, status), case
    assert message in case.message
    assert result.pass_fraction == (1.0 if status == "Finished" else 0.0)


@pytest.mark.parametrize(
    "code",
    [
        # it caught the MemoryError of a first try and answered by another way: the text on
        # its stderr is a memory verdict only for a run that did not exit cleanly (it was
        # MemoryLimitExceeded, scored 0, with the right answer printed)
        "try:\n    raise MemoryError\nexcept MemoryError:\n"
        "    import traceback\n    traceback.print_exc()\nprint(3)",
        "import sys\nprint('note: no MemoryError this time', file=sys.stderr)\nprint(3)",
    ],
)
def test_a_clean_exit_is_judged_on_its_output_whatever_its_stderr_says(verifier, code):
    result = verifier.verify(code, cases(("1 2", "3")))
    assert result.status == "Finished", result.cases[0]


@needs("gcc")
def test_a_c_program_that_survives_a_failed_malloc_is_judged_on_its_output(verifier):
    # perror of a refused allocation prints "Cannot allocate memory", C's out-of-memory text
    code = (
        "#include <stdio.h>\n#include <stdlib.h>\n"
        'int main(void){ if (!malloc(1ul << 40)) perror("malloc"); puts("3"); return 0; }'
    )
    result = verifier.verify(code, cases(("", "3")), "c", limits=ROOMY)
    assert result.status == "Finished", result.cases[0]


#: competitive programming's idiom for deep recursion: main() in a thread with a large stack,
#: the main thread done at once; Python waits for the thread before it exits
THREADED_MAIN = (
    "import sys, threading\nsys.setrecursionlimit(1 << 20)\nthreading.stack_size(1 << 26)\n"
    "def main():\n    n = int(input())\n    def depth(k):\n        return 0 if k == 0 else 1 + depth(k - 1)\n"
    "    print(depth(n))\nthreading.Thread(target=main).start()"
)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        # the sandbox ended the run when the main thread's code did: no output, "wrong output"
        (THREADED_MAIN, "100000"),
        ("import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.2), print(3))).start()", "3"),
        # nor did it run what the program registered for its exit
        ("import atexit\natexit.register(print, 'bye')\nprint('hi')", "hi\nbye"),
        ("import atexit, sys\natexit.register(print, 'bye')\nprint('hi')\nsys.exit(0)", "hi\nbye"),
        # and a program that closed its stdout exited 1 (Python skips a closed stream at exit)
        ("import sys\nprint(3)\nsys.stdout.close()", "3"),
    ],
)
def test_a_program_ends_as_python_would_end_it(verifier, code, expected):
    result = verifier.verify(code, cases(("100000", expected)))
    assert result.status == "Finished", result.cases[0]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        # the program ran in a bare dict: sys.modules["__main__"] was the sandbox's own module,
        # so what finds a program's names through it did not (pickle: "attribute lookup P on
        # __main__ failed"; typing's string annotations: NameError; doctest: no example)
        ("import pickle\nclass P:\n    x = 3\nprint(pickle.loads(pickle.dumps(P())).x)", "3"),
        ("import sys\nanswer = 42\nprint(sys.modules['__main__'].answer)", "42"),
        (
            "from __future__ import annotations\nimport typing\nclass A:\n    b: B\nclass B:\n    pass\n"
            "print(typing.get_type_hints(A)['b'] is B)",
            "True",
        ),
        (
            'import doctest\ndef f():\n    """\n    >>> f()\n    1\n    """\n    return 1\n'
            "print(doctest.testmod())",
            "TestResults(failed=0, attempted=1)",
        ),
    ],
)
def test_the_program_is_the_main_module(verifier, code, expected):
    result = verifier.verify(code, cases(("", expected)))
    assert result.status == "Finished", result.cases[0]


def test_a_daemon_thread_is_not_waited_for(verifier):
    code = "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
    code += "print(1)"
    result = verifier.verify(code, cases(("", "1")))
    assert result.status == "Finished", result.cases[0]


@pytest.mark.parametrize(
    "code",
    [
        # multiprocessing's locks and queues are POSIX semaphores, which sem_open makes in
        # /dev/shm: the jail had none, so each of these died of FileNotFoundError (scored 0)
        "import multiprocessing as mp\nif __name__ == '__main__':\n"
        "    with mp.Pool(2) as pool:\n        print(sum(pool.map(abs, [-1, -2])))",
        "import multiprocessing as mp\nq = mp.Queue()\np = mp.Process(target=q.put, args=(3,))\n"
        "p.start()\nprint(q.get())\np.join()",
        "import multiprocessing as mp\nwith mp.Lock():\n    print(3)",
        "from concurrent.futures import ProcessPoolExecutor\nif __name__ == '__main__':\n"
        "    with ProcessPoolExecutor(2) as ex:\n        print(sum(ex.map(abs, [-1, -2])))",
        "from multiprocessing import shared_memory\nm = shared_memory.SharedMemory(create=True, size=64)\n"
        "m.buf[0] = 3\nprint(m.buf[0])\nm.close()\nm.unlink()",
    ],
    ids=["pool", "queue", "lock", "process_pool_executor", "shared_memory"],
)
def test_multiprocessing_works_as_it_does_outside(verifier, code):
    result = verifier.verify(code, cases(("", "3")))
    assert result.status == "Finished", result.cases[0]


@pytest.mark.parametrize(
    "code",
    [
        # the program was its session's leader (and so its group's): both calls, which work
        # for a program a judge starts with subprocess, failed with EPERM
        "import os\nos.setsid()\nprint(3)",
        "import os\nos.setpgrp()\nprint(3)",
        # and its own group is still what kill(0) and killpg reach: it and its children
        "import os, signal, subprocess, time\nsignal.signal(signal.SIGUSR1, lambda *_: print(3))\n"
        "child = subprocess.Popen(['sleep', '30'])\nos.killpg(0, signal.SIGUSR1)\n"
        "print(child.wait() == -signal.SIGUSR1)",
    ],
    ids=["setsid", "setpgrp", "killpg"],
)
def test_a_program_may_start_a_session_or_group_of_its_own(verifier, code):
    expected = "3\nTrue" if "killpg" in code else "3"
    result = verifier.verify(code, cases(("", expected)))
    assert result.status == "Finished", result.cases[0]


def test_orphaned_children_are_reaped_as_outside(verifier):
    # a shell's background command outlives the shell: orphaned, it went to the run's init,
    # which never reaped it. Each zombie held one of the run's 32 processes until a fork
    # failed ("sh: 0: Cannot fork")
    code = "import subprocess\nfor _ in range(80):\n    subprocess.run(['sh', '-c', 'true &'], check=True)\n"
    code += "print(3)"
    result = verifier.verify(code, cases(("", "3")), limits=LIMITS.model_copy(update={"wall_s": 10}))
    assert result.status == "Finished", result.cases[0]


def test_numpy_imports_on_a_machine_with_more_cores_than_the_run_has_processes(verifier):
    # OpenBLAS starts a thread per core as numpy is imported: on a worker with more cores than
    # the run's nproc (32 by default: a 64-core host), `import numpy` died of it ("pthread_create
    # failed", then SIGINT). Here an nproc of 1 stands for that host
    pytest.importorskip("numpy")
    code = "import numpy\nprint(int(numpy.ones(3).sum()))"
    result = verifier.verify(code, cases(("", "3")), limits=LIMITS.model_copy(update={"nproc": 1}))
    assert result.status == "Finished", result.cases[0]


POOL_SIZES = (
    "import os, multiprocessing as mp\n"
    "from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor\n"
    "if __name__ == '__main__':\n"
    "    with mp.Pool() as pool:\n        sizes = [pool._processes, sum(pool.map(abs, [-1]))]\n"
    "    with ProcessPoolExecutor() as ex:\n        sizes += [ex._max_workers, sum(ex.map(abs, [-1]))]\n"
    "    with ThreadPoolExecutor() as ex:\n        sizes += [ex._max_workers, sum(ex.map(abs, [-1] * 64))]\n"
    "    print(os.cpu_count(), *sizes)"
)
#: each thread's stack and malloc arena are address space: at 256 MB only 5 threads start
POOL_LIMITS = LIMITS.model_copy(update={"memory_mb": 512})


def test_a_run_sees_the_configured_cores_not_the_hosts():
    # os.cpu_count() (glibc reads /sys/devices/system/cpu/online, else /proc/stat) gave the
    # host's cores: on a 64-core worker Pool(), ProcessPoolExecutor() and ThreadPoolExecutor()
    # sized themselves past the run's 32 processes and threads, and a right program scored 0.
    # A count the host does not have stands for that host here
    cpus = (os.cpu_count() or 1) + 1
    with Sandbox(SandboxConfig(base_uid=326_000, spares=1, cpus=cpus)) as sb:
        expected = f"{cpus} {cpus} 1 {cpus} 1 {cpus + 4} 64"
        result = Verifier(sb, POOL_LIMITS).verify(POOL_SIZES, cases(("", expected)))
    assert result.status == "Finished", result.cases[0]


def test_the_default_core_count_leaves_default_sized_pools_room_under_the_limits(verifier):
    # well under the default nproc (32), whatever the host: here 16
    cpus = SandboxConfig().cpus
    expected = f"{cpus} {cpus} 1 {cpus} 1 {cpus + 4} 64"
    limits = POOL_LIMITS.model_copy(update={"nproc": 16})
    result = verifier.verify(POOL_SIZES, cases(("", expected)), limits=limits)
    assert result.status == "Finished", result.cases[0]


def test_busy_threads_fit_the_default_memory_limit(verifier):
    # glibc gave each thread that allocates a malloc arena of its own, 64 MiB of address
    # space reserved apiece, and RLIMIT_AS counts reservations: at memory_mb=256 a sixth
    # live thread failed to start ("can't start new thread"), so a right program with 16
    # threads at once scored 0 (MALLOC_ARENA_MAX bounds the arenas)
    code = (
        "import threading\n"
        "barrier = threading.Barrier(16)\n"
        "def work():\n"
        "    bytearray(100_000)\n"
        "    barrier.wait()\n"
        "ts = [threading.Thread(target=work) for _ in range(16)]\n"
        "[t.start() for t in ts]\n"
        "[t.join() for t in ts]\n"
        "print(len(ts))"
    )
    limits = LIMITS.model_copy(update={"wall_s": 15, "cpu_s": 5})
    result = verifier.verify(code, cases(("", "16")), limits=limits)
    assert result.status == "Finished", result.cases[0]


def test_the_user_has_a_name(verifier):
    # the run's uid has no entry in the host's /etc/passwd, and getpass.getuser() (which
    # caches of torch, triton and others are named by) raised KeyError: "uid not found"
    result = verifier.verify("import getpass\nprint(getpass.getuser())", cases(("", "sandbox")))
    assert result.status == "Finished", result.cases[0]


@pytest.mark.parametrize(
    "code",
    [
        # Python's own handlers, as python sets them at start-up: SIGINT raises KeyboardInterrupt
        # and SIGPIPE is ignored (a write to a closed pipe raises BrokenPipeError). The sandbox
        # left both at the kernel's default, and either one killed the program outright
        "import os, signal, time\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(1)\n"
        "except KeyboardInterrupt:\n    print(3)",
        "import subprocess\np = subprocess.Popen(['true'], stdin=subprocess.PIPE)\np.wait()\ntry:\n"
        "    p.stdin.write(b'x' * 100_000)\n    p.stdin.flush()\nexcept BrokenPipeError:\n    print(3)",
    ],
    ids=["sigint", "sigpipe"],
)
def test_signals_are_handled_as_python_handles_them(verifier, code):
    result = verifier.verify(code, cases(("", "3")))
    assert result.status == "Finished", result.cases[0]


@pytest.mark.parametrize(
    "code",
    [
        # the jail's /dev had no /dev/stdin, /dev/stdout, /dev/stderr nor /dev/fd: a program
        # that read its input by that name died of FileNotFoundError (scored 0)
        "print(open('/dev/stdin').read().split()[0])",
        "with open('/dev/stdout', 'w') as f:\n    f.write(input() + '\\n')",
        "import os\nprint(os.read(os.open('/dev/fd/0', os.O_RDONLY), 1).decode())",
        "import subprocess\nsubprocess.run(['sh', '-ec', 'read x; echo $x >/dev/stderr; echo $x'], "
        "check=True)",
    ],
    ids=["stdin", "stdout", "fd", "shell_stderr"],
)
def test_the_standard_streams_have_their_dev_names(verifier, code):
    result = verifier.verify(code, cases(("3\n", "3")))
    assert result.status == "Finished", result.cases[0]


def test_the_standard_streams_are_buffered_as_pythons(verifier):
    # they were text over raw descriptors: sys.stdin.buffer.readline, the fast-input idiom of
    # competitive programming, read a byte per system call (4x python's CPU on 200 000 lines,
    # a time limit where python passes), and .peek, .read1 and .raw were missing
    code = (
        "import sys\nprint(*(type(s.buffer).__name__ for s in (sys.stdin, sys.stdout, sys.stderr)))\n"
        "print(sys.stdin.buffer.peek(1)[:1].decode(), sys.stdin.buffer.readline().decode().strip())"
    )
    result = verifier.verify(code, cases(("3\n", "BufferedReader BufferedWriter BufferedWriter\n3 3")))
    assert result.status == "Finished", result.cases[0]


@pytest.mark.parametrize(
    "code",
    [
        # sys.__stdout__ was still the zygote's own stream (on the same descriptor): what went
        # there was never flushed, and the right answer was lost
        "import sys\nprint(3, file=sys.__stdout__)",
        "import sys\nprint(sys.__stdin__.readline().strip())",
        "import sys, io\nsys.stdout = io.StringIO()\nprint('hidden')\nsys.stdout = sys.__stdout__\nprint(3)",
    ],
    ids=["stdout", "stdin", "restored"],
)
def test_the_original_streams_are_the_runs(verifier, code):
    result = verifier.verify(code, cases(("3\n", "3")))
    assert result.status == "Finished", result.cases[0]


def test_pass_fraction_and_the_worst_status_wins(verifier):
    code = "a, b = map(int, input().split())\nif a == 3:\n    while True: pass\nprint(a + b)"
    result = verifier.verify(code, cases(("1 2", "3"), ("2 2", "5"), ("3 1", "4"), ("5 5", "10")))
    assert [c.status for c in result.cases] == ["Finished", "Failed", "TimeLimitExceeded", "Finished"]
    assert (result.status, result.passed, result.total, result.pass_fraction) == (
        "TimeLimitExceeded",
        2,
        4,
        0.5,
    )


def test_cases_that_cannot_finish_within_the_budget_are_not_run_but_judged():
    # each case had its own limits and nothing bounded them together: a program that sleeps,
    # on 512 cases of 5 s, 4 at a time, took 640 s, and code_verify's 120 s timeout killed
    # the worker (its zygote too) and retried the call, which timed out again
    limits = Limits(cpu_s=1, wall_s=1, memory_mb=256)
    with Sandbox(SandboxConfig(base_uid=324_000, spares=4)) as sb:
        slow = Verifier(sb, limits, budget_s=2.0)
        result = slow.verify("import time\ntime.sleep(10)", cases(*[("", "")] * 12))
        fine = slow.verify("print(1)", cases(*[("", "1")] * 12))
    # 3 rounds of 4 at 1 s each: the third cannot start by the budget's end
    assert [c.status for c in result.cases] == ["TimeLimitExceeded"] * 12
    skipped = [c for c in result.cases if c.message.startswith("not run")]
    assert skipped and skipped[0].message == (
        "not run: a 1 s case would end past the verification's 2 s budget (the others used it)"
    )
    assert (fine.status, fine.passed) == ("Finished", 12)


def test_limits_past_the_budget_are_refused(verifier):
    with pytest.raises(ValueError, match="wall_s 200 s is over the verifier's budget_s 100 s"):
        verifier.verify("print(1)", cases(("", "1")), limits=LIMITS.model_copy(update={"wall_s": 200}))


def test_a_program_is_compiled_with_its_own_future_flags(verifier):
    # the sandbox's `from __future__ import annotations` reached every Python program: its
    # annotations were strings (an honest program that read them failed)
    code = "def f(x: int):\n    return x\nprint(f.__annotations__['x'] is int)"
    assert verifier.verify(code, cases(("", "True"))).status == "Finished"


def test_an_expected_output_longer_than_the_stdout_cap_can_be_matched(verifier):
    # 200 000 numbers a line each, 1.6 MB: the right answer was killed at the 1 MiB stdout cap
    # ("wrote more than the stdout cap") and scored 0. A flood still is (test_each_verdict)
    first, n = 10**6, 200_000
    expected = "\n".join(map(str, range(first, first + n)))
    code = f"import sys\nsys.stdout.write('\\n'.join(map(str, range({first}, {first + n}))) + '\\n')"
    assert len(expected) > LIMITS.stdout_bytes
    result = verifier.verify(code, cases(("", expected)))
    assert result.status == "Finished", result.cases[0]
    wrong = verifier.verify(code.replace(str(first), str(first + 1), 1), cases(("", expected)))
    assert (wrong.status, wrong.cases[0].message) == ("Failed", "wrong output")


def test_output_comparison_ignores_trailing_whitespace_only(verifier):
    ok = verifier.verify("print('a  \\nb\\n\\n')", cases(("", "a\nb")))
    assert ok.status == "Finished"
    assert verifier.verify("print('a b')", cases(("", "ab"))).status == "Failed"
    assert verifier.verify("print('A')", cases(("", "a"))).status == "Failed"


def test_assert_style_tests(verifier):
    code = "def add(a, b):\n    return a + b\n"
    assert verifier.verify(code, CodeTests(test_code="assert add(2, 3) == 5")).status == "Finished"
    failed = verifier.verify(code, CodeTests(test_code="assert add(2, 3) == 6, 'add is wrong'"))
    assert (failed.status, failed.cases[0].message) == ("Failed", "an assertion failed")
    assert "add is wrong" in failed.cases[0].stderr
    crashed = verifier.verify(code, CodeTests(test_code="add(1)"))
    assert crashed.status == "RuntimeError"


def test_non_utf8_output_is_judged_not_fatal(verifier):
    result = verifier.verify("import sys\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')", cases(("", "ok")))
    assert result.status == "Failed"
    assert "\ufffd" in result.cases[0].stdout
    result.model_dump_json()  # and the result is valid JSON for the wire


def test_chatty_stderr_is_cut_in_the_middle_not_the_end_of_the_run(verifier):
    # stderr past its 64 KiB cap killed the run ("wrote more than the stderr cap"): a right
    # program that logged its progress scored 0, where judges ignore stderr. Now its middle is
    # cut and marked, and its end (where a traceback would be) is kept
    code = (
        "import sys\nfor i in range(20_000):\n    print('debug line', i, file=sys.stderr)\n"
        "print('last words', file=sys.stderr)\nprint(sum(map(int, input().split())))"
    )
    result = verifier.verify(code, cases(("1 2", "3")))
    case = result.cases[0]
    assert (result.status, case.message) == ("Finished", ""), case
    assert case.stderr.endswith("debug line 19999\nlast words\n"), case.stderr[-100:]


@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 1000, 100_000])
def test_stderr_keeps_its_start_and_end_however_it_arrives(size):
    data = bytes(65 + i % 26 for i in range(size))  # ASCII: the cut drops no broken character
    kept = kept_stderr(data, 100)
    for step in (1, 7, 64, 65536):  # as the pipe hands it over
        drain = _Drain(100)
        for i in range(0, size, step):
            drain.feed(data[i : i + step])
        assert drain.kept() == kept and drain.total == size
    if size <= 100:
        assert kept == data
    else:
        assert kept == data[:50] + cut_marker(size - 100, at_line_start=False) + data[-50:]


def test_stderr_cut_at_its_cap_shows_no_broken_character(verifier):
    # the cut fell inside a 2-byte character: its halves showed as U+FFFD
    code = "import sys\nsys.stderr.buffer.write(b'a' + '\u00e9'.encode() * 40_000 + b'a')"
    case = verifier.verify(code, cases(("", ""))).cases[0]
    assert case.status == "Finished", case
    assert "\ufffd" not in case.stderr and case.stderr.endswith("\u00e9" * 100 + "a"), case.stderr[-20:]


def test_each_case_is_a_fresh_process(verifier):
    code = "import os\nprint(os.path.exists('/sandbox/mark'))\nopen('/sandbox/mark', 'w').write('x')"
    result = verifier.verify(code, cases(("", "False"), ("", "False"), ("", "False")))
    assert result.passed == 3


@needs("gcc")
def test_c(verifier):
    code = '#include <stdio.h>\nint main(){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);return 0;}'
    result = verifier.verify(code, CodeTests(cases=ADD_CASES), "c", limits=ROOMY)
    assert (result.status, result.passed) == ("Finished", 2), result.cases
    assert result.compile is not None and result.compile.status == "Finished"
    broken = verifier.verify("int main(){ return nope; }", CodeTests(cases=ADD_CASES), "c")
    assert broken.status == "RuntimeError" and broken.compile is not None
    assert "nope" in broken.compile.stderr and broken.cases[0].message.startswith("not run")
    segv = verifier.verify("int main(){ int *p = 0; return *p; }", CodeTests(cases=ADD_CASES[:1]), "c")
    assert "SIGSEGV" in segv.cases[0].message


@needs("g++")
def test_cpp(verifier):
    code = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"
    result = verifier.verify(code, CodeTests(cases=ADD_CASES), "c++", limits=ROOMY)
    assert result.status == "Finished", result.cases
    oom = "#include <vector>\nint main(){std::vector<char> v(1L<<34); return v[5];}"
    assert verifier.verify(oom, CodeTests(cases=ADD_CASES[:1]), "cpp").status == "MemoryLimitExceeded"


@needs("node")
def test_javascript(verifier):
    code = (
        "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
        "console.log(a + b);\n"
    )
    result = verifier.verify(code, CodeTests(cases=ADD_CASES), "js", limits=ROOMY)
    assert result.status == "Finished", result.cases
    asserted = verifier.verify(
        "function sq(x) { return x * x; }",
        CodeTests(test_code="require('assert').strictEqual(sq(3), 10);"),
        "javascript",
        limits=ROOMY,
    )
    assert asserted.status == "Failed", asserted.cases
    hog = "const a = []; while (true) a.push(new Array(1e6).fill(1));"
    assert verifier.verify(hog, CodeTests(cases=ADD_CASES[:1]), "js").status in (
        "MemoryLimitExceeded",
        "TimeLimitExceeded",
    )


@needs("node")
def test_javascript_reads_its_input_as_dev_stdin(verifier):
    # the idiom of JavaScript on the judges (readFileSync("/dev/stdin")) died of ENOENT: the
    # jail had no /dev/stdin
    code = (
        "const [a, b] = require('fs').readFileSync('/dev/stdin', 'utf8').trim().split(/\\s+/).map(Number);\n"
        "console.log(a + b);\n"
    )
    result = verifier.verify(code, CodeTests(cases=ADD_CASES), "js", limits=ROOMY)
    assert result.status == "Finished", result.cases


def test_bad_input_is_a_clear_error(verifier):
    with pytest.raises(ValueError, match="unknown language 'cobol'"):
        verifier.verify("print(1)", cases(("", "1")), "cobol")
    with pytest.raises(ValueError, match=r"unknown language 'pyhton' \(did you mean 'python'\?\)"):
        verifier.verify("print(1)", cases(("", "1")), "pyhton")


def test_an_over_long_program_scores_zero_not_an_error(verifier):
    # the policy wrote it: an error would mask the trajectory instead of scoring it
    result = verifier.verify("x" * (300 * 1024), cases(("", "1"), ("", "2")))
    assert (result.status, result.passed, result.total) == ("RuntimeError", 0, 2)
    assert result.cases[0].message == "not run: program too long: 307200 bytes > 262144"
    asserted = verifier.verify("#" * (300 * 1024), CodeTests(test_code="pass"))
    assert asserted.total == 1 and asserted.pass_fraction == 0.0


def test_malformed_tests_are_refused():
    with pytest.raises(ValueError, match="exactly one of"):
        CodeTests()
    with pytest.raises(ValueError, match="exactly one of"):
        CodeTests(cases=ADD_CASES, test_code="assert True")
    with pytest.raises(ValueError, match="empty"):
        CodeTests(cases=[])
    with pytest.raises(ValueError):
        CodeTests(cases=[{"stdin": "1"}])  # no expected output


def test_extract_code_takes_the_last_fenced_block():
    text = "First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\nDone."
    assert extract_code(text) == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


FENCE = "`" * 3
PROGRAM_THEN_OUTPUT = f"The program:\n{FENCE}python\nprint(6 * 7)\n{FENCE}\nIt prints:\n{FENCE}\n42\n{FENCE}"


@pytest.mark.parametrize(
    ("text", "language", "expected"),
    [
        # the plain block after the program (its output) was taken for the program
        (PROGRAM_THEN_OUTPUT, "python", "print(6 * 7)\n"),
        (PROGRAM_THEN_OUTPUT, "py", "print(6 * 7)\n"),
        (PROGRAM_THEN_OUTPUT.replace("python", "py3"), "python", "print(6 * 7)\n"),
        (f"{FENCE}cpp\nint main() {{}}\n{FENCE}\n{FENCE}text\n0\n{FENCE}", "c++", "int main() {}\n"),
        (f"{FENCE}js\nconsole.log(1)\n{FENCE}\n{FENCE}\n1\n{FENCE}", "javascript", "console.log(1)\n"),
        (f"{FENCE}Python title=a.py\nprint(1)\n{FENCE}\n{FENCE}\n1\n{FENCE}", "python", "print(1)\n"),
        # the last block in the language, not the first
        (
            f"{FENCE}py\nprint(1)\n{FENCE}{FENCE}python\nprint(2)\n{FENCE}{FENCE}\n2\n{FENCE}",
            "py",
            "print(2)\n",
        ),
        # no block in the language: the last block, as before (a C block is not a C++ one)
        (f"{FENCE}\nprint(1)\n{FENCE}\n{FENCE}\nprint(2)\n{FENCE}", "python", "print(2)\n"),
        (f"{FENCE}cpp\nint main() {{}}\n{FENCE}\n{FENCE}\n0\n{FENCE}", "c", "0\n"),
        (PROGRAM_THEN_OUTPUT, None, "42\n"),
        ("print(3)", "python", "print(3)"),
    ],
)
def test_extract_code_prefers_the_last_block_in_the_requested_language(text, language, expected):
    assert extract_code(text, language) == expected


INDENTED = (
    f"Steps:\n1. Read n:\n   {FENCE}python\n   n = int(input())\n   if n:\n       print(n)\n\n   {FENCE}\n"
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a block inside a list item is indented with the item: its lines kept the indentation
        # and the program was an IndentationError. Markdown takes the fence's off each line
        (INDENTED, "n = int(input())\nif n:\n    print(n)\n\n"),
        (
            f"1. x:\n    {FENCE}py\n    n = 1\n    if n:\n        print(n)\n    {FENCE}",
            "n = 1\nif n:\n    print(n)\n",
        ),
        # up to the fence's indentation: a line indented less loses what it has
        (f"  {FENCE}python\n  a = 1\n b = 2\n    c = 3\n  {FENCE}", "a = 1\nb = 2\n  c = 3\n"),
        # a fence after text on its line is not indented
        (f"see {FENCE}python\n  x = 1\n{FENCE}", "  x = 1\n"),
    ],
)
def test_extract_code_takes_off_the_indentation_of_its_fence(text, expected):
    assert extract_code(text, "python") == expected


def test_code_verify_runs_the_program_not_the_output_shown_after_it():
    class Recorder:
        def verify(self, code, tests, language):
            seen.append(code)
            done = {"status": "Finished", "passed": 1, "total": 1, "pass_fraction": 1.0}
            return VerifyResult(**done, language=language, cases=[], total_ms=1)

    seen: list[str] = []
    code_verify(PROGRAM_THEN_OUTPUT, tests=[{"stdin": "", "expected_stdout": "42"}], ctx=Recorder())
    as_py = PROGRAM_THEN_OUTPUT.replace("python", "py")
    code_verify(as_py, test_code="assert True", language="py", ctx=Recorder())
    assert seen == ["print(6 * 7)\n", "print(6 * 7)\n"]


def test_extract_code_is_linear_in_unclosed_fences():
    # a regex tried at every fence scanned to the end each time: ~4 s at 120 KB, so minutes
    # at these 2 MB; one pass takes milliseconds (the bound only catches the quadratic)
    for hostile in ("```" * 700_000, "```\n" + "```x" * 500_000, "```py\nprint(1)\n```" + "``` " * 500_000):
        t0 = time.monotonic()
        extract_code(hostile)
        assert time.monotonic() - t0 < 10.0
    assert extract_code("```py\nprint(1)\n```" + "``` " * 10) == "print(1)\n"
    assert extract_code("````\nx\n```") == "x\n" and extract_code("```py") == "```py"


def test_a_dead_zygote_is_a_retryable_sandbox_error_then_recovers():
    with Sandbox(SandboxConfig(base_uid=330_000, spares=1)) as sb:
        verifier = Verifier(sb, LIMITS)
        assert verifier.verify("print(1)", cases(("", "1"))).status == "Finished"
        zygote = sb._zygote
        assert zygote is not None
        outcome: list[BaseException | object] = []

        def long_run():
            try:
                outcome.append(sb.run_python("import time\ntime.sleep(2)", limits=LIMITS))
            except BaseException as e:
                outcome.append(e)

        t = threading.Thread(target=long_run)
        t.start()
        time.sleep(0.5)
        os.kill(zygote.pid, signal.SIGKILL)  # its supervisors die with it, mid-run
        t.join()
        assert isinstance(outcome[0], SandboxError), outcome
        assert "died" in str(outcome[0])
        # the next run starts a fresh zygote
        assert verifier.verify("print(2)", cases(("", "2"))).status == "Finished"
        assert sb._zygote is not zygote


def test_sandbox_errors_surface_as_retryable_failures_not_zero_rewards():
    class Broken:
        def verify(self, *a, **kw):
            failed = CaseResult(status="SandboxError", message="zygote died")
            return VerifyResult(
                status="SandboxError",
                passed=0,
                total=1,
                pass_fraction=0.0,
                language="python",
                cases=[failed],
                total_ms=1,
            )

    with pytest.raises(SandboxError):
        code_verify("print(1)", tests=[{"stdin": "", "expected_stdout": "1"}], extract=False, ctx=Broken())


async def test_closing_a_local_pool_that_ran_it_leaves_no_zygote_or_cgroups():
    # the pool killed its stopped worker's process group, the zygote in it, before the
    # zygote's own shutdown (end the runs, remove the cgroups) and the worker's exit handler
    # (Sandbox.close) ran: every clean close left rlfabric-<pid> cgroup dirs behind
    reg = Registry()
    reg.discover("functions.verifiers.code")
    async with Client(backend=LocalConfig(), registry=reg) as client:
        payload = {
            "traj": "print(input()[::-1])",
            "extract": False,
            "tests": [{"stdin": "ab", "expected_stdout": "ba"}],
        }
        r = await client.call("code_verify", payload)
        assert r.ok and r.value["score"] == 1.0, r
        zygotes = [z for w in client.backend.stats()["code_verify"]["pids"] for z in _zygotes_of(w)]
        assert zygotes
    deadline = time.monotonic() + 5  # a loaded machine may have killed the worker mid-exit
    while time.monotonic() < deadline and (_cgroup_dirs(zygotes) or any(map(_alive, zygotes))):  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    assert [z for z in zygotes if _alive(z)] == []
    assert _cgroup_dirs(zygotes) == []


def _zygotes_of(worker: int) -> list[int]:
    with open(f"/proc/{worker}/task/{worker}/children") as f:
        children = [int(pid) for pid in f.read().split()]
    return [pid for pid in children if b"functions.verifiers.zygote" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _cgroup_dirs(zygotes: list[int]) -> list[str]:
    roots = [Path("/sys/fs/cgroup", ctl) for ctl in ("cpuacct", "memory")]
    return [str(p) for root in roots for z in zygotes for p in root.glob(f"**/rlfabric-{z}")]


async def test_through_the_fabric_local_backend_bad_input_leaves_the_pool_healthy():
    reg = Registry()
    reg.discover("functions.verifiers.code", "functions.tools.python")
    async with Client(backend=LocalConfig(), registry=reg) as client:
        ok = await client.call(
            "code_verify",
            {
                "traj": "print(input()[::-1])",
                "extract": False,
                "tests": [{"stdin": "ab", "expected_stdout": "ba"}],
            },
        )
        assert ok.ok and ok.value["score"] == 1.0, ok
        assert ok.value["info"]["cases"][0]["status"] == "Finished"
        bad = [
            (
                {"traj": "print(1)", "language": "brainfuck", "test_code": "pass"},
                ErrorCode.USER_ERROR,
                "unknown language",
            ),
            ({"traj": "print(1)", "tests": [{"stdin": ""}]}, ErrorCode.INVALID_ARGUMENTS, "expected_stdout"),
            ({"traj": "print(1)", "tests": "nope"}, ErrorCode.INVALID_ARGUMENTS, "tests"),
            ({"traj": "print(1)"}, ErrorCode.USER_ERROR, "exactly one of"),
            # tests that test nothing are the caller's to fix: neither a 0 nor a 1
            ({"traj": "print(1)", "test_code": "pass"}, ErrorCode.USER_ERROR, "they ran nothing"),
        ]
        for payload, code, fragment in bad:
            r = await client.call("code_verify", payload)
            assert not r.ok and r.error.type == code and not r.error.retryable, r
            assert fragment in r.error.message, r.error.message
        long = await client.call("code_verify", {"traj": "x" * 300_000, "test_code": "pass"})
        assert long.ok and long.value["score"] == 0.0, long
        assert "program too long: 300000 bytes" in long.value["info"]["cases"][0]["message"]
        again = await client.call(
            "code_verify", {"traj": "print(6*7)", "extract": False, "test_code": "assert True"}
        )
        assert again.ok and again.value["score"] == 1.0
        tool = await client.call("python", {"code": "import sys\nprint(6 * 7)\nsys.exit(2)"})
        assert tool.ok and tool.value == "42\n\n[exit code 2]", tool
