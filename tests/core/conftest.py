"""Fixtures the test modules of ``tests/core`` share."""

from __future__ import annotations

import os
from typing import Any

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for the module's jobs (started once: a start costs seconds)."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def tok() -> Any:
    """The proxy tests' word tokenizer (a module may define its own ``tok``); imported here,
    not at the top, so that a module that needs no torch loads none through this file."""
    from proxy_fakes import WORDS

    from core.policy.tokenizer import WordTokenizer

    return WordTokenizer(WORDS)
