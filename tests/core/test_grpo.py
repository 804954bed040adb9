import math

import pytest
import torch

from core.rollout.engines.base import Completion
from core.trainer.base import TrainerError, TrainSample, assistant_message, batch_advantages, turn_samples
from core.trainer.grpo import (
    aggregate,
    discounted_returns,
    entropy,
    group_advantages,
    kl_k3,
    masked_mean,
    policy_loss,
    step_advantages,
    token_logprobs,
)
from fabric.protocol import Message, Trajectory

SQRT_HALF = math.sqrt(0.5)


def test_group_advantages_by_hand():
    adv = group_advantages(
        [1.0, 0.0, 1.0, 2.0, 3.0, 5.0, 0.5, 0.5], ["a", "a", "b", "b", "b", "c", "d", "d"], eps=0.0
    )
    # a: mean .5, sample std sqrt(.5) -> +-.5/sqrt(.5); b: mean 2, std 1; c: alone; d: no spread
    expected = [SQRT_HALF, -SQRT_HALF, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)


def test_group_advantages_eps_and_unscaled():
    adv = group_advantages([1.0, 0.0], [0, 0], eps=0.1)
    assert adv.tolist() == pytest.approx([0.5 / (SQRT_HALF + 0.1), -0.5 / (SQRT_HALF + 0.1)])
    assert group_advantages([1.0, 0.0, 0.0, 0.0], [0] * 4, scale=False).tolist() == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )
    with pytest.raises(ValueError, match="one group id per reward"):
        group_advantages([1.0, 2.0], ["a"])


@pytest.mark.parametrize("reward", [0.3, 0.7, 0.95, 1 / 3])
def test_a_group_whose_rewards_are_all_equal_has_exactly_zero_advantage(reward):
    # in float32 the mean of eight 0.3s is not 0.3: the centred rewards were ~3e-8 while the
    # std was exactly 0, and (r - mean) / (0 + eps) gave every member an advantage of ~0.03
    for scale in (True, False):
        adv = group_advantages([reward] * 8 + [0.0, 1.0], ["g"] * 8 + ["h", "h"], scale=scale)
        assert adv[:8].abs().max().item() == 0.0, adv.tolist()
        assert adv[8].item() < 0 < adv[9].item()  # a group with spread still has its advantages
    # GiGPO: two turns taken in the same state with the same discounted return
    step = step_advantages([reward, reward], ["g", "g"], ["s", "s"])
    assert step.abs().max().item() == 0.0, step.tolist()
    assert adv.dtype == step.dtype == torch.float32


def test_discounted_returns_by_hand():
    assert discounted_returns([0.0, -0.5, 1.0], 0.5) == pytest.approx([0.0 - 0.25 + 0.25, -0.5 + 0.5, 1.0])
    assert discounted_returns([], 0.9) == []


def test_step_advantages_compare_turns_taken_in_the_same_state():
    # group g: two trajectories both start in state s0; one of them visits s1 twice
    returns = [0.9, 0.5, 1.0, 0.0, 0.7]
    groups = ["g", "g", "g", "g", "h"]
    states = ["s0", "s0", "s1", "s1", "s0"]  # h's s0 is another map: not comparable
    adv = step_advantages(returns, groups, states, eps=0.0)
    assert adv.tolist() == pytest.approx([SQRT_HALF, -SQRT_HALF, SQRT_HALF, -SQRT_HALF, 0.0])
    with pytest.raises(ValueError, match="2 returns, 1 group ids, 2 states"):
        step_advantages([1.0, 0.0], ["g"], ["a", "b"])


def ratios_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.5, 0.75, 0.25]])).requires_grad_(True)  # ratios 1, 1.5, 0.5
    return old, new, torch.ones(1, 3)


