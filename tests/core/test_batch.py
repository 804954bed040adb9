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
from core.trainer.batch import build_batch, step_rewards
from core.trainer.grpo import discounted_returns, group_advantages, step_advantages
from fabric.protocol import Message, RewardResult, Trajectory
from functions.rewards.compose import combine


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
    # scored by env_return: each score is the sum of its turn rewards (1 and 1)
    groups = [Group("g", 0, [sample(a, "g", 1.0), sample(b, "g", 1.0)])]
    # gamma 1: returns A (1, 1), B (1, 0); (g, s0): 0 / 0, (g, s1): +0.5 / -0.5; episode 0
    cfg = TrainerConfig(scale_advantages=False, step_adv=1.0, gamma=1.0)
    out = build_batch(groups, cfg, env_shares={"lake": 1.0})  # the turn rewards are the signal
    got = advantages(out)
    assert got["B"] == pytest.approx([0.0, -0.5])
    assert got["A"] == pytest.approx([0.5])  # its one sample is the s1 turn


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
    got = advantages(build_batch(groups, cfg, env_shares={"lake": 1.0}))
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
    assert cfg.env_return_shares == {"lake": 1.0, "judged": 0.0, "mixed": 0.5}


def test_env_returns_share_of_a_tags_score():
    # the stream's score is the weighted mean of a tag's components: env_return's share is
    # its weight over all of them. A component of weight 0 (a format check kept for its
    # metric) or env_return twice under two names leaves the score the environment's return
    # all the same: share 1
    from core.config import JobConfig

    cfg = JobConfig.from_dict(
        {
            "envs": [
                {"id": "frozenlake-v1", "tag": "watched"},
                {"id": "latency-v0", "tag": "twice"},
                {"id": "latency-v0", "tag": "mixed"},
                {"id": "latency-v0", "tag": "three"},
            ],
            "rewards": {
                "watched": [{"function": "env_return"}, {"function": "format_reward", "weight": 0.0}],
                "twice": [
                    {"function": "env_return", "name": "a", "weight": 1.0},
                    {"function": "env_return", "name": "b", "weight": 3.0},
                ],
                "mixed": [{"function": "env_return"}, {"function": "format_reward", "weight": 0.5}],
                "three": [
                    {"function": "env_return", "weight": 0.3},
                    {"function": "format_reward", "weight": 0.5},
                    {"function": "llm_judge", "weight": 0.2},
                ],
            },
        },
        check_references=False,
    )
    shares = cfg.env_return_shares
    assert shares == pytest.approx({"watched": 1.0, "twice": 1.0, "mixed": 2 / 3, "three": 0.3})
    assert shares["watched"] == shares["twice"] == 1.0  # exactly: the env-scored rule applies


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
        advantages(build_batch(groups, cfg, env_shares={"lake": 1.0})),
        {
            "A": [0.5 + 0.375, 0.5 + 0.25],
            "B": [-0.5 - 0.375, -0.5 - 0.25],
            "C": [-0.5 - 0.25, -0.5 - 0.5],
            "D": [0.5 + 0.25, 0.5 + 0.5],
        },
    )


# ----------------------------------------------------------------------------- env_return's share
# A tag whose score mixes env_return (share f of the weights) with other components: each turn
# gets f * its turn reward, and the last turn also the rest of the score, score - f * sum; the
# step rewards sum to the score. f = 1 is the env-scored rule, f = 0 the last-turn credit.


def test_a_mix_with_env_return_keeps_its_share_of_the_turn_credit():
    # env_return 0.5 + judge 0.5 (f = 0.5), gamma 0.9, three turns in s0, s1, s2.
    # A: turn rewards (0, 0.2, 1.0), judge 0 -> score 0.6; step rewards (0, 0.1, 0.5 + 0)
    #    returns (0.9 * 0.55, 0.1 + 0.9 * 0.5, 0.5) = (0.495, 0.55, 0.5)
    # B: turn rewards (0, 0, 0), judge 1 -> score 0.5; step rewards (0, 0, 0.5)
    #    returns (0.405, 0.45, 0.5)
    # (g, s0): +-0.045, (g, s1): +-0.05, (g, s2): 0; episode (0.6, 0.5): +-0.05
    # (the last-turn credit gave A returns (0.486, 0.54, 0.6): s2 +-0.05, blaming B's last turn
    # for the env reward A's middle turn earned)
    assert step_rewards([0.0, 0.2, 1.0], 0.6, 0.5) == pytest.approx([0.0, 0.1, 0.5])
    a = traj("A", [0.0, 0.2, 1.0], ["s0", "s1", "s2"])
    b = traj("B", [0.0, 0.0, 0.0], ["s0", "s1", "s2"])
    groups = [Group("g", 0, [sample(a, "g", 0.6), sample(b, "g", 0.5)])]
    cfg = TrainerConfig(scale_advantages=False, step_adv=1.0, gamma=0.9)
    close(
        advantages(build_batch(groups, cfg, env_shares={"lake": 0.5})),
        {"A": [0.05 + 0.045, 0.05 + 0.05, 0.05], "B": [-0.05 - 0.045, -0.05 - 0.05, -0.05]},
    )
    # judge 1 for A too (score 1.1): the judge's half lands on the last turn
    assert step_rewards([0.0, 0.2, 1.0], 1.1, 0.5) == pytest.approx([0.0, 0.1, 1.0])


