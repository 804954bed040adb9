"""envpool, reviewed (17c): ``prewarm`` when the pool has no room for all it asks.

* With every slot claimed it starts nothing and returns at once, keeping the want: the
  housekeeping warms the image as slots free. Its docstring said it started ``n`` and
  waited for them. The job's start-up prewarms its images one after another, and a wait
  for room there would last as long as the sessions holding the slots (and there are none
  at start-up to free them but the other images' warm containers).
* A prewarm whose starts all failed, the rest having found no room, raises the first error
  and keeps nothing warm, as one whose every start failed does: it returned normally, and
  an image that does not start was kept warm (the start-up check of the job's images let
  it through).
"""

from __future__ import annotations

import asyncio

import pytest
from echo_bundle import DirImages
from pool_util import wait_for

from envpool.images.errors import ImageNotFound
from envpool.pool import EnvPool

POOL = {"runtime": {"heartbeat_s": 0.1}, "min_warm": 0}
MISSING = "missing@sha256:" + "0" * 64


async def test_prewarm_with_every_slot_claimed_keeps_the_want_and_returns(images):
    async with EnvPool({**POOL, "max_containers": 1}, images=images) as p:
        async with p.session("frozenlake-v1") as s:
            await s.reset(seed=1)
            # (a bound only so that a prewarm that waited for room fails, not hangs)
            await asyncio.wait_for(p.prewarm(None, 1), 30)
            assert p.stats()["containers"] == 1 and p._wanted == {None: 1}
        # the session's container is kept idle for the want, once its slot is free
        await wait_for(lambda: len(p._idle[None]) == 1)


class SlowImages(DirImages):
    """Its fetch yields: a start is under way (holding its slot) when the next one looks
    for room, as a real fetch is."""

    async def get(self, digest: str):
        await asyncio.sleep(0.05)
        return await super().get(digest)


async def test_prewarm_whose_only_start_fails_raises_though_the_rest_had_no_room(images):
    async with EnvPool({**POOL, "max_containers": 2}, images=SlowImages(images.root)) as p:
        async with p.session("frozenlake-v1") as s:
            await s.reset(seed=1)
            # room for one of the two: it fails, the other found no room
            with pytest.raises(ImageNotFound):
                await p.prewarm(MISSING, 2)
            assert MISSING not in p._wanted
