"""A multi-turn episode whose conversation outgrew the model's context (the next turn's
prompt leaves no room for a single new token: the engines' ``PromptTooLongError``) ends
``truncated`` at that turn and is scored, as verl's multi-turn rollout ends one; before, it
was ``infra_failed``: masked, re-run (to overflow again), which trained only short episodes."""

from __future__ import annotations

from env_manager_fixtures import _every_session_ends, pool_fixture, tools_fixture  # noqa: F401 - by name=
from env_manager_helpers import LAKE, ScriptedProxy, assistant_turns, check_turn_info, env, job, module_loop

from core.rollout.engines.base import PromptTooLongError
from core.rollout.env_manager import EnvManager, Task
from core.sample import Sample
from core.tally import Tally
from fabric.protocol import Trajectory

FULL = PromptTooLongError("prompt is 66 tokens; the model's context is 64 (no room to generate)")


@module_loop
async def test_a_full_context_ends_the_episode_truncated_at_that_turn(pool):
    cfg = job(env(LAKE, max_turns=6))
    proxy = ScriptedProxy(lambda tid, turn: FULL if turn == 2 else "left")
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0, traj_id="t-full")
    assert traj.status == "truncated", traj.info.get("error")
    assert traj.info["finish_reason"] == "context_full"
    assert "error" not in traj.info and "error_type" not in traj.info  # no infra error to count
    assert len(proxy.calls) == 3 and assistant_turns(traj) == 2
    check_turn_info(traj)
    # the episode ends on the observation the policy was to answer, as one cut at max_turns
    assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant", "user"]
    assert traj.env_reward == 0.0  # the steps' rewards summed, as any finished episode's
    assert proxy.aborted == [] and proxy.released == ["t-full"]
    # a finished trajectory: its sample is scored by the reward stream, not masked
    assert not Sample.of(traj).masked


@module_loop
async def test_a_first_prompt_that_does_not_fit_is_still_infra_failed(pool):
    # no turn was played: nothing to score or train, and the job's give-up check names the
    # fault (the prompt does not fit engine.kwargs.max_len) instead of training empty episodes
    cfg = job(LAKE)
    proxy = ScriptedProxy([FULL])
    traj = await EnvManager(cfg, pool, proxy).run(Task(cfg.envs[0], 1, "g"), version=0)
    assert traj.status == "infra_failed" and traj.info["error_type"] == "PromptTooLongError"
    assert "finish_reason" not in traj.info


def test_the_tally_counts_full_contexts_under_their_own_name():
    tally = Tally()
    base = {"task": {"tag": "lake", "group_id": "g"}, "info": {"start_version": 0}}
    tally.finished(Trajectory(id="a", status="truncated", **base))
    full = Trajectory(id="b", status="truncated", **base)
    full.info["finish_reason"] = "context_full"
    tally.finished(full)
    # a part of ``truncated`` (the finished counts stay disjoint), counted apart too
    assert tally.counts["truncated"] == 2 and tally.counts["context_full"] == 1
    assert tally.counts["infra_failed"] == 0
