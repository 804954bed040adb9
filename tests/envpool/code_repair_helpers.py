"""What test_code_repair.py, test_code_repair_judge.py and test_code_repair_runs.py share:
an edit action, and a ``code-repair-v1`` env per test (the ``repair`` fixture: a module
imports ``repair_fixture``, known to pytest by ``name=``)."""

from __future__ import annotations

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
