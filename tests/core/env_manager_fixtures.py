"""The fixtures of test_env_manager.py and test_env_manager_turns.py: the module's pool (one
pool and event loop per module: its zygote starts once, containers stay warm) and its tool
bridge, and the autouse check that every session gave its container back. A module imports
them by their functions' names (``*_fixture``; pytest knows them by ``name=``), so that a
test's argument of the fixture's name redefines no import."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from env_manager_helpers import Tools

from envpool.pool import EnvPool


@pytest.fixture(scope="module", name="tools")
def tools_fixture() -> Tools:
    return Tools()


@pytest_asyncio.fixture(loop_scope="module", scope="module", name="pool")
async def pool_fixture(tools: Tools) -> AsyncIterator[EnvPool]:
    cfg = {
        "min_warm": 0,
        "runtime": {"heartbeat_s": 0.1},
        "retry": {"attempts": 2, "initial_backoff_s": 0.01, "max_backoff_s": 0.02},
    }
    async with EnvPool(cfg, tool_caller=tools) as p:
        yield p
    assert not p.runtime.live  # every container stopped


@pytest.fixture(autouse=True)
def _every_session_ends(request):
    yield
    if "pool" in request.fixturenames:
        assert request.getfixturevalue("pool").stats()["claimed"] == 0  # containers given back
