"""What test_code_repair.py, test_code_repair_judge.py and test_code_repair_runs.py share:
an edit action, and a ``code-repair-v1`` env per test (the ``repair`` fixture: a module
imports ``repair_fixture``, known to pytest by ``name=``)."""

from __future__ import annotations

import functools
import subprocess
import sys

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
