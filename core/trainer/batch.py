"""From the buffer's complete groups to ``TrainSample``s with their advantages.

Each generated turn of a trajectory is one sample. Its advantage is the trajectory's
episode-level group advantage (GRPO: its reward against the group's) plus, with
``trainer.step_adv > 0``, GiGPO's step-level advantage: the turns of the group taken in the
same state (``traj.info["turn_states"]``, recorded by the env manager) compared by their
discounted return (``traj.info["turn_rewards"]``, ``trainer.gamma``). The advantages are
computed here, on the whole batch, so the trainer (a Ray actor) receives finished samples.

Both levels compare the same signal: the score the reward functions gave. The step returns
are computed from per-turn rewards that sum to that score (``step_rewards``): a tag's score
is ``f * env_return + the rest``, ``f`` being ``env_return``'s share of the weights
(``JobConfig.env_return_shares``), and ``env_return`` is the sum of the environment's turn
rewards, so each turn gets ``f`` times its turn reward (the credit of each turn, where the
score has it) and the last turn also the rest of the score. Scored by ``env_return`` alone
(``f = 1``) the turn rewards are used as they are; under a judge or a verifier alone
(``f = 0``) the score is credited at the last turn, the reward of an episode scored as a
whole. Comparing the environment's signal turn by turn and the judge's per episode pulled
the same turns in opposite directions when the two disagreed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from core.buffer import Group
from core.config import TrainerConfig
from core.trainer.base import TrainerError, TrainSample, turn_samples
from core.trainer.grpo import discounted_returns, group_advantages, step_advantages
from fabric.protocol import Trajectory


def build_batch(
    groups: Sequence[Group], cfg: TrainerConfig, *, env_shares: Mapping[str, float] | None = None
) -> list[TrainSample]:
    """``env_shares``: tag -> ``env_return``'s share of its score
    (``JobConfig.env_return_shares``; a tag left out has none): the part of its step
    rewards given turn by turn (``step_rewards``)."""
    shares = env_shares or {}
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
            turn_rewards = [float(r) for r in s.traj.info.get("turn_rewards", [])]
            rewards = step_rewards(turn_rewards, s.score, shares.get(s.tag, 0.0))
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


def step_rewards(turn_rewards: Sequence[float], score: float, share: float) -> list[float]:
    """The per-turn rewards the step returns are computed from: ``share`` times the
    environment's turn rewards, and at the last turn also the rest of the score, ``score -
    share * sum(turn_rewards)`` (the other components' part, or what a ``failure_score`` put
    in place of ``env_return``); they sum to the score. ``share`` 1: the turn rewards; 0: the
    score at the last turn."""
    n = len(turn_rewards)
    if not n:
        return []
    if share <= 0:  # exactly the last-turn credit (0 * a negative reward is -0.0)
        return [0.0] * (n - 1) + [score]
    out = [share * r for r in turn_rewards]
    env = share * float(sum(turn_rewards))
    # a rest within rounding of nothing is not credited: the stream's weighted mean rounds
    # (w * x / w is x only to an ulp), and an ulp put on the last turn would move a tag
    # scored by env_return alone off its turn rewards, which its step returns were before
    if not math.isclose(score, env, rel_tol=1e-9, abs_tol=1e-12):
        out[-1] += score - env
    return out


def _turns_with_tokens(traj: Trajectory) -> list[int]:
    """Turn numbers (0-based, over assistant messages) of the turns ``turn_samples`` keeps."""
    assistant = [m for m in traj.messages if m.role == "assistant"]
    return [n for n, m in enumerate(assistant) if (m.model_extra or {}).get("token_ids")]


def _turns(info: dict[str, object]) -> int:
    rewards = info.get("turn_rewards")
    return len(rewards) if isinstance(rewards, list) else 0