def test_approx_kl_is_kl_of_the_behaviour_policy_to_the_current_one():
    # tokens sampled by the behaviour policy [0.5, 0.5] (one of each: its exact expectation),
    # scored by a current policy [0.9, 0.1]: KL(old || new) = 0.5108. The k3 form for samples
    # of the current policy read 1.267 (chi-squared minus KL)
    old = torch.log(torch.tensor([[0.5, 0.5]]))
    new = torch.log(torch.tensor([[0.9, 0.1]]))
    _, stats = policy_loss(new, old, torch.tensor([0.0]), torch.ones(1, 2))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert stats["approx_kl"].item() == pytest.approx(expected, rel=1e-5)


def test_policy_loss_positive_advantage_by_hand():
    old, new, _ = ratios_case()
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2)
    # per token -min(r A, clip(r) A): -1, -min(1.5, 1.2) = -1.2, (masked out)
    assert loss.item() == pytest.approx(-1.1)
    assert float(stats["clip_frac"]) == pytest.approx(0.5)
    assert float(stats["ratio_mean"]) == pytest.approx(1.25)
    loss.backward()
    assert new.grad is not None
    # d/dlogp of -r*A = -r: token 0 (unclipped, r=1) gets -1/2 (mean over 2 tokens); the
    # clipped token and the masked token get nothing
    assert new.grad[0].tolist() == pytest.approx([-0.5, 0.0, 0.0])


def test_policy_loss_negative_advantage_by_hand():
    old, new, mask = ratios_case()
    loss, stats = policy_loss(new, old, torch.tensor([-1.0]), mask, clip_low=0.2)
    # -min(-1, -1) = 1; -min(-1.5, -1.2) = 1.5; -min(-0.5, -0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((1 + 1.5 + 0.8) / 3)
    assert float(stats["clip_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([1 / 3, 1.5 / 3, 0.0])


def test_masked_positions_with_a_restricted_vocabulary_leave_the_stats_and_gradients_finite():
    # a padded or prompt position under a restricted vocabulary: logprob -1e9 against an old
    # logprob of 0; exp(1e9) there once made approx_kl NaN (inf * a mask of 0)
    old = torch.tensor([[-0.5, 0.0, 0.0]])
    new = torch.tensor([[-0.4, -1e9, -1e9]]).requires_grad_(True)
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2)
    r = math.exp(0.1)
    assert float(stats["approx_kl"]) == pytest.approx(math.exp(0.1) - 1 - 0.1, rel=1e-4)  # float32
    assert float(stats["ratio_mean"]) == pytest.approx(r) and loss.item() == pytest.approx(-r)
    loss.backward()
    assert new.grad is not None and new.grad[0].tolist() == pytest.approx([-r, 0.0, 0.0])


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_a_log_ratio_past_what_exp_can_hold_leaves_the_gradients_finite(adv):
    # an old logprob 99.9 below the current one (a server's -100 placeholder): exp overflowed
    # float32 to inf and inf * 0 made the gradient NaN, even where the clipped branch is taken
    # (gradient zero), and the job stopped on a non-finite gradient norm
    old = torch.tensor([[-100.0, -0.5]])
    new = torch.tensor([[-0.1, -0.4]]).requires_grad_(True)
    loss, stats = policy_loss(new, old, torch.tensor([adv]), torch.ones(1, 2), clip_low=0.2)
    loss.backward()
    assert new.grad is not None and torch.isfinite(new.grad).all(), new.grad
    assert math.isfinite(loss.item()) and all(math.isfinite(float(v)) for v in stats.values())
    r = math.exp(0.1)  # the ordinary token is untouched
    want = -r / 2 if adv > 0 else r / 2
    assert new.grad[0, 1].item() == pytest.approx(want, rel=1e-5)
    assert new.grad[0, 0].item() == 0.0  # the far token: clipped (adv > 0) or past the clamp


def test_clip_high_widens_the_upper_bound_only():
    old, new, mask = ratios_case()
    loss, stats = policy_loss(new, old, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.6)
    assert loss.item() == pytest.approx(-(1 + 1.5 + 0.5) / 3)  # 1.5 < 1.6: not clipped
    assert float(stats["clip_frac"]) == 0.0


def test_dual_clip_bounds_the_loss_of_a_negative_advantage_at_c():
    # ratios 1, 5 (a stale sample the policy now much prefers) and 0.5, advantage -2: the ratio
    # clip takes the larger loss for A < 0, so the ratio of 5 was unclipped, loss 10
    old = torch.log(torch.tensor([[0.1, 0.1, 0.1]]))
    new = torch.log(torch.tensor([[0.1, 0.5, 0.05]])).requires_grad_(True)
    mask = torch.ones(1, 3)
    plain, plain_stats = policy_loss(new, old, torch.tensor([-2.0]), mask, clip_low=0.2)
    assert plain.item() == pytest.approx((2 + 10 + 1.6) / 3, rel=1e-5)
    assert float(plain_stats["dual_clip_frac"]) == 0.0
    # dual clip c = 3: min(max(-A r, -A clip(r)), -A c) = min(10, 6) = 6; 2 and 1.6 are under it
    loss, stats = policy_loss(new, old, torch.tensor([-2.0]), mask, clip_low=0.2, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx((2 + 6 + 1.6) / 3, rel=1e-5)
    assert float(stats["dual_clip_frac"]) == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp of -A r = 2 r: the ratio-1 token 2/3; the dual-clipped one and the one the
    # ratio clip took (r = 0.5 < 0.8) get nothing
    assert new.grad is not None and new.grad[0].tolist() == pytest.approx([2 / 3, 0.0, 0.0], rel=1e-5)


def test_dual_clip_leaves_a_positive_advantage_alone():
    old = torch.log(torch.tensor([[0.1, 0.1]]))
    new = torch.log(torch.tensor([[0.1, 0.5]]))
    with_c, stats = policy_loss(new, old, torch.tensor([2.0]), torch.ones(1, 2), clip_ratio_c=3.0)
    without, _ = policy_loss(new, old, torch.tensor([2.0]), torch.ones(1, 2))
    assert with_c.item() == pytest.approx(without.item()) == pytest.approx(-(2 + 2.4) / 2)
    assert float(stats["dual_clip_frac"]) == 0.0


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_dual_clip_needs_a_bound_above_one(c):
    lp = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="clip_ratio_c must be above 1"):
        policy_loss(lp, lp, torch.tensor([-1.0]), torch.ones(1, 1), clip_ratio_c=c)


def test_per_token_advantages_and_on_policy_ratio():
    lp = torch.log(torch.tensor([[0.2, 0.4]]))
    loss, stats = policy_loss(lp, lp.clone(), torch.tensor([[2.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-(2.0 - 1.0) / 2)
    assert float(stats["approx_kl"]) == pytest.approx(0.0)
    assert float(stats["clip_frac"]) == 0.0


def test_kl_k3_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.5, 0.1]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.2]))
    k3 = kl_k3(logp, ref)
    # exp(d) - d - 1 with d = ref - logp: d = log .5, 0, log 2
    assert k3.tolist() == pytest.approx([0.5 + math.log(2) - 1, 0.0, 2 - math.log(2) - 1])
    assert (k3 >= 0).all()


