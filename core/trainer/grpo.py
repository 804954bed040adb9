"""GRPO as pure tensor functions: advantages, the clipped policy loss, the k3 KL.

Shapes: ``[batch, tokens]`` for per-token quantities (completion tokens, padded, with a
0/1 ``mask``), ``[batch]`` for per-sample ones. Nothing here knows about models or
batching, so each piece is checked against hand-computed numbers in the tests.

    A_i   = (r_i - mean(r_group)) / (std(r_group) + eps)               group_advantages
    ratio = exp(clamp(logp - logp_old, -20, 20))
    loss  = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)  policy_loss
            and for A < 0, at most -A * c (dual clip, c = clip_ratio_c)
    kl    = exp(ref - logp) - (ref - logp) - 1                          kl_k3 (Schulman's k3)

For multi-turn agents, ``step_advantages`` adds GiGPO's per-state comparison on top of the
episode-level group advantage.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from core.config_backends import LossAgg as LossAgg  # with the torch trainer's config

#: How far (in nats) a token's log-ratio to the policy that sampled it is taken: ``exp`` of
#: more overflows float32 on its way to a NaN gradient (``policy_loss``).
LOG_RATIO_BOUND = 20.0


def group_advantages(
    rewards: Tensor | Sequence[float],
    groups: Sequence[Hashable],
    *,
    eps: float = 1e-6,
    scale: bool = True,
) -> Tensor:
    """``(r - group mean) / (group std + eps)`` per element.

    ``std`` is the sample standard deviation (Bessel-corrected, as ``torch.std``); a group
    of one has advantage 0 (nothing to compare with), and so has a group whose rewards are
    all equal. ``scale=False`` keeps the centred reward only (Dr. GRPO: the std division
    over-weights near-uniform groups). Returned as float32.
    """
    # float64, and an exact zero for a group with no spread: in float32 the mean of eight
    # 0.3s is not 0.3, so the centred rewards are ~3e-8 while the std is exactly 0, and
    # dividing by (0 + eps) turned that rounding into an advantage of ~0.03 for every
    # member: a push on all of a uniform group's tokens, exactly where there is no signal
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 1 or len(groups) != r.shape[0]:
        raise ValueError(f"need one group id per reward: {len(groups)} ids for shape {tuple(r.shape)}")
    out = torch.zeros_like(r)
    index: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    for members in index.values():
        if len(members) < 2:
            continue
        idx = torch.tensor(members)
        gr = r[idx]
        if bool(gr.max() == gr.min()):
            continue  # no spread: nothing to learn from (and 0/0 with eps=0)
        centred = gr - gr.mean()
        denom = gr.std() + eps
        out[idx] = centred / denom if scale and denom > 0 else centred
    return out.to(torch.float32)


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    """``G_t = r_t + gamma * G_{t+1}`` for one trajectory's per-turn rewards."""
    out: list[float] = []
    g = 0.0
    for r in reversed(rewards):
        g = r + gamma * g
        out.append(g)
    return out[::-1]


