"""EnvPool with real containers: a lost container (killed) is replaced and a deterministic
episode replayed on the new one, checked against what the policy saw (a step or reset that
raised is repeated); a non-deterministic environment's session, or a replay that diverges,
is lost instead of faked; resets retry through crashing containers."""

from __future__ import annotations

import json
import os
import signal

import pytest
from echo_bundle import IMAGE, DirImages, write_env_bundle
from pool_util import alive, pool

from envpool.api import EnvRegistry
from envpool.errors import (
    EnvLogicError,
)
from envpool.pool import EnvPool, SessionLost
from envpool.testing import check_env


async def test_a_dead_container_is_replaced_and_the_episode_replayed(images):
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        await s.step("a")
        await s.step("b")
        old = s.container.pid
        os.killpg(old, signal.SIGKILL)
        r = await s.step("c")
        assert r.obs.text == "c #3" and r.reward == 3.0  # same episode, rebuilt on a new container
        assert s.container.pid != old and s.status == "ok"
        stats = p.stats()
        assert stats["replays"] == 1 and stats["step_retries"] == 1
        assert not alive(old)


async def test_a_non_deterministic_session_is_lost_not_faked(images):
    async with pool(images) as p, p.session("bundle-random-v0", image=IMAGE) as s:
        await s.reset()
        await s.step("a")
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="not deterministic"):
            await s.step("b")
        assert s.status == "infra_failed" and p.stats()["sessions_infra_failed"] == 1


@pytest.mark.parametrize("deterministic", [False, True])
async def test_an_image_modules_own_registration_decides_whether_a_lost_session_is_replayed(
    tmp_path, deterministic
):
    # the driver's registry never sees what an image's module registers: the session learns
    # the spec from the container's hello (an image env was once feared replayed regardless)
    root = tmp_path / "bundle"
    root.mkdir()
    (root / "coin_env.py").write_text(
        "import envpool\n"
        "class Coin(envpool.Env):\n"
        "    def reset(self, *, seed=None, options=None):\n"
        "        return f'seed {seed}', {}\n"
        "    def step(self, action):\n"
        "        return envpool.StepResult(obs=envpool.Observation(text=action))\n"
        f"envpool.register('mod-coin-v0', entry_point='coin_env:Coin', deterministic={deterministic})\n"
    )
    (root / "envpool.json").write_text(json.dumps({"modules": ["coin_env"]}))
    async with pool(DirImages(root)) as p, p.session("mod-coin-v0", image=IMAGE) as s:
        await s.reset(seed=3)
        await s.step("a")
        assert s.deterministic is deterministic
        os.killpg(s.container.pid, signal.SIGKILL)
        if deterministic:
            assert (await s.step("b")).obs.text == "b" and s.status == "ok"
            assert p.stats()["replays"] == 1
        else:
            with pytest.raises(SessionLost, match="mod-coin-v0 is not deterministic"):
                await s.step("b")
            assert s.status == "infra_failed" and "replays" not in p.stats()


async def test_reset_retries_through_container_crashes(images):
    async with pool(images, min_warm=0, runtime={"heartbeat_s": 0.1, "faults": {"crash_rate": 0.3}}) as p:
        ok = 0
        for seed in range(20):
            async with p.session("bundle-echo-v0", image=IMAGE) as s:
                try:
                    await s.reset(seed=seed)
                    ok += 1
                except SessionLost:
                    pass  # its retries ran out: counted as sessions_infra_failed, checked below
        stats = p.stats()
        assert stats.get("reset_retries", 0) > 0
        assert ok + stats.get("sessions_infra_failed", 0) == 20  # every reset accounted for


async def test_a_replay_rebuilds_the_same_random_episode(images):
    async with EnvPool({"min_warm": 0}) as p, p.session("frozenlake-v1") as s:
        obs, _ = await s.reset()  # no seed: the pool draws one, so a replay can rebuild it
        await s.step("up")  # into the wall: the agent stays on S, whatever the random map
        os.killpg(s.container.pid, signal.SIGKILL)
        res = await s.step("left")  # replayed on a new container, checked step by step
        assert s.status == "ok" and p.stats()["replays"] == 1
        assert res.info["position"] == [0, 0] and not res.terminated

        def grid(text: str) -> list[str]:
            return [ln for ln in text.splitlines() if ln.strip() and set(ln) <= set("@SFHG ")]

        assert grid(res.obs.text) == grid(obs.text)  # the same map as the episode the policy saw


