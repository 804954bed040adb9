"""What test_code_repair.py, test_code_repair_judge.py and test_code_repair_runs.py share:
an edit action, and a ``code-repair-v1`` env per test (the ``repair`` fixture: a module
imports ``repair_fixture``, known to pytest by ``name=``)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

import envpool
import envpool.envs  # registers the built-ins


def edit_action(file: str, search: str, replace: str) -> str:
    return f"edit {file}\n<<<<<<< SEARCH\n{search}\n=======\n{replace}\n>>>>>>> REPLACE"


@pytest.fixture(name="repair")
def repair_fixture():
    env = envpool.make("code-repair-v1")
    yield env
    env.close()


#: the namespaces a test run may get, as unshare(2) flags
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000


@functools.cache
def kernel_allows(flags: int) -> bool:
    """Whether a process here can unshare ``flags``. Tried in a child, which the namespaces
    die with."""
    probe = f"import ctypes, sys\nsys.exit(0 if ctypes.CDLL(None).unshare({flags}) == 0 else 1)\n"
    return subprocess.run([sys.executable, "-c", probe], timeout=30).returncode == 0


# An env in a process of its own (a session of its own too: what the module sends to the env's
# process group never reaches this test), which prints each run's info and text as JSON, then
# "ENV ALIVE": a run of the module with the attack, then one without it. RUNNER_EDIT edits the
# runner's text first (a part of the isolation refused, as the kernel may)
ENV_SCRIPT = """
import json, envpool, envpool.envs
from envpool.envs import code_repair_runner
code_repair_runner.PID_NAMESPACE = {pid_namespace!r}
for old, new in {runner_edit!r}:
    assert old in code_repair_runner.RUNNER
    code_repair_runner.RUNNER = code_repair_runner.RUNNER.replace(old, new)
env = envpool.make("code-repair-v1", workdir_root={work!r}, run_uid_base={uid_base!r}, test_timeout_s=20)
env.reset(options={{"task": "mathutils"}})

def edit(search, replace):
    return f"edit mathutils.py\\n<<<<<<< SEARCH\\n{{search}}\\n=======\\n{{replace}}\\n>>>>>>> REPLACE"

assert env.step(edit("    return a - b", "    return a + b")).info["valid"]
assert env.step(edit("def add", {attack!r} + "def add")).info["valid"]

def run_tests():
    res = env.step("run_tests")
    print(json.dumps({{"info": res.info, "text": res.obs.text}}), flush=True)

run_tests()
assert env.step(edit({attack!r} + "def add", "def add")).info["valid"]
run_tests()
env.close()
print("ENV ALIVE", flush=True)
"""


def run_env_script(
    work: Path,
    attack: str,
    *,
    prefix: list[str],
    uid_base: int | None,
    pid_namespace: bool,
    runner_edit: tuple[tuple[str, str], ...] = (),
) -> tuple[int, str]:
    """ENV_SCRIPT's exit status and output, run under ``prefix`` (setpriv, or nothing). In a
    session of its own: a signal the module sends to the env's process group reaches the env
    process, never the test's."""
    script = ENV_SCRIPT.format(
        work=str(work), attack=attack, uid_base=uid_base, pid_namespace=pid_namespace, runner_edit=runner_edit
    )
    out = subprocess.run(
        [*prefix, sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    return out.returncode, out.stdout + out.stderr
