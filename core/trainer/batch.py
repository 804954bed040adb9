"""From the buffer's complete groups to ``TrainSample``s with their advantages.

Each generated turn of a trajectory is one sample. Its advantage is the trajectory's
episode-level group advantage (GRPO: its reward against the group's) plus, with
``trainer.step_adv > 0``, GiGPO's step-level advantage: the turns of the group taken in the
same state (``traj.info["turn_states"]``, recorded by the env manager) compared by their
discounted return (``traj.info["turn_rewards"]``, ``trainer.gamma``). The advantages are
computed here, on the whole batch, so the trainer (a Ray actor) receives finished samples.

Both levels compare the same signal: the score the reward functions gave. For a tag scored
by ``env_return`` alone (``env_scored``) that score is the sum of the environment's turn
rewards, so the step returns use them (the credit of each turn); for any other tag (a judge,
a verifier, a mix) the environment's turn rewards are not what the episode level compares,
and the step returns credit the score at the trajectory's last turn (zero before it), the
reward of an episode scored as a whole. Comparing the environment's signal turn by turn and
the judge's per episode pulled the same turns in opposite directions when the two disagreed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from core.buffer import Group
from core.config import TrainerConfig
from core.trainer.base import TrainerError, TrainSample, turn_samples
from core.trainer.grpo import discounted_returns, group_advantages, step_advantages
from fabric.protocol import Trajectory


def build_batch(
    groups: Sequence[Group], cfg: TrainerConfig, *, env_scored: Collection[str] = ()
) -> list[TrainSample]:
    """``env_scored``: the tags whose score is the environment's return
    (``JobConfig.env_scored_tags``): their step returns use the turn rewards."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        raise TrainerError("build_batch needs at least one sample")
    episode = group_advantages(
        [s.score for s in samples], [s.group_id for s in samples], scale=cfg.scale_advantages
    ).tolist()
    per_turn: list[list[float]] = [[0.0] * _turns(s.traj.info) for s in samples]
    if cfg.step_adv > 0:
        returns: list[float] = []
        keys: list[str] = []
        states: list[str] = []
        for s in samples:
            rewards = _step_rewards(s.traj.info, s.score, env=s.tag in env_scored)
            returns += discounted_returns(rewards, cfg.gamma)
            keys += [s.group_id] * len(rewards)
            states += [str(x) for x in s.traj.info.get("turn_states", [])][: len(rewards)]
        if len(states) != len(returns):
            raise TrainerError("trajectories lack turn_states for step-level advantages (step_adv > 0)")
        flat = iter(step_advantages(returns, keys, states, scale=cfg.scale_advantages).tolist())
        per_turn = [[next(flat) for _ in turns] for turns in per_turn]
    out: list[TrainSample] = []
    for s, ep, steps in zip(samples, episode, per_turn, strict=True):
        turns = turn_samples(s.traj, reward=s.score, group_id=s.group_id)
        # step advantages are per env turn (the n-th assistant message), but a turn without
        # tokens has no sample: pair each sample with its own turn's advantage
        kept = _turns_with_tokens(s.traj)
        for t, turn in zip(turns, kept, strict=True):
            extra = cfg.step_adv * steps[turn] if turn < len(steps) else 0.0
            out.append(t.model_copy(update={"advantage": ep + extra}))
    return out


def _step_rewards(info: dict[str, Any], score: float, *, env: bool) -> list[float]:
    """The per-turn rewards the step returns are computed from: the environment's when the
    score is their sum (``env``), else the score at the last turn."""
    rewards = [float(r) for r in info.get("turn_rewards", [])]
    if env or not rewards:
        return rewards
    return [0.0] * (len(rewards) - 1) + [score]


def _turns_with_tokens(traj: Trajectory) -> list[int]:
    """Turn numbers (0-based, over assistant messages) of the turns ``turn_samples`` keeps."""
    assistant = [m for m in traj.messages if m.role == "assistant"]
    return [n for n, m in enumerate(assistant) if (m.model_extra or {}).get("token_ids")]


def _turns(info: dict[str, object]) -> int:
    rewards = info.get("turn_rewards")
    return len(rewards) if isinstance(rewards, list) else 0
