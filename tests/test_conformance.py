"""Every built-in function passes the conformance check shipped in fabric.testing."""

from __future__ import annotations

import pytest
from sample_fns import REG

from fabric.registry import Registry
from fabric.testing import ConformanceError, check_function

BUILTINS = Registry()
BUILTINS.discover("functions")


def test_builtins_are_discovered():
    assert "exact_match" in BUILTINS


@pytest.mark.parametrize("name", BUILTINS.names())
def test_builtin_conforms(name):
    check_function(name, BUILTINS)


def test_check_function_reports_problems():
    # sample functions have no examples, and boom raises: both are reported, not hidden
    with pytest.raises(ConformanceError) as e:
        check_function("boom", REG)
    assert "no example payloads" in str(e.value)
