"""Adaptive entropy control: the entropy bonus's coefficient steered toward a target entropy.

A fixed ``trainer.entropy_coef`` is a guess about how hard the policy gradient will push the
policy toward certainty, and on FrozenLake a wrong guess cost runs: ``lr: 2e-3`` or
``entropy_coef: 0.01`` let the entropy collapse to ~0.01 nats (so did one of 20 demo runs at
0.03), after which a group's rollouts all agree, their advantages are 0, and greedy success
froze (at 0.73). With ``trainer.entropy_target`` (mean entropy of the trained tokens, in nats) the
coefficient is adjusted after every step from the step's measured entropy, as SAC learns its
temperature toward a target entropy (the gradient of ``coef * (entropy - target)``) and
Skywork-OR1 adjusts its entropy weight:

    coef <- min(max(coef + coef_lr * (target - entropy), coef_min), coef_max)

raised while the policy is more certain than the target, lowered toward ``coef_min`` (0 by
default: no bonus) while it is less. ``entropy_coef`` is then only the coefficient the first
step uses. The target is on the *mean* entropy, which cannot tell a policy hesitating
between two moves everywhere from one that is sure of most states and open on a few: on
FrozenLake a coefficient let down to 0 while the entropy sat above the target (~ln 2, two
moves) left the policy at success ~0.4 for 60-120 steps, where a fixed 0.01 kept the other
moves alive (docs/job.md has the runs). ``coef_min`` keeps such a floor; the target then
only raises the bonus when the entropy falls below it.

Torch-free: the job config checks the settings with it, and both trainers (torch, megatron)
steer with the same ``EntropyControl``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationInfo


def entropy_target_problem(target: float | None, choices: int, what: str) -> str | None:
    """Why ``target`` cannot be reached by a distribution over ``choices`` tokens (whose
    entropy is at most ``ln(choices)``, reached only by the uniform one), or None. An
    unreachable target would only raise the coefficient to its bound, step after step."""
    if target is None:
        return None
    top = math.log(choices) if choices > 0 else 0.0
    if target < top:
        return None
    if choices <= 1:
        # every target (> 0) is out of reach: "a lower target" would be no advice at all
        return (
            f"entropy_target {target:g} nats cannot be reached: {what} has no entropy (one choice, "
            "ln(1) = 0) and nothing to steer; remove entropy_target"
        )
    return (
        f"entropy_target {target:g} nats is not below ln({choices}) = {top:.3g}, the most entropy "
        f"{what} can have: the coefficient would only rise to entropy_coef_max; choose a lower target"
    )


def entropy_ceiling(turns: Sequence[tuple[int, int]], agg: str = "token_mean") -> float | None:
    """The most mean entropy a batch can measure: ``turns`` holds each sample's trained tokens
    and the choices each of them had (its ``allowed_token_ids``, or the vocabulary). A token
    of ``n`` choices has at most ``ln(n)`` nats, so the batch's mean (``agg`` as the loss
    aggregates it: per token, or per sample then over samples) is at most that mean of
    ``ln(n)``: below ``ln`` of the widest choice as soon as some tokens have fewer. None when
    no token trains."""
    turns = [(k, n) for k, n in turns if k > 0]
    if not turns:
        return None
    if agg == "seq_mean_token_mean":
        return sum(math.log(n) for _, n in turns) / len(turns)
    return sum(k * math.log(n) for k, n in turns) / sum(k for k, _ in turns)


def entropy_coef_min_fits(coef_min: float, info: ValidationInfo) -> float:
    """A config's ``entropy_coef_min`` validator (the job's ``trainer`` and both backends'
    configs): with a target, ``entropy_coef`` is the starting coefficient, within the bounds.
    Declared after ``entropy_coef`` and ``entropy_target``, whose values it reads (absent when
    they failed their own checks, which say so)."""
    coef, target = info.data.get("entropy_coef"), info.data.get("entropy_target")
    if target is not None and coef is not None and coef < coef_min:
        raise ValueError(
            f"{coef_min:g} is above entropy_coef {coef:g}, the starting coefficient with an "
            "entropy_target: lower entropy_coef_min or raise entropy_coef"
        )
    return coef_min


def entropy_coef_max_fits(coef_max: float, info: ValidationInfo) -> float:
    """``entropy_coef_max``'s validator, as ``entropy_coef_min_fits``."""
    coef, target = info.data.get("entropy_coef"), info.data.get("entropy_target")
    if target is not None and coef is not None and coef > coef_max:
        raise ValueError(
            f"{coef_max:g} is below entropy_coef {coef:g}, the starting coefficient with an "
            "entropy_target: raise entropy_coef_max or lower entropy_coef"
        )
    return coef_max


@dataclass
class EntropyControl:
    """The entropy coefficient a trainer uses, fixed (``target`` None) or steered."""

    coef: float
    """The coefficient of the next update (``entropy_coef`` at the start)."""
    target: float | None = None
    coef_lr: float = 0.05
    """Change of the coefficient per step per nat between the target and the entropy."""
    coef_max: float = 0.1
    coef_min: float = 0.0
    """The floor the coefficient is lowered to above the target."""

    @classmethod
    def from_config(cls, cfg: Any) -> EntropyControl:
        """From a backend config's ``entropy_coef``, ``entropy_target``, ``entropy_coef_lr``
        ``entropy_coef_min`` and ``entropy_coef_max`` (the torch and megatron configs have the
        same fields)."""
        return cls(
            coef=cfg.entropy_coef,
            target=cfg.entropy_target,
            coef_lr=cfg.entropy_coef_lr,
            coef_max=cfg.entropy_coef_max,
            coef_min=cfg.entropy_coef_min,
        )

    def update(self, entropy: float | None) -> float:
        """After a step that measured ``entropy``: the next step's coefficient. A step with no
        entropy (every sample masked) or a non-finite one leaves it as it is."""
        if self.target is None or entropy is None or not math.isfinite(entropy):
            return self.coef
        coef = self.coef + self.coef_lr * (self.target - entropy)
        self.coef = min(max(coef, self.coef_min), self.coef_max)
        return self.coef

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps: the steered coefficient (a fixed one is the config's).
        Nothing without a target: a resume that adds one (``--allow-change trainer``) starts
        from its own ``entropy_coef``, not from the fixed coefficient of the earlier run."""
        return {"entropy_coef": self.coef} if self.target is not None else {}

    def load(self, state: Mapping[str, Any]) -> None:
        """Back to ``state``'s coefficient when steering: a resumed run goes on from where the
        earlier one had taken it (within this run's bounds, which a resume may have
        changed). A fixed coefficient stays this config's, and a checkpoint without one (it
        was written without a target) leaves the starting ``entropy_coef``."""
        saved = state.get("entropy_coef")
        if self.target is not None and saved is not None:
            self.coef = min(max(float(saved), self.coef_min), self.coef_max)
