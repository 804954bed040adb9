"""EnvSession's retries, counted: a call that fails on every attempt is tried exactly
``retry.attempts`` times (the first attempt outside tenacity, the rest inside it), each
failure noted and its container dropped, and the session is then lost."""

from __future__ import annotations

import pytest
from echo_bundle import IMAGE
from pool_util import pool

from envpool.pool import SessionLost


async def test_a_reset_failing_on_every_attempt_is_tried_attempts_times(images):
    cfg = {"retry": {"attempts": 3, "initial_backoff_s": 0.001, "max_backoff_s": 0.001}}
    async with pool(
        images, min_warm=0, runtime={"heartbeat_s": 0.1, "faults": {"crash_rate": 1.0}}, **cfg
    ) as p:
        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            with pytest.raises(SessionLost, match=r"^reset failed after 3 attempts: "):
                await s.reset(seed=1)
            assert s.status == "infra_failed" and len(s.failures) == 3
        stats = p.stats()
        assert stats["reset_retries"] == 2 and stats["sessions_infra_failed"] == 1, stats
        assert sum(v for k, v in stats.items() if k.startswith("infra:")) == 3, stats
        assert "resets" not in stats or stats["resets"] == 0, stats


async def test_a_reset_that_succeeds_at_once_is_not_retried(images):
    async with pool(images, min_warm=0) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        await s.step("a")
        stats = p.stats()
        assert stats.get("reset_retries", 0) == 0 and stats.get("step_retries", 0) == 0, stats
        assert not s.failures and s.status == "ok"
