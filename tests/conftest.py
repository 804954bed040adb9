import os

import pytest

# Ray (the bench baseline) writes an auth token and asks for it otherwise; tests run offline
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("POWERTOOLS_TRACE_DISABLED", "1")


@pytest.fixture(autouse=True)
def _the_working_directory_is_left_as_it_was():
    """A test (or the product code it runs in this process) that changes the working
    directory breaks every later test that finds files relative to the repository, on
    whichever pytest-xdist worker it lands: put it back and name the test."""
    before = os.getcwd()
    yield
    after = os.getcwd()
    if after != before:
        os.chdir(before)
        pytest.fail(f"the working directory changed to {after!r} and was not put back")
