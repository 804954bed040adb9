"""The ``python`` tool: what a run printed, and which limit ended it (with the limit's value),
in a real sandbox with small limits."""

from __future__ import annotations

import pytest

from functions.tools.python import TOOL_LIMITS, run_python
from functions.verifiers import _linux
from functions.verifiers.sandbox import Limits, Sandbox, SandboxConfig
from functions.verifiers.verify import Verifier

pytestmark = pytest.mark.skipif(_linux.supported() is not None, reason=str(_linux.supported()))

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=128, stdout_bytes=1024, stderr_bytes=4096, fsize_mb=1, nproc=8)


@pytest.fixture(scope="module")
def verifier():
    with Sandbox(SandboxConfig(base_uid=450_000, spares=1)) as sb:
        yield Verifier(sb, LIMITS)


@pytest.mark.parametrize(
    ("code", "ending"),
    [
        # each limit is named with its value (it said "killed by signal 9: CPU or memory limit?")
        ("import time\ntime.sleep(30)", "[killed: wall time limit 3 s exceeded]"),
        ("while True:\n    pass", "[killed: CPU time limit 1 s exceeded]"),
        ("x = bytearray(10**10)", "[exit code 1: memory limit 128 MB reached (MemoryError)]"),
        ("print('x' * 100_000)", "[killed: stdout limit 1 KiB exceeded]"),
        (
            "open('/tmp/big', 'wb').write(b'x' * (4 << 20))",
            "[exit code 1: file size limit 1 MB reached (File too large)]",
        ),
        (
            # daemons: the run waits for the others to end, as Python does
            "import threading, time\n"
            "ts = [threading.Thread(target=time.sleep, args=(2,), daemon=True) for _ in range(64)]\n"
            "[t.start() for t in ts]",
            "[exit code 1: process limit 8 processes and threads reached]",
        ),
        (
            "import os\nfor _ in range(64):\n    if os.fork() == 0:\n        import time\n"
            "        time.sleep(2)\n        os._exit(0)",
            "[exit code 1: process limit 8 processes and threads reached]",
        ),
        (
            "import subprocess\nps = [subprocess.Popen(['sleep', '2']) for _ in range(64)]",
            "[exit code 1: process limit 8 processes and threads reached]",
        ),
        # not a limit: what ended it, as before
        # (EAGAIN from a read of an empty non-blocking pipe is no fork's: it was named the
        # process limit)
        ("import os\nr, w = os.pipe()\nos.set_blocking(r, False)\nos.read(r, 1)", "[exit code 1]"),
        ("import os\nos.kill(os.getpid(), 11)", "[killed by SIGSEGV]"),
        ("import sys\nprint(6 * 7)\nsys.exit(3)", "[exit code 3]"),
    ],
)
def test_the_result_names_the_limit_that_ended_the_run(verifier, code, ending):
    # a spinning loop must get its 1 s of CPU before the 3 s of wall: on a loaded machine
    # (other tests' processes on 2 cores) it got less and ended at the wall limit instead
    limits = LIMITS.model_copy(update={"wall_s": 15}) if "CPU time" in ending else LIMITS
    out = run_python(verifier, code, limits=limits)
    assert out.endswith(ending), out


def test_a_clean_run_shows_its_output_only(verifier):
    assert run_python(verifier, "print(input().upper())", "hi", limits=LIMITS) == "HI\n"
    assert run_python(verifier, "pass", limits=LIMITS) == "[no output]"


def test_the_tools_description_states_its_limits():
    from functions.tools.python import OPENAI_SCHEMA

    text = OPENAI_SCHEMA["function"]["description"]
    assert f"{TOOL_LIMITS.wall_s:g} s" in text and f"{TOOL_LIMITS.memory_mb} MB" in text
    for stream in ("stdout", "stderr"):
        cap = getattr(TOOL_LIMITS, f"{stream}_bytes")
        assert f"{cap >> 10} KiB" in text and stream in text, text


def test_output_under_the_advertised_cap_is_not_killed_whichever_stream(verifier):
    # the description says 256 KiB of output, but stderr's cap was the sandbox's default 64 KiB:
    # a program that logged 100 KiB to stderr was killed before it printed its answer
    code = "import sys\nsys.stderr.write('e' * (100 << 10))\nprint('done')"
    out = run_python(verifier, code, limits=TOOL_LIMITS)
    assert out.startswith("done\n") and "[stderr]\n" in out and "killed" not in out, out[-200:]


