"""build_batch: per-turn samples with GRPO episode advantages (centred per group) plus
GiGPO step advantages, checked against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from core.buffer import Group
from core.config import TrainerConfig
from core.rollout.engines.base import Completion
from core.sample import Sample
from core.trainer.base import TrainerError, assistant_message
from core.trainer.batch import build_batch
from fabric.protocol import Message, RewardResult, Trajectory


def turn(tokens: list[int], version: int = 0) -> Message:
    return assistant_message(
        Completion(
            request_id="r",
            text="move",
            prompt_ids=[1, 2],
            token_ids=tokens,
            logprobs=[-0.5] * len(tokens),
            policy_version=version,
            finish_reason="stop",
        )
    )


def traj(
    tid: str,
    rewards: list[float],
    states: list[str] | None,
    *,
    tokens: list[list[int]] | None = None,
) -> Trajectory:
    tokens = tokens if tokens is not None else [[5 + i] for i in range(len(rewards))]
    messages = [Message(role="user", content="start")]
    for t in tokens:
        messages += [turn(t), Message(role="user", content="obs")]
    info: dict = {"turn_rewards": rewards}
    if states is not None:
        info["turn_states"] = states
    return Trajectory(id=tid, messages=messages, info=info)


def sample(t: Trajectory, gid: str, score: float) -> Sample:
    return Sample(traj=t, tag="lake", group_id=gid, version=0, reward=RewardResult(score=score))


def advantages(out) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {}
    for s in out:
        got.setdefault(s.trajectory_id, []).append(s.advantage)
    return got


def close(got: dict[str, list[float]], want: dict[str, list[float]]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-5), k


def two_groups(states: bool = True) -> list[Group]:
    """Group g: A (score 1) and B (score 0), two turns each, both starting in s0.
    Group h: C (score 1) and D (score 0), one turn each, also in a state named s0."""
    st = (lambda x: x) if states else (lambda x: None)
    return [
        Group(
            "g",
            0,
            [
                sample(traj("A", [0.0, 1.0], st(["s0", "s1"])), "g", 1.0),
                sample(traj("B", [0.0, 0.0], st(["s0", "s2"])), "g", 0.0),
            ],
        ),
        Group(
            "h",
            0,
            [
                sample(traj("C", [1.0], st(["s0"])), "h", 1.0),
                sample(traj("D", [0.0], st(["s0"])), "h", 0.0),
            ],
        ),
    ]


def test_episode_advantages_are_centred_per_group_without_scaling():
    groups = [
        Group(
            "g", 0, [sample(traj(t, [0.0], None), "g", s) for t, s in (("a", 2.0), ("b", 2.0), ("c", 5.0))]
        ),
        Group("h", 0, [sample(traj(t, [0.0], None), "h", s) for t, s in (("d", 10.0), ("e", 0.0))]),
    ]
    out = build_batch(groups, TrainerConfig(scale_advantages=False))
    close(advantages(out), {"a": [-1.0], "b": [-1.0], "c": [2.0], "d": [5.0], "e": [-5.0]})
    assert [s.group_id for s in out] == ["g", "g", "g", "h", "h"]


def test_episode_advantages_scaled_by_the_group_std():
    out = build_batch(two_groups(), TrainerConfig(scale_advantages=True))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # scores (1, 0): centred +-0.5, sample std sqrt(0.5)
    close(advantages(out), {"A": [a, a], "B": [-a, -a], "C": [a], "D": [-a]})


def test_every_turn_is_a_sample_carrying_its_trajectory_advantage():
    out = build_batch(two_groups(), TrainerConfig(scale_advantages=False))
    assert [s.trajectory_id for s in out] == ["A", "A", "B", "B", "C", "D"]
    assert [s.completion_ids for s in out] == [[5], [6], [5], [6], [5], [5]]
    assert all(s.prompt_ids == [1, 2] and s.old_logprobs == [-0.5] for s in out)
    close(advantages(out), {"A": [0.5, 0.5], "B": [-0.5, -0.5], "C": [0.5], "D": [-0.5]})


def test_step_advantages_compare_turns_taken_in_the_same_state_of_the_same_group():
    # gamma 0.5: returns A = (0 + 0.5 * 1, 1) = (0.5, 1), B = (0, 0), C = (1), D = (0)
    # (g, s0): A0 0.5 vs B0 0 -> +0.25 / -0.25; (g, s1), (g, s2): alone -> 0
    # (h, s0): C0 1 vs D0 0 -> +0.5 / -0.5 (not pooled with g's s0)
    # episode (unscaled): A, C +0.5; B, D -0.5; total = episode + 2 * step
    cfg = TrainerConfig(scale_advantages=False, step_adv=2.0, gamma=0.5)
    out = build_batch(two_groups(), cfg)
    close(advantages(out), {"A": [1.0, 0.5], "B": [-1.0, -0.5], "C": [1.5], "D": [-1.5]})


def test_step_advantages_scaled():
    # (g, s0): returns (0.5, 0) -> centred +-0.25, std 0.25 * sqrt(2); (h, s0): +-0.5 / (0.5 * sqrt(2))
    cfg = TrainerConfig(scale_advantages=True, step_adv=1.0, gamma=0.5)
    out = build_batch(two_groups(), cfg)
    ep = 0.5 / (math.sqrt(0.5) + 1e-6)
    sg = 0.25 / (0.25 * math.sqrt(2) + 1e-6)
    sh = 0.5 / (0.5 * math.sqrt(2) + 1e-6)
    close(advantages(out), {"A": [ep + sg, ep], "B": [-ep - sg, -ep], "C": [ep + sh], "D": [-ep - sh]})


def test_step_adv_zero_ignores_states():
    out = build_batch(two_groups(states=False), TrainerConfig(scale_advantages=False, step_adv=0.0))
    close(advantages(out), {"A": [0.5, 0.5], "B": [-0.5, -0.5], "C": [0.5], "D": [-0.5]})


def test_turns_without_states_are_an_error_when_step_adv_is_on():
    with pytest.raises(TrainerError, match="turn_states"):
        build_batch(two_groups(states=False), TrainerConfig(step_adv=0.5))
    groups = two_groups()
    groups[0].samples[1].traj.info["turn_states"] = ["s0"]  # one state short
    with pytest.raises(TrainerError, match="turn_states"):
        build_batch(groups, TrainerConfig(step_adv=0.5))


def test_an_empty_batch_is_an_error():
    with pytest.raises(TrainerError, match="at least one sample"):
        build_batch([], TrainerConfig())
    with pytest.raises(TrainerError, match="at least one sample"):
        build_batch([Group("g", 0, [])], TrainerConfig())


def test_a_turn_without_tokens_does_not_shift_the_step_advantages():
    # A's first turn has no tokens; its second turn (in s1) must get s1's step advantage
    a = traj("A", [0.0, 1.0], ["s0", "s1"], tokens=[[], [6]])
    b = traj("B", [1.0, 0.0], ["s0", "s1"])
    groups = [Group("g", 0, [sample(a, "g", 1.0), sample(b, "g", 0.0)])]
    # gamma 1: returns A (1, 1), B (1, 0); (g, s0): 0 / 0, (g, s1): +0.5 / -0.5; episode +-0.5
    cfg = TrainerConfig(scale_advantages=False, step_adv=1.0, gamma=1.0)
    out = build_batch(groups, cfg, env_scored={"lake"})  # the turn rewards are the signal
    got = advantages(out)
    assert got["B"] == pytest.approx([-0.5, -1.0])
    assert got["A"] == pytest.approx([1.0])  # its one sample is the s1 turn (0.5 + 0.5)


def test_step_returns_compare_the_score_the_episode_level_does():
    # a reward function other than env_return (a judge) scores A 0 and B 1, while the
    # environment's own turn rewards say the opposite: the step level compared the env's
    # signal and the episode level the judge's, pulling the same turns both ways. Without
    # env_return the score is the episode's return, credited at its last turn
    a = traj("A", [0.0, 1.0], ["s0", "s1"])
    b = traj("B", [0.0, 0.0], ["s0", "s1"])
    groups = [Group("g", 0, [sample(a, "g", 0.0), sample(b, "g", 1.0)])]
    cfg = TrainerConfig(scale_advantages=False, step_adv=1.0, gamma=0.5)
    # returns from the scores: A (0, 0), B (0.5, 1); (g, s0): -0.25 / +0.25, (g, s1): -0.5 / +0.5
    got = advantages(build_batch(groups, cfg))
    close(got, {"A": [-0.5 - 0.25, -0.5 - 0.5], "B": [0.5 + 0.25, 0.5 + 0.5]})
    # scored by env_return, a tag's score is the sum of its turn rewards: they are used
    # (A: returns (0.5, 1), B: (0, 0)), the same signal with its credit per turn
    groups = [Group("g", 0, [sample(a, "g", 1.0), sample(b, "g", 0.0)])]
    got = advantages(build_batch(groups, cfg, env_scored={"lake"}))
    close(got, {"A": [0.5 + 0.25, 0.5 + 0.5], "B": [-0.5 - 0.25, -0.5 - 0.5]})


def test_the_tags_scored_by_the_environments_return():
    from core.config import JobConfig

    cfg = JobConfig.from_dict(
        {
            "envs": [
                {"id": "frozenlake-v1", "tag": "lake"},
                {"id": "latency-v0", "tag": "judged"},
                {"id": "latency-v0", "tag": "mixed"},
            ],
            "rewards": {
                "lake": [{"function": "env_return", "weight": 2.0}],
                "judged": [{"function": "llm_judge"}],
                "mixed": [{"function": "env_return"}, {"function": "llm_judge"}],
            },
        },
        check_references=False,
    )
    assert cfg.env_scored_tags == frozenset({"lake"})


def test_a_tag_whose_other_components_weigh_nothing_is_scored_by_the_environments_return():
    # a component of weight 0 (a format check kept for its metric) or env_return twice under
    # two names leaves the score the environment's return all the same (the weighted mean of
    # the components that count); such a tag lost the per-turn credit of its turn rewards
    from core.config import JobConfig

    cfg = JobConfig.from_dict(
        {
            "envs": [
                {"id": "frozenlake-v1", "tag": "watched"},
                {"id": "latency-v0", "tag": "twice"},
                {"id": "latency-v0", "tag": "mixed"},
            ],
            "rewards": {
                "watched": [{"function": "env_return"}, {"function": "format_reward", "weight": 0.0}],
                "twice": [
                    {"function": "env_return", "name": "a", "weight": 1.0},
                    {"function": "env_return", "name": "b", "weight": 3.0},
                ],
                "mixed": [{"function": "env_return"}, {"function": "format_reward", "weight": 0.5}],
            },
        },
        check_references=False,
    )
    assert cfg.env_scored_tags == frozenset({"watched", "twice"})


def test_a_terminal_score_is_discounted_back_from_the_last_turn():
    # GiGPO (Feng et al., 2025): R_t = sum_k gamma^k r_{t+k}; with the whole score on the
    # last turn (a judged tag), R_t = gamma^(T-1-t) * score. A (3 turns, score 1) passes s0,
    # s1, s2; B (2 turns, score 0.5) passes s1, s2: it meets s1 one turn nearer its end.
    # gamma 0.9: A's returns (0.81, 0.9, 1), B's (0.45, 0.5)
    # (g, s0): A alone -> 0; (g, s1): 0.9 vs 0.45 -> +-0.225; (g, s2): 1 vs 0.5 -> +-0.25
    # episode (scores 1, 0.5): +-0.25
    a = traj("A", [0.0, 0.0, 0.0], ["s0", "s1", "s2"])
    b = traj("B", [0.0, 0.0], ["s1", "s2"])
    groups = [Group("g", 0, [sample(a, "g", 1.0), sample(b, "g", 0.5)])]
    cfg = TrainerConfig(scale_advantages=False, step_adv=1.0, gamma=0.9)
    close(
        advantages(build_batch(groups, cfg)),
        {"A": [0.25, 0.25 + 0.225, 0.25 + 0.25], "B": [-0.25 - 0.225, -0.25 - 0.25]},
    )


def test_a_batch_mixing_an_env_scored_tag_and_a_judged_one():
    # one batch, two tags: group g (tag lake, scored by env_return: its turn rewards) and
    # group h (tag judged: the judge's score on the last turn, the env's turn rewards unused)
    def tagged(t: Trajectory, gid: str, score: float, tag: str) -> Sample:
        return Sample(traj=t, tag=tag, group_id=gid, version=0, reward=RewardResult(score=score))

    groups = [
        Group(
            "g",
            0,
            [
                tagged(traj("A", [0.5, 0.5], ["s0", "s1"]), "g", 1.0, "lake"),
                tagged(traj("B", [0.0, 0.0], ["s0", "s1"]), "g", 0.0, "lake"),
            ],
        ),
        Group(
            "h",
            0,
            [
                tagged(traj("C", [1.0, 0.0], ["s0", "s1"]), "h", 0.0, "judged"),
                tagged(traj("D", [0.0, 0.0], ["s0", "s1"]), "h", 1.0, "judged"),
            ],
        ),
    ]
    cfg = TrainerConfig(scale_advantages=False, step_adv=1.0, gamma=0.5)
    # g: returns A (0.75, 0.5), B (0, 0): (g, s0) +-0.375, (g, s1) +-0.25; episode +-0.5
    # h: returns C (0, 0), D (0.5, 1): (h, s0) -+0.25, (h, s1) -+0.5; episode -+0.5
    close(
        advantages(build_batch(groups, cfg, env_scored={"lake"})),
        {
            "A": [0.5 + 0.375, 0.5 + 0.25],
            "B": [-0.5 - 0.375, -0.5 - 0.25],
            "C": [-0.5 - 0.25, -0.5 - 0.5],
            "D": [0.5 + 0.25, 0.5 + 0.5],
        },
    )
