"""envpool, reviewed (17b).

* ``prewarm(n)`` with ``n`` over ``max_containers`` is refused (``EnvUsageError``, naming
  both), as ``PoolConfig`` refuses such a ``min_warm``: it stored the want unclamped, the
  housekeeping then started ``n`` - idle do-nothing tasks every tick, forever, and the want
  let go of every other image's warm containers.
* The housekeeping starts no more idle containers than the pool has room for: with every
  slot claimed it started one task per missing idle container every tick, each of which
  found no room and returned.
"""

from __future__ import annotations

import asyncio

import pytest
from echo_bundle import IMAGE

from envpool.errors import EnvUsageError
from envpool.pool import EnvPool

POOL = {"runtime": {"heartbeat_s": 0.1}}


async def test_prewarm_of_more_than_max_containers_is_refused(images):
    async with EnvPool({**POOL, "min_warm": 1, "max_containers": 2}, images=images) as p:
        await p.prewarm(IMAGE, 1)
        with pytest.raises(EnvUsageError, match=r"prewarm\(n=3\).*max_containers \(2\)"):
            await p.prewarm(None, 3)
        # nothing started for it, and the other image is still kept warm
        assert p.stats()["containers"] == 1
        assert p._wanted == {IMAGE: 1}


async def test_housekeeping_starts_no_idle_container_it_has_no_room_for():
    async with EnvPool({**POOL, "min_warm": 2, "max_containers": 2}) as p:
        starts = 0
        real = p._start_idle

        async def counted(image: str | None, *, background: bool = True) -> None:
            nonlocal starts
            starts += 1
            await real(image, background=background)

        p._start_idle = counted  # type: ignore[method-assign]
        async with p.session("frozenlake-v1") as a, p.session("frozenlake-v1") as b:
            await a.reset(seed=1)
            await b.reset(seed=2)
            await asyncio.sleep(0.5)  # a few ticks of the housekeeping, every slot claimed
            assert starts == 0
            assert p.stats()["containers"] == 2
