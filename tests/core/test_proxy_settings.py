"""LLMProxy settings (the rejoin timings, taken from the engine config) and ``Wakes``, which
ends the waits of turns filed under a key.

No Ray: the proxy is a plain object here; fakes are in ``proxy_fakes``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from proxy_fakes import Fake, until

from core.config import JobConfig
from core.config_sections import EngineConfig
from core.errors import ConfigError
from core.rollout.llm_proxy import (
    LLMProxy,
    proxy_options,
)
from fabric.protocol import Trajectory
from fabric.registry import Registry


def test_the_rejoin_timings_are_engine_settings_the_proxy_takes():
    # they were module constants: a job could not wait less (a node back in seconds) or more
    cfg = EngineConfig(rejoin_first_s=5, rejoin_max_s=40, recover_timeout_s=9, swap_timeout_s=7)
    proxy = LLMProxy({"default": [Fake("r")]}, **proxy_options(cfg))
    assert (proxy.rejoin_first_s, proxy.rejoin_max_s) == (5, 40)
    assert (proxy.recover_timeout_s, proxy.swap_timeout_s) == (9, 7)
    off = LLMProxy({"default": [Fake("r")]}, **proxy_options(EngineConfig(rejoin_first_s=None)))
    assert off.rejoin_first_s is None  # never tried again
    plain = LLMProxy({"default": [Fake("r")]})  # the proxy's defaults are the config's
    defaults = EngineConfig()
    assert (plain.rejoin_first_s, plain.rejoin_max_s) == (defaults.rejoin_first_s, defaults.rejoin_max_s)
    assert (plain.rejoin_first_s, plain.rejoin_max_s) == (30.0, 600.0)
    assert (plain.recover_timeout_s, plain.swap_timeout_s) == (
        defaults.recover_timeout_s,
        defaults.swap_timeout_s,
    )
    assert plain.max_engine_restarts == defaults.max_restarts


@pytest.mark.parametrize("module", ["core.rollout.llm_proxy", "core.rollout.replicas"])
def test_the_proxy_and_replica_actors_load_no_job_config(module):
    # every job start imports these in the proxy's actor and in each engine replica's:
    # core.config, imported only for the engine section's defaults, was ~0.35 s of CPU there
    # (its pydantic models, envpool's image tiers)
    code = f"import sys, {module}; sys.exit(1 if 'core.config' in sys.modules else 0)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0


def _problems(engine: dict[str, Any]) -> list[tuple[str, str]]:
    reg = Registry()

    @reg.reward
    def env_return(traj: Trajectory) -> float:
        return traj.env_reward or 0.0

    data = {
        "envs": [{"id": "frozenlake-v1", "tag": "frozenlake"}],
        "rewards": {"frozenlake": [{"function": "env_return"}]},
        "engine": engine,
    }
    with pytest.raises(ConfigError) as e:
        JobConfig.from_dict(data, registry=reg, env_ids=["frozenlake-v1"])
    return e.value.problems


@pytest.mark.parametrize(
    ("engine", "key", "text"),
    [
        ({"rejoin_first_s": 0}, "engine.rejoin_first_s", "must be > 0"),
        ({"rejoin_first_s": "soon"}, "engine.rejoin_first_s", "valid number"),
        ({"rejoin_max_s": -1}, "engine.rejoin_max_s", "must be > 0"),
        ({"rejoin_max_s": float("inf")}, "engine.rejoin_max_s", "finite"),
        ({"rejoin_max_s": None}, "engine.rejoin_max_s", "valid number"),
        (
            {"rejoin_first_s": 60, "rejoin_max_s": 30},
            "engine",
            "rejoin_max_s 30 is below rejoin_first_s 60: a dropped replica's tries start "
            "rejoin_first_s apart and back off up to rejoin_max_s; raise rejoin_max_s or lower "
            "rejoin_first_s",
        ),
    ],
)
def test_bad_rejoin_timings_are_refused_with_what_to_do(engine, key, text):
    [(k, msg)] = _problems(engine)
    assert k == key and text in msg


async def test_wakes_end_the_waits_filed_under_a_key_and_only_those():
    from core.rollout.wakes import Wakes, Woken

    wakes = Wakes()
    never = asyncio.Event()
    a = asyncio.create_task(wakes.wait(["a", "both"], never.wait()))
    b = asyncio.create_task(wakes.wait(["b", "both"], never.wait()))
    await until(lambda: wakes.waiting("a") and wakes.waiting("b"))
    assert wakes.wake("a") == 1
    await asyncio.sleep(0)  # a's expiry runs, its task not yet: a wake of "both" finds it expiring
    assert wakes.wake("both") == 2  # (rescheduling an expiring scope raised RuntimeError)
    with pytest.raises(Woken):
        await a
    with pytest.raises(Woken):
        await b
    assert not any(wakes.waiting(k) for k in ("a", "b", "both"))  # nothing left filed
    assert await wakes.wait(["c"], asyncio.sleep(0, "done")) == "done" and not wakes.waiting("c")
    assert wakes.wake("nobody") == 0

    async def times_out() -> None:
        async with asyncio.timeout(0):
            await never.wait()

    with pytest.raises(TimeoutError):  # the awaited call's own timeout is not a wake
        await wakes.wait(["d"], times_out())
    c = asyncio.create_task(wakes.wait(["e"], never.wait()))
    await until(lambda: wakes.waiting("e"))
    c.cancel()  # the waiter's own cancellation stays a cancellation
    with pytest.raises(asyncio.CancelledError):
        await c
    assert not wakes.waiting("e")
