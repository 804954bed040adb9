"""A whole reply followed, in the same read, by bytes that are not a frame (a debug line the
server wrote after answering): the reply is the server's answer and reaches its caller; the
connection ends on what follows it, and the next request fails with ``GarbledFrame`` (never
retried), as one whose own reply was garbled does."""

from __future__ import annotations

import pytest
from pool_util import alive, wait_for
from test_foreign_server import _foreign_pool

from envpool.errors import GarbledFrame


async def test_a_reply_read_with_garbage_after_it_is_delivered_and_the_next_request_fails():
    # the decoder raised on the garbage before returning the reply it had decoded: the step
    # the server answered failed with GarbledFrame (and its trajectory with it)
    async with await _foreign_pool("step-then-print") as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            pid = s.container.pid
            out = await s.step("a")
            assert out.obs.text == "a #1" and out.reward == 1.0
            with pytest.raises(GarbledFrame, match=r"b.DEBUG stepped\\n") as err:
                await s.step("b")
            assert str(err.value).endswith("This request was not sent: the connection broke before it")
            assert s.container is None and s.status == "ok"  # discarded; the session lives on
        stats = p.stats()
        assert stats["protocol_errors"] == 1 and stats["garbled_frames"] == 1, stats
        assert stats["discarded"] == 1 and stats.get("step_retries", 0) == 0, stats
        await wait_for(lambda: not alive(pid))
