"""EnvSession after a review: a step that outlives its session's block releases what it
claims."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
from echo_bundle import IMAGE
from pool_util import pool

from envpool.errors import EnvOrderError
from envpool.session import EnvSession


def _on_first_failure(monkeypatch: pytest.MonkeyPatch, s: EnvSession) -> asyncio.Event:
    """An event set when the session notes its first infrastructure failure: the failed
    attempt's container is dropped next, then the retry waits its backoff (a task woken by
    the event runs before the retry does, whatever the backoff drawn)."""
    failed = asyncio.Event()
    note = s._note

    def noting(e: BaseException) -> None:
        note(e)
        failed.set()

    monkeypatch.setattr(s, "_note", noting)
    return failed


async def _cancel(t: asyncio.Task) -> None:
    t.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await t


# -- a step that outlives its session's block


async def test_a_retry_after_the_block_ended_claims_nothing(images, monkeypatch):
    # a gather whose other arm raised ends the block while a step waits out its retry's
    # backoff: the retry's replay claimed a new container, ran the episode on it and
    # returned; nothing released that container until the reaper (session_ttl_s, 1 h)
    async with pool(images, min_warm=0) as p:
        claims = []
        claim = p._claim

        async def counted(image):
            claims.append(image)
            return await claim(image)

        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            await s.step("a")
            failed = _on_first_failure(monkeypatch, s)
            monkeypatch.setattr(p, "_claim", counted)
            os.killpg(s.container.pid, signal.SIGKILL)
            step = asyncio.create_task(s.step("b"))
            await failed.wait()
        # the block ended (its _detach ran) before the retry
        with pytest.raises(EnvOrderError, match="this session is closed"):
            await step
        assert claims == [] and p.stats()["claimed"] == 0 and s.container is None


async def test_a_claim_that_ends_after_the_block_gives_its_container_back(images, monkeypatch):
    # the block ends while the retry's claim waits (for capacity, say): the container the
    # claim gets is released at once, not kept by a session nobody holds
    async with pool(images, min_warm=0) as p:
        claim = p._claim
        claiming, go = asyncio.Event(), asyncio.Event()

        async def gated(image):
            claiming.set()
            await go.wait()
            return await claim(image)

        async with p.session("bundle-echo-v0", image=IMAGE) as s:
            await s.reset(seed=1)
            await s.step("a")
            monkeypatch.setattr(p, "_claim", gated)
            os.killpg(s.container.pid, signal.SIGKILL)
            step = asyncio.create_task(s.step("b"))
            await claiming.wait()
        go.set()
        with pytest.raises(EnvOrderError, match="this session is closed"):
            await step
        stats = p.stats()
        assert stats["claimed"] == 0 and s.container is None and s.conn is None
        assert stats["idle"] == 1  # unused, sound: back to the pool for the next session