def test_kl_k3_outside_the_mask_is_zero_and_keeps_the_loss_finite():
    # a prompt position under a restricted vocabulary: about -1e9 on both sides, 128 apart
    # after float32 rounding; exp(128) is inf, and inf times a mask of 0 was a NaN loss
    logp = torch.tensor([[-0.7, -1e9]]).requires_grad_(True)
    ref = torch.tensor([[-0.6, -1e9 + 128.0]])
    mask = torch.tensor([[1.0, 0.0]])
    assert torch.isnan(aggregate(kl_k3(logp, ref), mask))  # unguarded
    kl = aggregate(kl_k3(logp, ref, mask), mask)
    assert kl.item() == pytest.approx(math.exp(0.1) - 0.1 - 1, rel=1e-4)
    kl.backward()
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx(
        [1 - math.exp(0.1), 0.0], rel=1e-4
    )


def test_aggregations_and_masked_mean():
    per_token = torch.tensor([[1.0, 1.0, 1.0], [4.0, 100.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(per_token, mask, "token_mean")) == pytest.approx(7 / 4)
    assert float(aggregate(per_token, mask, "seq_mean_token_mean")) == pytest.approx((1 + 4) / 2)
    assert float(masked_mean(per_token, torch.zeros_like(mask))) == 0.0
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(per_token, mask, "sum")  # type: ignore[arg-type]


def test_token_logprobs_and_entropy():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    lp = token_logprobs(logits, torch.tensor([[1, 0]]))
    assert lp[0].tolist() == pytest.approx([math.log(0.5), math.log(0.75)])
    assert entropy(logits)[0, 0].item() == pytest.approx(math.log(2))
    # temperature 2 halves the logits: log(3)/2 -> p = sqrt(3) / (sqrt(3) + 1)
    assert token_logprobs(logits, torch.tensor([[1, 0]]), 2.0)[0, 1].item() == pytest.approx(
        math.log(math.sqrt(3) / (math.sqrt(3) + 1))
    )


def sample(traj: str, reward: float, group: str = "g", n: int = 1) -> TrainSample:
    return TrainSample(
        prompt_ids=[1],
        completion_ids=[2] * n,
        old_logprobs=[-1.0] * n,
        reward=reward,
        group_id=group,
        trajectory_id=traj,
        policy_version=0,
    )


def test_batch_advantages_count_trajectories_not_turns():
    # trajectory A has 3 turn samples, B has 1: the group is {A: 1, B: 0}, not {1, 1, 1, 0}
    batch = [sample("A", 1.0), sample("A", 1.0), sample("B", 0.0), sample("A", 1.0)]
    adv = batch_advantages(batch, eps=0.0)
    assert adv == pytest.approx([SQRT_HALF, SQRT_HALF, -SQRT_HALF, SQRT_HALF])
    given = batch[0].model_copy(update={"advantage": 0.25})
    assert batch_advantages([given, *batch[1:]], eps=0.0)[0] == 0.25
    with pytest.raises(TrainerError, match="different rewards"):
        batch_advantages([sample("A", 1.0), sample("A", 0.0)])


def test_sample_validation():
    with pytest.raises(ValueError, match="2 completion ids but 1 old logprobs"):
        TrainSample(
            prompt_ids=[1],
            completion_ids=[2, 3],
            old_logprobs=[0.0],
            reward=1,
            group_id="g",
            policy_version=0,
        )
    with pytest.raises(ValueError, match="advantage or a reward"):
        TrainSample(prompt_ids=[1], completion_ids=[2], old_logprobs=[0.0], group_id="g", policy_version=0)
    with pytest.raises(ValueError, match="mask of 2"):
        TrainSample(
            prompt_ids=[1],
            completion_ids=[2],
            old_logprobs=[0.0],
            mask=[1, 0],
            reward=1,
            group_id="g",
            policy_version=0,
        )


def test_turn_samples_from_a_recorded_trajectory():
    def completion(ids: list[int], version: int) -> Completion:
        return Completion(
            request_id="r",
            text="right",
            prompt_ids=[2, 5, 9],
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            policy_version=version,
            finish_reason="stop" if ids else "abort",
            allowed_token_ids=[11, 12, 8],
        )

    traj = Trajectory(
        messages=[
            Message(role="user", content="obs"),
            assistant_message(completion([11, 8], 3)),
            Message(role="user", content="obs"),
            assistant_message(completion([], 4)),  # aborted before its first token: no sample
        ]
    )
    traj = Trajectory.model_validate_json(traj.model_dump_json())  # survives the wire
    [s] = turn_samples(traj, reward=1.0, group_id="g1")
    assert (s.prompt_ids, s.completion_ids, s.old_logprobs) == ([2, 5, 9], [11, 8], [-0.5, -0.5])
    assert (s.reward, s.group_id, s.trajectory_id, s.policy_version) == (1.0, "g1", traj.id, 3)
    assert s.allowed_token_ids == [11, 12, 8]  # trained under the restriction it was sampled with
    bare = Trajectory(messages=[Message(role="assistant", content="right", policy_version=0)])
    with pytest.raises(TrainerError, match="lacks"):
        turn_samples(bare, reward=0.0, group_id="g")
