"""Every built-in function passes the conformance check shipped in fabric.testing."""

from __future__ import annotations

import pytest
from cli_fns import REG as CLI_REG
from sample_fns import REG

from fabric.registry import Registry
from fabric.testing import ConformanceError, check_function
from functions.fakes import FakeOpenAI

BUILTINS = Registry()
BUILTINS.discover("functions")


def test_builtins_are_discovered():
    assert "exact_match" in BUILTINS


@pytest.fixture
def fake_judge_env(monkeypatch):
    """A FakeOpenAI server on 127.0.0.1 with RL_FABRIC_JUDGE_* pointing llm_judge at it:
    the judge's examples run against a real (fake) endpoint, never the network."""
    with FakeOpenAI() as srv:
        for key, value in srv.env.items():
            monkeypatch.setenv(key, value)
        yield srv


@pytest.mark.parametrize("name", BUILTINS.names())
def test_builtin_conforms(name, fake_judge_env):
    check_function(name, BUILTINS)


def test_check_function_reports_problems():
    # sample functions have no examples, and boom raises: both are reported, not hidden
    with pytest.raises(ConformanceError) as e:
        check_function("boom", REG)
    assert "no example payloads" in str(e.value)


def test_check_function_lists_an_example_that_is_not_json():
    """An example the client would refuse (NaN) was raised as PayloadNotSerializableError
    instead of being listed among the problems."""
    with pytest.raises(ConformanceError) as e:
        check_function("cli_nan_example", CLI_REG)
    assert "example 0 is not JSON-serialisable" in str(e.value)


async def test_check_function_of_an_async_function_from_an_async_test():
    """asyncio.run refused inside the test's running loop; the calls now run on a private
    loop of their own."""
    check_function("cli_async", CLI_REG)
    with pytest.raises(ConformanceError, match="example 0 failed: UserError: ValueError"):
        check_function("cli_raises", CLI_REG)
