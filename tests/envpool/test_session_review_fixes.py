"""EnvSession after a review: a step that outlives its session's block releases what it
claims; a reset() or step() cancelled before it returned ends the episode (the container may
still be running it) and the next reset() starts on a fresh container; an episode that lost
its container to a failure nothing rebuilt ends too, rather than reaching a fresh container
that was never reset."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from pathlib import Path

import pytest
from echo_bundle import IMAGE, DirImages, write_env_bundle
from pool_util import alive, pool, wait_for

from envpool.errors import EnvLogicError, EnvOrderError
from envpool.pool import SessionLost
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


# -- a cancelled reset() or step()


async def test_a_step_cancelled_before_its_reply_ends_the_episode(images):
    # a step cut off by a timeout (asyncio.wait_for) left its container running it: the
    # next step queued behind it and came back as step 2 of an episode whose log held only
    # the reset and that step (silently wrong data); a replay could not have rebuilt it
    async with pool(images, min_warm=0) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        assert (await s.step("a")).obs.text == "a #1"
        pid = s.container.pid
        t = asyncio.create_task(s.step("sleep 1"))
        await wait_for(lambda: s.container.in_flight > 0)
        await _cancel(t)
        with pytest.raises(EnvOrderError, match=r"step\(\) was cancelled.*; call reset\(\)"):
            await s.step("y")
        # a new episode on a fresh container: the one still running the step is discarded
        assert (await s.reset(seed=2))[0].text == "ready 2"
        assert s.container.pid != pid
        assert (await s.step("z")).obs.text == "z #1"
        assert p.stats()["discarded"] == 1
        await wait_for(lambda: not alive(pid))


async def test_a_reset_cancelled_before_its_reply_ends_the_episode(images):
    # (heartbeats every second: the cancel lands long before the silence would be a timeout)
    async with (
        pool(images, min_warm=0, runtime={"heartbeat_s": 1.0}) as p,
        p.session("bundle-echo-v0", image=IMAGE) as s,
    ):
        await s.reset(seed=1)
        await s.step("a")
        pid = s.container.pid
        os.kill(pid, signal.SIGSTOP)  # the reset gets no reply
        t = asyncio.create_task(s.reset(seed=2))
        await wait_for(lambda: s.container.in_flight > 0)
        await _cancel(t)
        with pytest.raises(EnvOrderError, match=r"reset\(\) was cancelled"):
            await s.step("b")
        assert (await s.reset(seed=3))[0].text == "ready 3"
        assert s.container.pid != pid and (await s.step("c")).obs.text == "c #1"
        assert p.stats()["discarded"] == 1
        await wait_for(lambda: not alive(pid))


async def test_a_step_cancelled_in_its_retrys_backoff_ends_the_episode(images, monkeypatch):
    # its container was lost and the retry not yet begun: the next step claimed a fresh
    # container and sent it the step of an episode it never ran ("step() before reset()")
    async with pool(images, min_warm=0) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        await s.step("a")
        failed = _on_first_failure(monkeypatch, s)
        os.killpg(s.container.pid, signal.SIGKILL)
        t = asyncio.create_task(s.step("c"))
        await failed.wait()
        await _cancel(t)
        with pytest.raises(EnvOrderError, match=r"step\(\) was cancelled.*; call reset\(\)"):
            await s.step("d")
        assert s.container is None  # nothing claimed for a step refused
        assert (await s.reset(seed=2))[0].text == "ready 2"
        assert (await s.step("e")).obs.text == "e #1"
        assert p.stats()["claimed"] == 1


# -- an episode whose container a failure took


_FLAKY = """
import os
import envpool


class Flaky(envpool.Env):
    def __init__(self, marker):
        if os.path.exists(marker):
            raise ValueError("not today")

    def reset(self, *, seed=None, options=None):
        self.n = 0
        return f"ready {seed}", {}

    def step(self, action):
        self.n += 1
        return envpool.StepResult(obs=envpool.Observation(text=f"{action} #{self.n}"))
"""


async def test_a_reset_whose_new_container_cannot_open_ends_the_episode(tmp_path: Path):
    # the reset's container was lost and the retry's could not make the environment: the
    # episode, its container gone, went on, and its next step reached a fresh container
    # that no reset had run on
    images = write_env_bundle(tmp_path / "b", "flaky_env", _FLAKY, {"bundle-flaky-v0": "Flaky"})
    marker = tmp_path / "marker"
    async with (
        pool(images, min_warm=0) as p,
        p.session("bundle-flaky-v0", image=IMAGE, env_kwargs={"marker": str(marker)}) as s,
    ):
        await s.reset(seed=1)
        await s.step("a")
        marker.touch()
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(EnvLogicError, match="not today"):
            await s.reset(seed=2)
        marker.unlink()
        with pytest.raises(EnvOrderError, match=r"ended when reset\(\) failed.*; call reset\(\)"):
            await s.step("b")
        assert s.container is None
        assert (await s.reset(seed=3))[0].text == "ready 3"
        assert (await s.step("c")).obs.text == "c #1"


async def test_a_replay_whose_container_does_not_know_the_env_loses_the_session(tmp_path: Path):
    # an EnvRegistryError (the new container's image module did not register the id) came
    # out of the replay as it was, the episode open and no container attached: the next
    # step reached a fresh container that no reset had run on
    root = tmp_path / "bundle"
    root.mkdir()
    marker = tmp_path / "marker"
    (root / "gone_env.py").write_text(
        _FLAKY.replace("def __init__(self, marker):", "def __init__(self, marker=''):")
        + f"\nif not os.path.exists({str(marker)!r}):\n"
        "    envpool.register('mod-gone-v0', entry_point='gone_env:Flaky')\n"
    )
    (root / "envpool.json").write_text(json.dumps({"modules": ["gone_env"]}))
    async with pool(DirImages(root), min_warm=0) as p, p.session("mod-gone-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        await s.step("a")
        marker.touch()
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="replaying the episode on a new container failed"):
            await s.step("b")
        marker.unlink()
        assert s.status == "infra_failed" and s.container is None
        with pytest.raises(SessionLost):
            await s.step("c")
        assert p.stats()["claimed"] == 0