def test_stdout_cut_at_its_cap_is_marked_where_it_was_cut(verifier):
    # what was kept ended mid-stream with nothing to say so
    out = run_python(verifier, "import sys\nsys.stdout.write('x' * 100_000)", limits=LIMITS)
    assert out.endswith("x\n[... cut at the stdout limit]\n[killed: stdout limit 1 KiB exceeded]"), out[-200:]


def test_stderr_past_its_cap_is_cut_in_the_middle_and_the_run_goes_on(verifier):
    # past its cap stderr killed the run, before it printed its answer; now the sandbox keeps
    # its start and end, and the end shown is the program's own (a traceback stays whole)
    code = "import sys\nsys.stderr.write('e' * 100_000 + '\\nend of log\\n')\nprint('answer')\nsys.exit(2)"
    out = run_python(verifier, code, limits=LIMITS)
    assert out.startswith("answer\n\n[stderr]\n") and "killed" not in out, out[:200]
    cut = 100_000 + len("\nend of log\n") - LIMITS.stderr_bytes
    assert f"e\n[... {cut} bytes of stderr cut]\ne" in out, out
    assert out.endswith("e\nend of log\n\n[exit code 2]"), out[-200:]


@pytest.mark.parametrize(
    ("code", "stdin", "message"),
    [
        # an empty program, or the tool's JSON arguments as the program, ran and answered
        # "[no output]": the policy could not tell what it did wrong
        ("", "", "code is empty"),
        ("  \n", "", "code is empty"),
        ('{"code": "print(1)"}', "", "pass the program itself"),
        # text no UTF-8 encodes (a lone surrogate from a direct call) raised the codec's error
        ("print(1)\ud800", "", "code is not valid Unicode text"),
        ("print(input())", "\ud800", "stdin is not valid Unicode text"),
    ],
)
def test_bad_inputs_say_what_to_fix(verifier, code, stdin, message):
    with pytest.raises(ValueError, match=message):
        run_python(verifier, code, stdin, limits=LIMITS)


def test_stdin_has_a_cap_of_its_own(verifier):
    # stdin had none but the 6 MiB payload's, and the supervisor writes it into a memfd
    # charged to the worker, not to the run's memory limit
    from functions.tools.python import MAX_STDIN_BYTES, OPENAI_SCHEMA

    code = "import sys\nprint(len(sys.stdin.buffer.read()))"
    assert run_python(verifier, code, "x" * MAX_STDIN_BYTES, limits=LIMITS) == f"{MAX_STDIN_BYTES}\n"
    with pytest.raises(
        ValueError, match=f"stdin is {MAX_STDIN_BYTES + 2} bytes; the limit is {MAX_STDIN_BYTES}"
    ):
        run_python(verifier, code, "\u00e9" + "x" * MAX_STDIN_BYTES, limits=LIMITS)
    stdin = OPENAI_SCHEMA["function"]["parameters"]["properties"]["stdin"]["description"]
    assert f"{MAX_STDIN_BYTES >> 10} KiB" in stdin, stdin


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_cut_at_its_cap_does_not_end_in_a_broken_character(verifier, stream):
    # the sandbox keeps the first stdout_bytes bytes (the first and last halves of
    # stderr_bytes): a cut inside a 2-byte character left half of it, shown as U+FFFD
    cap = LIMITS.stdout_bytes if stream == "stdout" else LIMITS.stderr_bytes
    code = f"import sys\nsys.{stream}.buffer.write(b'a' + '\u00e9'.encode() * {cap} + b'a')"
    out = run_python(verifier, code, limits=LIMITS)
    assert "\ufffd" not in out, out[-200:]
    end = "limit 1 KiB exceeded]" if stream == "stdout" else "\u00e9" * 100 + "a"
    assert "\u00e9" * 100 in out and out.endswith(end), out[-200:]


def test_a_program_that_writes_a_broken_character_itself_is_shown_so(verifier):
    out = run_python(verifier, "import sys\nsys.stdout.buffer.write(b'ok \\xc3')", limits=LIMITS)
    assert out == "ok \ufffd"
