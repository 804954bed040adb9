"""The job's start waits for its actors with a deadline (``engine.start_timeout_s``)."""

from __future__ import annotations

import time

import pytest

from core.cluster import wait_ready
from core.errors import StartupTimeout


def _actors(ray):
    """Three actor classes, made here: classes local to a function go to Ray's workers by
    value (a test module is not importable there)."""

    class Hangs:
        def __init__(self) -> None:
            time.sleep(3600)  # a model load that never ends

    class Fails:
        def __init__(self) -> None:
            raise ValueError("bad engine kwarg")

    class Fine:
        pass  # an actor whose constructor returns at once

    return [ray.remote(c).options(num_cpus=0) for c in (Hangs, Fails, Fine)]


async def test_an_actor_that_never_starts_is_named_after_the_deadline(ray_cluster):
    ray = ray_cluster
    hangs_cls, _, fine_cls = _actors(ray)
    hangs, fine = hangs_cls.remote(), fine_cls.remote()
    try:
        # made before the 2 s start: a worker process that takes longer to start on a loaded
        # machine would be named too
        await fine.__ray_ready__.remote()
        with pytest.raises(StartupTimeout, match=r"after 2 s: default-0 \(.*engine\.start_timeout_s") as e:
            await wait_ready({"default-0": hangs, "trainer": fine}, 2.0)
        assert "trainer" not in str(e.value)
    finally:
        for a in (hangs, fine):
            ray.kill(a, no_restart=True)


async def test_a_constructor_error_is_raised_at_once_not_at_the_deadline(ray_cluster):
    ray = ray_cluster
    hangs_cls, fails_cls, _ = _actors(ray)
    hangs, fails = hangs_cls.remote(), fails_cls.remote()
    try:
        t0 = time.monotonic()
        with pytest.raises(Exception, match="bad engine kwarg"):
            await wait_ready({"default-0": hangs, "trainer": fails}, 600.0)
        assert time.monotonic() - t0 < 300  # the deadline was not waited for
    finally:
        for a in (hangs, fails):
            ray.kill(a, no_restart=True)
