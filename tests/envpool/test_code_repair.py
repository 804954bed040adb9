"""``code-repair-v1``: its actions, its judge (a module cannot forge a pass) and its test
runner (timeouts, and nothing a run started outlives it)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from pool_util import wait_for

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs import code_repair_limits, code_repair_runner
from envpool.envs.code_repair import TASKS, parse_blocks
from envpool.pool import EnvPool


def edit_action(file: str, search: str, replace: str) -> str:
    return f"edit {file}\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


@pytest.fixture
def repair():
    env = envpool.make("code-repair-v1")
    yield env
    env.close()


def test_code_repair_view(repair):
    obs, info = repair.reset(options={"task": "mathutils"})
    assert info == {"task": "mathutils", "files": ["README.md", "mathutils.py", "test_mathutils.py"]}
    assert "view <file>" in obs.text and "mathutils.py" in obs.text
    res = repair.step("view mathutils.py")
    assert "   6 |     return a - b" in res.obs.text
    assert (res.reward, res.terminated, res.info) == (0.0, False, {"valid": True})
    res = repair.step("view nope.py")
    assert "No such file 'nope.py'" in res.obs.text and res.info == {"valid": False}


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_code_repair_fix_run_tests_and_submit(repair, task):
    repair.reset(options={"task": task.name})
    res = repair.step("run_tests")
    assert res.info["failed"] > 0 and not res.info["all_passed"]
    assert res.info["outcome"] == "test_failure"  # the schedulers' signal
    for file, search, replace in task.fix:
        res = repair.step(edit_action(file, search, replace))
        assert "block(s) applied" in res.obs.text and res.info == {"valid": True}
    res = repair.step("run_tests")
    assert res.info == {"passed": task.n_tests, "failed": 0, "all_passed": True, "outcome": "success"}
    assert res.obs.text.startswith(f"Tests: {task.n_tests} passed, 0 failed.")
    res = repair.step("submit")
    assert (res.reward, res.terminated) == (1.0, True)


def test_code_repair_submit_unfixed_scores_zero(repair):
    repair.reset(options={"task": "stats"})
    res = repair.step("submit")
    assert (res.reward, res.terminated) == (0.0, True)
    assert res.info == {"passed": 2, "failed": 2, "all_passed": False, "outcome": "test_failure"}


@pytest.mark.parametrize(
    "action",
    [
        "view ../outside.txt",
        "view /etc/passwd",
        "view sub/../../outside.txt",
        edit_action("../outside.txt", "secret", "changed"),
        edit_action("/tmp/outside.txt", "secret", "changed"),
    ],
)
def test_code_repair_refuses_paths_outside_the_work_dir(repair, action):
    repair.reset(options={"task": "mathutils"})
    outside = repair.env.workdir.parent / "outside.txt"
    res = repair.step(action)
    assert res.obs.text.startswith("Refused") and res.info == {"valid": False}
    assert not outside.exists() or "changed" not in outside.read_text()


def test_code_repair_refuses_a_symlink_out(repair, tmp_path):
    repair.reset(options={"task": "mathutils"})
    secret = tmp_path / "secret.txt"
    secret.write_text("secret\n")
    (repair.env.workdir / "link.txt").symlink_to(secret)
    assert "points outside" in repair.step("view link.txt").obs.text
    assert "points outside" in repair.step(edit_action("link.txt", "secret", "x")).obs.text
    assert secret.read_text() == "secret\n"


@pytest.mark.parametrize(
    "action",
    [
        "view " + "a" * 300,
        "view " + "a/" * 3000,
        edit_action("b" * 300, "x", "y"),
    ],
)
def test_code_repair_answers_a_name_the_file_system_refuses(repair, action):
    # over NAME_MAX / PATH_MAX: an OSError raised from step would mask the episode as an
    # infra failure (and its message shows the work dir); it is the policy's bad name
    repair.reset(options={"task": "mathutils"})
    res = repair.step(action)
    assert res.obs.text.startswith("No such file") and (res.reward, res.terminated) == (0.0, False)
    assert res.info == {"valid": False}
    assert str(repair.env.workdir) not in res.obs.text


def test_code_repair_answers_a_file_it_cannot_read(repair, monkeypatch):
    # the policy's code may chmod its module to 0; the OS's refusal is played here (it was a
    # chmod, skipped as root, which reads a mode-0 file all the same: always skipped in CI)
    repair.reset(options={"task": "mathutils"})
    module = repair.env.workdir / "mathutils.py"
    read_text = Path.read_text

    def refused(self: Path, *args, **kwargs) -> str:
        if self == module:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", refused)
    res = repair.step("view mathutils.py")
    assert "cannot be read (Permission denied)" in res.obs.text and res.info["valid"] is False
    res = repair.step(edit_action("mathutils.py", "a - b", "a + b"))
    assert "cannot be read (Permission denied)" in res.obs.text and res.info["valid"] is False


def test_code_repair_refuses_to_edit_a_module_that_is_not_text(repair):
    # the policy's code can write any bytes
    repair.reset(options={"task": "mathutils"})
    (repair.env.workdir / "mathutils.py").write_bytes(b"\xff\xfe def add(a, b): return a - b\n")
    res = repair.step(edit_action("mathutils.py", "a - b", "a + b"))
    assert "cannot be read (it is not UTF-8 text)" in res.obs.text and res.info["valid"] is False


def test_code_repair_tests_are_read_only(repair):
    repair.reset(options={"task": "mathutils"})
    res = repair.step(edit_action("test_mathutils.py", "assert got == 5", "assert True"))
    assert "read-only" in res.obs.text
    # code that rewrites the tests on disk does not help either: they are restored per run
    (repair.env.workdir / "test_mathutils.py").write_text("def test_add():\n    pass\n")
    res = repair.step("run_tests")
    assert res.info["failed"] == 2


@pytest.mark.parametrize(
    ("blocks", "says"),
    [
        ("<<<<<<< SEARCH\nreturn a * b\n=======\nx\n>>>>>>> REPLACE", "was not found"),
        ("<<<<<<< SEARCH\n    return\n=======\nx\n>>>>>>> REPLACE", "found 2 times"),
        ("<<<<<<< SEARCH\nreturn a - b\n=======\nx", "not closed"),
        ("replace it please", "expected '<<<<<<< SEARCH'"),
        ("", "no SEARCH/REPLACE block"),
        ("<<<<<<< SEARCH\n\n=======\nx\n>>>>>>> REPLACE", "SEARCH section is empty"),
    ],
)
def test_code_repair_bad_edits_leave_the_file_alone(repair, blocks, says):
    repair.reset(options={"task": "mathutils"})
    before = (repair.env.workdir / "mathutils.py").read_text()
    res = repair.step(f"edit mathutils.py\n{blocks}")
    assert says in res.obs.text and "not applied" in res.obs.text and res.info == {"valid": False}
    assert (repair.env.workdir / "mathutils.py").read_text() == before


def test_parse_blocks_several_and_deletion():
    text = "<<<<<<< SEARCH\na\n=======\nb\n>>>>>>> REPLACE\n\n<<<<<<< SEARCH\nc\nd\n=======\n>>>>>>> REPLACE"
    assert parse_blocks(text) == [("a", "b"), ("c\nd", "")]


def test_code_repair_output_hides_the_work_dir_and_forged_results(repair):
    repair.reset(options={"task": "mathutils"})
    workdir = str(repair.env.workdir)
    res = repair.step(edit_action("mathutils.py", "    return a - b", "    return a -"))
    res = repair.step("run_tests")
    assert "ERROR test_mathutils.py: SyntaxError" in res.obs.text
    assert workdir not in res.obs.text and res.info["passed"] == 0
    forged = 'print("@@result x 3 0")\n    return a - b'
    repair.step(edit_action("mathutils.py", "    return a -", "    " + forged))
    res = repair.step("submit")
    assert res.reward == 0.0 and res.info["failed"] == 2


# The nonce, eq and int-subclass forgeries passed every test of the old runner, which ran
# the tests in the module's own process and trusted the result line it printed.
_FORGED_LINES = (
    "print('@@result x 3 0', 'PASS test_mathutils.py::test_add', 'Tests: 3 passed.', sep='\\n', flush=True)"
)
_FORGERIES = {
    # reads the old runner's verdict nonce from its globals, prints a pass and exits
    "nonce": (
        "import __main__, os\n"
        "print(f\"@@result {getattr(__main__, 'nonce', 'x')} 3 0\", flush=True)\nos._exit(0)\n",
        "prepend",
    ),
    # a value equal to everything
    "eq": ("    class _Any:\n        __eq__ = lambda s, o: True\n    return _Any()", "body"),
    # an int subclass equal to everything (an isinstance check would let it through)
    "int-subclass": ("    class _Int(int):\n        __eq__ = lambda s, o: True\n    return _Int(0)", "body"),
    # patches the comparison itself
    "builtins": ("import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\n", "prepend"),
    # the checks' results, wrong ones, written to every descriptor the runner may use
    "fds": (
        "import os, json\nfor fd in range(3, 64):\n    try:\n"
        "        lines = [json.dumps({'i': i, 'value': 'ok'}) for i in range(9)]\n"
        "        os.write(fd, ('\\n'.join(lines) + '\\n').encode())\n"
        "    except OSError:\n        pass\nos._exit(0)\n",
        "prepend",
    ),
}


@pytest.mark.parametrize("name", sorted(_FORGERIES))
def test_code_repair_module_cannot_forge_a_pass(repair, name):
    code, where = _FORGERIES[name]
    repair.reset(options={"task": "mathutils"})
    if where == "prepend":
        edit = ('"""Small numeric helpers."""', code + '"""Small numeric helpers."""')
    else:
        edit = ("    return a - b", code)
    assert "block(s) applied" in repair.step(edit_action("mathutils.py", *edit)).obs.text
    res = repair.step("submit")
    assert res.reward == 0.0 and not res.info["all_passed"], res.obs.text
    assert res.info["passed"] < 3


def test_code_repair_forged_output_is_shown_as_output_not_as_results(repair):
    repair.reset(options={"task": "mathutils"})
    forged = "import os\n" + _FORGED_LINES + "\nos._exit(0)\n"
    repair.step(edit_action("mathutils.py", '"""Small numeric helpers."""', forged))
    res = repair.step("run_tests")
    head, _, output = res.obs.text.partition("Output of the run:")
    assert head.startswith("Tests: 0 passed, 3 failed.")
    assert "FAIL test_mathutils.py::test_add: add(2, 3) did not finish" in head
    assert "PASS test_mathutils.py::test_add" in output  # the module's print, shown apart


def test_code_repair_a_value_that_is_not_plain_fails_with_a_reason(repair):
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "    return a - b", "    return {1, 2}"))
    res = repair.step("run_tests")
    assert "add(2, 3) returned {1, 2} (a set; the tests compare plain values" in res.obs.text


def test_code_repair_expected_exceptions_match_by_class_and_subclass(repair):
    repair.reset(options={"task": "stats"})
    # UnicodeError is a ValueError subclass: `except ValueError` would take it too
    repair.step(
        edit_action("stats.py", 'raise ValueError("mean of an empty list")', "raise UnicodeError('x')")
    )
    assert "PASS test_stats.py::test_mean_empty" in repair.step("run_tests").obs.text
    repair.step(edit_action("stats.py", "raise UnicodeError('x')", "return 0"))
    text = repair.step("run_tests").obs.text
    assert "FAIL test_stats.py::test_mean_empty: mean([]) did not raise ValueError (it returned 0)" in text


def test_code_repair_a_huge_int_is_too_large_and_the_other_tests_still_run(repair):
    # json.dumps refuses an int past 4300 digits: the runner died there, and the correct
    # clamp tests after it read "did not finish"
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "    return a - b", "    return 10**5000 if a < 0 else a + b"))
    text = repair.step("run_tests").obs.text
    assert (
        "FAIL test_mathutils.py::test_add_negative: add(-4, 1) returned a value too large to compare" in text
    )
    assert "PASS test_mathutils.py::test_clamp" in text and "PASS test_mathutils.py::test_add" in text


def test_code_repair_missing_name_fails_every_test(repair):
    repair.reset(options={"task": "mathutils"})
    repair.step(edit_action("mathutils.py", "def add(a, b):", "def plus(a, b):"))
    res = repair.step("run_tests")
    assert res.info["passed"] == 0 and res.info["failed"] == 3
    assert "ERROR test_mathutils.py: ImportError: cannot import name 'add' from 'mathutils'" in res.obs.text


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.name)
def test_code_repair_rendered_tests_agree_with_the_judge(task, tmp_path):
    """The test file the policy reads, run as plain Python, fails and passes the same tests
    as the judge does, before and after the fix."""
    for fixed in (False, True):
        source = task.source
        if fixed:
            for _, search, replace in task.fix:
                source = source.replace(search, replace, 1)
        (tmp_path / task.module).write_text(source)
        (tmp_path / task.test_file).write_text(task.files[task.test_file])
        script = (
            f"import {task.test_file[:-3]} as t\n"
            f"for name in {[x.name for x in task.tests]!r}:\n"
            "    try:\n        getattr(t, name)()\n    except BaseException:\n        print('FAIL', name)\n"
            "    else:\n        print('PASS', name)\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True
        )
        env = envpool.make("code-repair-v1")
        try:
            env.reset(options={"task": task.name})
            (env.env.workdir / task.module).write_text(source)
            judged = env.step("run_tests").obs.text
        finally:
            env.close()
        for line in run.stdout.splitlines():
            verdict, name = line.split()
            assert f"{verdict} {task.test_file}::{name}" in judged, (fixed, line, judged)
        assert (f"Tests: {task.n_tests} passed" in judged) == fixed


def test_code_repair_test_timeout():
    env = envpool.make("code-repair-v1", test_timeout_s=0.5)
    try:
        env.reset(options={"task": "mathutils"})
        env.step(edit_action("mathutils.py", "    return a - b", "    while True:\n        pass"))
        res = env.step("run_tests")
        assert "The test run timed out after 0.5 s" in res.obs.text
        assert res.info == {"passed": 0, "failed": 3, "all_passed": False, "outcome": "timeout"}
        assert env.step("submit").reward == 0.0
    finally:
        env.close()


def _running_in(root: Path) -> list[int]:
    """Processes whose working directory is under ``root`` (a test run in a work dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cwd = Path(os.readlink(entry / "cwd"))
            except OSError:  # gone, or a zombie
                continue
            if cwd.is_relative_to(root):
                found.append(int(entry.name))
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _repair_in(tmp_path: Path, test_timeout_s: float):
    """A code-repair env on the mathutils task whose work dirs are under ``tmp_path/work``
    (what runs there is found by its cwd), and every process left there killed at the end."""
    work = tmp_path / "work"
    work.mkdir()
    env = envpool.make("code-repair-v1", test_timeout_s=test_timeout_s, workdir_root=str(work))
    try:
        env.reset(options={"task": "mathutils"})
        yield env, work
    finally:
        _kill_all(_running_in(work))
        env.close()


def _none_left_in(work: Path, within_s: float) -> bool:
    """Whether no process runs in ``work`` within ``within_s`` (a SIGKILL lands when each
    is next scheduled)."""
    deadline = time.monotonic() + within_s
    while _running_in(work) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _running_in(work)


@pytest.fixture(params=[True, False], ids=["pid_namespace", "fallback"])
def pid_namespace(request, monkeypatch):
    """Each test run in a PID namespace of its own where the kernel allows it, and in the
    fallback (the keeper, a child subreaper) everywhere."""
    monkeypatch.setattr(code_repair_runner, "PID_NAMESPACE", request.param)
    return request.param


LOOP = "    while True:\n        pass"
# a test run that starts a helper process of its own, then loops
SPAWN_AND_LOOP = '    import subprocess\n    subprocess.Popen(["sleep", "60"])\n' + LOOP


def test_code_repair_test_timeout_kills_what_the_run_started(tmp_path, pid_namespace):
    with _repair_in(tmp_path, 0.5) as (env, work):
        env.step(edit_action("mathutils.py", "    return a - b", SPAWN_AND_LOOP))
        res = env.step("run_tests")
        assert "The test run timed out after 0.5 s" in res.obs.text
        assert _none_left_in(work, 2)  # the runner and the helper it started


# the fix, plus helpers the module starts at import and leaves behind: a child that sleeps, and
# a daemon (a child that forks a sleeper and exits, so the sleeper's parent is gone)
FIX_AND_FORKS = (
    "    return a + b\n"
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    time.sleep(60)\n"
    "    os._exit(0)\n"
    "if os.fork() == 0:\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(60)\n"
    "    os._exit(0)"
)


@pytest.mark.parametrize("early_exit", [False, True])
def test_code_repair_a_run_that_ends_takes_what_it_started_with_it(tmp_path, pid_namespace, early_exit):
    # the runner returned normally and its module's forked helpers, reparented to pid 1, ran
    # on for good: only a timeout killed the tree. Now the runner stays alive past its
    # results, a subreaper, and its parent kills it with all it started
    with _repair_in(tmp_path, 10) as (env, work):
        body = FIX_AND_FORKS + ("\nos.close(int(sys.argv[3]))" if early_exit else "")
        if early_exit:  # the module closes the done pipe: the runner's end must still be seen
            body = "import sys\n" + body.replace("    return a + b\n", "", 1)
            env.step(edit_action("mathutils.py", "    return a - b", "    return a + b"))
            env.step(edit_action("mathutils.py", "def add", body + "\ndef add"))
        else:
            env.step(edit_action("mathutils.py", "    return a - b", FIX_AND_FORKS))
        t0 = time.monotonic()
        res = env.step("run_tests")
        assert time.monotonic() - t0 < 8  # ended by the runner, not at the timeout
        assert res.info["all_passed"] and res.info["failed"] == 0, res.obs.text
        assert "timed out" not in res.obs.text
        assert _none_left_in(work, 3)  # the sleeper and the daemon's child too (they sleep 60 s)


def test_code_repair_a_runner_that_ends_after_its_done_byte_is_swept(tmp_path, pid_namespace, monkeypatch):
    # the runner's wait on its parent can be cut short by the module (it puts /dev/null where
    # the runner waits): the runner wrote its done byte, then ended by itself; its parent,
    # scheduled after that end (slowed here), took the run for one that waited, killed the
    # runner's tree (empty: its daemon had left it) and never swept the work dir
    kill_tree = code_repair_runner.kill_tree

    def late_kill_tree(pid: int) -> None:
        time.sleep(0.5)
        kill_tree(pid)

    monkeypatch.setattr(code_repair_runner, "kill_tree", late_kill_tree)
    with _repair_in(tmp_path, 10) as (env, work):
        cut = "import __main__\nos.dup2(os.open(os.devnull, os.O_RDONLY), __main__.stdin_fd)"
        env.step(edit_action("mathutils.py", "    return a - b", FIX_AND_FORKS + "\n" + cut))
        res = env.step("run_tests")
        assert res.info["all_passed"], res.obs.text
        assert _none_left_in(work, 3)


def _daemon(pidfile: Path, chdir: bool, end: str) -> str:
    """The fix, then a daemon started at import: a child that calls setsid() (a session and
    process group of its own), maybe moves to /, and forks a grandchild that writes its pid
    to ``pidfile`` and sleeps; then the runner goes on (``end="returns"``), ends the
    interpreter (``"exits"``) or kills its parent and the parent's parent it finds in /proc
    (``"kills_ancestors"``)."""
    ends = {
        "returns": "",
        "exits": "os._exit(0)\n",
        "kills_ancestors": (
            "pid = os.readlink('/proc/self')\n"
            "for _ in range(2):  # the runner's parent and grandparent (never the test's process)\n"
            "    pid = open(f'/proc/{pid}/stat').read().rpartition(')')[2].split()[1]\n"
            f"    for target in {{int(pid), os.getppid()}} - {{{os.getpid()}}}:\n"
            "        try:\n"
            "            os.kill(target, signal.SIGKILL)\n"
            "        except OSError:\n"
            "            pass\n"
            "time.sleep(0.5)\n"
        ),
    }
    return (
        "    return a + b\n"
        "import os, signal, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n" + ("    os.chdir('/')\n" if chdir else "") + "    if os.fork() == 0:\n"
        f"        with open({str(pidfile)!r} + '.tmp', 'w') as f:\n"
        "            f.write(os.readlink('/proc/self'))  # its pid outside any PID namespace\n"
        f"        os.rename({str(pidfile)!r} + '.tmp', {str(pidfile)!r})\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "for _ in range(500):  # until the daemon is up\n"
        f"    if os.path.exists({str(pidfile)!r}):\n"
        "        break\n"
        "    time.sleep(0.01)\n" + ends[end]
    )


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _run_and_await_the_daemon(tmp_path: Path, chdir: bool, end: str, passes: bool = True) -> None:
    pidfile = tmp_path / "daemon.pid"
    with _repair_in(tmp_path, 10) as (env, _):
        env.step(edit_action("mathutils.py", "    return a - b", _daemon(pidfile, chdir, end)))
        res = env.step("run_tests")
        pid = int(pidfile.read_text())
        try:
            if end != "exits" and passes:
                assert res.info["all_passed"], res.obs.text
            deadline = time.monotonic() + 3
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not _alive(pid), f"the daemon {pid} outlived its run"
        finally:
            _kill_all([pid])


@pytest.mark.parametrize("chdir", [False, True], ids=["setsid", "setsid_chdir"])
@pytest.mark.parametrize("end", ["returns", "exits"])
def test_code_repair_a_daemon_in_a_session_of_its_own_goes_with_the_run(tmp_path, pid_namespace, chdir, end):
    # a daemon (setsid, maybe chdir away) left the runner's process group, and the work dir:
    # when the runner ended by itself, the daemon, reparented out of its tree, escaped both
    # the tree's kill and the sweep of the group's processes in the work dir, for good
    _run_and_await_the_daemon(tmp_path, chdir, end)


@functools.cache
def _pid_namespaces_here() -> bool:
    """Whether a test run gets a PID namespace of its own here (its runner is pid 2 there)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = envpool.make("code-repair-v1", workdir_root=tmp)
        try:
            env.reset(options={"task": "mathutils"})
            out = Path(tmp) / "pid"
            code = f"import os\nopen({str(out)!r}, 'w').write(str(os.getpid()))\n"
            env.step(edit_action("mathutils.py", "def add", code + "def add"))
            env.step("run_tests")
            return out.read_text() == "2"
        finally:
            env.close()


def test_code_repair_a_daemon_whose_run_kills_its_ancestors_goes_with_the_run(tmp_path):
    # the fallback's limit (the runner's parent, the keeper, is the module's to kill): in a
    # PID namespace the runner's parent is the namespace's init, which ignores what comes from
    # inside, and nothing outside has a pid there
    if not _pid_namespaces_here():
        pytest.skip("no PID namespace for a test run here (no CAP_SYS_ADMIN, no user namespaces)")
    _run_and_await_the_daemon(tmp_path, chdir=True, end="kills_ancestors")


@pytest.mark.parametrize("reader", ["module", "helper"])
def test_code_repair_a_module_that_reads_stdin_reads_nothing(tmp_path, pid_namespace, reader):
    # the runner kept its stdin (the pipe its parent fed the spec on) open past the spec, to
    # wait on it once done: a module (or a helper it ran) that read stdin, which found it at
    # its end when the parent closed it after the spec, then blocked until test_timeout_s
    # and the run read "timed out"
    with _repair_in(tmp_path, 5) as (env, _):
        if reader == "module":
            read = "import sys\n_ = sys.stdin.read()"
        else:
            read = 'import subprocess\nsubprocess.run(["cat"], stdout=subprocess.DEVNULL)'
        env.step(edit_action("mathutils.py", "    return a - b", "    return a + b\n" + read))
        t0 = time.monotonic()
        res = env.step("run_tests")
        assert time.monotonic() - t0 < 4
        assert res.info["all_passed"], res.obs.text


@pytest.mark.parametrize("how", ["aborted", "leader_killed"])
async def test_a_test_run_dies_with_its_container(tmp_path, how):
    # the runner had a session of its own: killing the container's process group (an aborted
    # trajectory, EnvHung, a recycle) missed it, and a policy's infinite loop ran on outside
    # every container until test_timeout_s, or forever once its env was gone
    work = tmp_path / "work"
    work.mkdir()
    kwargs = {"workdir_root": str(work), "test_timeout_s": 30}
    runtime = {"heartbeat_s": 0.1, "zygote": how == "aborted"}
    try:
        async with EnvPool({"min_warm": 0, "runtime": runtime}) as p:
            started = asyncio.Event()
            pids: list[int] = []

            async def rollout() -> None:
                async with p.session("code-repair-v1", env_kwargs=kwargs) as s:
                    await s.reset(seed=0, options={"task": "mathutils"})
                    await s.step(edit_action("mathutils.py", "    return a - b", LOOP))
                    pids.append(s.container.pid)
                    started.set()
                    await s.step("run_tests")

            t = asyncio.create_task(rollout())
            await started.wait()
            await wait_for(lambda: bool(_running_in(work)))  # the test run is going
            if how == "aborted":
                t.cancel()  # the trajectory is aborted: its container is killed
            else:
                # the server alone is killed (the OOM killer): its test run goes with it
                os.kill(pids[0], signal.SIGKILL)
            await wait_for(lambda: not _running_in(work), 3.0)
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    finally:
        _kill_all(_running_in(work))


def test_code_repair_dirs_are_removed(repair):
    repair.reset(seed=1)
    first = repair.env.workdir
    assert first.is_dir()
    repair.reset(seed=2)
    second = repair.env.workdir
    assert not first.exists() and second.is_dir()
    repair.close()
    repair.close()
    assert not second.exists()


def test_code_repair_seed_picks_the_task():
    env = envpool.make("code-repair-v1")
    try:
        names = [env.reset(seed=s)[1]["task"] for s in range(12)]
        assert names == [env.reset(seed=s)[1]["task"] for s in range(12)]
        assert set(names) == {t.name for t in TASKS}
        with pytest.raises(ValueError, match="unknown task"):
            env.reset(options={"task": "nope"})
    finally:
        env.close()


def test_code_repair_unknown_action(repair):
    repair.reset(seed=0)
    res = repair.step("rm -rf /")
    assert "Unknown action 'rm -rf /'" in res.obs.text and "run_tests" in res.obs.text
    assert res.info == {"valid": False}


@pytest.mark.parametrize("then", ["returns", "loops"])
def test_code_repair_shows_what_the_module_printed(tmp_path, then):
    # the runner waits to be killed once its results are in (or loops until the timeout):
    # what the module printed without a flush sat in the buffer of its stdout, and was lost
    with _repair_in(tmp_path, 1) as (env, _):
        body = "    print('debug', a, b)\n" + ("    return a - b" if then == "returns" else LOOP)
        env.step(edit_action("mathutils.py", "    return a - b", body))
        text = env.step("run_tests").obs.text
        assert text.endswith(
            "Output of the run:\ndebug 2 3" + ("\ndebug -4 1" if then == "returns" else "")
        ), text


def test_code_repair_shows_the_end_of_a_long_output(repair):
    # past 1 MB the first megabyte was read, and the "end" shown was its end: the last line
    # (a traceback, say) was lost, and the count of characters cut was that of the megabyte
    repair.reset(options={"task": "mathutils"})
    body = "print('x' * 1_500_000)\nprint('the last line')\ndef add"
    repair.step(edit_action("mathutils.py", "def add", body))
    text = repair.step("run_tests").obs.text
    output = text.partition("Output of the run:\n")[2]
    assert output.endswith("the last line"), output[-200:]
    assert output.startswith("[... output cut: the run wrote 1,500,015 bytes; its end follows]\n")
    assert len(output) < 4_100


@pytest.mark.parametrize(
    "damage",
    [
        "shutil.rmtree(os.getcwd())",
        "os.remove('test_mathutils.py')\nos.mkdir('test_mathutils.py')\nopen('test_mathutils.py/x', 'w')",
        "os.remove('test_mathutils.py')\nos.symlink(OUTSIDE, 'test_mathutils.py')",
        "root = os.getcwd()\nos.rename(root, root + '.moved')\nos.symlink(os.path.dirname(OUTSIDE), root)",
    ],
    ids=["work_dir_removed", "test_file_a_dir", "test_file_a_symlink_out", "work_dir_a_symlink_out"],
)
def test_code_repair_a_module_that_damages_its_work_dir_gets_answers(tmp_path, damage):
    # the module runs in its work dir as this process's user: it can remove the dir, or put
    # a directory or a symlink where the env writes the tests back. The next step raised
    # (FileNotFoundError, IsADirectoryError: an infra failure, the work dir in its message),
    # or wrote the tests through the symlink, outside the work dir, or viewed files there
    outside = tmp_path / "outside.txt"
    outside.write_text("SECRET\n")
    with _repair_in(tmp_path, 10) as (env, work):
        code = f"import os, shutil\nOUTSIDE = {str(outside)!r}\n{damage}\ndef add"
        env.step(edit_action("mathutils.py", "def add", code))
        env.step("run_tests")  # the damage is done
        for action in ("run_tests", "view mathutils.py", "view outside.txt", "view nope.py"):
            res = env.step(action)
            assert str(work) not in res.obs.text
            assert "SECRET" not in res.obs.text, (action, res.obs.text)
        assert outside.read_text() == "SECRET\n"
        res = env.step("submit")
        assert res.terminated and res.reward == 0.0
    for moved in work.glob("*.moved"):
        shutil.rmtree(moved)


def test_code_repair_lists_at_most_a_few_files(repair):
    # a module that made 3,000 files: each "No such file" answer listed them all
    repair.reset(options={"task": "mathutils"})
    body = "for i in range(3000):\n    open(f'file_{i:05d}_' + 'n' * 100, 'w').close()\ndef add"
    repair.step(edit_action("mathutils.py", "def add", body))
    repair.step("run_tests")
    text = repair.step("view nope.py").obs.text
    assert len(text) < 2_000 and "README.md" in text and re.search(r"and [0-9,]+ more$", text), text[-300:]


@pytest.mark.parametrize("timeout", [0, -1, math.inf, math.nan])
def test_code_repair_refuses_a_test_timeout_that_is_not_a_positive_number(timeout):
    # an infinite or NaN timeout was taken, and failed at the first run (math.ceil), or waited
    # for good
    with pytest.raises(ValueError, match="test_timeout_s"):
        envpool.make("code-repair-v1", test_timeout_s=timeout)


def test_code_repair_runs_in_a_process_with_many_files_open(repair):
    # select() takes no fd past 1023: in a process with that many open (a server, many envs
    # in one process), the wait for the runner raised ValueError, and every run_tests failed
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"at most {hard} open files here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        repair.reset(options={"task": "mathutils"})
        res = repair.step("run_tests")
        assert res.info["failed"] == 2 and not res.info["all_passed"], res.obs.text
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("cgroup", ["pids", "memory"])
def test_code_repair_without_a_pid_namespace_a_daemon_whose_run_kills_its_keeper_goes_with_the_run(
    tmp_path, monkeypatch, cgroup
):
    # the fallback's hole: the module kills its keeper (its parent), and its daemon (setsid,
    # chdir /), reparented to the container's init, is in neither the keeper's tree nor the
    # process group's work-dir sweep. The member list of either cgroup of the run finds it
    # (each alone here: the other's lookup finds none)
    if cgroup == "pids":
        if not code_repair_limits.pids_cgroup_available():
            pytest.skip("no pids cgroup can be made here (cgroup v1's pids hierarchy, writable)")
        monkeypatch.setattr(code_repair_limits, "_memory_parent", lambda: None)
    else:
        if not code_repair_limits.memory_cgroup_available():
            pytest.skip("no memory cgroup can be made here (cgroup v1's memory hierarchy, writable)")
        monkeypatch.setattr(code_repair_limits, "_pids_parent", lambda: None)
    monkeypatch.setattr(code_repair_runner, "PID_NAMESPACE", False)
    # the keeper's death ends the run (its results cut short): what matters is the daemon
    _run_and_await_the_daemon(tmp_path, chdir=True, end="kills_ancestors", passes=False)


def test_code_repair_a_runs_shared_memory_files_go_with_the_run(tmp_path):
    # files a run wrote to /dev/shm (a tmpfs: memory, charged to the run's memory cgroup)
    # outlived it: still charged after the cgroup was removed, so that run after run filled
    # the container's memory past every run's cap, and the next episode (another
    # trajectory's, maybe) could read what the last one left there
    if not _pid_namespaces_here():
        pytest.skip("no PID namespace for a test run here (no CAP_SYS_ADMIN, no user namespaces)")
    left = Path("/dev/shm") / f"envpool-test-{os.getpid()}-{tmp_path.name}"
    try:
        with _repair_in(tmp_path, test_timeout_s=10) as (env, _):
            write = f"open({str(left)!r}, 'wb').write(b'x' * 2**20)\n"
            env.step(edit_action("mathutils.py", "def add", write + "def add"))
            env.step(edit_action("mathutils.py", "    return a - b", "    return a + b"))
            res = env.step("run_tests")
            assert res.info["all_passed"], res.obs.text  # it could write there
            assert not left.exists()
    finally:
        with contextlib.suppress(OSError):
            left.unlink()
