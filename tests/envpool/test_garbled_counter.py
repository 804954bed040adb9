"""A garbled frame from a container (``GarbledFrame``: bytes that are no frame, most often a
print to the session socket) has a counter of its own in the pool's stats,
``garbled_frames``, beside ``protocol_errors`` (which counts it too): an operator tells a
server that writes stray output from one whose replies are malformed."""

from __future__ import annotations

import asyncio

import pytest
from test_foreign_server import _foreign_pool

from envpool.errors import GarbledFrame, ProtocolError


@pytest.mark.parametrize("mode", ["step-print", "step-not-json", "step-huge"])
async def test_a_garbled_reply_to_a_step_is_counted_as_a_garbled_frame(mode):
    # it was counted only as one of protocol_errors, with every malformed reply
    async with await _foreign_pool(mode) as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            with pytest.raises(GarbledFrame):
                await s.step("a")
        stats = p.stats()
        assert stats.get("garbled_frames") == 1 and stats["protocol_errors"] == 1, stats


@pytest.mark.parametrize("mode", ["ok-not-bool", "wrong-id", "reset-shape"])
async def test_a_malformed_but_framed_reply_is_no_garbled_frame(mode):
    async with await _foreign_pool(mode) as p:
        async with p.session("echo-v0") as s:
            with pytest.raises(ProtocolError) as err:
                await s.reset(seed=1)
            assert not isinstance(err.value, GarbledFrame)
        stats = p.stats()
        assert stats.get("garbled_frames", 0) == 0 and stats["protocol_errors"] == 1, stats


async def test_a_garbled_reply_to_the_open_is_counted_as_a_garbled_frame():
    async with await _foreign_pool("open-print") as p:
        with pytest.raises(GarbledFrame, match=r"b'starting up"):
            async with p.session("echo-v0"):  # the open (the session's start) raises
                pass  # never reached
        stats = p.stats()
        assert stats.get("garbled_frames") == 1 and stats["protocol_errors"] == 1, stats
        assert stats.get("reset_retries", 0) == 0, stats


async def test_a_garbled_frame_found_at_the_goodbye_is_counted():
    # stray output after the last reply broke the connection with nothing waiting; the
    # goodbye found it broken and the container was discarded, with no error counted at all
    async with await _foreign_pool("print-after-reset") as p:
        async with p.session("echo-v0") as s:
            await s.reset(seed=1)
            conn = s.conn
            assert conn is not None and s.container is not None
            server = s.container.handle
            server.stdin.write(b"go\n")
            server.stdin.flush()
            deadline = asyncio.get_running_loop().time() + 5
            while conn.broken is None:  # the stray bytes were read
                assert asyncio.get_running_loop().time() < deadline, "the stray output never arrived"
                await asyncio.sleep(0.01)
            assert isinstance(conn.broken, GarbledFrame)
        stats = p.stats()
        assert stats.get("garbled_frames") == 1 and stats["protocol_errors"] == 1, stats
        assert stats["discarded"] == 1, stats
