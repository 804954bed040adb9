"""The megatron trainer's micro-batch: samples packed into right-padded GPU tensors, with
only the positions that score completion tokens kept (``core.trainer.megatron_``)."""

from __future__ import annotations

import torch
from torch import Tensor

from core.trainer.base import TrainSample

__all__ = ["Packed", "pack_samples"]


class Packed:
    """A micro-batch on the GPU: right-padded inputs, and per completion token the position
    that scores it, its target, mask and old logprob (``[B, C]``)."""

    def __init__(
        self,
        ids: Tensor,
        position_ids: Tensor,
        positions: Tensor,
        targets: Tensor,
        mask: Tensor,
        old: Tensor,
        restrict: Tensor | None,
    ) -> None:
        self.ids = ids
        self.position_ids = position_ids
        self.positions = positions
        self.targets = targets
        self.mask = mask
        self.old = old
        self.restrict = restrict


def pack_samples(samples: list[TrainSample], vocab_size: int, device: torch.device) -> Packed:
    """Position ``t`` predicts token ``t + 1``, so completion token ``j`` of a sample (at
    ``len(prompt) + j``) is scored by the logits at ``len(prompt) + j - 1``. Only those
    positions' logits are kept: ``[B, C, V]`` rather than ``[B, T, V]``."""
    width = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples) - 1
    comp = max(len(s.completion_ids) for s in samples)
    b = len(samples)
    ids = torch.zeros(b, width, dtype=torch.long)
    positions = torch.zeros(b, comp, dtype=torch.long)
    targets = torch.zeros(b, comp, dtype=torch.long)
    mask = torch.zeros(b, comp)
    old = torch.zeros(b, comp)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[i, : len(seq) - 1] = torch.tensor(seq[:-1])
        positions[i, :c] = torch.arange(p - 1, p - 1 + c)
        targets[i, :c] = torch.tensor(s.completion_ids)
        mask[i, :c] = torch.tensor(s.token_mask, dtype=torch.float32)
        old[i, :c] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    restrict = None
    if any(s.allowed_token_ids is not None for s in samples):
        # finite, so entropy's p * log p stays 0 rather than NaN (as the torch backend)
        restrict = torch.zeros(b, vocab_size)
        for i, s in enumerate(samples):
            if s.allowed_token_ids is not None:
                restrict[i] = -1e9
                restrict[i, s.allowed_token_ids] = 0.0
    position_ids = torch.arange(width).expand(b, width)
    return Packed(
        ids.to(device),
        position_ids.to(device),
        positions.to(device),
        targets.to(device),
        mask.to(device),
        old.to(device),
        None if restrict is None else restrict.to(device),
    )