async def test_a_replay_checks_what_the_policy_saw_not_info_timings(images, monkeypatch):
    # deterministic where it counts (check_env passes) but with wall-clock times in info, which
    # the docs allow: a replay that compared info lost every such session with its container
    monkeypatch.syspath_prepend(str(images.root))
    reg = EnvRegistry()
    reg.register("bundle-timed-info-v0", entry_point="echo_env:TimedInfoEnv", max_episode_steps=4)
    check_env("bundle-timed-info-v0", reg)
    async with pool(images) as p, p.session("bundle-timed-info-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        await s.step("a")
        os.killpg(s.container.pid, signal.SIGKILL)
        res = await s.step("b")
        assert res.obs.text == "b #2" and res.reward == 2.0 and s.status == "ok"
        assert p.stats()["replays"] == 1


async def test_a_replay_that_diverges_loses_the_session(images):
    async with pool(images) as p, p.session("bundle-liar-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="differs from the original"):
            await s.step("x")
        assert s.status == "infra_failed"


async def test_a_replay_repeats_a_step_that_raised(images):
    # the step ran (the env counted it) before it raised: a replay that left it out rebuilt
    # another episode, and the session went on with a result the policy would not have got
    async with pool(images) as p, p.session("bundle-echo-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        assert (await s.step("a")).obs.text == "a #1"
        with pytest.raises(EnvLogicError, match="ZeroDivisionError"):
            await s.step("boom")  # the env's counter is 2 now
        os.killpg(s.container.pid, signal.SIGKILL)  # the container is lost
        assert (await s.step("c")).obs.text == "c #3"  # as on the container that was lost
        assert s.status == "ok" and p.metrics["replays"] == 1


_HALFWAY = """
import os
import envpool


class HalfwayEnv(envpool.Env):
    \"\"\"A reset that fails half way (the episode goes on from where it left the state), and a
    step that raises only the first time it runs anywhere (a marker file): not the
    deterministic environment it claims to be.\"\"\"

    example_actions = ("a",)

    def __init__(self, marker=""):
        self.marker = marker

    def reset(self, *, seed=None, options=None):
        self.n = 100
        if (options or {}).get("fail"):
            raise RuntimeError("reset failed half way")
        self.n = 0
        return "ready", {}

    def step(self, action):
        self.n += 1
        if action == "once" and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise ValueError("raised the first time only")
        return envpool.StepResult(obs=envpool.Observation(text=f"{action} #{self.n}"))
"""


async def test_a_replay_repeats_a_reset_that_raised_mid_episode(tmp_path):
    images = write_env_bundle(tmp_path / "b", "halfway_env", _HALFWAY, {"halfway-v0": "HalfwayEnv"})
    async with pool(images, min_warm=0) as p, p.session("halfway-v0", image=IMAGE) as s:
        await s.reset(seed=1)
        assert (await s.step("a")).obs.text == "a #1"
        with pytest.raises(EnvLogicError, match="half way"):
            await s.reset(seed=2, options={"fail": True})
        assert (await s.step("b")).obs.text == "b #101"  # the episode goes on from there
        os.killpg(s.container.pid, signal.SIGKILL)
        assert (await s.step("c")).obs.text == "c #102"
        assert s.status == "ok" and p.metrics["replays"] == 1


async def test_a_replayed_step_that_no_longer_raises_loses_the_session(tmp_path):
    images = write_env_bundle(tmp_path / "b", "halfway_env", _HALFWAY, {"halfway-v0": "HalfwayEnv"})
    kwargs = {"marker": str(tmp_path / "raised")}
    async with pool(images, min_warm=0) as p, p.session("halfway-v0", image=IMAGE, env_kwargs=kwargs) as s:
        await s.reset(seed=1)
        with pytest.raises(EnvLogicError, match="first time only"):
            await s.step("once")
        os.killpg(s.container.pid, signal.SIGKILL)
        with pytest.raises(SessionLost, match="differs from the original"):
            await s.step("c")  # the replayed "once" answered instead of raising