def step_advantages(
    returns: Sequence[float],
    groups: Sequence[Hashable],
    states: Sequence[Hashable],
    *,
    eps: float = 1e-6,
    scale: bool = True,
) -> Tensor:
    """Step-level advantages of GiGPO (Feng et al., 2025, "Group-in-Group Policy
    Optimization for LLM Agent Training"): the turns of a group's trajectories that were
    taken in the *same state* (an anchor state: same task, identical observation) form a
    sub-group, compared by their discounted returns. In a multi-turn task this says which
    action was better *here*, which the episode-level advantage (the same for every turn of
    a trajectory) cannot; add the two. Members are turns (a state revisited within one
    trajectory counts once per visit)."""
    if not len(returns) == len(groups) == len(states):
        raise ValueError(f"{len(returns)} returns, {len(groups)} group ids, {len(states)} states")
    return group_advantages(returns, list(zip(groups, states, strict=True)), eps=eps, scale=scale)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` where ``mask`` is 1; 0 where nothing is masked in."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1.0)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / T)[target]`` per position: ``[B, T, V]`` x ``[B, T]`` -> ``[B, T]``."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / T)`` per position."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def aggregate(per_token: Tensor, mask: Tensor, how: LossAgg = "token_mean") -> Tensor:
    """``token_mean``: every trained token weighs the same (long turns weigh more);
    ``seq_mean_token_mean``: mean per sample, then over samples (GRPO's paper form)."""
    if how == "token_mean":
        return masked_mean(per_token, mask)
    if how == "seq_mean_token_mean":
        per_seq = masked_mean(per_token, mask, dim=-1)
        has = (mask.sum(-1) > 0).to(per_seq.dtype)
        return (per_seq * has).sum() / has.sum().clamp(min=1.0)
    raise ValueError(f"unknown loss aggregation {how!r}")


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    clip_ratio_c: float | None = None,
    agg: LossAgg = "token_mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped-ratio surrogate (to minimise) and its diagnostics.

    ``advantages`` is ``[B]`` (one per sample, broadcast over its tokens) or ``[B, T]``.
    ``clip_high`` defaults to ``clip_low`` (DAPO's clip-higher sets it larger).
    ``clip_ratio_c`` (> 1; None: off) is the dual clip of Ye et al. (2020), as veRL applies
    it: where ``A < 0`` the token's loss is at most ``-A * c``. The PPO clip bounds the ratio
    only from the side that would grow the objective; with a negative advantage a large ratio
    (a stale sample under ``alpha > 0``, a token the policy now much prefers) is the unclipped
    branch, and its loss and gradient grow with the ratio without bound. Past ``c`` the
    token's gradient is 0 instead. Stats: ``clip_frac`` (share of tokens where the clipped
    branch is the one taken, i.e. the gradient is zero), ``dual_clip_frac`` (share where
    the dual clip is), ``ratio_mean``, ``approx_kl`` (KL(old || new) by k3 on the old
    policy's samples, a drift gauge).
    """
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(
            f"clip_ratio_c must be above 1 (a ratio bound past 1 + clip_high), got {clip_ratio_c}"
        )
    if clip_high is None:
        clip_high = clip_low
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    # zero outside the mask before exp: a padded or prompt position can hold -1e9 (a restricted
    # vocabulary) against an old logprob of 0, and exp(1e9) * 0 would be NaN in the stats
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))
    # and bounded (as verl does): a token ~89 nats above its old logprob (a server's -100
    # placeholder, a badly stale sample) overflows exp to inf, and inf * 0 made the gradient
    # NaN even where the clipped branch is taken; the job then stopped on a non-finite
    # gradient norm. Past +-20 a token is clipped (gradient 0) or its ratio (4.9e8) is noise
    # either way, and the clamp gives it no gradient
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -adv * clip_ratio_c  # positive where A < 0
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual, bound.expand_as(per_token), per_token)
    loss = aggregate(per_token, mask, agg)
    with torch.no_grad():
        m = mask.to(ratio.dtype)
        took_clip = (clipped < unclipped).to(ratio.dtype)
        stats = {
            "clip_frac": masked_mean(took_clip, m),
            "dual_clip_frac": masked_mean(dual.to(ratio.dtype), m),
            "ratio_mean": masked_mean(ratio, m),
            # KL(behaviour || current) by k3 on the tokens the behaviour policy sampled:
            # (r - 1) - log r with r = current / behaviour. The form for samples of the
            # current policy, exp(-log r) + log r - 1, read 1.27 for a true 0.51
            "approx_kl": masked_mean(ratio - 1.0 - log_ratio, m),
        }
    return loss, stats


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor | None = None) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference) on tokens sampled from the policy:
    ``exp(ref - logp) - (ref - logp) - 1``; unbiased, always >= 0, low variance.

    ``mask``: 0 where the estimate is not wanted, which is then 0. Under a restricted
    vocabulary a prompt or padded position holds about -1e9 on both sides, where float32
    steps by 64 or 128: a drifted policy can read ``exp(128)`` = inf there, and inf times a
    mask of 0 is a NaN loss and NaN gradients (as ``policy_loss`` guards its ratio)."""
    d = ref_logprobs - logprobs
    if mask is not None:
        d = torch.where(mask.bool(), d, torch.zeros_like(d))
    return torch.exp(d) - d - 1.0
