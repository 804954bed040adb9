"""``code-repair-v1``'s actions: view, edit (SEARCH/REPLACE blocks), run_tests and submit;
what it refuses (paths out of the work dir, names the file system refuses, files it cannot
read, the read-only tests), its work dirs, seeds and options. Its judge is in
test_code_repair_judge.py, its test runner in test_code_repair_runs.py."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import pytest
from code_repair_helpers import edit_action, repair_fixture  # noqa: F401 - by name=

import envpool
import envpool.envs  # registers the built-ins
from envpool.envs.code_repair import TASKS, parse_blocks


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
