"""Fixtures the job's test modules share."""

from __future__ import annotations

import os

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
