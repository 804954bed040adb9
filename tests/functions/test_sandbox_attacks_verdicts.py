"""Attacks on the code sandbox (see ``attack_box``) that try to forge a verdict: the right
output then a crash, exiting early, reading fd 3 or the tests' marker, an always-equal
answer, a fake retryable sandbox error. Honest programs still pass the same tests."""

from __future__ import annotations

import shutil

import pytest
from attack_box import MARKS, after_each_attack, module_sandbox
from sandbox_probe import FAST

from functions.verifiers.verify import CodeTests, Verifier

pytestmark = MARKS

BASE_UID = 360_000  # apart from the other attack modules (340_000, 370_000)
# attack_box: this module's sandbox, and the checks after every attack
sandbox = pytest.fixture(module_sandbox, scope="module", name="sandbox")
sb = pytest.fixture(after_each_attack, name="sb")


# node, and a fresh gcc binary, can take seconds of wall to start on a loaded 2-core machine:
# an attack test must fail the program on its attack, not on the clock
ROOMY = FAST.model_copy(update={"wall_s": 20, "cpu_s": 5})


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
        # files only: the run's own stdout pipe (/proc/self/fd/1, the run's since it may
        # reopen it as /dev/stdout) would block the read on what the run itself writes
        "        if os.path.isfile(path) and b'rlfabric-expected' in open(path, 'rb').read(1 << 20):\n"
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
