"""Found in an adversarial review of the pool and the image cache: each test pins a bug
that was demonstrated, then fixed."""

from __future__ import annotations

import os
import signal

from echo_bundle import IMAGE
from pool_util import pool


async def test_an_episode_replayed_on_a_fresh_container_counts_toward_its_recycling(images):
    # the replay ran the episode's reset on the new container without counting it: with
    # max_episodes=1 (a fresh container per episode) that container went back to the idle
    # pool with 0 episodes and the next trajectory ran in the state the replay left
    async with pool(images, min_warm=0, max_episodes=1) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            await s.step("a")
            os.killpg(s.container.pid, signal.SIGKILL)
            assert (await s.step("b")).obs.text == "b #2"  # replayed on a new container
            replayed = s.container
            assert replayed.episodes == 1
        async with p.session("bundle-echo-v0", image=IMAGE) as s2:
            await s2.reset(seed=2)
            assert s2.container.id != replayed.id
        assert p.stats()["recycled"] == 2
