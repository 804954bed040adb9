"""``info["finish_reason"]``: how a finished trajectory ended, for every ending the env manager
knows. Only a full context said so; one cut at ``max_turns`` and one the environment ended
truncated (its own step limit) were both plain ``truncated``, not told apart."""

from __future__ import annotations

from env_manager_fixtures import _every_session_ends, pool_fixture, tools_fixture  # noqa: F401 - by name=
from env_manager_helpers import ABORT, LAKE, MATH, ScriptedProxy, assistant_turns, env, job, module_loop

from core.rollout.env_manager import EnvManager, Task


async def _run(pool, cfg, proxy):
    return await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)


@module_loop
async def test_an_episode_the_environment_terminated(pool):
    cfg = job(LAKE)
    traj = await _run(pool, cfg, ScriptedProxy(["right", "down"]))  # S F / F G: the goal
    assert traj.status == "ok" and traj.info["finish_reason"] == "terminated"


@module_loop
async def test_an_episode_cut_at_max_turns(pool):
    cfg = job(LAKE)  # max_turns 4; "left" bumps into the edge and the episode goes on
    traj = await _run(pool, cfg, ScriptedProxy(lambda tid, turn: "left"))
    assert traj.status == "truncated" and traj.info["finish_reason"] == "max_turns"
    assert assistant_turns(traj) == 4


@module_loop
async def test_an_episode_the_environment_truncated(pool):
    # math-tools-v1 is registered with max_episode_steps=10: its own limit comes first
    cfg = job(env(MATH, max_turns=12))
    traj = await _run(pool, cfg, ScriptedProxy(lambda tid, turn: "I am thinking."))
    assert traj.status == "truncated" and traj.info["finish_reason"] == "env_truncated"
    assert assistant_turns(traj) == 10


@module_loop
async def test_an_aborted_episode_has_no_finish_reason(pool):
    # not finished: it never reaches the trainer, its status says it all
    cfg = job(LAKE)
    traj = await _run(pool, cfg, ScriptedProxy(["right", ABORT]))
    assert traj.status == "aborted" and "finish_reason" not in traj.info