def test_a_score_that_is_not_the_sum_of_the_turn_rewards_puts_the_rest_on_the_last_turn():
    # env_return failed on the trajectory and was given its failure_score: the score and the
    # turn rewards disagree, and the difference is the last turn's. Alone (f = 1) with
    # failure_score -1: (0, 0.2, 1.0 + (-1 - 1.2)) = (0, 0.2, -1.2)
    assert step_rewards([0.0, 0.2, 1.0], -1.0, 1.0) == pytest.approx([0.0, 0.2, -1.2])
    # beside a judge (f = 0.5), failure_score 0 and judge 1: score 0.5;
    # (0, 0.1, 0.5 + (0.5 - 0.6)) = (0, 0.1, 0.4)
    assert step_rewards([0.0, 0.2, 1.0], 0.5, 0.5) == pytest.approx([0.0, 0.1, 0.4])
    # through the batch, gamma 0.9: A's returns (0.9 * -0.88, 0.2 - 1.08, -1.2) =
    # (-0.792, -0.88, -1.2) against B's (0, 0, 0): (g, s_k): -+half of each; episode (-1, 0)
    a = traj("A", [0.0, 0.2, 1.0], ["s0", "s1", "s2"])
    b = traj("B", [0.0, 0.0, 0.0], ["s0", "s1", "s2"])
    groups = [Group("g", 0, [sample(a, "g", -1.0), sample(b, "g", 0.0)])]
    cfg = TrainerConfig(scale_advantages=False, step_adv=1.0, gamma=0.9)
    close(
        advantages(build_batch(groups, cfg, env_shares={"lake": 1.0})),
        {"A": [-0.5 - 0.396, -0.5 - 0.44, -0.5 - 0.6], "B": [0.5 + 0.396, 0.5 + 0.44, 0.5 + 0.6]},
    )


@pytest.mark.parametrize("weight", [1.0, 0.3, 2.5, 0.7])
def test_the_limits_are_the_two_rules_exactly(weight):
    # f = 1: the turn rewards as they are, bit for bit, though the stream's score is the
    # weighted mean (weight * x / weight rounds off x for most weights); f = 0: the score at
    # the last turn, zero before it
    turns_list = [[0.0, 0.0, 1.0], [0.1, -0.05, 0.7], [0.3, 0.3, 0.3, 0.1], [1e-3, 2.0 / 3.0], [0.0]]
    for turns in turns_list:
        x = float(sum(turns))  # the env manager's env_reward
        score = combine({"env_return": x}, {"env_return": weight}).score
        got = step_rewards(turns, score, 1.0)
        assert got == turns and [math.copysign(1, g) for g in got] == [math.copysign(1, t) for t in turns]
        last = step_rewards(turns, 0.37, 0.0)
        assert last == [0.0] * (len(turns) - 1) + [0.37]
        assert all(math.copysign(1, v) == 1 for v in last)  # no -0.0 from 0 * a negative reward
    assert step_rewards([], 1.0, 0.5) == []


def test_the_frozenlake_demos_batches_do_not_change():
    # the demo scores its tag by a lone env_return (share 1): its batches are what the
    # env-scored rule made, computed here the way build_batch did before the shares. The
    # lake rewards only the step onto the goal, so the last-turn credit would agree too; the
    # turn rewards of share 1 in general are pinned bit for bit above
    import pathlib

    import yaml

    from core.config import JobConfig

    raw = yaml.safe_load(pathlib.Path("examples/frozenlake/config.yaml").read_text())
    cfg = JobConfig.from_dict(raw, check_references=False)
    assert cfg.env_return_shares == {"frozenlake": 1.0}
    weights = {s.component: s.weight for s in cfg.rewards["frozenlake"]}
    episodes = {  # turn rewards and states (position on the lake) of two groups' rollouts
        "A": ([0.0, 0.0, 1.0], ["p0", "p1", "p5"]),
        "B": ([0.0, 0.0], ["p0", "p4"]),
        "C": ([0.0, 0.0, 0.0, 1.0], ["p0", "p1", "p2", "p6"]),
        "D": ([0.0, 1.0], ["p3", "p7"]),
        "E": ([0.0, 0.0, 0.0], ["p3", "p2", "p6"]),
    }
    members = {"g": ["A", "B", "C"], "h": ["D", "E"]}
    groups = [
        Group(
            gid,
            0,
            [
                Sample(
                    traj=traj(t, *episodes[t]),
                    tag="frozenlake",
                    group_id=gid,
                    version=0,
                    reward=combine({"env_return": float(sum(episodes[t][0]))}, weights),
                )
                for t in ts
            ],
        )
        for gid, ts in members.items()
    ]
    order = [t for ts in members.values() for t in ts]
    gids = [g for g, ts in members.items() for _ in ts]
    for scale in (False, True):
        tc = cfg.trainer.model_copy(update={"scale_advantages": scale})
        assert tc.step_adv > 0 and tc.gamma < 1  # the demo's GiGPO
        # before: the step returns from the turn rewards themselves
        ep = group_advantages([float(sum(episodes[t][0])) for t in order], gids, scale=scale).tolist()
        returns = [r for t in order for r in discounted_returns(episodes[t][0], tc.gamma)]
        keys = [g for t, g in zip(order, gids, strict=True) for _ in episodes[t][0]]
        states = [s for t in order for s in episodes[t][1]]
        flat = iter(step_advantages(returns, keys, states, scale=scale).tolist())
        want = {
            t: [e + tc.step_adv * next(flat) for _ in episodes[t][0]] for t, e in zip(order, ep, strict=True)
        }
        assert advantages(build_batch(groups, tc, env_shares=cfg.env_return_shares)) == want
